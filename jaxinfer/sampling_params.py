"""`SamplingParams` and `StructuredOutputsParams`, with vLLM's field names and meanings,
validated on construction."""

from __future__ import annotations

import dataclasses
import json as _json
import math
import numbers

import numpy as np

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on a request's output: exactly one of

    json: a JSON schema (a dict, or its text); json_object=True: any JSON object; regex: a
    regular expression the whole output matches; choice: a list of strings, the output is one of
    them; grammar: a context-free grammar, in Lark / llguidance syntax or llama.cpp's GBNF.

    disable_any_whitespace: JSON without optional whitespace (the default is llguidance's
    compact separators, ", " and ": ", no free whitespace, which keeps small models from
    wandering into runs of spaces); whitespace_pattern: a regex for the whitespace JSON may hold
    between tokens instead.

    reasoning_end (jaxinfer's; set by the server's --reasoning-parser, as vLLM applies structured
    outputs to the answer after the reasoning): the output first holds free text (a reasoning
    model's thinking) up to and including this tag, and the constraint applies to what follows
    (whitespace may come between). reasoning_start: a tag the output may open with, before the
    reasoning. reasoning_optional: the output may instead be the answer alone, and holds
    reasoning only when it opens with reasoning_start (Qwen3's non-thinking mode). A tag that is
    one added token of the tokenizer (Qwen3's <think> and </think>) is matched as that token.

    Generation stops when the constraint is complete (EOS is then the only token allowed).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning_end: str | None = None
    reasoning_start: str | None = None
    reasoning_optional: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams: give exactly one of {', '.join(self.KINDS)} "
                f"(got {', '.join(given) if given else 'none'})"
            )
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json: not valid JSON ({e})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"StructuredOutputsParams.json: a JSON schema is an object, got {type(self.json).__name__}")
        for field in ("regex", "grammar", "whitespace_pattern", "reasoning_end", "reasoning_start"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{field}: must be a non-empty string")
        if not isinstance(self.reasoning_optional, bool):
            raise ValueError("StructuredOutputsParams.reasoning_optional: must be True or False")
        if self.reasoning_end is None and (self.reasoning_start is not None or self.reasoning_optional):
            raise ValueError("StructuredOutputsParams: reasoning_start and reasoning_optional need reasoning_end")
        if self.reasoning_optional and self.reasoning_start is None:
            raise ValueError("StructuredOutputsParams.reasoning_optional: needs reasoning_start (the tag that opens the reasoning)")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice: must be a non-empty list of non-empty strings")
        if self.choice is not None:
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """The constraint as text: equal constraints share one compiled grammar."""
        return _json.dumps({k: getattr(self, k) for k in (self.kind, "disable_any_whitespace", "whitespace_pattern",
                                                          "reasoning_end", "reasoning_start", "reasoning_optional")},
                           sort_keys=True)


# The sampler holds every float setting as a float32: values past its range would become inf.
FLOAT32_MAX = 3.4028234663852886e38
# vLLM's floor for a sampling temperature: 0 < t < MIN_TEMPERATURE is raised to it (logits / t
# would overflow float32 and the draw turn into NaN).
MIN_TEMPERATURE = 1e-2


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_integer(value) -> bool:
    """An integer, Python's or NumPy's, and not a bool (True is an int to Python, not to a client)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass
class SamplingParams:
    """How to decode one request.

    n: completions per prompt. temperature: 0 means greedy (a temperature in (0, 0.01) is raised
    to 0.01, as vLLM does). top_k: 0 or -1 disables it (stored as 0); the engine refuses one over
    the vocabulary, as vLLM does. top_p: nucleus mass in (0, 1]. min_p: drop tokens below
    min_p x the top token's probability.
    repetition_penalty (> 0, 1 = off): logits of tokens already in the prompt or output are divided
    (if positive) or multiplied (if negative) by it. presence_penalty / frequency_penalty (in
    [-2, 2], 0 = off): subtracted once / once per occurrence from tokens already in the output.
    seed: makes sampling reproducible whatever else shares the batch; any Python int (over HTTP a
    signed 64-bit one, as vLLM's API). The sampler's seeds are uint32: a seed in [0, 2**32) is
    used as it is, any other is hashed to one (`jaxinfer.engine.seeds.sampler_seed`: the 4-byte
    BLAKE2b digest, read little-endian, of `seed.to_bytes(seed.bit_length() // 8 + 1, "little",
    signed=True)`), the same in every process. max_tokens: tokens to generate at most (None: up
    to the context). min_tokens: EOS and stop_token_ids cannot end generation before this many
    tokens (the engine holds back at most `ops.sampling.MAX_BANNED_IDS` = 32 such ids, EOS
    included). ignore_eos: keep going past EOS.
    logprobs: also return the top-`logprobs` alternatives of each generated token (0 = only the
    sampled token's; True = 1, as vLLM); the engine's max_logprobs bounds it. prompt_logprobs: the
    same for every prompt token. stop_token_ids: extra tokens that end generation (ids in the
    vocabulary). stop: strings that end generation (trimmed from the text unless
    include_stop_str_in_output). skip_special_tokens: drop special tokens from the text.
    detokenize: False leaves the output text empty (token ids only; no stop strings then).
    num_speculative_tokens (jaxinfer's, not vLLM's): with speculative decoding on, this
    request's draft length (None: the engine's; 0: this request does not speculate).
    structured_outputs: a `StructuredOutputsParams` (or a dict of its fields) the output must
    follow; the older names guided_json / guided_regex / guided_choice / guided_grammar are
    accepted as keywords and become it. A constrained request does not speculate.

    Every field is checked on construction: a ValueError names the field
    ("SamplingParams.<field>=<value>: why"). Integers may be NumPy's (stored as int), never bools;
    numbers must be finite and within float32's range (stored as float).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    num_speculative_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dataclasses.InitVar[str | dict | None] = None
    guided_regex: dataclasses.InitVar[str | None] = None
    guided_choice: dataclasses.InitVar[list[str] | None] = None
    guided_grammar: dataclasses.InitVar[str | None] = None

    def __post_init__(self, guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None):
        guided = {name: v for name, v in zip(GUIDED_ALIASES, (guided_json, guided_regex, guided_choice, guided_grammar))
                  if v is not None}
        if guided:
            if self.structured_outputs is not None or len(guided) > 1:
                raise ValueError(f"SamplingParams: give one constraint, got {', '.join(guided)}"
                                 + (" and structured_outputs" if self.structured_outputs is not None else ""))
            (name, value), = guided.items()
            self.structured_outputs = StructuredOutputsParams(**{GUIDED_ALIASES[name]: value})
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            self._bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")

        for field in ("logprobs", "prompt_logprobs"):  # vLLM: True asks for one alternative
            if getattr(self, field) is True:
                setattr(self, field, 1)
        self._integer("n", low=1)
        self._integer("top_k", low=-1, why="must be -1 or 0 (disabled) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        self._integer("seed", none_ok=True)
        self._integer("max_tokens", low=1, none_ok=True, why="must be an integer >= 1 (or None: up to the context limit)")
        self._integer("min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            self._bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for field in ("logprobs", "prompt_logprobs"):
            self._integer(field, low=0, none_ok=True, why="must be None or an integer >= 0")
        self._integer("num_speculative_tokens", low=0, none_ok=True, why="must be None or an integer >= 0")

        self._number("temperature", 0.0, FLOAT32_MAX, note=" (0: greedy)")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self._number("top_p", 0.0, 1.0, low_open=True)
        self._number("min_p", 0.0, 1.0)
        self._number("repetition_penalty", 0.0, FLOAT32_MAX, low_open=True, note=" (1 disables it)")
        for field in ("presence_penalty", "frequency_penalty"):
            self._number(field, -2.0, 2.0)

        for field in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                self._bad(field, "must be True or False")
            setattr(self, field, bool(getattr(self, field)))
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, np.ndarray)) or not all(
                is_integer(t) and t >= 0 for t in self.stop_token_ids
            ):
                self._bad("stop_token_ids", "must be a list of non-negative token ids")
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                self._bad("stop", "must be a non-empty string or a list of non-empty strings")
            self.stop = list(self.stop)
        if self.stop and not self.detokenize:
            self._bad("stop", "stop strings need detokenize=True")

    def _bad(self, field: str, why: str):
        raise ValueError(f"SamplingParams.{field}={_shown(getattr(self, field))}: {why}")

    def _integer(self, field: str, *, low: int | None = None, none_ok: bool = False, why: str | None = None) -> None:
        """Checks an integer field (stored as a Python int); `low`: its least value."""
        value = getattr(self, field)
        if value is None and none_ok:
            return
        if not is_integer(value) or (low is not None and value < low):
            self._bad(field, why or ("must be an integer" + (f" >= {low}" if low is not None else "")
                                     + (" or None" if none_ok else "")))
        setattr(self, field, int(value))

    def _number(self, field: str, low: float, high: float, *, low_open: bool = False, note: str = "") -> None:
        """Checks a finite number in [low, high] (low excluded if `low_open`), stored as a float."""
        value = getattr(self, field)
        if high == FLOAT32_MAX:
            want = f"a finite number {'>' if low_open else '>='} {low:g} (at most {FLOAT32_MAX:.4g}, float32's largest)"
        else:
            want = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        want += note
        if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
            self._bad(field, f"must be {want}")
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
        if not (math.isfinite(number) and (low < number if low_open else low <= number) and number <= high):
            self._bad(field, f"must be {want}")
        setattr(self, field, number)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""`SamplingParams` and `StructuredOutputsParams`, with vLLM's field names and meanings,
validated on construction."""

from __future__ import annotations

import dataclasses
import json as _json

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

    Generation stops when the constraint is complete (EOS is then the only token allowed).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

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
        for field in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{field}: must be a non-empty string")
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
        return _json.dumps({k: getattr(self, k) for k in (self.kind, "disable_any_whitespace", "whitespace_pattern")},
                           sort_keys=True)


@dataclasses.dataclass
class SamplingParams:
    """How to decode one request.

    n: completions per prompt. temperature: 0 means greedy. top_k: 0 or -1 disables it.
    top_p: nucleus mass in (0, 1]. min_p: drop tokens below min_p x the top token's probability.
    repetition_penalty (1 = off): logits of tokens already in the prompt or output are divided
    (if positive) or multiplied (if negative) by it. presence_penalty / frequency_penalty (0 =
    off): subtracted once / once per occurrence from tokens already in the output. seed: makes
    sampling reproducible whatever else shares the batch. max_tokens: tokens to generate at
    most. min_tokens: EOS and stop_token_ids cannot end generation before this many tokens.
    ignore_eos: keep going past EOS.
    logprobs: also return the top-`logprobs` alternatives of each generated token (0 = only the
    sampled token's). prompt_logprobs: the same for every prompt token. stop_token_ids: extra
    tokens that end generation. stop: strings that end generation (trimmed from the text unless
    include_stop_str_in_output). skip_special_tokens: drop special tokens from the text.
    detokenize: False leaves the output text empty (token ids only; no stop strings then).
    num_speculative_tokens (jaxinfer's, not vLLM's): with speculative decoding on, this
    request's draft length (None: the engine's; 0: this request does not speculate).
    structured_outputs: a `StructuredOutputsParams` (or a dict of its fields) the output must
    follow; the older names guided_json / guided_regex / guided_choice / guided_grammar are
    accepted as keywords and become it. A constrained request does not speculate.
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
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

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
            bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature is None or self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0 (1 disables it)")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                bad(field, "must be in [-2, 2]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None: up to the context limit)")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or v < 0):
                bad(field, "must be None or an integer >= 0")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.num_speculative_tokens is not None and (
            not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0
        ):
            bad("num_speculative_tokens", "must be None or an integer >= 0")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

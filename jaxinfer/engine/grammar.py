"""Constrained decoding on the host: a compiled grammar per constraint, a matcher per sequence,
and the bitmask of allowed tokens for each constrained row of a step.

    backend = GrammarBackend(hf_tokenizer, vocab_size, eos_token_ids)
    grammar = backend.compile(params.structured_outputs)  # cached by the constraint's text
    matcher = backend.matcher(grammar)                    # one per sequence (copied when it forks)
    backend.fill_bitmasks([matcher, ...], out)            # out: int32 [n, ceil(vocab / 32)]
    matcher.accept(token)                                 # each emitted token, in order

Speculative decoding: a constrained sequence's drafts end before the first token its grammar
forbids (`matcher.valid_prefix(draft)`, nothing consumed), and its verification rows get one mask
each: `backend.fill_bitmasks(matchers, out, drafts)` writes len(draft) + 1 rows per matcher, the
tokens allowed now and after each draft in turn (llguidance walks the matcher through the drafts
and rolls it back; a draft tree, `parents` given: the row after each node's path, nodes cut by
`matcher.valid_nodes`), so every row is masked as unspeculated decoding would mask it. The matcher
then takes the accepted drafts and the token sampled after them through `accept`, as any token.

Bit t % 32 of word t // 32 is set when token t is allowed (llguidance's layout, which the
device's `ops.sampling.allowed_mask` reads). Logits past the tokenizer's vocabulary (the model's
padding rows) are never allowed. When the grammar is complete and cannot continue, only EOS is.

The engine is llguidance: a Rust library with a small wheel and no Python dependencies (xgrammar
needs torch and triton installed to import), computing masks for a batch in parallel threads
with the GIL released. Its mask time per token at batch 32 is measured by
`scripts/bench_structured_output.py`. Another engine fits behind the same four calls.
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from jaxinfer.sampling_params import StructuredOutputsParams

try:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
except ImportError:  # pragma: no cover - a dependency of the package; the error says what is missing
    llguidance = None


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a malformed schema, regex or grammar)."""


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher):
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Advances past an emitted token; False if the grammar forbids it (the matcher is then
        in an error state and allows nothing but EOS)."""
        return self._m.consume_token(int(token))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and cannot continue (or failed): the sequence should stop."""
        return self._m.is_stopped()

    def copy(self) -> "Matcher":
        return Matcher(self._m.deep_copy())

    def valid_prefix(self, tokens) -> int:
        """How many leading `tokens` the grammar allows from here, in order (nothing consumed).
        Past the token that completes the grammar only EOS is allowed, and nothing past EOS."""
        return self._m.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0

    def valid_nodes(self, tokens, parents) -> list[bool]:
        """A draft tree's (tokens in topological order, parents[i] node i's parent, -1 the root):
        whether the grammar allows each node's path from here (nothing consumed)."""
        ok, paths = [], []
        for token, parent in zip(tokens, parents):
            path = (paths[parent] if parent >= 0 else []) + [int(token)]
            paths.append(path)
            ok.append((parent < 0 or ok[parent]) and self._m.validate_tokens(path) == len(path))
        return ok


class GrammarBackend:
    """llguidance behind the engine's grammar interface (module docstring)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, *, cache_size: int = 256):
        """Cheap: llguidance's view of the tokenizer (~0.5 s for a 49k vocabulary) is built by
        the first constrained request."""
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self._hf_tokenizer = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self.executor = None
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # requests are checked in the callers' threads

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if llguidance is None:
                    raise ImportError("structured outputs need llguidance: pip install llguidance")
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
                self.executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The constraint's llguidance grammar, checked against the tokenizer (cached by its text).
        GrammarError names the constraint and says what is wrong with it."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._grammar_text(params)
        if params.reasoning_end is not None:
            grammar = self._after_reasoning(grammar, params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"structured_outputs.{params.kind}: {messages[0] if messages else 'invalid'}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"structured_outputs: {m.get_error()}")
        return Matcher(m)

    def fill_bitmasks(self, matchers: list[Matcher], out: np.ndarray, drafts: list[list[int]] | None = None,
                      parents: list[list[int]] | None = None) -> None:
        """Row i of `out` (int32 [n, num_words], C-contiguous) <- the tokens matchers[i] allows.
        With `drafts` (speculative decoding; each a prefix the grammar allows: `valid_prefix`),
        matcher i has len(drafts[i]) + 1 consecutive rows, in matcher order: the tokens allowed
        now, then after each of its drafts in turn. A draft tree (`parents[i]` not empty: each
        node's parent, -1 the root; every path allowed: `valid_nodes`) has the row after each
        node's path instead. No matcher is advanced."""
        assert out.dtype == np.int32 and out.shape[1] == self.num_words and out.flags["C_CONTIGUOUS"]
        if not matchers:
            return
        if drafts is None:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m._m, i) for i, m in enumerate(matchers)], out)
            return
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
        assert len(drafts) == len(matchers) and starts[-1] == len(out)
        out[:] = 0
        trees = [bool(parents and len(parents[i])) and len(drafts[i]) > 0 for i in range(len(matchers))]
        for i in (i for i, tree in enumerate(trees) if tree):
            self._fill_tree(matchers[i], drafts[i], parents[i], out[starts[i] : starts[i + 1]])
        plain = [(m._m, int(first)) for m, first, d, tree in zip(matchers, starts, drafts, trees) if not len(d)]
        drafted = [(m._m, int(first), [int(t) for t in d]) for m, first, d, tree in zip(matchers, starts, drafts, trees)
                   if len(d) and not tree]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, plain, out)
        if drafted:  # (llguidance refuses an empty draft here)
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, out)
        # llguidance writes no row past a draft it does not take: after an EOS draft, where the
        # sequence ends anyway (a row allowing nothing could not be sampled): only EOS, as when complete
        unwritten = ~out.any(axis=1)
        if unwritten.any():
            out[unwritten] = self.eos_bitmask

    def _fill_tree(self, matcher: Matcher, tokens, parents, out: np.ndarray) -> None:
        """Row 0: the tokens allowed now; row i + 1: after node i's path (taken, then rolled back).
        After an EOS node, where the sequence ends, the row is left for `fill_bitmasks`' EOS-only."""
        m, paths = matcher._m, []
        llguidance.numpy.fill_next_token_bitmask(m, out, 0)
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            paths.append((paths[parent] if parent >= 0 else []) + [int(token)])
            if int(token) in self._eos:
                continue
            if not m.consume_tokens(paths[i]):
                raise GrammarError(f"structured_outputs: a draft the grammar forbids: {m.get_error()}")
            try:
                llguidance.numpy.fill_next_token_bitmask(m, out, i + 1)
            finally:
                m.rollback(len(paths[i]))

    @property
    def eos_bitmask(self) -> np.ndarray:
        """int32 [num_words]: the EOS tokens alone."""
        mask = np.zeros(self.num_words * 32, bool)
        mask[[t for t in self._eos if t < self.vocab_size]] = True
        return np.packbits(mask, bitorder="little").view(np.int32)

    def _after_reasoning(self, answer: str, p: StructuredOutputsParams) -> str:
        """`answer` (a grammar) preceded by free text up to and including p.reasoning_end: a
        Lark grammar referring to the answer's grammars by name. A tag that is one special
        token to llguidance (an added token, e.g. Qwen3's </think>) is matched as that token,
        after text that cannot hold it; a tag of several tokens ends a lazy lexeme (the shortest
        text that ends with it)."""
        grammars = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [{"lark_grammar": answer}]
        grammars[0]["name"] = name = grammars[0].get("name") or "answer"
        start, end = (self._tag(t) if t is not None else None for t in (p.reasoning_start, p.reasoning_end))
        if end.startswith('"'):  # text: the reasoning ends at the first end tag
            lines = [f"reasoning_text[lazy]: REASONING_TEXT {end}"]
            reasoning = "reasoning_text"
        else:
            lines, reasoning = [], f"REASONING_TEXT {end}"
        if p.reasoning_optional:
            head = f"start: @{name} | {start} {reasoning} WS @{name}"
        else:
            head = f"start: {start + '? ' if start else ''}{reasoning} WS @{name}"
        lark = "\n".join(["%llguidance {}", head, *lines, r"REASONING_TEXT: /(.|\n)*/", r"WS: /[ \t\r\n]*/"]) + "\n"
        return json.dumps({"grammars": [{"name": "jaxinfer_reasoning", "lark_grammar": lark}, *grammars]})

    def _tag(self, tag: str) -> str:
        """A reasoning tag in Lark: <[id]> when the tokenizer holds it as one special token, else its text."""
        try:
            ids = self._hf_tokenizer.encode(tag, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: match the text
            ids = []
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(tag)

    @staticmethod
    def _grammar_text(p: StructuredOutputsParams) -> str:
        try:
            if p.kind in ("json", "json_object"):
                schema = {"type": "object"} if p.kind == "json_object" else p.json
                if p.whitespace_pattern is not None:
                    options = {"whitespace_flexible": True, "whitespace_pattern": p.whitespace_pattern}
                elif p.disable_any_whitespace:
                    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
                else:
                    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
            if p.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(p.regex)
            if p.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
            return llguidance.grammar_from("grammar", p.grammar)  # Lark, or GBNF converted to Lark
        except (ValueError, TypeError) as e:
            raise GrammarError(f"structured_outputs.{p.kind}: {e}") from None

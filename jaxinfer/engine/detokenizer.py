"""Incremental detokenization: the text of a growing token list, one delta per new token.

Decoding the whole output at every step costs O(n²) over a generation, and decoding each token
alone breaks characters that span several tokens (byte-level BPE splits "é" or an emoji across
tokens) and spaces that depend on the previous token. This keeps two offsets into the token
list instead:

    prefix_offset ... read_offset ... len(tokens)
    \\____ context ___/\\___ new ____/

Each step decodes the context window with and without the new tokens; the difference is the new
text. While it ends in an incomplete character (U+FFFD from a partial byte sequence) nothing is
emitted and the offsets stay put, so the bytes complete on a later token. The window is only a
few tokens, so each step is O(1).
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, *, skip_special_tokens: bool = True,
                 context_tokens: int = 5):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Start the context inside the prompt so the first generated token gets its leading space right.
        self.tokens: list[int] = list(prompt_token_ids or [])
        self.prefix_offset = max(len(self.tokens) - context_tokens, 0)
        self.read_offset = len(self.tokens)
        self.output_start = len(self.tokens)
        self.text = ""  # the generated text so far (prompt excluded)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes (may be "")."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet (a special token skipped, or a character still incomplete)
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: emits whatever is still held back (e.g. a truncated character)."""
        rest = self._decode(self.tokens[self.prefix_offset :])[len(self._decode(self.tokens[self.prefix_offset : self.read_offset])) :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += rest
        return rest

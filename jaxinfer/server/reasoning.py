"""Reasoning content for the chat API (`jaxinfer serve --reasoning-parser qwen3|deepseek_r1`):
the thinking of a reasoning model, `<think>...</think>`, goes to `message.reasoning_content`
(`delta.reasoning_content` when streaming) and the rest to `content`, as vLLM's parsers split it.

    parser = ReasoningParser("qwen3")
    opened = parser.opened_by(prompt_text)          # the chat template left <think> open
    parser.extract("<think>hm</think>Hi", opened)   # ("hm", "Hi")
    stream = parser.stream(opened)                  # one per streamed choice
    stream.update(text_so_far) -> (reasoning_delta, content_delta); stream.update(text, finished=True) last

The split works on the text, so it holds whatever the tokenizer does with the tags (one added
token each in Qwen3 and DeepSeek-R1, several byte tokens in the tests' tokenizer). Leading
whitespace and a leading `<think>` are dropped. Then:

- deepseek_r1: the chat template puts `<think>` in the prompt, the output holds `</think>`: the
  text before the first `</think>` is reasoning, after it content; without `</think>` the whole
  output is reasoning (content None: the model was cut off while thinking).
- qwen3: the output is in a think block when it opens with `<think>` (Qwen3's templates) or the
  rendered prompt ends with an open `<think>` (`opened`: Qwen3-Thinking-2507 / Qwen3.5
  templates); the block's text up to `</think>` is reasoning, the rest content, and a block cut
  off before `</think>` is all reasoning. An output that is not in a think block is all content
  (non-thinking mode), `</think>`s included.

Streaming sends reasoning as it comes once the output is known to be in a think block, holding
back only a tail that could be the start of `</think>` (or leading whitespace that could precede
`<think>`): the deltas add up exactly to the non-streamed split, whatever the split points.

With a reasoning parser, the server applies a request's structured-output constraint to the
answer after the reasoning (`constrain`: StructuredOutputsParams' reasoning_* fields), as vLLM.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.sampling_params import StructuredOutputsParams

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"reasoning_parser={name!r}: expected one of {PARSERS}")
        self.name = name

    def opened_by(self, prompt: str | None) -> bool:
        """Whether a reply to `prompt` (the rendered chat) starts inside a think block: always for
        deepseek_r1; for qwen3 when the prompt ends with an open `<think>`."""
        return self.name == "deepseek_r1" or (prompt or "").rstrip().endswith(START)

    def stream(self, opened: bool = False) -> "ReasoningStream":
        """The splitter of one reply's growing text; `opened`: see opened_by."""
        return ReasoningStream(opened or self.name == "deepseek_r1")

    def extract(self, text: str, opened: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; reasoning None when there is none, content None
        when the reply is all reasoning (or nothing follows `</think>`)."""
        s = self.stream(opened)
        reasoning, content = s.update(text, finished=True)
        if not s.in_think:
            return None, content
        return reasoning or None, (content or None) if s.closed else None

    def constrain(self, constraint: StructuredOutputsParams, opened: bool = False) -> StructuredOutputsParams:
        """`constraint` applied to the answer after the reasoning (the reasoning is free text)."""
        if constraint.reasoning_end is not None:  # the request said where the constrained part starts
            return constraint
        opened = opened or self.name == "deepseek_r1"
        return dataclasses.replace(constraint, reasoning_end=END, reasoning_start=START, reasoning_optional=not opened)


class ReasoningStream:
    """One reply's split, fed its text as it grows (each text extends the last)."""

    def __init__(self, opened: bool):
        self.opened = opened
        self.state = "start"  # -> "reasoning" -> "content", or "start" -> "content"
        self.pos = 0  # the text before it is sent (or dropped: a leading <think>)
        self.in_think = False  # the reply is in a think block
        self.closed = False  # ... and </think> ended it

    def update(self, text: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning, content) added since the last call; `finished`: the text is whole, send the rest."""
        reasoning = ""
        if self.state == "start":
            head = text[self.pos:]
            rest = head.lstrip()
            if rest.startswith(START):
                self.pos += len(head) - len(rest) + len(START)
                self.state, self.in_think = "reasoning", True
            elif not finished and START.startswith(rest):  # only whitespace, or what may become <think>
                return "", ""
            else:
                self.state, self.in_think = ("reasoning", True) if self.opened else ("content", False)
        if self.state == "reasoning":
            end = text.find(END, self.pos)
            if end < 0:
                keep = 0 if finished else _tag_start(text, self.pos, END)
                reasoning, self.pos = text[self.pos:len(text) - keep], len(text) - keep
                return reasoning, ""
            reasoning, self.pos = text[self.pos:end], end + len(END)
            self.state, self.closed = "content", True
        content, self.pos = text[self.pos:], len(text)
        return reasoning, content


def _tag_start(text: str, pos: int, tag: str) -> int:
    """The length of the longest tail of text[pos:] that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text) - pos), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0

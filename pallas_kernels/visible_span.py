"""Where a query's visible keys start, for every attention kernel and reference.

Causal attention lets a query at position p see keys 0 .. p. Two layer kinds start later:

- a sliding window of W (Mistral, Gemma, GPT-OSS): keys p - W + 1 .. p;
- chunked local attention of C (Llama 4): the keys of p's own chunk, floor(p / C) * C .. p.

Both starts never decrease as p grows, so a block of queries needs keys from its *first* query's
start on: the kernels skip every KV block before `span_start(first query)` and mask within the
blocks they read with `key >= span_start(query)`.
"""

from __future__ import annotations


def limits_span(sliding_window: int | None, attention_chunk: int | None) -> bool:
    """Whether the span starts after position 0 for some query (static)."""
    return sliding_window is not None or attention_chunk is not None


def span_start(q_pos, *, sliding_window: int | None = None, attention_chunk: int | None = None):
    """The first key position a query at q_pos may see (q_pos: an int or an int array; the same back).

    A power-of-two chunk is found with a bit mask, which every kernel language lowers (a vector
    integer division is not lowered everywhere); other chunk sizes divide."""
    start = 0 * q_pos
    if sliding_window is not None:
        start = q_pos - (sliding_window - 1)
        start = start * (start > 0)  # max(start, 0), for Python ints and arrays alike
    if attention_chunk is not None:
        if attention_chunk & (attention_chunk - 1) == 0:
            chunk_start = q_pos & ~(attention_chunk - 1)
        else:
            chunk_start = (q_pos // attention_chunk) * attention_chunk
        start = chunk_start if sliding_window is None else _maximum(start, chunk_start)
    return start


def _maximum(a, b):
    return a + (b - a) * (b > a)

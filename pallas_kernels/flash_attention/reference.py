"""Flash attention over packed variable-length segments, in plain jnp: the truth the kernels match.

Layout (int arrays are int32):

    q            [T, Hq, D]    queries of every segment, packed one after another
    k, v         [T, Hkv, D]   keys and values of the same tokens (no cached prefix)
    cu_seq_lens  [S + 1]       segment s owns rows cu_seq_lens[s] : cu_seq_lens[s+1]
    num_seqs     [1] or []     segments in use; rows from cu_seq_lens[num_seqs] on are padding

Every segment starts at position 0, so a token's position is its row minus its segment's first
row. A query sees the keys of its own segment only:
- causal (the default): key position <= query position, and, with `sliding_window=W`, also
  key position > query position - W (the query sees the last W positions, its own included);
- `causal=False`: every key of the segment (a sliding window needs causal mode).
Scores are q.k * sm_scale, then soft_cap * tanh(score / soft_cap) when `soft_cap` is given.
GQA: query head h reads KV head h // (Hq // Hkv). Padding rows and rows that see no key come out 0.
The result has q's dtype; everything in between is float32. Padding rows of k and v must hold
finite values (a masked weight is an exact 0, and 0 * inf is NaN).

This version builds the dense [Hq, T, T] score matrix, so its memory grows with T^2: it is meant
for tests and short inputs, not for long prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def check_options(q, k, v, *, causal: bool, sliding_window: int | None, soft_cap: float | None,
                  attention_chunk: int | None = None) -> None:
    """ValueError for shapes or options the operation does not define."""
    if q.ndim != 3 or k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"expected q [T,Hq,D], k and v [T,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}")
    (T, Hq, D), (Tk, Hkv, Dk) = q.shape, k.shape
    if Tk != T or Dk != D:
        raise ValueError(f"k/v must hold the same tokens and head_dim as q: q {q.shape}, k {k.shape}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError("sliding_window must be >= 1 and needs causal=True")
    if attention_chunk is not None and (not causal or attention_chunk < 1):
        raise ValueError("attention_chunk must be >= 1 and needs causal=True")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError("soft_cap must be > 0")


def token_segments(cu_seq_lens: jax.Array, num_seqs: jax.Array, num_rows: int):
    """Which segment every row belongs to, and where that segment starts and ends.

    Returns (segment [R], seg_start [R], seg_end [R]) for rows 0..num_rows-1 (num_rows may exceed
    T: the extra rows are padding). Padding rows get segment -1 and an empty range. Entries of
    cu_seq_lens past num_seqs are ignored, so they may hold anything.
    """
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    cu = cu_seq_lens.astype(jnp.int32)
    used_end = cu[num_seqs]  # first padding row
    cu = jnp.where(jnp.arange(cu.shape[0]) <= num_seqs, cu, used_end)  # sorted, unused slots empty
    row = jnp.arange(num_rows, dtype=jnp.int32)
    # the last segment starting at or before the row; empty segments start where the next one does
    segment = jnp.searchsorted(cu, row, side="right").astype(jnp.int32) - 1
    segment = jnp.clip(segment, 0, cu.shape[0] - 2)
    is_padding = row >= used_end
    seg_start = jnp.where(is_padding, row, cu[segment])
    seg_end = jnp.where(is_padding, row, cu[segment + 1])
    return jnp.where(is_padding, -1, segment), seg_start, seg_end


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "sliding_window", "soft_cap", "attention_chunk"))
def flash_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    cu_seq_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [1]
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk: int | None = None,
) -> jax.Array:  # [T, Hq, D], q.dtype
    check_options(q, k, v, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv  # query heads per KV head
    segment, seg_start, _ = token_segments(cu_seq_lens, num_seqs, T)  # [T] each

    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    scores = jnp.einsum("qhgd,khd->hgqk", qf, k.astype(jnp.float32)) * sm_scale  # [Hkv, G, T, T]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    row = jnp.arange(T)
    visible = (segment[:, None] == segment[None, :]) & (segment[:, None] >= 0)  # [T (query), T (key)]
    if causal:
        visible &= row[None, :] <= row[:, None]
    if sliding_window is not None:
        visible &= row[None, :] > row[:, None] - sliding_window
    if attention_chunk is not None:  # positions in the sequence: rows counted from the segment's start
        pos = row - seg_start
        visible &= pos[None, :] // attention_chunk == pos[:, None] // attention_chunk
    scores = jnp.where(visible, scores, -jnp.inf)

    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows that see nothing
    p = jnp.exp(scores - row_max)  # 0 where masked
    denom = jnp.sum(p, axis=-1, keepdims=True)
    weights = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("hgqk,khd->qhgd", weights, v.astype(jnp.float32))  # [T, Hkv, G, D]
    return out.reshape(T, Hq, D).astype(q.dtype)

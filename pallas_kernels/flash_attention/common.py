"""What the TPU and GPU flash attention kernels share: input preparation in the wrapper, and the
per-block math (mask, scores, online-softmax step) inside the kernels.

Wrapper side (`prepare_inputs`):
- rows are padded to a whole number of query and KV blocks;
- heads move in front of tokens so a block is a plain [tokens, head_dim] tile:
  q -> [Hkv, G, T, D] (the G query heads that share KV head h sit together), k/v -> [Hkv, T, D];
- every row gets a segment id (padding rows: -1 on the query side, -2 on the key side, so a
  padding query never matches a padding key);
- every query row gets its segment's first row (`q_start`): a fresh prefill's position in its
  sequence is row - q_start, which chunked attention's chunk boundaries need;
- every query block gets the half-open range [kv_lo, kv_hi) of KV blocks it needs: from the block
  holding its first row's segment start (or window or chunk start, if later) to the block holding its last
  real row (causal) or its last row's segment end (non-causal). Segments are contiguous, so every
  KV block in that range holds at least one visible key; the kernels skip all the others.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.reference import token_segments
from pallas_kernels.visible_span import limits_span, span_start

QUERY_PADDING_SEGMENT = -1
KEY_PADDING_SEGMENT = -2


class PreparedInputs(NamedTuple):
    q: jax.Array  # [Hkv, G, T_pad, D]
    k: jax.Array  # [Hkv, T_pad, D]
    v: jax.Array  # [Hkv, T_pad, D]
    q_segment: jax.Array  # [T_pad] int32, QUERY_PADDING_SEGMENT on padding rows
    kv_segment: jax.Array  # [T_pad] int32, KEY_PADDING_SEGMENT on padding rows
    q_start: jax.Array  # [T_pad] int32: the first row of each query row's segment
    kv_lo: jax.Array  # [num_q_blocks] int32: first KV block the query block needs
    kv_hi: jax.Array  # [num_q_blocks] int32: one past the last (kv_lo == kv_hi: nothing to do)


def _cdiv(a, b):
    return (a + b - 1) // b


def prepare_inputs(q, k, v, cu_seq_lens, num_seqs, *, block_q, block_k, causal, sliding_window,
                   attention_chunk=None) -> PreparedInputs:
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    T_pad = _cdiv(T, math.lcm(block_q, block_k)) * math.lcm(block_q, block_k)
    pad = ((0, T_pad - T), (0, 0), (0, 0))
    q_heads = jnp.pad(q, pad).reshape(T_pad, Hkv, G, D).transpose(1, 2, 0, 3)
    k_heads = jnp.pad(k, pad).transpose(1, 0, 2)
    v_heads = jnp.pad(v, pad).transpose(1, 0, 2)

    segment, seg_start, seg_end = token_segments(cu_seq_lens, num_seqs, T_pad)  # [T_pad] each
    is_padding = segment < 0
    q_segment = jnp.where(is_padding, QUERY_PADDING_SEGMENT, segment)
    kv_segment = jnp.where(is_padding, KEY_PADDING_SEGMENT, segment)

    used_rows = jnp.sum(~is_padding)  # padding rows are exactly the tail
    first_row = jnp.arange(T_pad // block_q, dtype=jnp.int32) * block_q  # [num_q_blocks]
    last_row = jnp.clip(jnp.minimum(first_row + block_q, used_rows) - 1, 0, T_pad - 1)
    first_key = seg_start[first_row]
    if limits_span(sliding_window, attention_chunk):
        first_key += span_start(first_row - first_key, sliding_window=sliding_window, attention_chunk=attention_chunk)
    key_stop = last_row + 1 if causal else seg_end[last_row]
    has_rows = first_row < used_rows
    kv_lo = jnp.where(has_rows, first_key // block_k, 0).astype(jnp.int32)
    kv_hi = jnp.where(has_rows, _cdiv(key_stop, block_k), 0).astype(jnp.int32)
    return PreparedInputs(q_heads, k_heads, v_heads, q_segment, kv_segment, seg_start.astype(jnp.int32), kv_lo, kv_hi)


def restore_layout(out_heads: jax.Array, num_tokens: int) -> jax.Array:
    """[Hkv, G, T_pad, D] kernel output -> [T, Hq, D]."""
    Hkv, G, _, D = out_heads.shape
    return out_heads.transpose(2, 0, 1, 3)[:num_tokens].reshape(num_tokens, Hkv * G, D)


# ---- inside the kernels -------------------------------------------------------------------------


def visible_keys(q_pos, k_pos, q_seg, k_seg, *, causal, sliding_window, attention_chunk=None, q_start=None):
    """Bool mask, broadcast of q_* [bq, 1] against k_* [1, bk]: may this query see this key?

    Positions are row numbers in the packed array; within one segment they differ from the
    positions in the sequence by the same offset (q_start, the segment's first row), so comparing
    rows compares positions; a chunk's boundaries are counted from q_start.
    """
    mask = q_seg == k_seg
    if causal:
        mask &= k_pos <= q_pos
    if limits_span(sliding_window, attention_chunk):
        mask &= k_pos >= q_start + span_start(q_pos - q_start, sliding_window=sliding_window, attention_chunk=attention_chunk)
    return mask


def dot_precision(dtype):
    """HIGHEST for float32 operands (both Pallas lowerings otherwise may take one bf16 / tf32 pass),
    the default for 16-bit ones."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def attention_scores(q, k, *, sm_scale, soft_cap):
    """q [M, D] . k [N, D] -> float32 scores [M, N], scaled and soft-capped."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=dot_precision(q.dtype), preferred_element_type=jnp.float32
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def online_softmax_step(m_prev, l_prev, scores, visible):
    """Fold one KV block into the running softmax statistics of a set of query rows.

    m_prev, l_prev [..., bq, 1]: running max and sum of exp(score - max) over the keys seen so far
    (-inf and 0 before any). scores [..., bq, bk] float32; visible broadcasts against scores.
    Returns (m_next, l_next, p, alpha): p [..., bq, bk] = exp(score - m_next), 0 where not
    visible; alpha [..., bq, 1] rescales what was accumulated under m_prev. The caller updates
    its accumulator as alpha * acc + p @ v. Rows that have seen no visible key keep m = -inf and
    l = 0 without producing NaNs.
    """
    scores = jnp.where(visible, scores, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(scores - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_next = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
    return m_next, l_next, p, alpha


def normalize(acc, l):
    """acc / l, with 0 for rows that saw no key (l == 0): padding rows come out as zeros."""
    return acc / jnp.where(l == 0.0, 1.0, l)

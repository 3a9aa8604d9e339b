"""Ring attention: causal attention over a ragged batch whose tokens are split across devices.

With sequence parallelism a step's flattened tokens (many sequences packed back to back, T rows,
padding rows at the end) are cut into `n` contiguous blocks of Tl = T / n rows, block i on device
i of the mesh axis (e.g. "sequence"). Every device holds the queries, keys and values of its own
block; the per-row metadata (sequence id, position in the sequence, real token or padding) of all
T rows is replicated. A query at position p sees the keys of its own sequence at positions <= p
(and from the start of its window or chunk, `pallas_kernels.visible_span`, when the layer has one).

Each device must see every block of keys, so the K/V blocks travel around a ring: at hop j device
i holds the block that started on device (i - j) mod n, attends its own queries to it, and passes
it on to device i + 1. The partial results are combined with their log-sum-exp (lse):

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

which is exact for partials over disjoint key sets. A row that sees no key has out 0, lse -inf.

    out, lse, carry = jax.shard_map(
        functools.partial(ring_attention, axis_name="sequence", axis_size=n, sm_scale=s),
        mesh=mesh, in_specs=(P("sequence"),) * 6 + (P(),) * 3, out_specs=(P("sequence"),) * 2 + (P(),),
        check_vma=False,
    )(q, k, v, seq, pos, valid, seq, pos, valid)

Everything here is plain jnp plus `jax.lax.ppermute`; `attention_partial` and `merge_partials`
also serve outside the ring (e.g. merging with a partial over the paged cache, see
`split_kv.ragged_paged_attention(kv_end=..., return_lse=True)`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels.visible_span import limits_span, span_start


def visibility_mask(q_seq, q_pos, q_valid, k_seq, k_pos, k_valid, sliding_window=None, attention_chunk=None):
    """[Tq, Tk] bool: which keys each query may attend to (same sequence, causal, in the window or
    chunk, both real tokens). Metadata arrays are [Tq] for queries and [Tk] for keys."""
    same_seq = q_seq[:, None] == k_seq[None, :]
    causal = k_pos[None, :] <= q_pos[:, None]
    mask = same_seq & causal & q_valid[:, None] & k_valid[None, :]
    if limits_span(sliding_window, attention_chunk):
        mask &= k_pos[None, :] >= span_start(q_pos, sliding_window=sliding_window, attention_chunk=attention_chunk)[:, None]
    return mask


def attention_partial(q, k, v, q_seq, q_pos, q_valid, k_seq, k_pos, k_valid, *, sm_scale, sliding_window=None,
                      attention_chunk=None, soft_cap=None):
    """Dense masked attention of queries against one block of keys.

    q [Tq, Hq, D], k / v [Tk, Hkv, D] (GQA: Hq = G * Hkv, query head h uses KV head h // G);
    metadata [Tq] / [Tk]. Returns (out [Tq, Hq, D] float32, normalised over the visible keys, 0 where
    none; lse [Tq, Hq] float32, the log-sum-exp of the visible scores (scaled by sm_scale, then soft
    capped), -inf where none).
    """
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(Tq, Hkv, G, D)  # query head h = (h // G, h % G)
    s = jnp.einsum("qhgd,khd->hgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale  # [Hkv, G, Tq, Tk]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = visibility_mask(q_seq, q_pos, q_valid, k_seq, k_pos, k_valid, sliding_window, attention_chunk)  # [Tq, Tk]
    s = jnp.where(mask, s, -jnp.inf)

    m = s.max(axis=-1)  # [Hkv, G, Tq]; -inf where nothing is visible
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m_safe[..., None])  # 0 at hidden keys
    l = p.sum(axis=-1)  # [Hkv, G, Tq]
    o = jnp.einsum("hgqk,khd->qhgd", p, v.astype(jnp.float32))  # [Tq, Hkv, G, D]

    l_q = l.transpose(2, 0, 1)  # [Tq, Hkv, G]
    out = o / jnp.where(l_q == 0.0, 1.0, l_q)[..., None]
    lse = jnp.where(l > 0.0, m_safe + jnp.log(jnp.where(l > 0.0, l, 1.0)), -jnp.inf)  # [Hkv, G, Tq]
    return out.reshape(Tq, Hq, D), lse.transpose(2, 0, 1).reshape(Tq, Hq)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets -> (out, lse); exact, -inf safe.

    out_* [T, H, D] float32, lse_* [T, H]: each normalised over its own keys (out 0, lse -inf where it
    saw none). The result is the attention over the union of the two key sets.
    """
    lse = jnp.logaddexp(lse_a, lse_b)  # -inf only where both sides are empty
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    w_a = jnp.exp(lse_a - lse_safe)  # [T, H]; 0 for an empty side
    w_b = jnp.exp(lse_b - lse_safe)
    out = w_a[..., None] * out_a + w_b[..., None] * out_b
    return out, lse


def _block_rows(x_all, origin, block_rows):
    """Rows [origin * block_rows, (origin + 1) * block_rows) of a replicated per-row array [T]."""
    return jax.lax.dynamic_slice_in_dim(x_all, origin * block_rows, block_rows)


def ring_attention(
    q,  # [Tl, Hq, D] this device's queries
    k,  # [Tl, Hkv, D] this device's keys (RoPE already applied)
    v,  # [Tl, Hkv, D]
    q_seq,  # [Tl] int32: sequence id of this device's rows
    q_pos,  # [Tl] int32: position of each row in its sequence
    q_valid,  # [Tl] bool: real token (False: padding)
    seq_all,  # [T] int32: the same metadata for every global row, replicated
    pos_all,  # [T] int32
    valid_all,  # [T] bool
    *,
    axis_name: str,
    axis_size: int,
    sm_scale: float,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    soft_cap: float | None = None,
    carry: Any = None,
    on_block: Callable[[Any, jax.Array, jax.Array, jax.Array], Any] | None = None,
):
    """Call inside jax.shard_map over `axis_name` (size axis_size). q [Tl, Hq, D], k / v [Tl, Hkv, D]:
    this device's block; q_seq / q_pos / q_valid [Tl]: the metadata of this device's rows (rows
    i * Tl ... of the global arrays on device i); seq_all / pos_all / valid_all [T]: metadata of every
    global row (T = axis_size * Tl).

    The K/V blocks travel around the ring with jax.lax.ppermute (device i sends to i + 1); at hop j
    device i holds the block that started on device (i - j) mod axis_size, attends its own queries to
    it (attention_partial) and merges the result (merge_partials). The next block's ppermute is issued
    before the current block is used, so XLA may overlap the transfer with the compute.

    If on_block is given, it is called once for every block a device holds, its own included:
    carry = on_block(carry, k_blk, v_blk, origin) where origin is the (traced int32) index of the
    device the block came from; this is how the caller writes each block into its paged KV cache as
    it passes. Returns (out [Tl, Hq, D] float32, lse [Tl, Hq], carry).
    """
    block_rows = q.shape[0]  # Tl
    me = jax.lax.axis_index(axis_name)
    to_next_device = [(i, (i + 1) % axis_size) for i in range(axis_size)]

    out = lse = None
    k_blk, v_blk = k, v
    for hop in range(axis_size):
        if hop + 1 < axis_size:  # start passing the block on before using it
            k_next = jax.lax.ppermute(k_blk, axis_name, to_next_device)
            v_next = jax.lax.ppermute(v_blk, axis_name, to_next_device)
        origin = jnp.mod(me - hop, axis_size).astype(jnp.int32)  # device the block started on
        if on_block is not None:
            carry = on_block(carry, k_blk, v_blk, origin)
        k_seq, k_pos, k_valid = (_block_rows(x, origin, block_rows) for x in (seq_all, pos_all, valid_all))
        part = attention_partial(
            q, k_blk, v_blk, q_seq, q_pos, q_valid, k_seq, k_pos, k_valid,
            sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
        )
        out, lse = part if hop == 0 else merge_partials(out, lse, *part)
        if hop + 1 < axis_size:
            k_blk, v_blk = k_next, v_next
    return out, lse, carry


def merge_partials_across(out, lse, axis_name: str, *, scatter_rows: bool = False, sinks=None):
    """Merge partial attentions of the same rows over disjoint key sets, one per device of mesh
    axis `axis_name` (context parallelism: each device attends every query to the keys of its own
    pages). out [T, H, D] float32, lse [T, H] as `attention_partial` returns them. The maximum lse
    goes around first (pmax), then the rescaled outputs and weights are summed (psum); with
    `scatter_rows` the sums are reduce-scattered instead, so device i gets rows i * T / n ... of
    the result (its own block of the step's rows) and the traffic is a reduce-scatter's.
    `sinks` [H] (attention sinks: a logit without a value) join the denominator once. Returns
    out [T or T / n, H, D] float32, normalised, 0 for a row that saw no key."""
    m = jax.lax.pmax(lse, axis_name)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m_safe)  # [T, H]; 0 where this device saw nothing
    num, den = w[..., None] * out, w
    if scatter_rows:
        num = jax.lax.psum_scatter(num, axis_name, scatter_dimension=0, tiled=True)
        den = jax.lax.psum_scatter(den, axis_name, scatter_dimension=0, tiled=True)
        m_safe = jax.lax.dynamic_slice_in_dim(m_safe, jax.lax.axis_index(axis_name) * den.shape[0], den.shape[0])
    else:
        num, den = jax.lax.psum(num, axis_name), jax.lax.psum(den, axis_name)
    if sinks is not None:
        den = den + jnp.exp(sinks.astype(jnp.float32)[None, :] - m_safe)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]

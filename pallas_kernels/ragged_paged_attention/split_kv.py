"""Ragged paged attention as a work list of (query block, KV block) pairs: the fast XLA path.

Same inputs and result as `reference.ragged_paged_attention`, computed the way a split-KV
("flash-decoding") kernel does it, in plain jnp:

1. Queries are cut into query blocks of `num_queries_per_block` rows of one sequence, as in the
   reference.
2. Each query block needs only the KV blocks it can see: from the window start (0 without a
   sliding window) up to its last query's position. Every (query block, KV block) pair that is
   needed becomes one *work item*; nothing is padded to the longest sequence of the batch.
3. A loop takes `items_per_step` work items at a time: it gathers their pages, computes scores
   and each item's partial softmax statistics (max m, sum l, unnormalised output o).
4. Each step merges its items' partials into their query blocks' running statistics: M' = max(M,
   m), L' = exp(M - M') L + sum exp(m - M') l, O' likewise; the output is O / L.

The reference loops every query block to the batch's longest context; on a batch of decodes with
mixed lengths most of that is padding. Here the work is the sum of what each block needs, which
is what makes the XLA CPU path fast. The trip count of the loop is dynamic, the shapes static.

`contraction` chooses how an item's scores and output are formed: "dot" (batched matmuls over
(item, head), which moves K and V's head axis in front of their token axis first) or "reduce"
(products summed over the contracted axis, reading K and V in their page layout: one fused
loop, no transposed copy). With one query row per block (decode) "reduce" is up to 2x faster on
XLA:CPU (32 decodes of 512 tokens, 30 layers: 55-85 ms against 99-125 ms); with query blocks of
many rows the matmuls win.

Two options make the result a *partial* attention that can be merged with others:

- `kv_end` [S]: sequence s sees only cache positions < kv_end[s] (on top of the causal, window
  and kv_lens rules). KV blocks wholly at or past kv_end get no work item, so they are never
  read. With kv_end = kv_lens - q_lens a step attends to what earlier steps wrote and nothing of
  its own; its own keys can then be attended densely (e.g. by ring attention) and the two merged.
- `return_lse=True`: also return the log-sum-exp of the visible scores of every (row, head),
  which is what two partials over disjoint keys need to be merged exactly:
      lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
  A row that sees no key has output 0 and lse -inf.

A strided page table (`page_stride` n > 1, `page_phase` j, traced or not): column k of
`page_indices` holds the sequence's page k * n + j, so keys at positions (k * n + j) * page_size +
offset; only those pages are read. This is one device's share of a context-parallel pool
(jaxinfer.ops.attention.attend_context_parallel: page k of a sequence lives on device k % n); with
`return_lse` the n devices' partials merge into the attention over every page.

Tree masks (`tree_base`, `tree_bits` [T] int32: draft trees of speculative decoding,
`pallas_kernels.tree_mask`) narrow each row's visible keys further; the work items stay those of
the causal span (a mask only removes keys).

Combined pages (`combined.py`, the TPU layout: one row of K and V per token) are read when
`v_pages` is None and `k_pages` is [P, page_size, Hkv * 2 * Ds]: each work item gathers its rows
and splits them, so the pool is never copied whole. Quantized combined pages take their scales as
one pool, `k_scale` [P, Hkv * 2 * page_size] in (head, K|V, token) order, and `v_scale` None
(jaxinfer.ops.kv_cache).

Outlier tokens (separate quantized pages): `outliers` = (token [P, R], k_res [P, R, Hkv, D], v_res
[P, R, Hkv, D]) gives R residual slots per page; the slot holding page offset token[p, r] (-1: none)
adds its residuals to that token's dequantized K and V rows as they are read (jaxinfer.ops.kv_cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import combined as combined_layout
from pallas_kernels.ragged_paged_attention.reference import check_kv_scales, dequantize_kv, is_pool, sink_weight
from pallas_kernels.tree_mask import check_tree, tree_visible
from pallas_kernels.visible_span import limits_span, span_start

DEFAULT_KV_TOKENS_PER_BLOCK = 128


def _cdiv(a, b):
    return (a + b - 1) // b


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "attention_chunk",
        "soft_cap",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "items_per_step",
        "max_query_blocks",
        "return_lse",
        "contraction",
        "page_stride",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D], or combined pages [P, page_size, Hkv * 2 * Ds]
    v_pages: jax.Array | None,  # [P, page_size, Hkv, D]; None with combined pages
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, pages_per_seq]
    cu_q_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [] or [1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,  # Llama 4's chunked local attention (pallas_kernels.visible_span)
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,  # int8 / fp8 pages: entry * scale is the value (see reference.py)
    v_scale: float | jax.Array | None = None,
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    items_per_step: int = 32,
    seq_mask: jax.Array | None = None,  # [S] bool: serve only these sequences (others' rows come out 0)
    max_query_blocks: int | None = None,  # static bound on query blocks, when the caller knows a smaller one
    kv_end: jax.Array | None = None,  # [S] int32: sequence s sees only cache positions < kv_end[s]
    q_span_end: jax.Array | None = None,  # [T] int32: the last key position each query row sees (default: its own)
    return_lse: bool = False,  # also return lse [T, Hq] float32 (log-sum-exp of the visible scores)
    contraction: str = "dot",  # "dot" | "reduce": see the module docstring
    sinks: jax.Array | None = None,  # [Hq] float32: attention sinks (reference.py)
    outliers: tuple[jax.Array, jax.Array, jax.Array] | None = None,  # (token, k_res, v_res): module docstring
    tree_base: jax.Array | None = None,  # [T] int32: first cache position each row's tree mask covers (module docstring)
    tree_bits: jax.Array | None = None,  # [T] int32: its mask, bit j = key tree_base + j visible
    page_stride: int = 1,  # column k of page_indices holds the sequence's page k * page_stride + page_phase
    page_phase: jax.Array | int = 0,  # (a context-parallel device's share of the pages: module docstring)
) -> jax.Array | tuple[jax.Array, jax.Array]:
    if sinks is not None and return_lse:
        raise ValueError("attention sinks with return_lse: a partial attention has no sink (add it once, after merging)")
    combined = v_pages is None
    combined_scales = combined and is_pool(k_scale)  # [P, Hkv * 2 * page_size]: K's and V's scales in one pool
    if combined_scales:
        if v_scale is not None or k_scale.shape != (k_pages.shape[0], k_pages.shape[1] * 2 * combined_layout.num_heads(k_pages, q.shape[-1])):
            raise ValueError(f"combined pages {k_pages.shape} take one scale pool [pages, Hkv * 2 * page_size] as k_scale and "
                             f"no v_scale; got k_scale {getattr(k_scale, 'shape', k_scale)}, v_scale {getattr(v_scale, 'shape', v_scale)}")
    else:
        check_kv_scales(k_pages, k_pages if combined else v_pages, k_scale, v_scale)
    if outliers is not None and (combined or k_scale is None):
        raise ValueError("outliers: residual slots add to the dequantized rows of separate int8 / e4m3 K and V pages")
    if contraction not in ("dot", "reduce"):
        raise ValueError(f"contraction={contraction!r}: expected 'dot' or 'reduce'")
    T, Hq, D = q.shape
    has_tree = check_tree(tree_base, tree_bits, T)
    page_size = k_pages.shape[1]
    Hkv = combined_layout.num_heads(k_pages, D) if combined else k_pages.shape[2]
    S, pages_per_seq = page_indices.shape
    G = Hq // Hkv
    Bq = num_queries_per_block
    C = num_kv_pages_per_block or max(1, DEFAULT_KV_TOKENS_PER_BLOCK // page_size)
    C = min(C, pages_per_seq)
    kv_block = C * page_size
    max_kv_blocks = _cdiv(pages_per_seq, C)  # KV blocks of the longest possible sequence

    # ---- query blocks (as in the reference): block b = rows of sequence block_seq[b]
    num_seqs = jnp.reshape(num_seqs, ())
    seq_in_use = jnp.arange(S) < num_seqs
    if seq_mask is not None:
        seq_in_use &= seq_mask
    q_lens = jnp.where(seq_in_use, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    blocks_per_seq = _cdiv(q_lens, Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)
    NB = max_query_blocks or min(T, _cdiv(T, Bq) + S)
    b = jnp.arange(NB)
    block_valid = b < cu_blocks[-1]
    block_seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1)  # [NB]
    q_offset = (b - (cu_blocks[block_seq] - blocks_per_seq[block_seq])) * Bq
    row_in_seq = q_offset[:, None] + jnp.arange(Bq)[None, :]  # [NB, Bq]
    block_q_len = q_lens[block_seq]
    row_valid = block_valid[:, None] & (row_in_seq < block_q_len[:, None])
    rows = jnp.where(row_valid, cu_q_lens[block_seq][:, None] + row_in_seq, T)
    block_kv_len = jnp.where(block_valid, kv_lens[block_seq], 0)
    q_pos = block_kv_len[:, None] - block_q_len[:, None] + row_in_seq  # [NB, Bq]
    # keys a block may see lie below kv_visible_end (kv_lens, or kv_end when that is smaller)
    kv_visible_end = block_kv_len if kv_end is None else jnp.minimum(block_kv_len, kv_end[block_seq])  # [NB]

    qb = q[jnp.minimum(rows, T - 1)].reshape(NB, Bq, Hkv, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, Bq * G, D)  # row r: query r // G, head r % G
    if q_span_end is not None:  # a query may see keys past its own position (an image's tokens see each other)
        q_end = jnp.maximum(q_pos, jnp.where(row_valid, q_span_end[jnp.minimum(rows, T - 1)], q_pos))  # [NB, Bq]
    else:
        q_end = q_pos
    q_pos_rows = jnp.repeat(q_pos, G, axis=1)  # [NB, Bq*G]
    q_end_rows = jnp.repeat(q_end, G, axis=1)
    row_valid_rows = jnp.repeat(row_valid, G, axis=1)
    if has_tree:  # each block row's (base, bits), [NB, Bq*G] each
        tree_rows = [jnp.repeat(a[jnp.minimum(rows, T - 1)], G, axis=1) for a in (tree_base, tree_bits)]

    # ---- the KV blocks each query block needs: [first_kv_block, last_kv_block]
    last_pos = jnp.minimum(q_offset + Bq, block_q_len) - 1 + block_kv_len - block_q_len  # last query's position
    first_pos = block_kv_len - block_q_len + q_offset
    lo = span_start(first_pos, sliding_window=sliding_window, attention_chunk=attention_chunk)
    first_kv_block = lo // kv_block
    hi = last_pos if q_span_end is None else jnp.max(jnp.where(row_valid, q_end, 0), axis=1)  # last key any query of the block sees
    sees_keys = block_valid
    if kv_end is not None:
        hi = jnp.minimum(hi, kv_visible_end - 1)
        sees_keys = block_valid & (hi >= lo)  # blocks whose visible range is empty get no work item
    if page_stride == 1:
        kv_blocks_needed = jnp.where(sees_keys, hi // kv_block + 1 - first_kv_block, 0)  # [NB]
    else:  # columns of the sequence's pages lo // page_size .. hi // page_size (this phase's only)
        first_col = jnp.maximum(_cdiv(lo // page_size - page_phase, page_stride), 0)
        last_col = jnp.floor_divide(hi // page_size - page_phase, page_stride)
        sees_keys = block_valid & (hi >= lo) & (last_col >= first_col)
        first_kv_block = first_col // C
        kv_blocks_needed = jnp.where(sees_keys, last_col // C + 1 - first_kv_block, 0)
    cu_items = jnp.cumsum(kv_blocks_needed)
    num_items = cu_items[-1]

    # ---- partial results of every work item, merged per query block at the end
    W = items_per_step
    NI = _cdiv(NB * max_kv_blocks, W) * W  # static bound on work items
    pad = max_kv_blocks * C - pages_per_seq
    seq_pages = jnp.pad(page_indices, ((0, 0), (0, pad))).reshape(S, max_kv_blocks, C)

    # every work item's query block and KV block, computed once for the static bound NI
    item = jnp.arange(NI)
    item_valid_all = item < num_items
    owner = jnp.searchsorted(cu_items, item, side="right", method="compare_all")  # NB past the end
    item_block_all = jnp.minimum(owner, NB - 1)
    kv_blk_all = first_kv_block[item_block_all] + item - (cu_items[item_block_all] - kv_blocks_needed[item_block_all])
    kv_blk_all = jnp.clip(kv_blk_all, 0, max_kv_blocks - 1)
    item_pages_all = seq_pages[block_seq[item_block_all], kv_blk_all]  # [NI, C]

    def work(i, blocks):
        m_blk, l_blk, o_blk = blocks
        start = i * W
        item_valid = jax.lax.dynamic_slice_in_dim(item_valid_all, start, W)  # [W]
        item_block = jax.lax.dynamic_slice_in_dim(item_block_all, start, W)
        kv_blk = jax.lax.dynamic_slice_in_dim(kv_blk_all, start, W)
        pages = jax.lax.dynamic_slice_in_dim(item_pages_all, start, W)  # [W, C]
        if combined:
            k, v = combined_layout.split_kv(k_pages[pages], D)  # [W, C, page_size, Hkv, D] each
        else:
            k, v = k_pages[pages], v_pages[pages]
        if combined_scales:  # [W, C, Hkv * 2 * page_size] -> [W, C, page_size, Hkv] for K and for V
            k_s, v_s = combined_layout.split_scales(k_scale[pages], page_size)
        else:
            k_s = k_scale[pages] if is_pool(k_scale) else k_scale
            v_s = v_scale[pages] if is_pool(v_scale) else v_scale
        k, v = dequantize_kv(k, k_s), dequantize_kv(v, v_s)  # [W, C, page_size, Hkv, D]
        if outliers is not None:
            k, v = add_outlier_residuals(k, v, pages, *outliers)
        k, v = k.reshape(W, kv_block, Hkv, D), v.reshape(W, kv_block, Hkv, D)
        s = _scores(qb[item_block], k, contraction) * sm_scale  # [W, Hkv, Bq*G, kv_block]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = kv_blk[:, None] * kv_block + jnp.arange(kv_block)[None, :]  # [W, kv_block]
        if page_stride != 1:  # column c of the table is the sequence's page c * page_stride + page_phase
            column, offset = kv_pos // page_size, kv_pos % page_size
            kv_pos = (column * page_stride + page_phase) * page_size + offset
        qp = q_pos_rows[item_block]  # [W, Bq*G]
        mask = (kv_pos[:, None, :] <= q_end_rows[item_block][:, :, None]) & (kv_pos[:, None, :] < kv_visible_end[item_block][:, None, None])
        if limits_span(sliding_window, attention_chunk):
            mask &= kv_pos[:, None, :] >= span_start(qp, sliding_window=sliding_window, attention_chunk=attention_chunk)[:, :, None]
        if has_tree:
            mask &= tree_visible(kv_pos[:, None, :], tree_rows[0][item_block][:, :, None], tree_rows[1][item_block][:, :, None])
        mask &= row_valid_rows[item_block][:, :, None] & item_valid[:, None, None]
        s = jnp.where(mask[:, None], s, -jnp.inf)  # [W, Hkv, Bq*G, kv_block]
        m = s.max(axis=-1)  # [W, Hkv, Bq*G]; -inf where an item row sees nothing
        p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
        l = p.sum(axis=-1)
        o = _weighted_values(p, v.astype(jnp.float32), contraction)  # [W, Hkv, Bq*G, D]
        # merge the W partials into their query blocks' running (max, sum, output); several of
        # the W items may belong to one block, so the new maxima come first, then one rescale
        target = jnp.where(item_valid, item_block, NB)  # NB: dropped
        m_new = m_blk.at[target].max(m, mode="drop")  # [NB, Hkv, Bq*G]
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        keep = jnp.exp(m_blk - m_ref)  # what the block's earlier partials are worth now (0 when none)
        weight = jnp.exp(m - m_ref[item_block])  # [W, Hkv, Bq*G]; 0 for rows that saw nothing
        l_blk = (l_blk * keep).at[target].add(weight * l, mode="drop")
        o_blk = (o_blk * keep[..., None]).at[target].add(weight[..., None] * o, mode="drop")
        return m_new, l_blk, o_blk

    # Running per-block results, not per-item partials: the number of items has only a static
    # bound of NB x (KV blocks of the longest possible sequence), e.g. 768 for a 512-token prefill
    # at max_model_len 8192, and per-item buffers of that size cost more than the attention.
    blocks = (
        jnp.full((NB, Hkv, Bq * G), -jnp.inf, jnp.float32),
        jnp.zeros((NB, Hkv, Bq * G), jnp.float32),
        jnp.zeros((NB, Hkv, Bq * G, D), jnp.float32),
    )
    m_blk, l_blk, o_blk = jax.lax.fori_loop(0, _cdiv(num_items, W), work, blocks)
    l_blk = l_blk + sink_weight(sinks, m_blk, G)
    m_blk = jnp.where(m_blk == -jnp.inf, 0.0, m_blk)
    out = o_blk / jnp.where(l_blk == 0.0, 1.0, l_blk)[..., None]  # [NB, Hkv, Bq*G, D]
    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    result = result.at[rows.reshape(-1)].set(out.astype(q.dtype), mode="drop")
    if not return_lse:
        return result
    return result, _scatter_lse(m_blk, l_blk, rows, T)


def add_outlier_residuals(k, v, pages, token, k_res, v_res):
    """Dequantized rows k, v [..., page_size, Hkv, D] of pages [...] plus their outlier slots'
    residuals: slot r of page p adds k_res[p, r] / v_res[p, r] to the row at offset token[p, r]
    (residuals stored as bfloat16's bytes, uint16, are read as bfloat16)."""
    page_size = k.shape[-3]
    hit = (token[pages][..., None] == jnp.arange(page_size)).astype(jnp.float32)  # [..., R, page_size]

    def values(res):  # the gathered slots only: a bitcast of the small array
        res = res[pages]
        return (jax.lax.bitcast_convert_type(res, jnp.bfloat16) if res.dtype == jnp.uint16 else res).astype(jnp.float32)

    k = k + jnp.einsum("...rt,...rhd->...thd", hit, values(k_res))
    v = v + jnp.einsum("...rt,...rhd->...thd", hit, values(v_res))
    return k, v


def _scores(q, k, contraction: str) -> jax.Array:
    """q [W, Hkv, R, D] . k [W, kv_block, Hkv, D] -> float32 [W, Hkv, R, kv_block]."""
    if contraction == "dot":
        return jnp.einsum("whrd,wkhd->whrk", q, k, preferred_element_type=jnp.float32)
    products = q.astype(jnp.float32)[:, None] * k.astype(jnp.float32)[:, :, :, None, :]  # [W, kv_block, Hkv, R, D]
    return products.sum(axis=-1).transpose(0, 2, 3, 1)


def _weighted_values(p, v, contraction: str) -> jax.Array:
    """p [W, Hkv, R, kv_block] (float32) x v [W, kv_block, Hkv, D] -> [W, Hkv, R, D]."""
    if contraction == "dot":
        return jnp.einsum("whrk,wkhd->whrd", p, v)
    return (p.transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :]).sum(axis=1)


def _scatter_lse(m_blk, l_blk, rows, T):
    """Per-block softmax statistics -> lse [T, Hq] float32 in row order, -inf where nothing is visible.

    m_blk, l_blk [NB, Hkv, Bq*G]: the max (0 where nothing is visible) and the sum of exp(score - max)
    of every block row and head; rows [NB, Bq]: the output row of each block row (T = none).
    """
    NB, Hkv, BqG = l_blk.shape
    Bq = rows.shape[1]
    G = BqG // Bq
    lse = jnp.where(l_blk > 0.0, m_blk + jnp.log(jnp.where(l_blk > 0.0, l_blk, 1.0)), -jnp.inf)
    lse = lse.reshape(NB, Hkv, Bq, G).transpose(0, 2, 1, 3).reshape(NB * Bq, Hkv * G)  # [NB*Bq, Hq]
    result = jnp.full((T, Hkv * G), -jnp.inf, jnp.float32)
    return result.at[rows.reshape(-1)].set(lse, mode="drop")

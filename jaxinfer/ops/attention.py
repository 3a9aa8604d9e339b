"""The one attention entry point of the model: rotate q and k, write this step's K/V into the
pages, then attend.

The model calls `write_kv_and_attend` once per layer. RoPE and the KV write are one Pallas kernel
on accelerators (`rope_and_write_kv`). Which attention runs is the model's `Kernels` choice
(jaxinfer.ops.kernels):

- reference: the work-list (split-KV) jnp version from
  `pallas_kernels.ragged_paged_attention.split_kv`, which XLA compiles well on the CPU;
- Pallas (TPU or GPU): the ragged paged attention kernel of that platform, one call for the
  whole mixed batch; and in steps of at least FLASH_MIN_TOKENS tokens whose every sequence starts
  at position 0 (a fresh prefill, no cached prefix), the flash attention kernel over this step's
  own K and V instead (chosen at run time by a lax.cond).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS, RaggedBatch
from jaxinfer.ops.kernels import PREFILL_KV_TOKENS_PER_ITEM, Kernels
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.ops.quantization import hadamard, random_orthogonal
from pallas_kernels.ragged_paged_attention import split_kv
from pallas_kernels.ragged_paged_attention.reference import dequantize_kv, quantize_kv
from pallas_kernels.ragged_paged_attention.combined import combine_kv
from pallas_kernels.rope_kv_write import apply_rope
from sharding.mesh import ParallelConfig
from sharding.ring_attention import merge_partials, merge_partials_across, ring_attention

# A step this long that only prefills fresh sequences runs flash attention (Pallas kernels only).
FLASH_MIN_TOKENS = 256


def kv_write_locations(batch: RaggedBatch, page_size: int, scratch_page: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) [T] each: where each token's K/V goes in one layer's page pool.

    Padding tokens (past the last real sequence) go to the scratch page.
    """
    T = batch.token_ids.shape[0]
    S = batch.kv_lens.shape[0]
    t = jnp.arange(T)
    is_real = t < batch.cu_q_lens[batch.num_seqs[0]]
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), S - 1)  # [T]
    page = jnp.where(is_real, batch.page_table[seq, batch.positions // page_size], scratch_page)
    offset = jnp.where(is_real, batch.positions % page_size, t % page_size)
    return page, offset


def rope_and_write_kv(q, k, v, cos, sin, pool: KVCache, write_page, write_offset, kernels: Kernels = Kernels(),
                      lane_blocks: int = 1, *, first=None, prev_pages=None, tensor_axis: str | None = None):
    """RoPE on q and k, then the rotated keys and the values into their page slots.

    q [T, Hq, D], k / v [T, Hkv, D], cos / sin [T, D], `pool` the folded page pools (kv_cache),
    write_page / write_offset [T] (pool page, slot). Returns (q_rot, k_rot [T, Hkv, D], pool).
    Separate float pools: the kernel table's `rope_kv_write` (one kernel on a GPU that writes each
    token's rows into its page in place). A combined pool (TPU: a token's row cannot be DMA'd
    alone, pallas_kernels.rope_kv_write) or a quantized one: RoPE in XLA, then `write_rows`, which
    writes each token's row in place (and quantizes it for a quantized pool; `first`,
    `prev_pages` and `tensor_axis` as write_rows takes them, for its outlier tokens).
    """
    if pool.combined or pool.quantized or cos.shape[-1] != q.shape[-1]:  # (partial RoPE: the XLA path too)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, write_rows(pool, write_page, write_offset, k, v, lane_blocks, first=first, prev_pages=prev_pages,
                                tensor_axis=tensor_axis)
    q, k, k_pages, v_pages = kernels.rope_kv_write(q, k, v, cos, sin, pool.k, pool.v, write_page, write_offset)
    return q, k, dataclasses.replace(pool, k=k_pages, v=v_pages)


def write_rows(pool: KVCache, pages, offsets, k, v, lane_blocks: int = 1, *, first=None, prev_pages=None,
               tensor_axis: str | None = None) -> KVCache:
    """Rows k, v [n, Hkv, D] (after RoPE) into slots (pages [n], offsets [n]) of the pool: one
    combined row per token, or K and V in separate pools. A quantized pool's rows are turned by
    `kv_rotation` and stored as entries and a scale per head (kv_cache). lane_blocks f > 1 (a
    combined pool of a narrower KV layer group): page v is lane block v % f of pool page v // f.

    A pool with outlier slots (kv_cache) also keeps the residuals of the tokens whose rows quantize
    worst (`write_outliers`): `first` [n] bool marks the tokens that always get a slot (a
    sequence's position 0), `prev_pages` [n] each token's sequence's page before its own (-1:
    none; `outlier_history`), and `tensor_axis` names the mesh axis the KV heads are split over
    (None: all here), so every shard picks the same tokens."""
    if not pool.quantized:
        if pool.combined:
            rows = combine_kv(k, v).astype(pool.kv.dtype)
            if lane_blocks > 1:
                return dataclasses.replace(pool, kv=write_lane_block_rows(pool.kv, pages, offsets, rows, lane_blocks))
            return dataclasses.replace(pool, kv=write_page_rows(pool.kv, pages, offsets, rows))
        return dataclasses.replace(pool, k=pool.k.at[pages, offsets].set(k.astype(pool.k.dtype)),
                                   v=pool.v.at[pages, offsets].set(v.astype(pool.v.dtype)))
    if lane_blocks > 1:
        raise ValueError("a quantized KV pool holds one row width: no lane blocks")
    rotation = kv_rotation(k.shape[-1])
    k, v = k.astype(jnp.float32) @ rotation, v.astype(jnp.float32) @ rotation
    dtype = pool.pages.dtype
    if pool.outliers:
        pool = write_outliers(pool, pages, offsets, k, v, first, prev_pages, tensor_axis)
    (k, k_scale), (v, v_scale) = quantize_kv(k, dtype), quantize_kv(v, dtype)  # entries [n, Hkv, D], scales [n, Hkv]
    if not pool.combined:
        return dataclasses.replace(pool, k=pool.k.at[pages, offsets].set(k), v=pool.v.at[pages, offsets].set(v),
                                   k_scale=pool.k_scale.at[pages, offsets].set(k_scale),
                                   v_scale=pool.v_scale.at[pages, offsets].set(v_scale))
    n, Hkv = k_scale.shape
    page_size = pool.kv.shape[1]  # a folded pool: [slots * P, page_size, ...]
    # scales run (head, K|V, token) within a page: token `offset`'s 2 Hkv of them are page_size apart
    slot = offsets[:, None] + page_size * jnp.arange(2 * Hkv)[None, :]  # [n, 2 Hkv]
    scales = jnp.stack([k_scale, v_scale], axis=-1).reshape(n, 2 * Hkv)  # (head, K|V) order
    return dataclasses.replace(pool, kv=write_page_rows(pool.kv, pages, offsets, combine_kv(k, v)),
                               kv_scale=pool.kv_scale.at[pages[:, None], slot].set(scales))


def outlier_history(pool: KVCache, batch: RaggedBatch, layer_page_offset, sliding_window, attention_chunk) -> dict:
    """What a write of the step's rows needs for a pool's outlier slots (`select_outliers`): `first`
    [T] (position 0 of a sequence) and `prev_pages` [T] (the pool page holding the page_size
    positions before the row's page, -1 for none: a sequence's first page, padding, and a layer
    with a window or chunks, which may have given that page back). {} for a pool without them."""
    if not pool.outliers:
        return {}
    T, S = batch.token_ids.shape[0], batch.kv_lens.shape[0]
    t = jnp.arange(T)
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), S - 1)
    block = batch.positions // pool.pages.shape[1]
    prev = batch.page_table[seq, jnp.maximum(block - 1, 0)] + layer_page_offset
    has_prev = (block > 0) & (t < batch.cu_q_lens[batch.num_seqs[0]])
    if sliding_window is not None or attention_chunk is not None:
        has_prev = jnp.zeros_like(has_prev)
    return dict(first=batch.positions == 0, prev_pages=jnp.where(has_prev, prev, -1))


def outlier_errors(k, k_back, v, v_back, tensor_axis: str | None = None) -> jax.Array:
    """Each token's quantization error, what its outlier slot is chosen by: the squared error of
    its K and V rows summed over its heads, ||k - k_back||^2 + ||v - v_back||^2 (the scores' error
    grows with the first, the output's with the second). k, v [n, Hkv, D] turned rows, k_back,
    v_back their dequantized entries; `tensor_axis`: the heads are split over that mesh axis (the
    sum spans its shards). [n] float32. (On SmolLM2's held-out text, 4 slots per page given to each
    page's largest errors, KL of the next-token distribution from the float pool's: 0.97e-4 nats
    for int8, 1.92e-3 for fp8; by K's error alone 1.03e-4 / 1.87e-3, V's alone 0.95e-4 / 1.86e-3,
    the error relative to each row's norm 1.10e-4 / 1.99e-3, the key's norm 1.07e-4 / 2.01e-3, at
    random 1.08e-4 / 2.19e-3; plain int8 1.62e-4, fp8 3.02e-3: the measure matters little.)"""
    error = jnp.sum(jnp.sum(jnp.square(k - k_back), axis=-1) + jnp.sum(jnp.square(v - v_back), axis=-1), axis=-1)
    return jax.lax.psum(error, tensor_axis) if tensor_axis else error


def select_outliers(token, error, pages, offsets, errors, first, prev_pages):
    """Which of the written tokens take an outlier slot of their page (kv_cache). In offset order,
    a token takes the page's next free slot when it is the first token of a sequence (`first`), or
    its error is among the R largest of the page_size tokens of its sequence ending at it (itself
    and the page_size - 1 before it: its page's earlier tokens, and the later ones of the page before
    (`prev_pages`); a token without page_size - 1 before it, R of them), or the page's slots left are
    as many as its tokens left (a page's R slots are always used). Slots stay with their tokens
    (never given to a later one) until a write at offset o drops those at o and past (a page handed
    to a new sequence, a rollback): a token's slot depends only on the tokens before it, so however
    the writes were cut the same tokens hold slots.

    token [N, R] (page offsets, -1 empty) and error [N, page_size]: every page's slots and tokens'
    errors; pages, offsets, errors, first, prev_pages [n]: this write's tokens. The tokens of one
    page in one write are consecutive rows, at most page_size of them (a sequence's rows run in
    position order), so each token is compared with the page_size - 1 rows either side, never all
    n. Returns (token, error) updated and (dest [n], slot [n]): where each token's residual goes
    (dest N: nowhere)."""
    N, R = token.shape
    n, page_size = pages.shape[0], error.shape[1]
    error = error.at[pages, offsets].set(errors)  # this write's tokens join their pages' history
    lane = jnp.arange(page_size)[None, :]
    earlier = jnp.where(lane < offsets[:, None], error[pages], -jnp.inf)  # [n, page_size]: the page's tokens before
    has_prev = prev_pages >= 0
    tail = jnp.where((lane > offsets[:, None]) & has_prev[:, None], error[jnp.maximum(prev_pages, 0)], -jnp.inf)
    worse = jnp.sum(earlier > errors[:, None], axis=1) + jnp.sum(tail > errors[:, None], axis=1)
    chosen = first | ((worse < R) & (has_prev | (offsets >= R)))  # by their errors; the rest go to a page's last tokens
    reach = min(page_size, n) - 1  # rows either side that may share a token's page
    near = jnp.arange(n)[:, None] + jnp.arange(2 * reach + 1)[None, :] - reach  # [n, w]
    inside = (near >= 0) & (near < n)
    near = jnp.clip(near, 0, n - 1)
    mate = inside & (pages[near] == pages[:, None])  # [n, w]: this write's tokens in the same page, itself too
    lowest = jnp.min(jnp.where(mate, offsets[near], page_size), axis=1)  # the lowest offset this write gives the page
    slot_token = token[pages]  # [n, R]
    stays = (slot_token >= 0) & (slot_token < lowest[:, None])  # slots of earlier writes' tokens, kept
    # slots taken before each offset o of the page, were only the chosen to take them: then from the
    # first offset written now where the slots left reach the tokens left, every token takes one
    at = mate[:, :, None] & (offsets[near][:, :, None] == lane[None])  # [n, w, page_size]
    written = jnp.any(at, axis=1)  # [n, page_size]: offsets of the page this write gives
    chosen_at = jnp.any(at & chosen[near][:, :, None], axis=1)
    taken = jnp.sum(stays, axis=1)[:, None] + jnp.cumsum(chosen_at, axis=1) - chosen_at  # [n, page_size]
    fills = written & (taken <= R - page_size + lane)
    takes = chosen | jnp.any(fills & (lane <= offsets[:, None]), axis=1)
    ordinal = jnp.sum(mate & takes[near] & (offsets[near] < offsets[:, None]), axis=1)  # this write's earlier takers
    free = ~stays
    target = free & (jnp.cumsum(free, axis=1) - 1 == ordinal[:, None])  # [n, R]: the ordinal-th free slot
    slot = jnp.argmax(target, axis=1)
    dest = jnp.where(takes & jnp.any(target, axis=1), pages, N)
    token = token.at[pages].set(jnp.where(stays, slot_token, -1))  # (every token of a page writes the same row)
    return token.at[dest, slot].set(offsets, mode="drop"), error, dest, slot


def write_outliers(pool: KVCache, pages, offsets, k, v, first=None, prev_pages=None, tensor_axis: str | None = None) -> KVCache:
    """The outlier slots of a quantized pool (kv_cache) after writing turned rows k, v [n, Hkv, D]
    at (pages, offsets): each token's error (`outlier_errors`), the slots taken (`select_outliers`;
    `first` [n]: tokens that always take one), the takers' residuals (row - dequantized entries)
    stored in bfloat16 (as its bytes)."""
    dtype = pool.pages.dtype
    (kq, ks), (vq, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
    k_res, v_res = k - dequantize_kv(kq, ks), v - dequantize_kv(vq, vs)
    errors = outlier_errors(k, k - k_res, v, v - v_res, tensor_axis)
    first = jnp.zeros(errors.shape, bool) if first is None else first
    prev_pages = jnp.full(errors.shape, -1, jnp.int32) if prev_pages is None else prev_pages
    token, error, dest, slot = select_outliers(pool.outlier_token, pool.outlier_error, pages, offsets, errors, first,
                                               prev_pages)
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), pool.k_outlier.dtype)  # noqa: E731  (kv_cache.OUTLIER_DTYPE)
    return dataclasses.replace(
        pool, outlier_token=token, outlier_error=error,
        k_outlier=pool.k_outlier.at[dest, slot].set(as_bytes(k_res), mode="drop"),
        v_outlier=pool.v_outlier.at[dest, slot].set(as_bytes(v_res), mode="drop"))


def write_page_rows(pages_array: jax.Array, pages, offsets, rows) -> jax.Array:
    """rows [n, W] into a combined pool pages_array [N, page_size, W] at (pages, offsets), in place.

    One scatter, except for 8-bit pages of 32 tokens or more: a TPU tiles those in (32, 128)
    tiles, and XLA's scatter wants (8, 128) ones, so it made the step copy the whole pool to that
    layout and back (measured with libtpu: 2 pool-sized copies per step). A loop of
    dynamic_update_slice, one token's row each, updates the pool in its own layout (0 copies)."""
    if pages_array.dtype.itemsize > 1 or pages_array.shape[1] < 32:
        return pages_array.at[pages, offsets].set(rows)

    def write(i, array):
        return jax.lax.dynamic_update_slice(array, rows[i][None, None], (pages[i], offsets[i], 0))

    return jax.lax.fori_loop(0, rows.shape[0], write, pages_array)


def write_lane_block_rows(pages_array: jax.Array, pages, offsets, rows, lane_blocks: int) -> jax.Array:
    """rows [n, W] into lane block pages % f of pool pages pages // f ([N, page_size, f * W]), at
    their offsets, in place: one dynamic_update_slice per row (XLA's scatter at a computed lane
    offset would move the pool out of its tiled layout)."""
    width = rows.shape[-1]

    def write(i, array):
        at = (pages[i] // lane_blocks, offsets[i], (pages[i] % lane_blocks) * width)
        return jax.lax.dynamic_update_slice(array, rows[i][None, None], at)

    return jax.lax.fori_loop(0, rows.shape[0], write, pages_array)


@functools.cache
def kv_rotation(head_dim: int) -> np.ndarray:
    """The orthogonal [D, D] matrix a quantized pool stores K and V turned by (kv_cache): the
    normalized Hadamard matrix when D is a power of two, else a fixed random orthogonal one. A
    key's few large channels (RoPE leaves some) spread over all of them, so a row's absmax no longer
    sets a coarse grid for the rest; q turned the same way keeps every score (q R . k R = q . k),
    and the attention output over turned values is turned back by R^T. Measured on SmolLM2
    (held-out text): int8 K and V per row +0.47 % perplexity, turned -0.02 %."""
    if head_dim & (head_dim - 1) == 0:
        return hadamard(head_dim)
    return random_orthogonal(head_dim, seed=0)


def write_kv_and_attend(
    q: jax.Array,  # [T, Hq, D], before RoPE
    k: jax.Array,  # [T, Hkv, D], before RoPE
    v: jax.Array,  # [T, Hkv, D]
    cos: jax.Array,  # [T, D]: each token's rotation (layers.rope_cos_sin)
    sin: jax.Array,  # [T, D]
    pool: KVCache,  # every slot's pages in one pool: [slots * P, page_size, ...] (KVCache.fold_slots)
    layer_page_offset: jax.Array,  # scalar: slot * P, where this layer's pages start
    write_page: jax.Array,  # [T] from kv_write_locations
    write_offset: jax.Array,  # [T]
    batch: RaggedBatch,
    *,
    sm_scale: float,
    sliding_window: int | None,
    query_block: int,
    attention_chunk: int | None = None,  # Llama 4's chunked local attention (pallas_kernels.visible_span)
    spec_block: int = 0,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hq_local] float32: attention sinks (GPT-OSS)
    kernels: Kernels = Kernels(),
    parallel: ParallelConfig = ParallelConfig(),
    lane_blocks: int = 1,  # pages as lane blocks of the combined pool's (write_rows)
    pages_per_slot: int | None = None,  # this device's pages per pool slot (context parallelism: the page owners)
) -> tuple[jax.Array, KVCache]:
    """Returns (attention output [T, Hq, D], pool).

    With sequence parallelism (parallel.sp > 1) q, k and v are this device's block of the step's
    rows ([T / sp, ...]) and the rest is every row's: see `attend_sequence_parallel`.

    The caches keep one shape from the write to the read (and through the layer loop), so XLA
    updates them in place; mixing shapes of one buffer makes it copy the whole pool.
    """
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
                   sinks=sinks, query_block=query_block, spec_block=spec_block, kernels=kernels)
    if parallel.sp > 1:
        if lane_blocks > 1:
            raise ValueError("sequence parallelism over pages held as lane blocks is not supported")
        if parallel.sp_attention == "context":  # the pool sharded over the axis (context parallelism)
            del options["kernels"], options["spec_block"]  # (the XLA split-KV path only)
            return attend_context_parallel(q, k, v, cos, sin, pool, layer_page_offset, write_page, write_offset, batch,
                                           pages_per_slot=pages_per_slot, **options)
        return attend_sequence_parallel(q, k, v, cos, sin, pool, layer_page_offset, write_page, write_offset,
                                        batch, mode=parallel.sp_attention, tensor_axis="tensor" if parallel.tp > 1 else None,
                                        **options)
    q, k, pool = rope_and_write_kv(q, k, v, cos, sin, pool, layer_page_offset + write_page, write_offset, kernels, lane_blocks,
                                   **outlier_history(pool, batch, layer_page_offset, sliding_window, attention_chunk),
                                   tensor_axis="tensor" if parallel.tp > 1 else None)
    return paged_attention(q, k, v, pool, layer_page_offset, batch, lane_blocks=lane_blocks, **options), pool


def write_latent_and_attend(
    q: jax.Array,  # [T, Hq, D]: queries against the latent rows, RoPE applied ([q_latent | q_rope])
    rows: jax.Array,  # [T, D]: this step's latent rows, RoPE applied ([c | k_rope])
    pool: KVCache,  # the latent pool, slots folded: kv [slots * P, page_size, W]
    layer_page_offset: jax.Array,  # scalar: slot * P
    write_page: jax.Array,  # [T]
    write_offset: jax.Array,  # [T]
    batch: RaggedBatch,
    *,
    value_dim: int,
    sm_scale: float,
    query_block: int,
    spec_block: int = 0,
    kernels: Kernels = Kernels(),
) -> tuple[jax.Array, KVCache]:
    """Multi-head latent attention's write and read (jaxinfer.models.deepseek): each token's row
    into its page slot (`write_latent_rows`), then every head's attention over the rows:
    (out [T, Hq, value_dim], pool). A quantized pool holds the rows turned by `kv_rotation`: q is
    turned the same way, and the attention's whole output row turned back before its values are kept."""
    pool = write_latent_rows(pool, rows, layer_page_offset, write_page, write_offset)
    options = dict(sm_scale=sm_scale, query_block=query_block, spec_block=spec_block)
    page_table = batch.page_table + layer_page_offset
    if not pool.quantized:
        return kernels.mla_attention(q, pool.kv, page_table, batch, value_dim=value_dim, **options), pool
    D = q.shape[-1]
    rotation = kv_rotation(D)
    out = kernels.mla_attention((q.astype(jnp.float32) @ rotation).astype(q.dtype), pool.kv, page_table, batch, value_dim=D,
                                scales=pool.kv_scale, **options)  # [T, Hq, D], turned
    return (out.astype(jnp.float32) @ rotation.T)[..., :value_dim].astype(q.dtype), pool


SPARSE_QUERY_BLOCK = 16  # queries per block of sparse_latent_attention: [block, context, row] gathered at a time


def sparse_latent_attention(
    q: jax.Array,  # [T, Hq, D]: absorbed queries [q_latent | q_rope], RoPE applied
    q_index: jax.Array,  # [T, Hi, Di]: the indexer's queries, RoPE applied
    index_weights: jax.Array,  # [T, Hi] float32: each indexer head's weight (times Hi ** -0.5)
    pages: jax.Array,  # [pages, page_size, W]: latent rows [c | k_rope | k_index | padding], written
    page_table: jax.Array,  # [S, P]: each sequence's pages, as indices of `pages`
    batch: RaggedBatch,
    *,
    value_dim: int,
    topk: int,
    sm_scale: float,
) -> jax.Array:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) over a latent pool, in XLA: each query
    scores every earlier position of its sequence with the indexer,

        index(t, s) = sum_h weight_h(t) * relu(q_index_h(t) . k_index(s) / sqrt(Di)),

    keeps its `topk` best (causal), and attends over those rows only (the MLA score of
    `write_latent_and_attend`; values: the rows' first value_dim dims). Returns [T, Hq, value_dim]
    float32. Queries go SPARSE_QUERY_BLOCK at a time, each block gathering its sequences' whole
    contexts [block, P * page_size, W]: memory linear in the context, time quadratic over a prefill."""
    if batch.tree_base is not None:
        raise ValueError("tree attention masks (draft trees) with DeepSeek sparse attention (its indexer's top-k) "
                         "are not supported")
    T, D = q.shape[0], q.shape[-1]
    Di, S = q_index.shape[-1], page_table.shape[0]
    context = page_table.shape[1] * pages.shape[1]
    block = math.gcd(T, SPARSE_QUERY_BLOCK)
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)  # [T]

    def attend(args):
        q, q_index, weights, seq, position = args  # one block of queries
        rows = pages[page_table[seq]].reshape(block, context, pages.shape[-1])  # [block, C, W]
        causal = jnp.arange(context)[None] <= position[:, None]  # [block, C]
        index = jnp.einsum("thd,tcd->thc", q_index.astype(jnp.float32), rows[..., D : D + Di].astype(jnp.float32))
        index = jnp.einsum("th,thc->tc", weights, jax.nn.relu(index * Di**-0.5))
        _, picked = jax.lax.top_k(jnp.where(causal, index, -jnp.inf), min(topk, context))  # [block, k]
        keep = jnp.zeros((block, context), bool).at[jnp.arange(block)[:, None], picked].set(True) & causal
        scores = jnp.einsum("thd,tcd->thc", q, rows[..., :D], preferred_element_type=jnp.float32) * sm_scale
        p = jax.nn.softmax(jnp.where(keep[:, None], scores, -jnp.inf), axis=-1)  # [block, Hq, C]
        return jnp.einsum("thc,tcv->thv", p, rows[..., :value_dim].astype(jnp.float32))

    blocks = [a.reshape(T // block, block, *a.shape[1:]) for a in (q, q_index, index_weights, seq, batch.positions)]
    return jax.lax.map(attend, blocks).reshape(T, q.shape[1], value_dim)


def write_latent_rows(pool: KVCache, rows, layer_page_offset, write_page, write_offset) -> KVCache:
    """rows [T, D] into their page slots of the latent pool, in place (zero past D when the pool
    pads its rows); a quantized pool's turned by `kv_rotation`, as entries and one scale per row."""
    width, pages = pool.kv.shape[-1], layer_page_offset + write_page
    if not pool.quantized:
        rows = jnp.pad(rows, ((0, 0), (0, width - rows.shape[-1]))).astype(pool.kv.dtype)
        return dataclasses.replace(pool, kv=write_page_rows(pool.kv, pages, write_offset, rows))
    entries, scales = quantize_kv(rows.astype(jnp.float32) @ kv_rotation(rows.shape[-1]), pool.kv.dtype)  # [T, D], [T]
    entries = jnp.pad(entries, ((0, 0), (0, width - entries.shape[-1])))
    return dataclasses.replace(pool, kv=write_page_rows(pool.kv, pages, write_offset, entries),
                               kv_scale=pool.kv_scale.at[pages, write_offset].set(scales))


def takes_flash_path(batch: RaggedBatch, num_tokens: int, *, query_block: int, kernels: Kernels) -> jax.Array | bool:
    """Whether a step attends over its own K/V by flash attention instead of the pages: a platform
    with a flash kernel, a prefill bucket of at least FLASH_MIN_TOKENS tokens, and (decided on the
    device) no sequence with a cached prefix. False when it never can; else a traced bool."""
    if kernels.flash_attention is None or query_block == 1 or num_tokens < FLASH_MIN_TOKENS:
        return False
    return fresh_prefill(batch)


def fresh_prefill(batch: RaggedBatch) -> jax.Array:
    """Whether no sequence of the step has a cached prefix (every one starts at position 0): a traced bool."""
    S = batch.kv_lens.shape[0]
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    in_use = jnp.arange(S) < batch.num_seqs[0]
    return jnp.all(jnp.where(in_use, batch.kv_lens == q_lens, True))


def attend_written_kv(q, cos, sin, pool: KVCache, layer_page_offset, batch: RaggedBatch, *, num_kv_heads: int, sm_scale,
                      sliding_window, query_block: int, attention_chunk: int | None = None, spec_block: int = 0,
                      soft_cap: float | None = None, sinks=None, kernels: Kernels = Kernels(), lane_blocks: int = 1) -> jax.Array:
    """Attention of q [T, Hq, D] (before RoPE) over K/V another layer has written into these pages
    this step and before (Gemma 4's KV-shared layers): RoPE on q, then the paged attention (never
    the flash path, which reads a layer's own fresh K/V). [T, Hq, D]."""
    q = apply_rope(q, cos, sin)
    no_kv = jnp.zeros((q.shape[0], num_kv_heads, q.shape[-1]), q.dtype)  # (only its shape is read)
    return paged_attention(q, no_kv, no_kv, pool, layer_page_offset, batch, sm_scale=sm_scale, sliding_window=sliding_window,
                           query_block=query_block, attention_chunk=attention_chunk, spec_block=spec_block,
                           soft_cap=soft_cap, sinks=sinks, kernels=kernels, flash=False, lane_blocks=lane_blocks)


def paged_attention(q, k, v, pool: KVCache, layer_page_offset, batch: RaggedBatch, *, sm_scale, sliding_window,
                    query_block: int, attention_chunk: int | None = None, spec_block: int = 0, soft_cap: float | None = None, sinks=None,
                    kernels: Kernels = Kernels(), flash: bool = True, lane_blocks: int = 1) -> jax.Array:
    """Attention of this step's queries q [T, Hq, D] (rotated; K/V already in the pages) over one
    layer's pages; k, v [T, Hkv, D] are this step's own rotated keys and values (flash attention
    of a fresh prefill reads them instead of the pages). [T, Hq, D].

    spec_block > 0 (speculative decoding): sequences of 2 .. spec_block queries (verifying drafted
    tokens; any number of them) get a pass of their own with query blocks of spec_block.

    Draft trees: a batch with tree masks (`batch.tree_base`, `tree_bits`: pallas_kernels.tree_mask)
    reaches the kernel table's attention with them (every implementation honours them). The flash
    path (causal over the step's own K/V) stays open to it: it runs only when every sequence starts
    at position 0, and a tree's root always follows a cached prefix, so such a step holds no tree
    rows (their masks there are plain causal). Images attended both ways (`span_end`) cannot be
    combined with them."""
    page_table = batch.page_table + layer_page_offset
    lanes = {"lane_blocks": lane_blocks} if lane_blocks > 1 else {}  # (the TPU kernel's option)

    def on_pages(attend, q, **extra):  # attend(q, ...) over the pages, a quantized pool's rotation undone around it
        options = dict(num_kv_heads=k.shape[1], sm_scale=sm_scale, sliding_window=sliding_window,
                       attention_chunk=attention_chunk, soft_cap=soft_cap, sinks=sinks, **extra)
        if not pool.quantized:
            return attend(q, pool.pages, pool.v, page_table, batch, **options)
        rotation = kv_rotation(q.shape[-1])  # the pool holds K and V turned: turn q, and the output back
        if pool.outliers:  # (given only then: attention implementations without the option take none)
            options["outliers"] = outlier_slots(pool)
        out = attend((q.astype(jnp.float32) @ rotation).astype(q.dtype), pool.pages, pool.v, page_table, batch,
                     k_scale=pool.scales, v_scale=pool.v_scale, **options)
        return (out.astype(jnp.float32) @ rotation.T).astype(q.dtype)

    def paged():
        return on_pages(kernels.ragged_attention, q, query_block=query_block, spec_block=spec_block, **lanes)

    tree = batch.tree_base is not None
    if tree and batch.span_end is not None:
        raise ValueError("tree attention masks (draft trees) with images attended both ways (span_end) are not supported")
    fresh_prefill = takes_flash_path(batch, q.shape[0], query_block=query_block, kernels=kernels)
    if not flash or fresh_prefill is False or sinks is not None:
        out = paged()  # (the flash kernels have no attention sinks)
    else:
        flash = lambda: kernels.flash_attention(q, k, v, batch.cu_q_lens, batch.num_seqs, causal=True, sm_scale=sm_scale,  # noqa: E731
                                                sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk)
        out = jax.lax.cond(fresh_prefill, flash, paged)
    if batch.span_end is not None:
        if lane_blocks > 1:
            raise ValueError("images attended both ways over pages held as lane blocks are not supported")
        out = attend_images_both_ways(out, q, batch, lambda q, seq_mask: on_pages(
            _xla_span_attention, q, query_block=query_block, seq_mask=seq_mask))
    return out


def attend_images_both_ways(out: jax.Array, q: jax.Array, batch: RaggedBatch, attend_spans) -> jax.Array:
    """Gemma 3's image tokens see every token of their own image, later ones too (the mask is
    causal OR same-image; a sliding window still bounds it from below). The kernels attend
    causally; the rows of image tokens whose image goes on past them are then attended again by
    the XLA split-KV path with each query's span ending at `batch.span_end` (its image's last
    position), and replace the causal rows. The step holds each such image whole (the scheduler
    never cuts one), so its keys are all in the pages. out, q: [T, Hq, D]."""
    T, S = q.shape[0], batch.kv_lens.shape[0]
    sees_ahead = batch.span_end > batch.positions  # [T]
    seq_of_token = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)
    in_batch = jnp.arange(T) < batch.cu_q_lens[-1]
    seq_has_image = jnp.zeros(S, bool).at[seq_of_token].max(sees_ahead & in_batch)  # [S]
    both_ways = attend_spans(q, seq_mask=seq_has_image)
    return jnp.where(sees_ahead[:, None, None], both_ways, out)


def outlier_slots(pool: KVCache) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A folded pool's outlier slots as the XLA attention reads them: (token [N, R], k_res, v_res
    [N, R, Hkv, D]), or None without them (split_kv)."""
    return (pool.outlier_token, pool.k_outlier, pool.v_outlier) if pool.outliers else None


def _xla_span_attention(q, k_pages, v_pages, page_table, batch: RaggedBatch, *, num_kv_heads: int, sm_scale, sliding_window,
                        attention_chunk, soft_cap, sinks, query_block: int, seq_mask, k_scale=None, v_scale=None,
                        outliers=None) -> jax.Array:
    """The split-KV attention of the sequences in seq_mask [S], each query seeing keys up to its span_end."""
    del num_kv_heads
    page_size = k_pages.shape[1]
    T, S = q.shape[0], batch.kv_lens.shape[0]
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    return split_kv.ragged_paged_attention(
        q, k_pages, v_pages, batch.kv_lens, page_table, batch.cu_q_lens, batch.num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, outliers=outliers, num_queries_per_block=query_block, num_kv_pages_per_block=max(1, PREFILL_KV_TOKENS_PER_ITEM // page_size), items_per_step=8,
        seq_mask=seq_mask & (q_lens > 1), max_query_blocks=min(T, -(-T // query_block) + min(S, MAX_PREFILL_CHUNKS)),
        q_span_end=batch.span_end)


# ----------------------------------------------------------------------------- sequence parallelism
def local_view(batch: RaggedBatch, first_row, num_rows: int) -> RaggedBatch:
    """The rows first_row : first_row + num_rows of a ragged batch as a ragged batch of their own.

    Each sequence keeps the part of its queries that falls in the rows (maybe none), and its
    kv_lens becomes the length after its last query there, so query i of the part still sits at
    kv_lens - q_len + i: every attention implementation runs unchanged on it.
    """
    cu = batch.cu_q_lens
    q_lens = cu[1:] - cu[:-1]
    end_in_rows = jnp.clip(first_row + num_rows - cu[:-1], 0, q_lens)  # [S]: how many of its queries end before the rows' end
    local_rows = lambda a: jax.lax.dynamic_slice_in_dim(a, first_row, num_rows)  # noqa: E731
    tree = {name: local_rows(getattr(batch, name)) for name in ("tree_base", "tree_bits", "tree_rope")
            if getattr(batch, name) is not None}  # draft trees' per-row masks (and RoPE positions)
    return dataclasses.replace(
        batch,
        token_ids=local_rows(batch.token_ids),
        positions=local_rows(batch.positions),
        token_src=local_rows(batch.token_src),
        cu_q_lens=jnp.clip(cu - first_row, 0, num_rows),
        kv_lens=batch.kv_lens - q_lens + end_in_rows,
        **tree,
    )


def attend_sequence_parallel(q, k, v, cos, sin, pool: KVCache, layer_page_offset, write_page, write_offset,
                             batch: RaggedBatch, *, mode: str, sm_scale, sliding_window, query_block: int,
                             attention_chunk: int | None = None,
                             spec_block: int = 0, soft_cap: float | None = None, sinks=None, kernels: Kernels = Kernels(),
                             tensor_axis: str | None = None):
    """Attention with the step's rows split over the mesh axis "sequence" (sp devices), the KV
    pool replicated over it (modes "allgather" and "ring"; "context", the pool split over the
    axis too, is `attend_context_parallel`).

    q [Tl, Hq, D], k / v [Tl, Hkv, D]: this device's block of rows (before RoPE); cos / sin /
    write_page / write_offset [T] and the batch: every row's (T = sp * Tl). The KV cache is
    replicated over the axis, so every device writes all T rows' K/V into its pages and later
    steps (decodes) need nothing special. Two ways to get the other devices' K/V:

    - "allgather": all-gather K and V, write them, then run the usual paged attention for this
      device's queries (their `local_view` of the batch): the kernels apply unchanged;
    - "ring" (ring attention): the K/V blocks travel around the ring (`sharding.ring_attention`);
      at each hop a device writes the block it holds into its pages and attends its queries to
      it with an online softmax, never holding more than two blocks; the cached part of each
      sequence (earlier steps) is one more partial, from the pages (split-KV, `kv_end`), merged
      in. Both give the same result; the ring overlaps communication with compute.
    Returns (out [Tl, Hq, D], pool).
    """
    sp = jax.lax.axis_size("sequence")
    Tl = q.shape[0]
    first_row = jax.lax.axis_index("sequence") * Tl
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, first_row, Tl)  # noqa: E731  (this device's rows of a [T, ...] array)
    q, k = apply_rope(q, mine(cos), mine(sin)), apply_rope(k, mine(cos), mine(sin))
    pages = layer_page_offset + write_page
    view = local_view(batch, first_row, Tl)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap)

    if mode == "allgather":
        options["sinks"] = sinks
        k_all = jax.lax.all_gather(k, "sequence", axis=0, tiled=True)  # [T, Hkv, D]
        v_all = jax.lax.all_gather(v, "sequence", axis=0, tiled=True)
        pool = write_rows(pool, pages, write_offset, k_all, v_all, tensor_axis=tensor_axis,
                          **outlier_history(pool, batch, layer_page_offset, sliding_window, attention_chunk))
        out = paged_attention(q, k, v, pool, layer_page_offset, view, query_block=query_block,
                              spec_block=spec_block, kernels=kernels, **options)
        return out, pool

    if sinks is not None:
        raise NotImplementedError("attention sinks with ring attention (sequence parallelism): use sp_attention='allgather'")
    if batch.tree_base is not None:  # the ring attends the step's own keys causally, without the rows' masks
        raise NotImplementedError("tree attention masks (draft trees) with ring attention (sequence parallelism): "
                                  "use sp_attention='allgather'")
    if pool.outliers:  # each device writes the blocks in its own ring order: a page's slots would differ between them
        raise NotImplementedError("KV outlier slots with ring attention (sequence parallelism): use sp_attention='allgather'")
    T = Tl * sp
    S = batch.kv_lens.shape[0]
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    seq_all = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)  # [T]
    valid_all = jnp.arange(T) < batch.cu_q_lens[batch.num_seqs[0]]
    Hkv, D = k.shape[1:]
    q_cached, scales = q, {}
    if pool.quantized:  # turned K / V in the pool (kv_rotation): q turned, the output turned back
        q_cached = (q.astype(jnp.float32) @ kv_rotation(D)).astype(q.dtype)
        scales = dict(k_scale=pool.scales, v_scale=pool.v_scale)
    cached_out, cached_lse = split_kv.ragged_paged_attention(  # earlier steps' K/V, from the pages (kv: combined)
        q_cached, pool.pages, pool.v, view.kv_lens, view.page_table + layer_page_offset,
        view.cu_q_lens, view.num_seqs,
        kv_end=batch.kv_lens - q_lens, return_lse=True, num_queries_per_block=query_block,
        num_kv_pages_per_block=max(1, PREFILL_KV_TOKENS_PER_ITEM // pool.pages.shape[1]), **scales, **options,
    )
    if pool.quantized:
        cached_out = cached_out.astype(jnp.float32) @ kv_rotation(D).T

    def write_block(pool, k_block, v_block, origin):
        rows = origin * Tl + jnp.arange(Tl)
        return write_rows(pool, pages[rows], write_offset[rows], k_block, v_block)

    ring_out, ring_lse, pool = ring_attention(
        q, k, v, mine(seq_all), mine(batch.positions), mine(valid_all), seq_all, batch.positions, valid_all,
        axis_name="sequence", axis_size=sp, carry=pool, on_block=write_block, **options,
    )
    out, _ = merge_partials(cached_out, cached_lse, ring_out, ring_lse)
    return out.astype(q.dtype), pool


# ----------------------------------------------------------------------------- context parallelism
def context_page_owner(pages, pages_per_device: int):
    """(owner, local page) of replica-local page ids `pages` in a pool sharded over the axis
    "sequence": device j holds pages j * pages_per_device ... (j + 1) * pages_per_device - 1 of
    its replica (a contiguous block, `jaxinfer.runtime.placement`), its first one a scratch page."""
    return pages // pages_per_device, pages % pages_per_device


def context_local_table(page_table, device, sp: int, pages_per_device: int):
    """This device's share of a page table [S, pages_per_seq] (replica-local page ids): column k
    holds the sequence's page k * sp + device, which the block manager gives from this device's
    block (`BlockManager(kv_shards=sp)`), as a local page id; a column past the row's end, or a
    page not held here (the scratch page of a sliding window's dropped pages), reads local page 0."""
    S, n = page_table.shape
    cols = -(-n // sp)
    padded = jnp.pad(page_table, ((0, 0), (0, cols * sp - n)))
    mine = jnp.take(padded.reshape(S, cols, sp), device, axis=2)  # [S, cols]
    owner, local = context_page_owner(mine, pages_per_device)
    return jnp.where(owner == device, local, 0)


def attend_context_parallel(q, k, v, cos, sin, pool: KVCache, layer_page_offset, write_page, write_offset,
                            batch: RaggedBatch, *, pages_per_slot: int | None, sm_scale, sliding_window, query_block: int,
                            attention_chunk: int | None = None, soft_cap: float | None = None, sinks=None):
    """Context parallelism: attention with the step's rows AND the KV pool split over the mesh axis
    "sequence" (sp devices). Each device holds its replica's pages j * Pl ... (j + 1) * Pl - 1
    (Pl = `pages_per_slot`, the pool's pages per slot on this device), and a sequence's page k lies
    on device k % sp (the block manager's round robin), so every device holds about 1/sp of every
    sequence, and of every decode's work.

    q [Tl, Hq, D], k / v [Tl, Hkv, D]: this device's block of the step's rows (before RoPE); cos /
    sin / write_page / write_offset [T] and the batch: every row's (T = sp * Tl). The step's K/V
    are all-gathered; each row is written by the owner of its page only (the others write it to
    their local scratch page 0). The queries are all-gathered too, and each device attends all
    of them to the keys of its own pages (the split-KV XLA path over its strided share of the
    page table: `context_local_table`, `page_stride`), with their log-sum-exp; the sp partials
    are merged exactly and reduce-scattered, so each device gets its own rows back
    (`sharding.ring_attention.merge_partials_across`). The Pallas kernels are not used (they read
    whole page tables): on accelerators this is the XLA path. Returns (out [Tl, Hq, D], pool)."""
    if pages_per_slot is None:
        raise ValueError("context parallelism (sequence_parallel_attention='context') needs the pool's pages per slot")
    if pool.outliers:
        raise NotImplementedError("KV outlier slots (kv_cache_outliers) with sequence_parallel_attention='context' are "
                                  "not supported: use sequence_parallel_attention='allgather'")
    if batch.span_end is not None:
        raise NotImplementedError("images attended both ways with sequence_parallel_attention='context' are not supported")
    sp = jax.lax.axis_size("sequence")
    me = jax.lax.axis_index("sequence")
    Tl = q.shape[0]
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * Tl, Tl)  # noqa: E731  (this device's rows of a [T, ...] array)
    q, k = apply_rope(q, mine(cos), mine(sin)), apply_rope(k, mine(cos), mine(sin))
    gather = lambda a: jax.lax.all_gather(a, "sequence", axis=0, tiled=True)  # noqa: E731
    q_all, k_all, v_all = gather(q), gather(k), gather(v)  # [T, ...]

    owner, local = context_page_owner(write_page, pages_per_slot)
    pool = write_rows(pool, layer_page_offset + jnp.where(owner == me, local, 0), write_offset, k_all, v_all)

    D = q.shape[-1]
    table = context_local_table(batch.page_table, me, sp, pages_per_slot) + layer_page_offset
    scales = {}
    if pool.quantized:  # turned K / V in the pool (kv_rotation): q turned, the output turned back
        q_all = (q_all.astype(jnp.float32) @ kv_rotation(D)).astype(q_all.dtype)
        scales = dict(k_scale=pool.scales, v_scale=pool.v_scale)
    out, lse = split_kv.ragged_paged_attention(
        q_all, pool.pages, pool.v, batch.kv_lens, table, batch.cu_q_lens, batch.num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap, return_lse=True,
        num_queries_per_block=query_block, num_kv_pages_per_block=max(1, PREFILL_KV_TOKENS_PER_ITEM // pool.pages.shape[1]),
        page_stride=sp, page_phase=me, tree_base=batch.tree_base, tree_bits=batch.tree_bits, **scales)
    out = merge_partials_across(out.astype(jnp.float32), lse, "sequence", scatter_rows=True, sinks=sinks)  # [Tl, Hq, D]
    if pool.quantized:
        out = out @ kv_rotation(D).T
    return out.astype(q.dtype), pool

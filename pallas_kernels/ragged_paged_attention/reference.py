"""Ragged paged attention in plain jnp: the truth every kernel is held to, and the CPU path.

One call serves a whole mixed batch: sequences prefilling a chunk and sequences decoding one
token, their queries flattened into one array. Keys and values are read straight from the page
pool through each sequence's row of the page table; nothing is copied into a contiguous cache.

Layout (all int arrays are int32):

    q             [T, Hq, D]           queries of all sequences, sequence s owning rows
                                       cu_q_lens[s] : cu_q_lens[s+1]
    k_pages       [P, page_size, Hkv, D]
    v_pages       [P, page_size, Hkv, D]
    kv_lens       [S]                  tokens in the cache for sequence s, this step's included
    page_indices  [S, pages_per_seq]   page ids of sequence s, in order
    cu_q_lens     [S + 1]              cumulative query lengths
    num_seqs      [] or [1]            sequences in use; slots >= num_seqs are padding

The i-th query of sequence s sits at position kv_lens[s] - q_len[s] + i and attends causally to
cache positions <= its own (and > position - sliding_window when a window is given). Query rows
past cu_q_lens[num_seqs] are padding and come out as zeros.

Attention sinks (GPT-OSS): `sinks` [Hq] gives each query head one more logit that every query
scores but that carries no value: softmax over (scores, sink), the sink's column dropped, i.e. the
output is sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)).

Tree masks (speculative decoding with draft trees, `pallas_kernels.tree_mask`): `tree_base`,
`tree_bits` [T] int32 give each query row the first cache position its mask covers and the mask's
32 bits; a key is then visible only if it is before the base or its bit is set (on top of the
causal and window rules). Rows outside a tree carry base = their position + 1, bits = 0.

Options: `sliding_window` (a query sees the last `sliding_window` positions, its own included),
`soft_cap` (scores become soft_cap * tanh(score / soft_cap) before the softmax), and int8 or
float8_e4m3fn pages with scales `k_scale` / `v_scale`: entry * scale is the value, the scale
either one float for the whole pool (the Pallas kernels' form) or a pool of its own,
[P, page_size, Hkv] float32, one per token and head (what jaxinfer's quantized KV cache stores:
jaxinfer.ops.kv_cache).

How it computes (the same tiling a kernel uses, written with gathers):
- queries are cut into *query blocks* of `num_queries_per_block` rows of one sequence, so a block
  reads its sequence's keys once however many queries it holds (1 for pure decode, more for
  prefill chunks);
- keys and values are read `num_kv_pages_per_block` pages at a time, in a loop that runs only as far
  as the longest sequence, with an online softmax carrying (max, sum, accumulator) across blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from pallas_kernels.tree_mask import check_tree, tree_visible
from pallas_kernels.visible_span import limits_span, span_start

DEFAULT_KV_TOKENS_PER_BLOCK = 128

# KV pages may be stored quantized (module docstring): the value a page entry stands for is
# entry * scale, dequantized in float32 as the pages are read. uint8 pages hold e4m3 entries as
# their bytes (a scale pool's form, `E4M3_BYTES`).
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8))
E4M3_BYTES = jnp.dtype(jnp.uint8)


def storage_dtype(dtype):
    """The dtype a pool of `dtype` entries is stored in: e4m3 as its bytes (uint8), since XLA:CPU
    scatters into a float8 array by converting the whole array (measured: 1.3 s for the 30
    writes of a step into a 60 000-page pool, against 0.02 ms as bytes); others as they are."""
    return E4M3_BYTES if jnp.dtype(dtype) == jnp.float8_e4m3fn else jnp.dtype(dtype)


def entry_dtype(stored) -> jnp.dtype:
    """The inverse of storage_dtype: what a pool's stored dtype holds."""
    return jnp.dtype(jnp.float8_e4m3fn) if jnp.dtype(stored) == E4M3_BYTES else jnp.dtype(stored)
KV_QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}  # what a row's absmax maps to


def check_kv_scales(k_pages, v_pages, k_scale, v_scale) -> None:
    """ValueError unless quantized pages come with their scale (a float, or an array of the
    pages' shape without head_dim) and float pages without one."""
    for name, pages, scale in (("k", k_pages, k_scale), ("v", v_pages, v_scale)):
        quantized = pages.dtype in QUANTIZED_KV_DTYPES
        if quantized and scale is None:
            raise ValueError(f"{name}_pages are {pages.dtype}: pass {name}_scale (the float they are multiplied by)")
        if not quantized and scale is not None:
            raise ValueError(f"{name}_scale is given but {name}_pages are {pages.dtype}, not int8/float8_e4m3fn")
        if is_pool(scale) and tuple(scale.shape) != tuple(pages.shape[:-1]):
            raise ValueError(f"{name}_scale of shape {tuple(scale.shape)}: expected one per token and head, "
                             f"{tuple(pages.shape[:-1])}")


def is_pool(scale) -> bool:
    """A per-token scale pool (an array of rank > 0), rather than one float for the whole pool."""
    return getattr(scale, "ndim", 0) > 0


def dequantize_kv(x: jax.Array, scale) -> jax.Array:
    """Quantized K or V values [..., D] -> float32: x * scale, the scale a float or [...] (one per
    row, gathered like x); float pages pass through unchanged."""
    if scale is None:
        return x
    if x.dtype == E4M3_BYTES:  # e4m3 bytes (gathered rows only: a bitcast of the small array)
        x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    return x.astype(jnp.float32) * (scale[..., None] if is_pool(scale) else scale)


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (entries [..., D] in `dtype` (int8 / e4m3, or uint8: e4m3 bytes), scales [...]
    float32): each row by its own absmax, rounded to nearest (int8) or cast (e4m3). An all-zero
    row has scale 0."""
    entries = entry_dtype(dtype)
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / KV_QUANT_MAX[entries]
    scaled = xf / jnp.where(scale > 0, scale, 1.0)[..., None]
    if entries == jnp.int8:
        scaled = jnp.round(scaled)
    q = scaled.astype(entries)
    return (jax.lax.bitcast_convert_type(q, E4M3_BYTES) if jnp.dtype(dtype) == E4M3_BYTES else q), scale


def _cdiv(a, b):
    return (a + b - 1) // b


def sink_weight(sinks: jax.Array | None, m: jax.Array, G: int) -> jax.Array | float:
    """exp(sink - m) for each row of the softmax statistics m [..., Hkv, R] (row r: query head
    h * G + r % G; m the row's running max, -inf where it saw nothing): what a sink adds to the
    softmax's denominator (0 without sinks). sinks [Hq]."""
    if sinks is None:
        return 0.0
    Hkv, R = m.shape[-2:]
    sink_rows = sinks.astype(jnp.float32).reshape(Hkv, G)[:, jnp.arange(R) % G]  # [Hkv, R]
    return jnp.exp(sink_rows - jnp.where(m == -jnp.inf, 0.0, m))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "attention_chunk", "soft_cap", "num_queries_per_block", "num_kv_pages_per_block"),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array | None = None,  # a float, or [P, page_size, Hkv] (module docstring)
    v_scale: float | jax.Array | None = None,
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    sinks: jax.Array | None = None,  # [Hq] float32: each head's sink logit (GPT-OSS; module docstring)
    tree_base: jax.Array | None = None,  # [T] int32: first cache position each row's tree mask covers (module docstring)
    tree_bits: jax.Array | None = None,  # [T] int32: its mask, bit j = key tree_base + j visible
) -> jax.Array:
    check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    T, Hq, D = q.shape
    has_tree = check_tree(tree_base, tree_bits, T)
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    S, pages_per_seq = page_indices.shape
    G = Hq // Hkv  # query heads per KV head
    Bq = num_queries_per_block
    C = num_kv_pages_per_block or max(1, DEFAULT_KV_TOKENS_PER_BLOCK // page_size)
    C = min(C, pages_per_seq)
    kv_block = C * page_size  # tokens per KV block

    # ---- query blocks: block b covers rows [q_start[b], q_start[b] + Bq) of sequence block_seq[b]
    num_seqs = jnp.reshape(num_seqs, ())
    seq_in_use = jnp.arange(S) < num_seqs
    q_lens = jnp.where(seq_in_use, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    blocks_per_seq = _cdiv(q_lens, Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)  # [S]
    NB = min(T, _cdiv(T, Bq) + S)  # static bound on the number of query blocks
    b = jnp.arange(NB)
    block_valid = b < cu_blocks[-1]
    block_seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1)  # [NB]
    q_offset = (b - (cu_blocks[block_seq] - blocks_per_seq[block_seq])) * Bq  # first query of the block, within its sequence
    row_in_seq = q_offset[:, None] + jnp.arange(Bq)[None, :]  # [NB, Bq]
    row_valid = block_valid[:, None] & (row_in_seq < q_lens[block_seq][:, None])
    rows = jnp.where(row_valid, cu_q_lens[block_seq][:, None] + row_in_seq, T)  # T = out of range: dropped
    block_kv_len = jnp.where(block_valid, kv_lens[block_seq], 0)  # [NB]
    q_pos = block_kv_len[:, None] - q_lens[block_seq][:, None] + row_in_seq  # [NB, Bq]

    # [NB, Bq, Hkv, G, D] -> [NB, Hkv, Bq*G, D]; row r of a block is query r // G, head r % G
    qb = q[jnp.minimum(rows, T - 1)].reshape(NB, Bq, Hkv, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, Bq * G, D)
    q_pos_rows = jnp.repeat(q_pos, G, axis=1)  # [NB, Bq*G]
    row_valid_rows = jnp.repeat(row_valid, G, axis=1)
    if has_tree:  # each block row's (base, bits), [NB, Bq*G] each
        tree_rows = [jnp.repeat(a[jnp.minimum(rows, T - 1)], G, axis=1) for a in (tree_base, tree_bits)]

    # page table rows of each block, padded to whole KV blocks
    pad = (-pages_per_seq) % C
    block_pages = jnp.pad(page_indices, ((0, 0), (0, pad)))[block_seq]  # [NB, pages]
    num_kv_blocks = _cdiv(jnp.max(block_kv_len), kv_block)

    def kv_step(j, carry):
        m, l, acc = carry  # [NB, Hkv, Bq*G], same, [NB, Hkv, Bq*G, D]
        pages = jax.lax.dynamic_slice_in_dim(block_pages, j * C, C, axis=1)  # [NB, C]
        k, v = (dequantize_kv(pool[pages], scale[pages] if is_pool(scale) else scale).reshape(NB, kv_block, Hkv, D)
                .transpose(0, 2, 1, 3) for pool, scale in ((k_pages, k_scale), (v_pages, v_scale)))  # [NB, Hkv, kv_block, D]
        s = jnp.einsum("bhqd,bhkd->bhqk", qb, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * kv_block + jnp.arange(kv_block)  # [kv_block]
        mask = (kv_pos[None, None, :] <= q_pos_rows[:, :, None]) & (kv_pos[None, None, :] < block_kv_len[:, None, None])
        if limits_span(sliding_window, attention_chunk):
            first = span_start(q_pos_rows, sliding_window=sliding_window, attention_chunk=attention_chunk)
            mask &= kv_pos[None, None, :] >= first[:, :, None]
        if has_tree:
            mask &= tree_visible(kv_pos[None, None, :], tree_rows[0][:, :, None], tree_rows[1][:, :, None])
        mask &= row_valid_rows[:, :, None]
        s = jnp.where(mask[:, None], s, -jnp.inf)  # [NB, Hkv, Bq*G, kv_block]
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32))
        return m_new, l, acc

    init = (
        jnp.full((NB, Hkv, Bq * G), -jnp.inf, jnp.float32),
        jnp.zeros((NB, Hkv, Bq * G), jnp.float32),
        jnp.zeros((NB, Hkv, Bq * G, D), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, num_kv_blocks, kv_step, init)
    l = l + sink_weight(sinks, m, G)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]  # [NB, Hkv, Bq*G, D]
    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    return result.at[rows.reshape(-1)].set(out.astype(q.dtype), mode="drop")

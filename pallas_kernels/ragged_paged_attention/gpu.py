"""Ragged paged attention for GPUs: a split-KV ("flash-decoding") Pallas kernel, Triton lowering.

Same inputs, keywords and result as `reference.ragged_paged_attention` (read its docstring for the
layout and the masking rules), plus tuning keywords and `interpret`.

Why the Triton lowering (`jax.experimental.pallas.triton`) and not Mosaic GPU: Mosaic GPU kernels
have no interpret mode in this JAX (0.10.2), and the project verifies every kernel on the CPU with
`interpret=True`. This kernel has only been run in interpret mode. It is written to the Triton
rules (every block dimension a power of two, dots at least 16 x 16, masked loads where a block is
wider than the data), and the tests lower it for a CUDA GPU on the CPU (`.lower(lowering_platforms=
("cuda",))`), which runs the Pallas-to-Triton lowering; Triton's own compiler has not seen it.

How it computes:

1. Query blocks (jnp, before the kernel). Queries are cut into blocks of `num_queries_per_block`
   (Bq) rows of one sequence, as in the reference. For each block and each KV head the G = Hq/Hkv
   query heads sharing that KV head are laid out as rows (row r = query r // G, head r % G), so a
   program reads each key and value once for all of them. The rows are padded to R, a power of two
   >= 16, and head_dim to Dp, a power of two >= 16; the padding is masked out. Gathering q into
   this layout copies q once, which is small next to the KV pages the kernel reads.

2. The kernel. Grid (query block b, KV head h, KV split j), every axis independent. The KV tiles a
   block can see run from its window start (0 without a sliding window) to its last query's
   position; they are shared out evenly among the `num_kv_splits` splits. A program walks its
   share tile by tile: it reads the page ids from the page table (in global memory), loads the K
   and V rows of those pages straight from the page pools (masked: positions past the sequence's
   length are never read), and keeps an online softmax (max m, sum l, unnormalised output o).
   Padding query blocks and splits past a block's last tile run zero tiles and store (-inf, 0, 0).

3. Merging the splits (jnp, after the kernel): M = max_j m_j, w_j = exp(m_j - M),
   out = sum_j w_j o_j / sum_j w_j l_j, then the rows go back to their tokens. This is plain jnp,
   not a second Pallas kernel: it is a few elementwise ops and a sum over a short axis that XLA
   fuses into the scatter back to [T, Hq, D], which has to happen anyway and which a Triton kernel
   would do no better.

The partial results cost num_kv_splits x (query rows) x Hq x Dp float32 values of memory; for
prefill-heavy batches, where the query blocks already fill the GPU, use num_kv_splits=1.

Tree masks (`tree_base`, `tree_bits` [T] int32: draft trees of speculative decoding,
`pallas_kernels.tree_mask`): each block's rows' (base, bits) come in as two more blocks [R] int32
beside q (padding rows: base 0, bits 0, masked anyway), and `tree_visible` joins the mask. The
tiles walked are those of the causal span (a mask only removes keys). A static option: a call
without them compiles exactly as before.

Quantized pages (int8 / float8_e4m3fn, per-tensor scales): each tile is converted to the dot's
input dtype in the kernel, which is exact (int8 and e4m3 values are exact in bfloat16 and
float32), and the scales are applied where they commute with the dots: k_scale multiplies the
scores together with sm_scale, v_scale the output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.ragged_paged_attention.reference import check_kv_scales, sink_weight
from pallas_kernels.tree_mask import check_tree, tree_visible
from pallas_kernels.visible_span import limits_span, span_start

DEFAULT_KV_TOKENS_PER_BLOCK = 64  # KV tokens per tile when num_kv_pages_per_block is not given
# ... and at most this many K (or V) entries per tile: a tile of 64 tokens x head_dim 512 in
# bfloat16, double-buffered, asked an H100 for 272 KiB of shared memory (it has 227): measured
MAX_KV_TILE_ENTRIES = 64 * 256
# ... and a program's query rows (query block x the G heads sharing a KV head) times head_dim at
# most this: GLM-4.5's 12 heads per KV head in query blocks of 64 (1024 rows of 128) asked an H100
# for 320 KiB (compiled by the CUDA plugin); the query block shrinks to fit (a tuning, not a result)
MAX_QUERY_TILE_ENTRIES = 256 * 128
DEFAULT_NUM_KV_SPLITS = 4
MIN_BLOCK_DIM = 16  # Triton dots need every dimension >= 16


def _cdiv(a, b):
    return (a + b - 1) // b


def triton_dim(n: int) -> int:
    """The smallest power of two >= max(n, 16): a block dimension Triton accepts."""
    return max(MIN_BLOCK_DIM, pl.next_power_of_2(n))


class QueryBlocks(NamedTuple):
    """Where each query block's rows come from and which KV tiles it needs; every field [NB] int32
    except `rows`."""

    rows: jax.Array  # [NB, Bq] token row of each query, T for padding
    seq: jax.Array  # the block's sequence
    kv_len: jax.Array  # that sequence's KV length (0 for padding blocks)
    first_pos: jax.Array  # position of the block's first query
    num_queries: jax.Array  # real queries in the block (0 for padding blocks)
    first_tile: jax.Array  # first KV tile any of its queries can see
    num_tiles: jax.Array  # KV tiles from first_tile to its last query's tile (0 for padding blocks)


def query_blocks(kv_lens, cu_q_lens, num_seqs, *, T, Bq, tile_tokens, sliding_window, attention_chunk) -> QueryBlocks:
    S = kv_lens.shape[0]
    seq_in_use = jnp.arange(S) < jnp.reshape(num_seqs, ())
    q_lens = jnp.where(seq_in_use, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    blocks_per_seq = _cdiv(q_lens, Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)  # [S]
    NB = min(T, _cdiv(T, Bq) + S)  # static bound on the number of query blocks
    b = jnp.arange(NB)
    block_valid = b < cu_blocks[-1]
    seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1)  # [NB]
    q_offset = (b - (cu_blocks[seq] - blocks_per_seq[seq])) * Bq  # first query of the block, within its sequence
    num_queries = jnp.where(block_valid, jnp.minimum(q_lens[seq] - q_offset, Bq), 0)
    row_in_seq = q_offset[:, None] + jnp.arange(Bq)[None, :]  # [NB, Bq]
    rows = jnp.where(jnp.arange(Bq)[None, :] < num_queries[:, None], cu_q_lens[seq][:, None] + row_in_seq, T)
    kv_len = jnp.where(block_valid, kv_lens[seq], 0)
    first_pos = kv_len - q_lens[seq] + q_offset
    last_pos = first_pos + num_queries - 1
    lo = span_start(first_pos, sliding_window=sliding_window, attention_chunk=attention_chunk)
    first_tile = lo // tile_tokens
    num_tiles = jnp.where(num_queries > 0, jnp.maximum(last_pos // tile_tokens + 1 - first_tile, 0), 0)
    as_i32 = lambda x: x.astype(jnp.int32)
    return QueryBlocks(rows, *map(as_i32, (seq, kv_len, first_pos, num_queries, first_tile, num_tiles)))


def _kernel(
    # per query block, [NB] each: read at this program's block
    seq_ref, kv_len_ref, first_pos_ref, num_queries_ref, first_tile_ref, num_tiles_ref,
    page_indices_ref,  # [S, pages_per_seq] (global memory)
    q_ref,  # [R, Dp]: block b's queries x the G heads of KV head h
    k_pages_ref,  # [P, page_size, Hkv, D] (global memory)
    v_pages_ref,  # [P, page_size, Hkv, D] (global memory)
    # with has_tree: tree_base_ref, tree_bits_ref, [R] int32 each (the block rows' tree masks); then
    #   o_ref: [R, Dp] float32, unnormalised output of this split
    #   m_ref: [R] float32, running max of the scores
    #   l_ref: [R] float32, sum of exp(score - max)
    *refs,
    has_tree,
    G, page_size, tile_tokens, tile_width, head_dim, num_kv_splits,
    sm_scale, sliding_window, attention_chunk, soft_cap, k_scale, v_scale,
):
    tree_refs, (o_ref, m_ref, l_ref) = (refs[:2], refs[2:]) if has_tree else ((), refs)
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, Dp = q_ref.shape
    seq, kv_len = seq_ref[b], kv_len_ref[b]

    # rows: query r // G of the block, at position first_pos + r // G
    row = jnp.arange(R)
    row_valid = row < num_queries_ref[b] * G  # padding rows, padding blocks: nothing
    q_pos = first_pos_ref[b] + row // G  # [R]
    d = jnp.arange(Dp)
    d_valid = d < head_dim  # [Dp]
    q = q_ref[...]  # [R, Dp]
    if has_tree:
        tree_base, tree_bits = (ref[...][:, None] for ref in tree_refs)  # [R, 1] each
    dot_dtype = q.dtype  # quantized K/V tiles are converted to it (exactly)
    # float32 dots in full precision (Triton's default for them is tf32), bfloat16 as they come
    dot = functools.partial(
        jnp.dot, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None,
    )
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    def kv_tile(tile, carry):
        m, l, acc = carry  # [R], [R], [R, Dp]
        col = jnp.arange(tile_width)
        kv_pos = tile * tile_tokens + col  # [N]
        in_seq = (col < tile_tokens) & (kv_pos < kv_len)  # tokens to read
        page = plt.load(page_indices_ref.at[seq, kv_pos // page_size], mask=in_seq, other=0)  # [N]
        # one gather index per element (interpret mode cannot mix index arrays with slices)
        at = (page[:, None], (kv_pos % page_size)[:, None], h, d[None, :])  # -> [N, Dp]
        kv_mask = in_seq[:, None] & d_valid[None, :]
        # masked-off entries are undefined (no `other`: Triton cannot splat a constant into fp8);
        # zero them after the (exact) conversion so they add nothing to the dots
        load = lambda ref: jnp.where(kv_mask, plt.load(ref.at[at], mask=kv_mask).astype(dot_dtype), 0)
        k, v = load(k_pages_ref), load(v_pages_ref)  # [N, Dp]

        s = dot(q, k.T) * score_scale  # [R, N]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = row_valid[:, None] & in_seq[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if limits_span(sliding_window, attention_chunk):
            visible &= kv_pos[None, :] >= span_start(q_pos, sliding_window=sliding_window, attention_chunk=attention_chunk)[:, None]
        if has_tree:  # draft trees: each row's keys narrowed by its (base, bits)
            visible &= tree_visible(kv_pos[None, :], tree_base, tree_bits)
        s = jnp.where(visible, s, -jnp.inf)

        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that see nothing yet: exp(-inf) = 0
        p = jnp.exp(s - m_safe[:, None])  # [R, N]
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=1)
        pv = dot(p.astype(dot_dtype), v)
        return m_new, l, alpha[:, None] * acc + pv

    # this split's share of the block's tiles; past the block's last tile it runs none
    first_tile, num_tiles = first_tile_ref[b], num_tiles_ref[b]
    tiles_per_split = _cdiv(num_tiles, num_kv_splits)
    start = first_tile + split * tiles_per_split
    stop = jnp.minimum(start + tiles_per_split, first_tile + num_tiles)
    init = (
        jnp.full((R,), -jnp.inf, jnp.float32),
        jnp.zeros((R,), jnp.float32),
        jnp.zeros((R, Dp), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(start, stop, kv_tile, init)
    if v_scale is not None:
        acc = acc * v_scale
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def merge_splits(o, m, l, sinks=None, G=1):
    """Partials of each split -> normalised output. o [J, NB, Hkv, R, Dp], m and l [J, NB, Hkv, R];
    sinks [Hq] (attention sinks) add to each row's denominator."""
    m_max = m.max(axis=0)
    l_sink = sink_weight(sinks, m_max, G)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)  # rows no split saw anything for
    w = jnp.exp(m - m_max[None])  # [J, NB, Hkv, R]; 0 for empty splits
    l_sum = (w * l).sum(axis=0) + l_sink
    o_sum = (w[..., None] * o).sum(axis=0)
    return o_sum / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]  # [NB, Hkv, R, Dp]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "attention_chunk", "soft_cap", "k_scale", "v_scale", "num_queries_per_block",
        "num_kv_pages_per_block", "num_kv_splits", "num_warps", "num_stages", "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hkv, D]
    v_pages: jax.Array,  # [P, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, pages_per_seq]
    cu_q_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [] or [1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    sinks: jax.Array | None = None,  # [Hq] float32: attention sinks (reference.py), added when the splits merge
    tree_base: jax.Array | None = None,  # [T] int32: tree masks (module docstring; pallas_kernels.tree_mask)
    tree_bits: jax.Array | None = None,  # [T] int32
) -> jax.Array:
    """Attention of a ragged batch over paged K/V; [T, Hq, D] in q's dtype (see the module docstring).

    Tuning: `num_queries_per_block` query tokens per block (times G heads, padded to a power of two,
    makes the rows of a program); `num_kv_pages_per_block` pages per KV tile (default: 64 tokens'
    worth; a tile is padded to a power of two >= 16 tokens); `num_kv_splits` programs sharing one
    block's KV tiles; `num_warps` / `num_stages` go to Triton.
    """
    check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    T, Hq, D = q.shape
    has_tree = check_tree(tree_base, tree_bits, T)
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    S, pages_per_seq = page_indices.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if min(num_queries_per_block, num_kv_splits, num_kv_pages_per_block or 1) < 1:
        raise ValueError("num_queries_per_block, num_kv_pages_per_block and num_kv_splits must be >= 1")
    G = Hq // Hkv
    Bq = num_queries_per_block
    while Bq > 1 and triton_dim(Bq * G) * triton_dim(D) > MAX_QUERY_TILE_ENTRIES:
        Bq //= 2
    default_tokens = min(DEFAULT_KV_TOKENS_PER_BLOCK, MAX_KV_TILE_ENTRIES // triton_dim(D))
    C = min(num_kv_pages_per_block or max(1, default_tokens // page_size), pages_per_seq)
    tile_tokens = C * page_size  # KV tokens per tile
    R, N, Dp = triton_dim(Bq * G), triton_dim(tile_tokens), triton_dim(D)  # rows, tile width, head_dim

    blocks = query_blocks(kv_lens, cu_q_lens, num_seqs, T=T, Bq=Bq, tile_tokens=tile_tokens, sliding_window=sliding_window,
                          attention_chunk=attention_chunk)
    NB = blocks.rows.shape[0]

    # [NB, Bq, Hq, D] -> [NB, Hkv, Bq*G, D] -> padded [NB, Hkv, R, Dp]; row r = query r // G, head r % G
    qb = q[jnp.minimum(blocks.rows, T - 1)].reshape(NB, Bq, Hkv, G, D)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, Bq * G, D)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, R - Bq * G), (0, Dp - D)))

    tree_inputs, tree_specs = (), []
    if has_tree:  # each block row's (base, bits), laid out like its queries and padded to R rows: [NB, R] each
        tree_inputs = tuple(jnp.pad(jnp.repeat(a[jnp.minimum(blocks.rows, T - 1)], G, axis=1), ((0, 0), (0, R - Bq * G)))
                            for a in (tree_base, tree_bits))
        tree_specs = [pl.BlockSpec((None, R), lambda b, h, j: (b, 0))] * 2

    kernel = functools.partial(
        _kernel, has_tree=has_tree, G=G, page_size=page_size, tile_tokens=tile_tokens, tile_width=N, head_dim=D,
        num_kv_splits=num_kv_splits, sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk,
        soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale,
    )
    whole = pl.no_block_spec  # the array stays in global memory; the kernel indexes it
    J = num_kv_splits
    if interpret:
        patch_interpret_mode()
    o, m, l = pl.pallas_call(
        kernel,
        grid=(NB, Hkv, J),
        in_specs=[whole] * 7
        + [pl.BlockSpec((None, None, R, Dp), lambda b, h, j: (b, h, 0, 0)), whole, whole] + tree_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, R, Dp), lambda b, h, j: (j, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, j: (j, b, h, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, j: (j, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((J, NB, Hkv, R, Dp), jnp.float32),
            jax.ShapeDtypeStruct((J, NB, Hkv, R), jnp.float32),
            jax.ShapeDtypeStruct((J, NB, Hkv, R), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.ragged_paged_attention(
            query_rows=NB * Bq, query_blocks=NB, Hq=Hq, Hkv_stored=Hkv, D=D, kv_tokens_per_block=pages_per_seq * page_size,
            q_itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize,
        ),
        name="ragged_paged_attention_split_kv",
    )(
        blocks.seq, blocks.kv_len, blocks.first_pos, blocks.num_queries, blocks.first_tile, blocks.num_tiles,
        page_indices.astype(jnp.int32), qb, k_pages, v_pages, *tree_inputs,
    )

    out = merge_splits(o, m, l, sinks, G)[:, :, : Bq * G, :D]  # [NB, Hkv, Bq*G, D]
    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    return result.at[blocks.rows.reshape(-1)].set(out.astype(q.dtype), mode="drop")

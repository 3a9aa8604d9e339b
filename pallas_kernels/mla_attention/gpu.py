"""Ragged paged MLA attention for GPUs: a split-KV Pallas kernel, Triton lowering.

The inputs and result of `reference.mla_attention` (the package docstring), plus tuning keywords.
It is the GQA kernel's scheme (`pallas_kernels.ragged_paged_attention.gpu`: query blocks, KV tiles
walked with an online softmax, splits merged in jnp) with two differences MLA's shapes ask for:

* Head blocks. All Hq heads share the one latent row, but 128 heads x 512 values of float32
  accumulator do not fit one program, so the grid is (query block, head block, KV split): a
  program's rows are its block's queries x Hb heads (row i: query i // Hb, head i % Hb of the
  block), at most `MAX_ROWS_X_VALUE` accumulator entries (64 rows of 512 values). Each program
  reads the rows of its tiles once for its Hb heads.
* The row in two parts. Triton blocks are powers of two and D = 576 is not: the row is read as its
  latent part [N, r] (r = 512) and its rope part [N, Dr] (64), both straight from the page, so
  scores = q_latent c^T + q_rope k_rope^T and the accumulator is p c, [R, r]. Nothing is padded to
  1024 and no K or V is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import cost
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.ragged_paged_attention.gpu import _cdiv, merge_splits, query_blocks, triton_dim

# Defaults measured on an H100 (scripts/mla_gpu_sweep.py: DeepSeek-V3 decode, 64 sequences x 4096
# tokens, bf16): 64 rows, tiles of 32 tokens, 2 splits, 8 warps took 0.985 ms; 32 rows and 4 splits
# 2.37 ms, 16 rows 1.9 to 3.7 ms; 128 rows or 64 rows with 64-token tiles ask for more than the 227
# KiB of shared memory. (Fewer sequences than 64 may want more splits.)
MAX_ROWS_X_VALUE = 64 * 512  # a program's query rows x value_dim (float32 accumulator)
KV_TILE_ENTRIES = 32 * 512  # a KV tile's tokens x value_dim: 32 KiB of bfloat16 per stage at r = 512
DEFAULT_NUM_KV_SPLITS = 2


def _kernel(
    # per query block, [NB] each
    seq_ref, kv_len_ref, first_pos_ref, num_queries_ref, first_tile_ref, num_tiles_ref,
    page_indices_ref,  # [S, pages_per_seq] (global memory)
    q_latent_ref,  # [R, r]: block b's queries x the Hb heads of head block h
    q_rope_ref,  # [R, Dr]
    pages_ref,  # [P, page_size, W] (global memory): rows [c | k_rope]
    o_ref,  # [R, r] float32, unnormalised output of this split
    m_ref,  # [R] float32
    l_ref,  # [R] float32
    *,
    Hb, page_size, tile_tokens, tile_width, value_dim, rope_dim, num_kv_splits, sm_scale,
):
    b, split = pl.program_id(0), pl.program_id(2)
    R = q_latent_ref.shape[0]
    Dr = q_rope_ref.shape[1]
    seq, kv_len = seq_ref[b], kv_len_ref[b]
    row = jnp.arange(R)
    row_valid = row < num_queries_ref[b] * Hb
    q_pos = first_pos_ref[b] + row // Hb  # [R]
    q_latent, q_rope = q_latent_ref[...], q_rope_ref[...]
    dot_dtype = q_latent.dtype
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None)
    latent_cols = jnp.arange(value_dim)
    rope_cols = jnp.arange(Dr)

    def kv_tile(tile, carry):
        m, l, acc = carry  # [R], [R], [R, r]
        col = jnp.arange(tile_width)
        kv_pos = tile * tile_tokens + col  # [N]
        in_seq = (col < tile_tokens) & (kv_pos < kv_len)
        page = plt.load(page_indices_ref.at[seq, kv_pos // page_size], mask=in_seq, other=0)  # [N]
        page, offset = page[:, None], (kv_pos % page_size)[:, None]

        def load(cols, mask_cols):  # [N, width] of the rows, zero where masked
            mask = in_seq[:, None] & mask_cols[None, :]
            return jnp.where(mask, plt.load(pages_ref.at[page, offset, cols[None, :]], mask=mask).astype(dot_dtype), 0)

        latent = load(latent_cols, latent_cols < value_dim)  # [N, r]
        k_rope = load(value_dim + rope_cols, rope_cols < rope_dim)  # [N, Dr]
        s = (dot(q_latent, latent.T) + dot(q_rope, k_rope.T)) * sm_scale  # [R, N]
        visible = row_valid[:, None] & in_seq[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * acc + dot(p.astype(dot_dtype), latent)

    first_tile, num_tiles = first_tile_ref[b], num_tiles_ref[b]
    tiles_per_split = _cdiv(num_tiles, num_kv_splits)
    start = first_tile + split * tiles_per_split
    stop = jnp.minimum(start + tiles_per_split, first_tile + num_tiles)
    init = (jnp.full((R,), -jnp.inf, jnp.float32), jnp.zeros((R,), jnp.float32), jnp.zeros((R, value_dim), jnp.float32))
    m, l, acc = jax.lax.fori_loop(start, stop, kv_tile, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def head_block(num_heads: int, max_rows: int) -> int:
    """Heads per program: the largest divisor of num_heads that is at most max_rows."""
    return max(d for d in range(1, min(num_heads, max_rows) + 1) if num_heads % d == 0)


@functools.partial(jax.jit, static_argnames=("value_dim", "sm_scale", "num_queries_per_block", "num_kv_pages_per_block",
                                             "num_kv_splits", "max_rows", "num_warps", "num_stages", "interpret"))
def mla_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, value_dim: int, sm_scale: float = 1.0,
                  num_queries_per_block: int = 8, num_kv_pages_per_block: int | None = None,
                  num_kv_splits: int = DEFAULT_NUM_KV_SPLITS, max_rows: int | None = None, num_warps: int = 8,
                  num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """[T, Hq, value_dim] (the package docstring). value_dim must be a power of two >= 16.

    Tuning: `max_rows` query rows (queries x heads) per program (default MAX_ROWS_X_VALUE / value_dim),
    `num_kv_pages_per_block` pages per KV tile (default KV_TILE_ENTRIES / value_dim tokens),
    `num_kv_splits` programs sharing a block's tiles, `num_warps` / `num_stages` to Triton."""
    T, Hq, D = q.shape
    page_size, W = latent_pages.shape[1], latent_pages.shape[2]
    S, pages_per_seq = page_indices.shape
    r, rope = value_dim, D - value_dim
    if r != triton_dim(r) or rope < 1 or W < D:
        raise ValueError(f"latent rows of {W} entries for queries of {D} with values of {r}: the values must be a power "
                         "of two >= 16 followed by at least one rope dim, all within the row")
    max_rows = max_rows or max(1, MAX_ROWS_X_VALUE // r)
    Hb = head_block(Hq, max_rows)
    Bq = max(1, min(num_queries_per_block, max_rows // Hb))
    R, Dr = triton_dim(Bq * Hb), triton_dim(rope)
    C = min(num_kv_pages_per_block or max(1, (KV_TILE_ENTRIES // r) // page_size), pages_per_seq)
    tile_tokens = C * page_size
    N = triton_dim(tile_tokens)
    HB = Hq // Hb

    blocks = query_blocks(kv_lens, cu_q_lens, num_seqs, T=T, Bq=Bq, tile_tokens=tile_tokens, sliding_window=None,
                          attention_chunk=None)
    NB = blocks.rows.shape[0]
    # [NB, Bq, Hq, D] -> [NB, HB, Bq * Hb, D] -> rows padded to R; row i = query i // Hb, head i % Hb of the block
    qb = q[jnp.minimum(blocks.rows, T - 1)].reshape(NB, Bq, HB, Hb, D).transpose(0, 2, 1, 3, 4).reshape(NB, HB, Bq * Hb, D)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, R - Bq * Hb), (0, 0)))
    q_latent = qb[..., :r]
    q_rope = jnp.pad(qb[..., r:], ((0, 0), (0, 0), (0, 0), (0, Dr - rope)))

    kernel = functools.partial(_kernel, Hb=Hb, page_size=page_size, tile_tokens=tile_tokens, tile_width=N, value_dim=r,
                               rope_dim=rope, num_kv_splits=num_kv_splits, sm_scale=sm_scale)
    whole = pl.no_block_spec
    J = num_kv_splits
    if interpret:
        patch_interpret_mode()
    o, m, l = pl.pallas_call(
        kernel,
        grid=(NB, HB, J),
        in_specs=[whole] * 7 + [pl.BlockSpec((None, None, R, r), lambda b, h, j: (b, h, 0, 0)),
                                pl.BlockSpec((None, None, R, Dr), lambda b, h, j: (b, h, 0, 0)), whole],
        out_specs=[pl.BlockSpec((None, None, None, R, r), lambda b, h, j: (j, b, h, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, j: (j, b, h, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, j: (j, b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((J, NB, HB, R, r), jnp.float32),
                   jax.ShapeDtypeStruct((J, NB, HB, R), jnp.float32),
                   jax.ShapeDtypeStruct((J, NB, HB, R), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.ragged_paged_attention(
            query_rows=NB * Bq, query_blocks=NB * HB, Hq=Hb, Hkv_stored=1, D=D, kv_tokens_per_block=pages_per_seq * page_size,
            q_itemsize=q.dtype.itemsize, kv_itemsize=latent_pages.dtype.itemsize),
        name="mla_attention_split_kv",
    )(blocks.seq, blocks.kv_len, blocks.first_pos, blocks.num_queries, blocks.first_tile, blocks.num_tiles,
      page_indices.astype(jnp.int32), q_latent, q_rope, latent_pages)

    out = merge_splits(o, m, l)[:, :, : Bq * Hb]  # [NB, HB, Bq * Hb, r]
    out = out.reshape(NB, HB, Bq, Hb, r).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, r)
    return jnp.zeros((T, Hq, r), q.dtype).at[blocks.rows.reshape(-1)].set(out.astype(q.dtype), mode="drop")

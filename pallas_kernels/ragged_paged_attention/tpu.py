"""Ragged paged attention as a Pallas TPU (Mosaic) kernel: one call for a mixed batch.

Same inputs and result as `reference.ragged_paged_attention` (read its docstring for the layout);
prefill chunks and decodes are served together, keys and values read straight from the page pool
through the page table. Runs on TPU, and on the CPU with `interpret=True` (or
`interpret=pltpu.InterpretParams(...)`, the TPU simulator), which is how the tests check it.

How the work is cut
-------------------
* Query blocks. As in the reference, queries are cut into blocks of `num_queries_per_block` (Bq)
  rows of ONE sequence. The wrapper finds each block's sequence and first query (`block_seq`,
  `block_q_start`, a search over `cu_q_lens` done once in XLA) and gathers its queries into the
  layout the kernel multiplies with: for every KV head h, the G = Hq // Hkv query heads that share
  it, rows r = query * G + head  ->  q_blocks [NB, Hkv, Bq*G, D]. NB = min(T, cdiv(T, Bq) + S) is
  a static bound on the number of blocks; blocks past the real ones are padding.
* Scalar prefetch (SMEM, readable before the grid starts): kv_lens, page_indices, cu_q_lens,
  num_seqs, block_seq, block_q_start. The kernel derives everything else from them: a block's
  query positions, its KV range, which pages to fetch.
* Grid (NB, Hkv): program (b, h) computes query block b against KV head h. Its q and output tiles
  [Bq*G, D] come through ordinary BlockSpecs (the Pallas pipeline double-buffers them); the
  wrapper scatters the output rows back to [T, Hq, D].
* KV loop inside the program. Keys and values stay in HBM (`memory_space=pl.ANY`). A loop walks the
  KV blocks (`num_kv_pages_per_block` (C) pages, C * page_size tokens) that the block can see:
  from the one holding the first query's window start (0 without a sliding window) to the one
  holding its last query's position. Blocks past that, or before the window, are never fetched;
  padding query blocks run the loop zero times and fetch nothing. Each page of a block is one DMA
  (`k_pages.at[page, :, h, :]`, [page_size, D]) into a VMEM slot; pages of the block that hold no
  token the queries can see are skipped too.
* Double buffering. Two VMEM slots per K and V. While block j is computed from one slot, block j+1
  is already on its way into the other; the last block of a program starts the FIRST block of the
  next program (b, h+1) or (b+1, 0), so a decode (often a single KV block per program) does not
  wait for its own fetch. Which slot holds what is carried across programs in a 2-int SMEM scratch
  `fetch_state` = [slot of this program's first block, 1 if that fetch is already in flight]. This
  cross-program hand-off needs the grid to run in order: both grid axes are "arbitrary" (no
  megacore split).
* Online softmax. Running max m, sum l and accumulator acc [Bq*G, D] (float32) are loop-carried;
  scores are computed in float32, masked (causal, sliding window, rows past the sequence) with
  -inf, soft-capped first when asked. Rows that see nothing end with l = 0 and output 0.
* Quantized pages (int8 / float8_e4m3fn): DMA'd as stored (1 byte per entry), then dequantized in
  VMEM: float32(entry) * scale, cast to q's dtype for the matmuls.

VMEM working set (see `vmem_working_set_bytes`; R = Bq*G rows, K = C*page_size tokens,
every 2-D tile padded to (8, 128)):
    q and output tiles, double-buffered:    2 * 2 * R * D * q_bytes
    K and V page buffers, two slots each:   2 * 2 * K * D * kv_bytes
    scores / probabilities (float32):       2 * R * K * 4
    dequantized K and V (float32):          2 * K * D * 4
    acc (float32) + m, l (lane-padded):     R * D * 4 + 2 * R * 128 * 4
Example, Bq=32, G=8 (R=256), D=128, bf16 q and pages, page_size=16, C=8 (K=128):
256 + 128 + 256 + 128 + 128 + 256 KiB ~ 1.1 MiB, far below the 16 MiB default scoped VMEM
(v4/v5e; 32 MiB on v6e). The wrapper raises ValueError when the estimate exceeds
`vmem_limit_bytes` (default 16 MiB), which is also handed to the compiler.

Real-TPU assumptions (interpret mode checks none of them; not yet run on a TPU):
* head_dim a multiple of 128 and page_size a multiple of 8 (16 for bf16, 32 for 8-bit pages), so
  the [page_size, D] page tiles and [K, D] buffers are whole (8, 128) tiles and the page DMAs land
  on tile boundaries. The tests also use head_dim 64: fine in interpret mode, untested on a TPU
  (where it would half-fill the 128-lane tiles).
* Bq*G a multiple of 8 is best (it is the sublane dim of the q/output tiles; any value is legal
  because the tile spans the whole dim).
* One page of ONE KV head is a strided HBM read (page_size rows of D contiguous entries, stride
  Hkv*D). If Mosaic rejects slicing a single head out of the tiled HBM layout of the pool,
  store the pool head-major ([Hkv, P, page_size, D], as jax's paged_attention does) or fetch a
  tile-aligned group of heads per DMA; the kernel's structure stays the same.
* Scalar prefetch puts the page table [S, pages_per_seq] in SMEM; very large tables may not fit.
* Checked here: `jax.export(..., platforms=["tpu"])` runs the Pallas -> Mosaic lowering for a
  v5e-like chip (the tests do it for bf16 and int8 pages at head_dim 128, page_size 16).

Padding contract as in the reference: rows past cu_q_lens[num_seqs] and sequences >= num_seqs
come out as zeros. Only pages a query block needs are fetched, so the unused tail of a page-table
row (and the rows of padding sequences) may hold anything, even ids outside the pool.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.ragged_paged_attention.reference import QUANTIZED_KV_DTYPES, check_kv_scales

DEFAULT_KV_TOKENS_PER_BLOCK = 128
DEFAULT_VMEM_LIMIT_BYTES = 16 * 1024 * 1024  # scoped VMEM default on TPU v4 / v5e


def _cdiv(a, b):
    return (a + b - 1) // b


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] VMEM tile once padded to whole (8, 128) tiles."""
    return _cdiv(rows, 8) * 8 * _cdiv(cols, 128) * 128 * itemsize


def vmem_working_set_bytes(
    *, rows: int, head_dim: int, kv_tokens: int, q_itemsize: int, kv_itemsize: int
) -> int:
    """VMEM one program needs: rows = Bq*G query rows, kv_tokens = C*page_size (module docstring)."""
    q_and_out = 2 * 2 * _tile_bytes(rows, head_dim, q_itemsize)
    kv_slots = 2 * 2 * _tile_bytes(kv_tokens, head_dim, kv_itemsize)
    scores = 2 * _tile_bytes(rows, kv_tokens, 4)
    dequantized_kv = 2 * _tile_bytes(kv_tokens, head_dim, 4)
    softmax_state = _tile_bytes(rows, head_dim, 4) + 2 * _tile_bytes(rows, 128, 4)
    return q_and_out + kv_slots + scores + dequantized_kv + softmax_state


class QueryBlock(NamedTuple):
    """Where query block b sits, read from the scalar-prefetched arrays (all int32 scalars)."""

    seq: jax.Array  # its sequence
    num_rows: jax.Array  # real queries in the block, 0 for a padding block
    first_pos: jax.Array  # cache position of its first query
    last_pos: jax.Array  # cache position of its last real query
    lo_pos: jax.Array  # first cache position any of its queries may see (sliding window)
    kv_lo: jax.Array  # KV blocks it needs: kv_lo <= j < kv_hi (empty for padding)
    kv_hi: jax.Array


def query_block(b, refs, *, Bq, kv_block, sliding_window) -> QueryBlock:
    """Geometry of query block b. refs = (kv_lens, cu_q_lens, num_seqs, block_seq, block_q_start)."""
    kv_lens_ref, cu_q_lens_ref, num_seqs_ref, block_seq_ref, block_q_start_ref = refs
    seq = block_seq_ref[b]
    q_start = block_q_start_ref[b]  # index of the block's first query within its sequence
    q_len = jnp.where(seq < num_seqs_ref[0], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq], 0)
    kv_len = kv_lens_ref[seq]
    num_rows = jnp.clip(q_len - q_start, 0, Bq)
    first_pos = kv_len - q_len + q_start
    last_pos = first_pos + num_rows - 1
    lo_pos = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    kv_lo = lo_pos // kv_block
    kv_hi = jnp.where(num_rows > 0, last_pos // kv_block + 1, kv_lo)
    return QueryBlock(seq, num_rows, first_pos, last_pos, lo_pos, kv_lo, kv_hi)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S, pages_per_seq]
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    block_seq_ref,  # [NB] sequence of each query block
    block_q_start_ref,  # [NB] first query of each block, within its sequence
    # inputs
    q_ref,  # [Bq*G, D] VMEM: query block b, the G heads of KV head h
    k_hbm,  # [P, page_size, Hkv, D] HBM
    v_hbm,  # [P, page_size, Hkv, D] HBM
    # output
    o_ref,  # [Bq*G, D] VMEM
    # scratch
    k_buf,  # [2, C*page_size, D] VMEM, two slots
    v_buf,  # [2, C*page_size, D]
    k_sems,  # DMA semaphores [2], one per slot
    v_sems,
    fetch_state,  # SMEM int32[2]: [slot of this program's first KV block, 1 if already fetching it]
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    Bq,
    G,
    pages_per_block,
):
    b, h = pl.program_id(0), pl.program_id(1)
    num_blocks, num_kv_heads = pl.num_programs(0), pl.num_programs(1)
    rows, _ = q_ref.shape
    kv_block, _ = k_buf.shape[1:]
    page_size = kv_block // pages_per_block
    pages_per_seq = page_indices_ref.shape[1]
    geometry = functools.partial(
        query_block,
        refs=(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, block_seq_ref, block_q_start_ref),
        Bq=Bq,
        kv_block=kv_block,
        sliding_window=sliding_window,
    )

    def page_copies(blk: QueryBlock, head, j, slot):
        """(needed, K copy, V copy) for each page of KV block j of query block `blk`."""
        copies = []
        for i in range(pages_per_block):
            page = j * pages_per_block + i  # page number within the sequence
            needed = (page * page_size <= blk.last_pos) & ((page + 1) * page_size > blk.lo_pos)
            page_id = page_indices_ref[blk.seq, jnp.minimum(page, pages_per_seq - 1)]
            dst = pl.ds(i * page_size, page_size)
            k_copy = pltpu.make_async_copy(k_hbm.at[page_id, :, head, :], k_buf.at[slot, dst, :], k_sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[page_id, :, head, :], v_buf.at[slot, dst, :], v_sems.at[slot])
            copies.append((needed, k_copy, v_copy))
        return copies

    def start_fetch(blk, head, j, slot):
        for needed, k_copy, v_copy in page_copies(blk, head, j, slot):

            @pl.when(needed)
            def _():
                k_copy.start()
                v_copy.start()

    def wait_fetch(blk, head, j, slot):
        for needed, k_copy, v_copy in page_copies(blk, head, j, slot):

            @pl.when(needed)
            def _():
                k_copy.wait()
                v_copy.wait()

    @pl.when((b == 0) & (h == 0))
    def _():
        fetch_state[0] = 0
        fetch_state[1] = 0

    blk = geometry(b)
    first_slot = fetch_state[0]
    has_kv = blk.kv_hi > blk.kv_lo

    @pl.when(has_kv & (fetch_state[1] == 0))
    def _():
        start_fetch(blk, h, blk.kv_lo, first_slot)

    # the program after this one in grid order, whose first KV block our last iteration prefetches
    next_b = jnp.where(h + 1 < num_kv_heads, b, b + 1)
    next_h = jnp.where(h + 1 < num_kv_heads, h + 1, 0)
    next_blk = geometry(jnp.minimum(next_b, num_blocks - 1))
    next_has_kv = (next_b < num_blocks) & (next_blk.kv_hi > next_blk.kv_lo)

    q = q_ref[...]  # [R, D]
    row_query = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // G  # query of each row, in the block
    q_pos = blk.first_pos + row_query  # [R, 1]
    row_real = row_query < blk.num_rows

    def kv_step(j, carry):
        slot, m, l, acc = carry  # m, l: [R, 1]; acc: [R, D]

        @pl.when(j + 1 < blk.kv_hi)
        def _():
            start_fetch(blk, h, j + 1, 1 - slot)

        @pl.when((j + 1 == blk.kv_hi) & next_has_kv)
        def _():
            start_fetch(next_blk, next_h, next_blk.kv_lo, 1 - slot)

        wait_fetch(blk, h, j, slot)
        k = k_buf[slot]  # [K, D]
        v = v_buf[slot]
        if k_scale is not None:
            k = k.astype(jnp.float32) * k_scale
        if v_scale is not None:
            v = v.astype(jnp.float32) * v_scale
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        kv_pos_col = j * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)  # [K, 1]
        # rows of pages that were not fetched (or past the cache) may hold anything, NaN included:
        # zero them so that 0 * garbage cannot leak into the sum
        v = jnp.where((kv_pos_col >= blk.lo_pos) & (kv_pos_col <= blk.last_pos), v, jnp.zeros_like(v))

        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # f32: no single bf16 pass
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)  # [R, K]
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)  # [1, K]
        visible = (kv_pos <= q_pos) & row_real
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        s = jnp.where(visible, s, -jnp.inf)

        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + p.sum(axis=1, keepdims=True)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        acc = alpha * acc + pv
        return 1 - slot, m_new, l, acc

    init = (
        first_slot,
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, q.shape[1]), jnp.float32),
    )
    slot_after, _, l, acc = jax.lax.fori_loop(blk.kv_lo, blk.kv_hi, kv_step, init)
    fetch_state[0] = slot_after
    fetch_state[1] = (has_kv & next_has_kv).astype(jnp.int32)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "k_scale",
        "v_scale",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
        "interpret",
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
    soft_cap: float | None = None,
    k_scale: float | None = None,  # int8 / fp8 pages: entry * scale is the value (see reference.py)
    v_scale: float | None = None,
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret=False,  # passed to pallas_call: True (HLO interpreter) or pltpu.InterpretParams(...)
) -> jax.Array:
    check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    T, Hq, D = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    S, pages_per_seq = page_indices.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split evenly over {Hkv} KV heads")
    if k_pages.dtype not in QUANTIZED_KV_DTYPES and k_pages.dtype != q.dtype:
        raise ValueError(f"float pages must have q's dtype: k_pages {k_pages.dtype}, q {q.dtype}")
    G = Hq // Hkv
    Bq = num_queries_per_block
    C = num_kv_pages_per_block or max(1, DEFAULT_KV_TOKENS_PER_BLOCK // page_size)
    C = min(C, pages_per_seq)
    kv_block = C * page_size
    R = Bq * G  # rows of one query block: query r // G, head r % G of the KV head's group

    limit = vmem_limit_bytes or DEFAULT_VMEM_LIMIT_BYTES
    need = vmem_working_set_bytes(
        rows=R, head_dim=D, kv_tokens=kv_block, q_itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize
    )
    if need > limit:
        raise ValueError(
            f"blocks need ~{need} bytes of VMEM (Bq={Bq}, G={G}, {C} pages of {page_size}, D={D}) but the"
            f" limit is {limit}: lower num_queries_per_block / num_kv_pages_per_block or raise vmem_limit_bytes"
        )

    # ---- query blocks (as in the reference): block b = Bq rows of sequence block_seq[b]
    num_seqs = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
    q_lens = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    blocks_per_seq = _cdiv(q_lens, Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)  # [S]
    NB = min(T, _cdiv(T, Bq) + S)  # static bound on the number of query blocks
    b = jnp.arange(NB)
    block_seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1).astype(jnp.int32)  # [NB]
    # padding blocks get a start >= their (clamped) sequence's length: no rows, no KV blocks
    block_q_start = ((b - (cu_blocks[block_seq] - blocks_per_seq[block_seq])) * Bq).astype(jnp.int32)
    row_in_seq = block_q_start[:, None] + jnp.arange(Bq)[None, :]  # [NB, Bq]
    row_real = row_in_seq < q_lens[block_seq][:, None]
    rows = jnp.where(row_real, cu_q_lens[block_seq][:, None] + row_in_seq, T)  # T: dropped on the way out

    q_blocks = q[jnp.minimum(rows, T - 1)].reshape(NB, Bq, Hkv, G, D)
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, R, D)

    tile = pl.BlockSpec((None, None, R, D), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        Bq=Bq,
        G=G,
        pages_per_block=C,
    )
    if interpret:
        patch_interpret_mode()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, R, D), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(NB, Hkv),
            in_specs=[tile, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=tile,
            scratch_shapes=[
                pltpu.VMEM((2, kv_block, D), k_pages.dtype),
                pltpu.VMEM((2, kv_block, D), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        # both axes "arbitrary": a program prefetches the next one's first KV block, so they run in order
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        num_seqs,
        block_seq,
        block_q_start,
        q_blocks,
        k_pages,
        v_pages,
    )  # [NB, Hkv, R, D]

    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    return result.at[rows.reshape(-1)].set(out, mode="drop")

"""Ragged paged attention as a Pallas TPU (Mosaic) kernel: one call for a mixed batch.

Same inputs and result as `reference.ragged_paged_attention` (read its docstring for the layout);
prefill chunks and decodes are served together, keys and values read straight from the page pool
through the page table. Runs on TPU, and on the CPU with `interpret=True` (or
`interpret=pltpu.InterpretParams(...)`, the TPU simulator), which is how the tests check it.
`jaxinfer.aot` compiles it with the real TPU compiler (libtpu, no TPU needed), which is how the
tests check that Mosaic takes it.

The page layout on a TPU
------------------------
The pools are token-major, `[P, page_size, Hs, D]`, the layout every back end uses. On a TPU the
last two dimensions of an array are tiled ((8, 128) 32-bit words; bf16 packs two rows in a word,
8-bit data four). So:

* A DMA may only cut the untiled leading dimensions: the kernel fetches whole pages, every KV
  head at once (`k_pages.at[page]`, [page_size, Hs, D]); the RoPE+KV write stores a token's row
  of all heads (`pages.at[page, slot]`). Neither cuts a tile.
* Head h of a fetched block is every Hs-th row of the block seen as [tokens * Hs, D]: a strided
  load. Mosaic strides over 32-bit rows only, so the block is read as uint32 words, each holding
  `packing` consecutive heads of one token (2 for bf16, 4 for int8 / fp8), and the heads are
  taken out with shifts: a bf16 in the low half is `word << 16` read as float32 (exact), the high
  half `word & 0xFFFF0000`.
* That needs Hs a multiple of `packing` and a whole number of tiles: `stored_kv_heads` says how
  many heads a pool holds for a model's Hkv (Hkv itself for 2, 4, 8, 16...; 3 -> 4; 1 -> 2 in
  bf16, 4 in int8). The padded heads hold zeros and are never read: `num_kv_heads` tells the
  kernel the real count. head_dim 64 needs no padding (measured: the strided loads and dots
  compile at D = 64 on v5e, v6e and v5p).

How the work is cut
-------------------
* Query blocks. As in the reference, queries are cut into blocks of `num_queries_per_block` (Bq)
  rows of ONE sequence. The wrapper finds each block's sequence and first query (`block_seq`,
  `block_q_start`, a search over `cu_q_lens` done once in XLA) and gathers its queries into the
  layout the kernel multiplies with: for every KV head h, the G = Hq // Hkv query heads that share
  it, rows r = query * G + head  ->  q_blocks [NB, Hkv, R = Bq*G, D]. NB = min(T, cdiv(T, Bq) + S)
  is a static bound on the number of blocks; blocks past the real ones are padding.
* Scalar prefetch (SMEM, readable before the grid starts): kv_lens, page_indices (flattened),
  cu_q_lens, num_seqs, block_seq, block_q_start. The kernel derives everything else from them.
  The whole page table lives in the chip's 1 MiB of SMEM while S x pages_per_seq entries fit
  (`smem_bytes`: e.g. 31 sequences of 128k tokens in pages of 16). Past that (`fetch_rows`) the
  table stays in HBM and each program DMAs the next program's row into one of two SMEM row slots
  (by program parity), waiting for it while its own first KV block is on its way; a sequence of
  up to ~2M tokens then fits whatever S.
* Grid (NB,): program b computes query block b for every KV head. Its q and output tiles
  [Hkv, R, D] come through ordinary BlockSpecs (the Pallas pipeline double-buffers them); the
  wrapper scatters the output rows back to [T, Hq, D].
* KV loop inside the program. Keys and values stay in HBM (`memory_space=pl.ANY`). A loop walks the
  KV blocks (`num_kv_pages_per_block` (C) pages, C * page_size tokens) the block can see: from the
  one holding the first query's window start to the one holding its last query's position. Blocks
  outside, and pages of a block that hold no visible token, are never fetched; padding query
  blocks fetch nothing.
* Double buffering. Two VMEM slots per K and V. While block j is computed from one slot, block j+1
  is on its way into the other; the last block of a program starts the FIRST block of program
  b + 1, so a decode (often one KV block per program) does not wait for its own fetch. The slot
  and whether that fetch is in flight are carried across programs in a 2-int SMEM scratch; this
  needs the grid to run in order ("arbitrary": no megacore split).
* Online softmax per KV head: running max m, sum l and accumulator acc (float32, VMEM scratch
  [Hkv, R, ...]); scores masked (causal, sliding window, rows past the sequence) with -inf,
  soft-capped first when asked. Rows that see nothing end with l = 0 and output 0.
* Quantized pages (int8 / float8_e4m3fn) are DMA'd as stored (1 byte per entry), then dequantized
  in VMEM: float32(entry) * scale, cast to q's dtype for the matmuls.

VMEM: `vmem_working_set_bytes` adds up the buffers (every tile padded to (8, 128)); the limit is
the chip's (`pallas_kernels.tpu_chip.vmem_limit_bytes`: half its VMEM) unless given, and the
wrapper raises ValueError before a compile that would not fit. Each `pallas_call` declares a
`pl.CostEstimate` (an upper bound: every query block reads its sequence's whole page-table row),
since XLA's cost analysis cannot see inside a kernel.

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
from pallas_kernels import cost
from pallas_kernels.ragged_paged_attention.reference import QUANTIZED_KV_DTYPES, check_kv_scales
from pallas_kernels.tpu_chip import smem_capacity_bytes
from pallas_kernels.tpu_chip import vmem_limit_bytes as chip_vmem_limit_bytes

DEFAULT_KV_TOKENS_PER_BLOCK = 128


def _cdiv(a, b):
    return (a + b - 1) // b


def heads_per_word(dtype) -> int:
    """KV heads of one token packed in a 32-bit word: 1 (f32), 2 (bf16), 4 (int8 / fp8)."""
    return 4 // jnp.dtype(dtype).itemsize


def stored_kv_heads(num_kv_heads: int, dtype) -> int:
    """KV heads a page pool of `dtype` holds on a TPU for `num_kv_heads` real ones: the fewest
    >= num_kv_heads whose rows are whole 32-bit words, and 1, 2, 4, 8 or a multiple of 8 words
    (so a fetched block is whole tiles; see the module docstring). Padded heads hold zeros."""
    packing = heads_per_word(dtype)
    heads = max(num_kv_heads, packing)
    while True:
        words = heads // packing
        if heads % packing == 0 and (words in (1, 2, 4, 8) or words % 8 == 0):
            return heads
        heads += 1


# SMEM the compiler keeps beside a kernel's own scalars (measured: ~4 KiB at the limit on v6e)
SMEM_RESERVED_BYTES = 16 * 1024


def smem_bytes(num_seqs: int, pages_per_seq: int, num_blocks: int, fetch_rows: bool = False) -> int:
    """SMEM the kernel's scalars take (kv_lens, the page table or with `fetch_rows` two of its
    rows, cu_q_lens, num_seqs, block_seq, block_q_start, int32 each, and its 2-int fetch state),
    with the compiler's reserve."""
    table = 1 + 2 * pages_per_seq if fetch_rows else num_seqs * pages_per_seq
    return 4 * (num_seqs + table + num_seqs + 1 + 1 + 2 * num_blocks + 2) + SMEM_RESERVED_BYTES


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] VMEM tile once padded to whole (8, 128) tiles."""
    return _cdiv(rows, 8) * 8 * _cdiv(cols, 128) * 128 * itemsize


def vmem_working_set_bytes(
    *, rows: int, num_kv_heads: int, stored_heads: int, head_dim: int, kv_tokens: int, q_itemsize: int,
    kv_itemsize: int,
) -> int:
    """VMEM one program needs: rows = Bq*G query rows per KV head, kv_tokens = C*page_size."""
    q_and_out = 2 * 2 * num_kv_heads * _tile_bytes(rows, head_dim, q_itemsize)
    kv_slots = 2 * 2 * _tile_bytes(kv_tokens * stored_heads, head_dim, kv_itemsize)
    scores = 2 * _tile_bytes(rows, kv_tokens, 4)
    one_head_kv = 2 * 2 * _tile_bytes(kv_tokens, head_dim, 4)  # loaded words and the dequantized K / V
    softmax_state = num_kv_heads * (_tile_bytes(rows, head_dim, 4) + 2 * _tile_bytes(rows, 1, 4))
    return q_and_out + kv_slots + scores + one_head_kv + softmax_state


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


def read_heads(block_ref, num_heads: int, scale: float | None):
    """The first `num_heads` heads of a fetched KV block [C, page_size, Hs, D] as (head, [C*page_size, D]).

    Float pages come out in float32 (bf16 values exactly), quantized ones as float32 * scale.
    The block is read as 32-bit words of `heads_per_word` heads each (module docstring)."""
    C, page_size, Hs, D = block_ref.shape
    tokens = C * page_size
    dtype = block_ref.dtype
    packing = heads_per_word(dtype)
    if packing == 1:
        for h in range(num_heads):
            yield h, block_ref[:, :, h, :].reshape(tokens, D).astype(jnp.float32)
        return
    words = block_ref.bitcast(jnp.uint32)  # [C, page_size, Hs / packing, D]: word j holds heads packing*j ...
    for j in range(_cdiv(num_heads, packing)):
        w = words[:, :, j, :].reshape(tokens, D)
        for i in range(min(packing, num_heads - j * packing)):
            if packing == 2:  # bf16: the low half is the even head
                x = pltpu.bitcast(w << 16 if i == 0 else w & jnp.uint32(0xFFFF0000), jnp.float32)
            else:
                x = pltpu.bitcast((w >> (8 * i)).astype(jnp.uint8), dtype).astype(jnp.float32)
            yield j * packing + i, x if scale is None else x * scale


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * pages_per_seq]: the page table flattened (a 2D SMEM array pads its rows to 8); [1] with fetch_rows
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    block_seq_ref,  # [NB] sequence of each query block
    block_q_start_ref,  # [NB] first query of each block, within its sequence
    # inputs
    q_ref,  # [Hkv, R, D] VMEM: query block b, for each KV head the G query heads it serves
    k_hbm,  # [P, page_size, Hs, D] HBM
    v_hbm,  # [P, page_size, Hs, D] HBM
    table_hbm,  # [S * pages_per_seq] HBM: the page table, read from here with fetch_rows
    # output
    o_ref,  # [Hkv, R, D] VMEM
    # scratch
    k_buf,  # [2, C, page_size, Hs, D] VMEM, two slots
    v_buf,
    k_sems,  # DMA semaphores [2], one per slot
    v_sems,
    fetch_state,  # SMEM int32[2]: [slot of this program's first KV block, 1 if already fetching it]
    m_ref,  # [Hkv, R, 1] float32: running max
    l_ref,  # [Hkv, R, 1] float32: running sum
    acc_ref,  # [Hkv, R, D] float32
    rows_ref,  # SMEM int32 [2 * pages_per_seq] with fetch_rows: the page-table rows of this program and the next
    rows_sem,  # DMA semaphore [1]
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    Bq,
    G,
    pages_per_seq,
    fetch_rows,
):
    b = pl.program_id(0)
    num_blocks = pl.num_programs(0)
    num_kv_heads, rows, _ = q_ref.shape
    pages_per_block, page_size = k_buf.shape[1:3]
    kv_block = pages_per_block * page_size
    geometry = functools.partial(
        query_block,
        refs=(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, block_seq_ref, block_q_start_ref),
        Bq=Bq,
        kv_block=kv_block,
        sliding_window=sliding_window,
    )

    def row_start(program, blk: QueryBlock):
        """Where the page ids of `program`'s sequence start: in the whole table, or with fetch_rows
        in the row slot of the program's parity."""
        return (program % 2) * pages_per_seq if fetch_rows else blk.seq * pages_per_seq

    def page_copies(blk: QueryBlock, j, slot, row):
        """(needed, K copy, V copy) for each page of KV block j of query block `blk`: whole pages.
        `row`: where its page ids start (row_start)."""
        table = rows_ref if fetch_rows else page_indices_ref
        copies = []
        for i in range(pages_per_block):
            page = j * pages_per_block + i  # page number within the sequence
            needed = (page * page_size <= blk.last_pos) & ((page + 1) * page_size > blk.lo_pos)
            page_id = table[row + jnp.minimum(page, pages_per_seq - 1)]
            k_copy = pltpu.make_async_copy(k_hbm.at[page_id], k_buf.at[slot, i], k_sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[page_id], v_buf.at[slot, i], v_sems.at[slot])
            copies.append((needed, k_copy, v_copy))
        return copies

    def start_fetch(blk, j, slot, row):
        for needed, k_copy, v_copy in page_copies(blk, j, slot, row):

            @pl.when(needed)
            def _():
                k_copy.start()
                v_copy.start()

    def wait_fetch(blk, j, slot, row):
        for needed, k_copy, v_copy in page_copies(blk, j, slot, row):

            @pl.when(needed)
            def _():
                k_copy.wait()
                v_copy.wait()

    def row_copy(program):  # with fetch_rows: the page-table row of `program`'s sequence into its parity's slot
        seq = block_seq_ref[program]
        return pltpu.make_async_copy(table_hbm.at[pl.ds(seq * pages_per_seq, pages_per_seq)],
                                     rows_ref.at[pl.ds((program % 2) * pages_per_seq, pages_per_seq)], rows_sem.at[0])

    @pl.when(b == 0)
    def _():
        fetch_state[0] = 0
        fetch_state[1] = 0
        if fetch_rows:
            copy = row_copy(0)
            copy.start()
            copy.wait()

    blk = geometry(b)
    row = row_start(b, blk)
    first_slot = fetch_state[0]
    has_kv = blk.kv_hi > blk.kv_lo

    @pl.when(has_kv & (fetch_state[1] == 0))
    def _():
        start_fetch(blk, blk.kv_lo, first_slot, row)

    # the next program, whose first KV block our last iteration prefetches
    next_b = jnp.minimum(b + 1, num_blocks - 1)
    next_blk = geometry(next_b)
    next_row = row_start(next_b, next_blk)
    next_has_kv = (b + 1 < num_blocks) & (next_blk.kv_hi > next_blk.kv_lo)
    if fetch_rows:  # the next program's row, into the other slot (this program's KV fetch is in flight meanwhile)

        @pl.when(b + 1 < num_blocks)
        def _():
            copy = row_copy(b + 1)
            copy.start()
            copy.wait()

    row_query = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // G  # query of each row, in the block
    q_pos = blk.first_pos + row_query  # [R, 1]
    row_real = row_query < blk.num_rows
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    dtype = q_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # f32: no single bf16 pass

    def kv_step(j, slot):
        @pl.when(j + 1 < blk.kv_hi)
        def _():
            start_fetch(blk, j + 1, 1 - slot, row)

        @pl.when((j + 1 == blk.kv_hi) & next_has_kv)
        def _():
            start_fetch(next_blk, next_blk.kv_lo, 1 - slot, next_row)

        wait_fetch(blk, j, slot, row)
        kv_pos_col = j * kv_block + jax.lax.broadcasted_iota(jnp.int32, (kv_block, 1), 0)  # [K, 1]
        # rows of pages that were not fetched may hold anything, NaN included: zero them so that
        # 0 * garbage cannot leak into the sum
        fetched = (kv_pos_col >= blk.lo_pos) & (kv_pos_col <= blk.last_pos)
        kv_pos = j * kv_block + jax.lax.broadcasted_iota(jnp.int32, (1, kv_block), 1)  # [1, K]
        visible = (kv_pos <= q_pos) & row_real  # [R, K]
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window

        keys, values = read_heads(k_buf.at[slot], num_kv_heads, k_scale), read_heads(v_buf.at[slot], num_kv_heads, v_scale)
        for (h, k), (_, v) in zip(keys, values):  # head by head: one head's K and V live at a time
            v = jnp.where(fetched, v, 0.0).astype(dtype)
            s = jax.lax.dot_general(q_ref[h], k.astype(dtype), (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)  # [R, K]
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, -jnp.inf)
            m = m_ref[h]
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m - m_safe)
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            pv = jax.lax.dot_general(p.astype(dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new
        return 1 - slot

    slot_after = jax.lax.fori_loop(blk.kv_lo, blk.kv_hi, kv_step, first_slot)
    fetch_state[0] = slot_after
    fetch_state[1] = (has_kv & next_has_kv).astype(jnp.int32)
    l = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "k_scale",
        "v_scale",
        "num_kv_heads",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
        "fetch_rows",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [P, page_size, Hs, D]: Hs = stored_kv_heads(Hkv) on a real TPU
    v_pages: jax.Array,  # [P, page_size, Hs, D]
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
    num_kv_heads: int | None = None,  # real KV heads (the first ones of the pool); default: all Hs
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,  # default: the target chip's (pallas_kernels.tpu_chip)
    fetch_rows: bool | None = None,  # page-table rows fetched per program (default: when the whole table overflows SMEM)
    interpret=False,  # passed to pallas_call: True (HLO interpreter) or pltpu.InterpretParams(...)
) -> jax.Array:
    check_kv_scales(k_pages, v_pages, k_scale, v_scale)
    T, Hq, D = q.shape
    page_size, Hs = k_pages.shape[1], k_pages.shape[2]
    Hkv = Hs if num_kv_heads is None else num_kv_heads
    S, pages_per_seq = page_indices.shape
    if not 0 < Hkv <= Hs:
        raise ValueError(f"num_kv_heads={Hkv}: the pools hold {Hs} KV heads")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split evenly over {Hkv} KV heads")
    if k_pages.dtype not in QUANTIZED_KV_DTYPES and k_pages.dtype != q.dtype:
        raise ValueError(f"float pages must have q's dtype: k_pages {k_pages.dtype}, q {q.dtype}")
    if Hs != stored_kv_heads(Hs, k_pages.dtype):
        raise ValueError(
            f"{k_pages.dtype} pools of {Hs} KV heads do not tile on a TPU: store {stored_kv_heads(Hs, k_pages.dtype)}"
            f" (pallas_kernels.ragged_paged_attention.tpu.stored_kv_heads; the extra heads stay zero)"
        )
    G = Hq // Hkv
    Bq = num_queries_per_block
    C = num_kv_pages_per_block or max(1, DEFAULT_KV_TOKENS_PER_BLOCK // page_size)
    C = min(C, pages_per_seq)
    kv_block = C * page_size
    R = Bq * G  # rows of one query block per KV head: query r // G, head r % G of the head's group

    limit = vmem_limit_bytes or chip_vmem_limit_bytes()
    need = vmem_working_set_bytes(rows=R, num_kv_heads=Hkv, stored_heads=Hs, head_dim=D, kv_tokens=kv_block,
                                  q_itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize)
    if need > limit:
        raise ValueError(
            f"blocks need ~{need} bytes of VMEM (Bq={Bq}, G={G}, {Hkv} KV heads, {C} pages of {page_size}, D={D}) but"
            f" the limit is {limit}: lower num_queries_per_block / num_kv_pages_per_block or raise vmem_limit_bytes"
        )

    # ---- query blocks (as in the reference): block b = Bq rows of sequence block_seq[b]
    num_seqs = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
    q_lens = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    blocks_per_seq = _cdiv(q_lens, Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)  # [S]
    NB = min(T, _cdiv(T, Bq) + S)  # static bound on the number of query blocks
    smem_limit = smem_capacity_bytes()
    if fetch_rows is None:  # the whole table while it fits the chip's scalar memory, else a row per program
        fetch_rows = smem_bytes(S, pages_per_seq, NB) > smem_limit
    smem_need = smem_bytes(S, pages_per_seq, NB, fetch_rows=fetch_rows)
    if smem_need > smem_limit:
        raise ValueError(
            f"SMEM: the kernel holds two page-table rows of {pages_per_seq} pages (max_model_len / page_size) in the "
            f"chip's scalar memory, ~{smem_need} bytes with the other scalars of {S} sequences, and the chip holds "
            f"{smem_limit}: lower max_model_len or raise page_size"
        )
    b = jnp.arange(NB)
    block_seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1).astype(jnp.int32)  # [NB]
    # padding blocks get a start >= their (clamped) sequence's length: no rows, no KV blocks
    block_q_start = ((b - (cu_blocks[block_seq] - blocks_per_seq[block_seq])) * Bq).astype(jnp.int32)
    row_in_seq = block_q_start[:, None] + jnp.arange(Bq)[None, :]  # [NB, Bq]
    row_real = row_in_seq < q_lens[block_seq][:, None]
    rows = jnp.where(row_real, cu_q_lens[block_seq][:, None] + row_in_seq, T)  # T: dropped on the way out

    q_blocks = q[jnp.minimum(rows, T - 1)].reshape(NB, Bq, Hkv, G, D)
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, R, D)

    tile = pl.BlockSpec((None, Hkv, R, D), lambda b, *_: (b, 0, 0, 0))
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
        v_scale=v_scale, Bq=Bq, G=G, pages_per_seq=pages_per_seq, fetch_rows=fetch_rows,
    )
    cost_estimate = cost.ragged_paged_attention(
        query_rows=NB * Bq, query_blocks=NB, Hq=Hq, Hkv_stored=Hs, D=D, kv_tokens_per_block=pages_per_seq * page_size,
        q_itemsize=q.dtype.itemsize, kv_itemsize=k_pages.dtype.itemsize,
    )
    table = page_indices.astype(jnp.int32).reshape(-1)  # [S * pages_per_seq]
    if interpret:
        patch_interpret_mode()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, R, D), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(NB,),
            in_specs=[tile] + [pl.BlockSpec(memory_space=pl.ANY)] * 3,
            out_specs=tile,
            scratch_shapes=[
                pltpu.VMEM((2, C, page_size, Hs, D), k_pages.dtype),
                pltpu.VMEM((2, C, page_size, Hs, D), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, D), jnp.float32),
                pltpu.SMEM((2 * pages_per_seq if fetch_rows else 1,), jnp.int32),
                pltpu.SemaphoreType.DMA((1,)),
            ],
        ),
        # "arbitrary": a program prefetches the next one's first KV block, so they run in order
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=limit),
        cost_estimate=cost_estimate,
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        kv_lens.astype(jnp.int32),
        jnp.zeros(1, jnp.int32) if fetch_rows else table,
        cu_q_lens.astype(jnp.int32),
        num_seqs,
        block_seq,
        block_q_start,
        q_blocks,
        k_pages,
        v_pages,
        table,
    )  # [NB, Hkv, R, D]

    out = out.reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    return result.at[rows.reshape(-1)].set(out, mode="drop")

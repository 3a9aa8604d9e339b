"""Ragged paged attention as a Pallas TPU (Mosaic) kernel: one call for a mixed batch.

The reference's result from the reference's inputs, but for the pool: the kernel reads combined
pages, `kv_pages [P, page_size, Hkv * 2 * Ds]`, one row per token holding K_0 V_0 K_1 V_1 ... in
Ds lanes each (`combined.py`: Ds = head_dim for 64 and multiples of 128). Prefill chunks and
decodes are served together, keys and values read straight from the pages through the page
table. Runs on TPU, and on the CPU with `interpret=True` (or `interpret=pltpu.InterpretParams(...)`,
the TPU simulator), which is how the tests check it. `jaxinfer.aot` compiles it with the real TPU
compiler (libtpu, no TPU needed), which is how the tests check that Mosaic takes it.

The page layout on a TPU
------------------------
On a TPU the last two dimensions of an array are tiled ((8, 128) 32-bit words; bf16 packs two
rows in a word, 8-bit data four). A combined page [page_size, W] is tokens in the sublanes and a
whole number of 128-lane rows per token, so the pool is stored with no padding and row-major
(tests/test_kv_layout.py), and:

* The kernel fetches whole pages, one DMA each (`kv_pages.at[page]` into rows i * page_size of a
  VMEM slot [C * page_size, W]); the copy cuts only the untiled page axis of the pool.
* K_h of a fetched block is the lane slice [2 Ds h, 2 Ds h + Ds), V_h the next Ds lanes: aligned
  to 128-lane rows for Ds a multiple of 128. With Ds = 64 (SmolLM2, Llama-3.2-1B, GPT-OSS) K_h and
  V_h share one 128-lane row, and the kernel never splits it (`read_head`, `combined.lane_width`):
  q is padded with zeros to 128 lanes, so q . row = q . K_h, and of p @ row it keeps lanes 64..127,
  p @ V_h. The MXU works on 128 lanes anyway; the HBM traffic is exactly the model's K/V.
* Lane blocks (`lane_blocks` f > 1): a pool whose pages hold f narrower pages side by side, each
  a lane block [page_size, W / f] of a physical page (a KV layer group whose rows are f times
  narrower than the pool's: Gemma 4's global layers; jaxinfer.kv_groups). The page table then
  names those pages, id v for lane block v % f of physical page v // f, and the DMA fetches that
  block (a rectangular copy at a 128-lane-aligned offset). Seen the other way, as a reshape to
  f times the tokens per page, the same bytes would be in another tile order, and XLA would copy
  the whole pool into it for every such layer.
* The write of a token's row is XLA's in-place scatter, not a DMA: a token's bf16 or 8-bit row
  shares 32-bit words with its neighbour tokens, and Mosaic refuses a DMA at such a row
  (`pallas_kernels.rope_kv_write`).

How the work is cut
-------------------
* Query blocks. As in the reference, queries are cut into blocks of `num_queries_per_block` (Bq)
  rows of ONE sequence. The wrapper finds each block's sequence and first query (`block_seq`,
  `block_q_start`, a search over `cu_q_lens` done once in XLA) and gathers its queries into the
  layout the kernel multiplies with: for every KV head h, the G = Hq // Hkv query heads that share
  it, rows r = query * G + head  ->  q_blocks [NB, Hkv, R = Bq*G, lanes] (zero lanes past D).
  NB = min(T, cdiv(T, Bq) + S)
  is a static bound on the number of blocks; blocks past the real ones are padding.
* Scalar prefetch (SMEM, readable before the grid starts): kv_lens, page_indices (flattened),
  cu_q_lens, num_seqs, block_seq, block_q_start. The kernel derives everything else from them.
  The whole page table lives in the chip's 1 MiB of SMEM while S x pages_per_seq entries fit
  (`smem_bytes`: e.g. 31 sequences of 128k tokens in pages of 16). Past that (`fetch_rows`) the
  table stays in HBM and each program DMAs the next program's row into one of two SMEM row slots
  (by program parity), waiting for it while its own first KV block is on its way; a sequence of
  up to ~2M tokens then fits whatever S.
* Grid (NB,): program b computes query block b for every KV head. Its q and output tiles
  [Hkv, R, lanes] come through ordinary BlockSpecs (the Pallas pipeline double-buffers them); the
  wrapper scatters the output rows back to [T, Hq, D].
* KV loop inside the program. Keys and values stay in HBM (`memory_space=pl.ANY`). A loop walks the
  KV blocks (`num_kv_pages_per_block` (C) pages, C * page_size tokens) the block can see: from the
  one holding the first query's window start to the one holding its last query's position. Blocks
  outside, and pages of a block that hold no visible token, are never fetched; padding query
  blocks fetch nothing.
* Double buffering. Two VMEM slots of combined rows. While block j is computed from one slot, block j+1
  is on its way into the other; the last block of a program starts the FIRST block of program
  b + 1, so a decode (often one KV block per program) does not wait for its own fetch. The slot
  and whether that fetch is in flight are carried across programs in a 2-int SMEM scratch; this
  needs the grid to run in order ("arbitrary": no megacore split).
* Online softmax per KV head: running max m, sum l and accumulator acc (float32, VMEM scratch
  [Hkv, R, ...]); scores masked (causal, sliding window, rows past the sequence) with -inf,
  soft-capped first when asked. Rows that see nothing end with l = 0 and output 0. Attention
  sinks (`sinks` [Hq], in SMEM) add exp(sink - m) to each row's l at the end: a logit with no value.
* Tree masks (`tree_base`, `tree_bits` [T] int32: draft trees of speculative decoding,
  `pallas_kernels.tree_mask`): the wrapper lays each query block's rows' (base, bits) out like its
  queries, [NB, R, 1] int32 each, and they come in as two more VMEM tiles [R, 1] beside q; the
  kernel ANDs `tree_visible(key, base, bits)` into its mask. The KV blocks fetched are those of
  the causal span, as without masks (a mask only removes keys). A static option: a call without
  them compiles exactly as before.
* Quantized pages (int8 / float8_e4m3fn, or e4m3 as bytes) are DMA'd as stored (1 byte per entry),
  then dequantized in VMEM: float32(entry), times one scale for K and one for V, or with a scale
  pool (`kv_scale` [P, Hkv * 2 * page_size], a scale per token and head in (head, K|V, token)
  order; page_size a multiple of 128) each page's scales DMA'd beside it: K's multiply the
  scores' columns, V's the softmax weights (`token_scales`: lane rows over the block's tokens).

VMEM: `vmem_working_set_bytes` adds up the buffers (every tile padded to (8, 128)); the limit is
the chip's (`pallas_kernels.tpu_chip.vmem_limit_bytes`: half its VMEM) unless given, and the
wrapper raises ValueError before a compile that would not fit. Each `pallas_call` declares a
`pl.CostEstimate` (an upper bound: every query block reads its sequence's whole page-table row),
since XLA's cost analysis cannot see inside a kernel.

Latent pages (`value_dim` r: multi-head latent attention, DeepSeek; `pallas_kernels.mla_attention`):
`kv_pages [P, page_size, W]` hold ONE row per token, the keys of the one KV head every query head
shares (W = D rounded up to whole 128-lane rows, zero past D), and the values are that row's first
r lanes (r a multiple of 128). Everything above holds with Hkv = 1 and G = Hq: K is the fetched
row, V its lanes [0, r), the accumulator and output r lanes wide; the result is [T, Hq, r].

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
from pallas_kernels.ragged_paged_attention.combined import combined_head_dim, lane_width
from pallas_kernels.ragged_paged_attention.reference import E4M3_BYTES, QUANTIZED_KV_DTYPES, check_kv_scales
from pallas_kernels.tpu_chip import smem_capacity_bytes
from pallas_kernels.tpu_chip import vmem_limit_bytes as chip_vmem_limit_bytes
from pallas_kernels.tree_mask import check_tree, tree_visible
from pallas_kernels.visible_span import limits_span, span_start

DEFAULT_KV_TOKENS_PER_BLOCK = 128


def _cdiv(a, b):
    return (a + b - 1) // b


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
    *, rows: int, num_kv_heads: int, row_width: int, lanes: int, kv_tokens: int, q_itemsize: int, kv_itemsize: int,
) -> int:
    """VMEM one program needs: rows = Bq*G query rows per KV head, kv_tokens = C*page_size tokens
    of `row_width` combined lanes, `lanes` (combined.lane_width) multiplied per head for K and V."""
    q_and_out = 2 * 2 * num_kv_heads * _tile_bytes(rows, lanes, q_itemsize)
    kv_slots = 2 * _tile_bytes(kv_tokens, row_width, kv_itemsize)
    scores = 2 * _tile_bytes(rows, kv_tokens, 4)
    one_head_kv = 2 * 2 * _tile_bytes(kv_tokens, lanes, 4)  # K and V of one head, loaded and dequantized
    softmax_state = num_kv_heads * (_tile_bytes(rows, lanes, 4) + 2 * _tile_bytes(rows, 1, 4))
    return q_and_out + kv_slots + scores + one_head_kv + softmax_state


class QueryBlock(NamedTuple):
    """Where query block b sits, read from the scalar-prefetched arrays (all int32 scalars)."""

    seq: jax.Array  # its sequence
    num_rows: jax.Array  # real queries in the block, 0 for a padding block
    first_pos: jax.Array  # cache position of its first query
    last_pos: jax.Array  # cache position of its last real query
    lo_pos: jax.Array  # first cache position any of its queries may see (sliding window, chunk)
    kv_lo: jax.Array  # KV blocks it needs: kv_lo <= j < kv_hi (empty for padding)
    kv_hi: jax.Array


def query_block(b, refs, *, Bq, kv_block, sliding_window, attention_chunk=None) -> QueryBlock:
    """Geometry of query block b. refs = (kv_lens, cu_q_lens, num_seqs, block_seq, block_q_start)."""
    kv_lens_ref, cu_q_lens_ref, num_seqs_ref, block_seq_ref, block_q_start_ref = refs
    seq = block_seq_ref[b]
    q_start = block_q_start_ref[b]  # index of the block's first query within its sequence
    q_len = jnp.where(seq < num_seqs_ref[0], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq], 0)
    kv_len = kv_lens_ref[seq]
    num_rows = jnp.clip(q_len - q_start, 0, Bq)
    first_pos = kv_len - q_len + q_start
    last_pos = first_pos + num_rows - 1
    lo_pos = span_start(first_pos, sliding_window=sliding_window, attention_chunk=attention_chunk) if limits_span(sliding_window, attention_chunk) else 0
    kv_lo = lo_pos // kv_block
    kv_hi = jnp.where(num_rows > 0, last_pos // kv_block + 1, kv_lo)
    return QueryBlock(seq, num_rows, first_pos, last_pos, lo_pos, kv_lo, kv_hi)


def read_head(block_ref, h: int, stored_head_dim: int, k_scale: float | None, v_scale: float | None,
              value_dim: int | None = None):
    """K_h and V_h of a fetched block [tokens, Hkv * 2 * Ds] as float32 [tokens, lanes] each
    (combined.lane_width lanes: with Ds = 64 both are the whole 128-lane row holding K_h and V_h;
    the caller's zero q lanes and its choice of output lanes pick the half it needs). Quantized
    entries come out multiplied by the pool's scale. Latent pages (value_dim r): the whole row and
    its first r lanes."""
    if value_dim is not None:
        row = block_ref[...].astype(jnp.float32)
        return row, row[:, :value_dim]
    Ds = stored_head_dim
    lanes = lane_width(Ds)
    k_start, v_start = 2 * Ds * h, 2 * Ds * h + 2 * Ds - lanes

    def load(start, scale):
        x = block_ref[:, pl.ds(start, lanes)]
        if x.dtype == E4M3_BYTES:  # e4m3 entries stored as their bytes (reference.storage_dtype)
            x = pltpu.bitcast(x, jnp.float8_e4m3fn)
        x = x.astype(jnp.float32)
        return x if scale is None else x * scale

    return load(k_start, k_scale), load(v_start, v_scale)


def token_scales(scale_ref, segment: int, page_size: int) -> jax.Array:
    """The scales of segment (2 h + K|V) of every token of a fetched block, [1, C * page_size]:
    row i of `scale_ref` [C, Hkv * 2 * page_size] holds page i's, (head, K|V, token) order, so the
    segment is lanes [segment * page_size, + page_size) of each row (whole 128-lane rows: page_size
    is a multiple of 128 with a scale pool)."""
    pages = scale_ref.shape[0]
    parts = [scale_ref[pl.ds(i, 1), pl.ds(segment * page_size, page_size)] for i in range(pages)]
    return parts[0] if pages == 1 else jnp.concatenate(parts, axis=1)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * pages_per_seq]: the page table flattened (a 2D SMEM array pads its rows to 8); [1] with fetch_rows
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    block_seq_ref,  # [NB] sequence of each query block
    block_q_start_ref,  # [NB] first query of each block, within its sequence
    # inputs
    q_ref,  # [Hkv, R, lanes] VMEM: query block b, for each KV head the G query heads it serves (zero lanes past D)
    kv_hbm,  # [P, page_size, Hkv * 2 * Ds] HBM: combined pages (combined.py)
    scale_hbm,  # [P, Hkv * 2 * page_size] HBM: a quantized pool's scales, (head, K|V, token) order ([1, 1] without)
    table_hbm,  # [S * pages_per_seq] HBM: the page table, read from here with fetch_rows
    sinks_smem,  # [Hq] float32 SMEM: each query head's sink logit ([1] unused without sinks)
    # with has_tree: tree_base_ref, tree_bits_ref, [R, 1] int32 VMEM each (the block rows' tree masks); then
    # output
    #   o_ref: [Hkv, R, lanes] VMEM
    # scratch
    #   kv_buf: [2, C * page_size, Hkv * 2 * Ds] VMEM, two slots
    #   kv_sems: DMA semaphores [2], one per slot
    #   scale_buf: [2, C, Hkv * 2 * page_size] float32 VMEM with a scale pool ([2, 1, 128] without)
    #   scale_sems: DMA semaphores [2]
    #   fetch_state: SMEM int32[2]: [slot of this program's first KV block, 1 if already fetching it]
    #   m_ref: [Hkv, R, 1] float32: running max
    #   l_ref: [Hkv, R, 1] float32: running sum
    #   acc_ref: [Hkv, R, lanes] float32
    #   rows_ref: SMEM int32 [2 * pages_per_seq] with fetch_rows: the page-table rows of this program and the next
    #   rows_sem: DMA semaphore [1]
    *refs,
    has_tree,
    sm_scale,
    sliding_window,
    attention_chunk,
    soft_cap,
    has_sinks,
    k_scale,
    v_scale,
    Bq,
    G,
    pages_per_seq,
    page_size,
    stored_head_dim,
    fetch_rows,
    scale_pool,
    lane_blocks,
    value_dim,
):
    tree_refs, refs = (refs[:2], refs[2:]) if has_tree else ((), refs)
    (o_ref, kv_buf, kv_sems, scale_buf, scale_sems, fetch_state, m_ref, l_ref, acc_ref, rows_ref, rows_sem) = refs
    b = pl.program_id(0)
    num_blocks = pl.num_programs(0)
    num_kv_heads, rows, _ = q_ref.shape
    kv_block = kv_buf.shape[1]
    pages_per_block = kv_block // page_size
    geometry = functools.partial(
        query_block,
        refs=(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, block_seq_ref, block_q_start_ref),
        Bq=Bq,
        kv_block=kv_block,
        sliding_window=sliding_window,
        attention_chunk=attention_chunk,
    )

    def row_start(program, blk: QueryBlock):
        """Where the page ids of `program`'s sequence start: in the whole table, or with fetch_rows
        in the row slot of the program's parity."""
        return (program % 2) * pages_per_seq if fetch_rows else blk.seq * pages_per_seq

    def page_copies(blk: QueryBlock, j, slot, row):
        """(needed, copies) for each page of KV block j of query block `blk`: whole pages, into
        rows i * page_size of the slot (and with a scale pool, the page's scales into row i of
        the scale slot). `row`: where its page ids start (row_start)."""
        table = rows_ref if fetch_rows else page_indices_ref
        copies = []
        for i in range(pages_per_block):
            page = j * pages_per_block + i  # page number within the sequence
            needed = (page * page_size <= blk.last_pos) & ((page + 1) * page_size > blk.lo_pos)
            page_id = table[row + jnp.minimum(page, pages_per_seq - 1)]
            if lane_blocks == 1:
                source = kv_hbm.at[page_id]
            else:  # lane block page_id % f of physical page page_id // f (module docstring)
                width = kv_buf.shape[2]
                source = kv_hbm.at[page_id // lane_blocks, :, pl.ds((page_id % lane_blocks) * width, width)]
            page_copies = [pltpu.make_async_copy(source, kv_buf.at[slot, pl.ds(i * page_size, page_size)], kv_sems.at[slot])]
            if scale_pool:
                page_copies.append(pltpu.make_async_copy(scale_hbm.at[page_id], scale_buf.at[slot, i], scale_sems.at[slot]))
            copies.append((needed, page_copies))
        return copies

    def start_fetch(blk, j, slot, row):
        for needed, copies in page_copies(blk, j, slot, row):
            for copy in copies:
                pl.when(needed)(copy.start)

    def wait_fetch(blk, j, slot, row):
        for needed, copies in page_copies(blk, j, slot, row):
            for copy in copies:
                pl.when(needed)(copy.wait)

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
        fetched_row = (kv_pos >= blk.lo_pos) & (kv_pos <= blk.last_pos)  # the same, along the lanes
        visible = (kv_pos <= q_pos) & row_real  # [R, K]
        if limits_span(sliding_window, attention_chunk):
            visible &= kv_pos >= span_start(q_pos, sliding_window=sliding_window, attention_chunk=attention_chunk)
        if has_tree:  # draft trees: each row's keys narrowed by its (base, bits) [R, 1]
            visible &= tree_visible(kv_pos, tree_refs[0][...], tree_refs[1][...])

        for h in range(num_kv_heads):  # head by head: one head's K and V live at a time
            k, v = read_head(kv_buf.at[slot], h, stored_head_dim, k_scale, v_scale, value_dim)
            if scale_pool:  # entry * its token's scale: K's scales multiply the scores' columns, V's the weights'
                k_scales, v_scales = (token_scales(scale_buf.at[slot], 2 * h + i, page_size) for i in (0, 1))  # [1, K]
                k_scales = jnp.where(fetched_row, k_scales, 0.0)
                v_scales = jnp.where(fetched_row, v_scales, 0.0)
            v = jnp.where(fetched, v, 0.0).astype(dtype)
            s = jax.lax.dot_general(q_ref[h], k.astype(dtype), (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)  # [R, K]
            s = s * (sm_scale if not scale_pool else k_scales * sm_scale)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, -jnp.inf)
            m = m_ref[h]
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m - m_safe)
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            weights = p if not scale_pool else p * v_scales
            pv = jax.lax.dot_general(weights.astype(dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = m_new
        return 1 - slot

    slot_after = jax.lax.fori_loop(blk.kv_lo, blk.kv_hi, kv_step, first_slot)
    fetch_state[0] = slot_after
    fetch_state[1] = (has_kv & next_has_kv).astype(jnp.int32)
    l = l_ref[...]  # [Hkv, R, 1]
    if has_sinks:  # a sink adds exp(sink - m) to the denominator and nothing to the sum (reference.sink_weight)
        head_of_row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) % G  # row r: query head h * G + r % G
        sink_rows = jnp.stack([
            sum(jnp.where(head_of_row == g, sinks_smem[h * G + g], 0.0) for g in range(G)) for h in range(num_kv_heads)
        ])  # [Hkv, R, 1]
        m = m_ref[...]
        l = l + jnp.exp(sink_rows - jnp.where(m == -jnp.inf, 0.0, m))
    o_ref[...] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "attention_chunk",
        "soft_cap",
        "k_scale",
        "v_scale",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "vmem_limit_bytes",
        "fetch_rows",
        "lane_blocks",
        "value_dim",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [P, page_size, Hkv * 2 * Ds]: combined pages (combined.py), Ds = combined_head_dim(D)
    kv_lens: jax.Array,  # [S]
    page_indices: jax.Array,  # [S, pages_per_seq]
    cu_q_lens: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [] or [1]
    kv_scale: jax.Array | None = None,  # [P, Hkv * 2 * page_size] float32: int8 / fp8 pages' scale per token and head
    sinks: jax.Array | None = None,  # [Hq] float32: one sink logit per query head (GPT-OSS)
    tree_base: jax.Array | None = None,  # [T] int32: tree masks (module docstring; pallas_kernels.tree_mask)
    tree_bits: jax.Array | None = None,  # [T] int32
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,  # Llama 4's chunked local attention (pallas_kernels.visible_span)
    soft_cap: float | None = None,
    k_scale: float | None = None,  # int8 / fp8 pages with one scale each for K and V: entry * scale is the value
    v_scale: float | None = None,
    num_queries_per_block: int = 8,
    num_kv_pages_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,  # default: the target chip's (pallas_kernels.tpu_chip)
    fetch_rows: bool | None = None,  # page-table rows fetched per program (default: when the whole table overflows SMEM)
    lane_blocks: int = 1,  # pages of W / lane_blocks lanes, side by side in each physical page (module docstring)
    value_dim: int | None = None,  # latent pages: one key row per token, values its first value_dim lanes (module docstring)
    interpret=False,  # passed to pallas_call: True (HLO interpreter) or pltpu.InterpretParams(...)
) -> jax.Array:
    scale_pool = kv_scale is not None
    if lane_blocks > 1 and scale_pool:
        raise ValueError("lane_blocks > 1 with a scale pool (a quantized KV cache) is not supported")
    if scale_pool:
        if kv_pages.dtype not in QUANTIZED_KV_DTYPES:
            raise ValueError(f"kv_scale is given but kv_pages are {kv_pages.dtype}, not int8 / float8_e4m3fn")
        if k_scale is not None or v_scale is not None:
            raise ValueError("pass either a scale pool (kv_scale) or one scale each for K and V (k_scale, v_scale), not both")
    else:
        check_kv_scales(kv_pages, kv_pages, k_scale, v_scale)
    T, Hq, D = q.shape
    has_tree = check_tree(tree_base, tree_bits, T)
    P, page_size, width = kv_pages.shape
    if lane_blocks > 1 and (width % lane_blocks or (width // lane_blocks) % 128):
        raise ValueError(f"pages of {width} lanes do not split into {lane_blocks} lane blocks of whole 128-lane rows")
    width //= lane_blocks  # a (logical) page's row
    S, pages_per_seq = page_indices.shape
    if value_dim is not None:  # latent pages: one key row of `width` lanes; values its first value_dim lanes
        if scale_pool or k_scale is not None or lane_blocks > 1:
            raise ValueError("latent pages (value_dim) are float pages of one width: no scales, no lane blocks")
        if width % 128 or width < D or value_dim % 128 or value_dim > D:
            raise ValueError(f"latent pages of {width} lanes for head_dim {D} with values of {value_dim} lanes: the row must "
                             "be whole 128-lane rows holding the head, the values whole 128-lane rows of it")
        Ds, lanes, Hkv, out_lanes = width, width, 1, value_dim
    else:
        Ds = combined_head_dim(D)
        lanes = out_lanes = lane_width(Ds)
        if width % (2 * Ds):
            raise ValueError(f"combined pages of {width} lanes do not hold whole heads of 2 x {Ds} lanes (head_dim {D})")
        Hkv = width // (2 * Ds)
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads do not split evenly over {Hkv} KV heads")
    if kv_pages.dtype not in QUANTIZED_KV_DTYPES and kv_pages.dtype != q.dtype:
        raise ValueError(f"float pages must have q's dtype: kv_pages {kv_pages.dtype}, q {q.dtype}")
    if scale_pool:
        if kv_scale.shape != (P, Hkv * 2 * page_size):
            raise ValueError(f"kv_scale must be [pages, Hkv * 2 * page_size] = {(P, Hkv * 2 * page_size)}; got {kv_scale.shape}")
        if page_size % 128:
            raise ValueError(f"page_size {page_size}: a scale pool is read by the TPU kernel with page_size a multiple of 128 "
                             f"(each head's scales of a page then fill whole 128-lane rows); use the XLA attention otherwise")
    G = Hq // Hkv
    Bq = num_queries_per_block
    C = num_kv_pages_per_block or max(1, DEFAULT_KV_TOKENS_PER_BLOCK // page_size)
    C = min(C, pages_per_seq)
    kv_block = C * page_size
    R = Bq * G  # rows of one query block per KV head: query r // G, head r % G of the head's group

    limit = vmem_limit_bytes or chip_vmem_limit_bytes()
    need = vmem_working_set_bytes(rows=R, num_kv_heads=Hkv, row_width=width, lanes=lanes, kv_tokens=kv_block,
                                  q_itemsize=q.dtype.itemsize, kv_itemsize=kv_pages.dtype.itemsize)
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

    q_lanes = jnp.pad(q, ((0, 0), (0, 0), (0, lanes - D)))  # zero lanes: K's padding and, with Ds = 64, V's half
    q_blocks = q_lanes[jnp.minimum(rows, T - 1)].reshape(NB, Bq, Hkv, G, lanes)
    q_blocks = q_blocks.transpose(0, 2, 1, 3, 4).reshape(NB, Hkv, R, lanes)

    tree_inputs, tree_specs = (), []
    if has_tree:  # each block row's (base, bits), laid out like its queries: [NB, R, 1] each
        tree_inputs = tuple(jnp.repeat(a[jnp.minimum(rows, T - 1)], G, axis=1)[..., None] for a in (tree_base, tree_bits))
        tree_specs = [pl.BlockSpec((None, R, 1), lambda b, *_: (b, 0, 0))] * 2

    tile = pl.BlockSpec((None, Hkv, R, lanes), lambda b, *_: (b, 0, 0, 0))
    out_tile = pl.BlockSpec((None, Hkv, R, out_lanes), lambda b, *_: (b, 0, 0, 0))
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, attention_chunk=attention_chunk, soft_cap=soft_cap,
        has_sinks=sinks is not None, has_tree=has_tree,
        k_scale=k_scale,
        v_scale=v_scale, Bq=Bq, G=G, pages_per_seq=pages_per_seq, page_size=page_size, stored_head_dim=Ds,
        fetch_rows=fetch_rows, scale_pool=scale_pool, lane_blocks=lane_blocks, value_dim=value_dim,
    )
    cost_estimate = cost.ragged_paged_attention(
        query_rows=NB * Bq, query_blocks=NB, Hq=Hq, Hkv_stored=Hkv, D=Ds, kv_tokens_per_block=pages_per_seq * page_size,
        q_itemsize=q.dtype.itemsize, kv_itemsize=kv_pages.dtype.itemsize,
    )
    table = page_indices.astype(jnp.int32).reshape(-1)  # [S * pages_per_seq]
    if interpret:
        patch_interpret_mode()
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, R, out_lanes), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(NB,),
            in_specs=[tile] + [pl.BlockSpec(memory_space=pl.ANY)] * 3 + [pl.BlockSpec(memory_space=pltpu.SMEM)] + tree_specs,
            out_specs=out_tile,
            scratch_shapes=[
                pltpu.VMEM((2, kv_block, width), kv_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((2, C, Hkv * 2 * page_size) if scale_pool else (2, 1, 128), jnp.float32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2,), jnp.int32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, 1), jnp.float32),
                pltpu.VMEM((Hkv, R, out_lanes), jnp.float32),
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
        kv_pages,
        kv_scale.astype(jnp.float32) if scale_pool else jnp.zeros((1, 1), jnp.float32),
        table,
        jnp.zeros(1, jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        *tree_inputs,
    )  # [NB, Hkv, R, lanes]: V's lanes of the row; with Ds = 64, the row's second half

    if value_dim is not None:  # [NB, 1, R, r]: the latent values
        out = out.reshape(NB * Bq, Hq, value_dim)  # row r of a block: query r // Hq, head r % Hq
        return jnp.zeros((T, Hq, value_dim), q.dtype).at[rows.reshape(-1)].set(out, mode="drop")
    out = out[..., lanes - Ds : lanes - Ds + D].reshape(NB, Hkv, Bq, G, D).transpose(0, 2, 1, 3, 4).reshape(NB * Bq, Hq, D)
    result = jnp.zeros((T, Hq, D), q.dtype)
    return result.at[rows.reshape(-1)].set(out, mode="drop")

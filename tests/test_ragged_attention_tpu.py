"""The Pallas TPU ragged paged attention kernel, run in interpret mode, against the jnp reference.

Every test compares `tpu.ragged_paged_attention(..., interpret=True)` with
`reference.ragged_paged_attention` on the same inputs. Each distinct shape or static option is one
interpreted compile (~2 s), so cases share shapes where they can.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_chip
from pallas_kernels.ragged_paged_attention import combined, reference, tpu
from test_ragged_attention_reference import make_case

SM_SCALE = 0.125
F32_TOL = 1e-5  # relative to the largest output entry
BF16_TOL = 2e-2


def combined_pages(k_pages, v_pages, rng):
    """Separate pools [P, page_size, Hkv, D] -> combined pages [P, page_size, Hkv * 2 * Ds] as a TPU
    stores them (combined.py), the lanes past D filled with large noise where the kernel must not
    let them count (K's padding lanes meet q's zero lanes, V's are never output) instead of zeros."""
    kv = combined.combine_kv(k_pages, v_pages)
    D, Ds = k_pages.shape[-1], combined.combined_head_dim(k_pages.shape[-1])
    if D == Ds:
        return kv
    lane = np.arange(kv.shape[-1]) % Ds
    noise = np.asarray(rng.normal(0, 100, kv.shape), np.float32)
    return jnp.where(lane >= D, jnp.asarray(noise).astype(kv.dtype), kv)


def run_kernel_and_reference(case, **kw):
    """(kernel output, reference output) as float64 numpy arrays. The kernel gets the pools as a
    TPU stores them: combined pages."""
    args = [jnp.asarray(x) for x in case]
    kw = {"sm_scale": SM_SCALE, **kw}
    q, k_pages, v_pages, *rest = args
    kv_pages = combined_pages(k_pages, v_pages, np.random.default_rng(99))
    got = tpu.ragged_paged_attention(q, kv_pages, *rest, interpret=kw.pop("interpret", True), **kw)
    kw.pop("vmem_limit_bytes", None), kw.pop("fetch_rows", None)  # kernel-only options
    want = reference.ragged_paged_attention(*args, **kw)
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    return np.asarray(got, np.float64), np.asarray(want, np.float64)


def assert_close(got, want, tol):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)


def real_rows(case):
    """Number of query rows that are not padding: cu_q_lens[num_seqs]."""
    *_, cu, num_seqs = case
    return int(cu[int(np.reshape(num_seqs, -1)[0])])


# (Hq, Hkv, head_dim, page_size): GQA ratios 1/2/4/8, head_dim 32 (stored in 64 lanes), 64 (K and V
# of a head share a 128-lane row) and 128, three page sizes
CONFIGS = [(2, 2, 64, 4), (4, 2, 128, 16), (8, 2, 64, 8), (8, 1, 128, 16), (4, 1, 32, 8)]


@pytest.mark.parametrize("Hq,Hkv,D,page_size", CONFIGS, ids=[f"G{hq // hkv}-D{d}-page{p}" for hq, hkv, d, p in CONFIGS])
def test_mixed_batch_matches_reference_and_padding_rows_are_zero(Hq, Hkv, D, page_size):
    rng = np.random.default_rng(0)
    # fresh prefills ending at (16) and just past (17 of 33) a page boundary of every page size,
    # decodes at 37 and one past a boundary (17), a chunk continuing a prefill, a one-token
    # prompt, a zero-length slot; then two padding sequences and five padding query rows
    q_lens = [16, 1, 8, 1, 0, 17, 1]
    kv_lens = [16, 37, 50, 1, 0, 33, 17]
    case = make_case(rng, q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=D, page_size=page_size, pad_seqs=2, pad_tokens=5)
    got, want = run_kernel_and_reference(case, num_queries_per_block=4, num_kv_pages_per_block=2)
    assert_close(got, want, F32_TOL)
    assert np.all(got[real_rows(case) :] == 0)


def test_page_table_rows_fetched_per_program_give_the_same_attention():
    """Long contexts (a page table over the chip's SMEM): each program DMAs the next program's
    page-table row into a slot of its own instead of reading the whole table from SMEM. Decodes,
    prefills over several query blocks and KV blocks, padding: as the reference."""
    rng = np.random.default_rng(0)
    case = make_case(rng, [16, 1, 8, 1, 0, 17, 1], [16, 37, 50, 1, 0, 33, 17], Hq=4, Hkv=2, D=128, page_size=4,
                     pad_seqs=2, pad_tokens=5)
    got, want = run_kernel_and_reference(case, num_queries_per_block=4, num_kv_pages_per_block=2, fetch_rows=True)
    assert_close(got, want, F32_TOL)
    assert np.all(got[real_rows(case) :] == 0)


def test_pages_held_as_lane_blocks_of_wider_pages_give_the_same_attention():
    """lane_blocks=2: the pool's pages are twice as wide, each holding two of the table's pages side
    by side (page v: lanes [v % 2 * W, v % 2 * W + W) of physical page v // 2): a KV layer group
    whose rows are half the pool's (Gemma 4). The kernel fetches those lane blocks and gives exactly
    what it gives on the pages laid out one by one."""
    rng = np.random.default_rng(2)
    case = make_case(rng, [16, 1, 8, 1], [16, 37, 50, 17], Hq=4, Hkv=1, D=128, page_size=8, pad_tokens=3)
    q, k_pages, v_pages, *rest = (jnp.asarray(x) for x in case)
    pages = combined.combine_kv(k_pages, v_pages)  # [P, page_size, W]
    P, ps, W = pages.shape
    pages = jnp.pad(pages, ((0, P % 2), (0, 0), (0, 0)))
    wide = pages.reshape(-1, 2, ps, W).transpose(0, 2, 1, 3).reshape(-1, ps, 2 * W)  # [P / 2, page_size, 2 W]
    options = dict(sm_scale=SM_SCALE, num_queries_per_block=4, num_kv_pages_per_block=2, interpret=True)
    got = tpu.ragged_paged_attention(q, wide, *rest, lane_blocks=2, **options)
    want = tpu.ragged_paged_attention(q, pages, *rest, **options)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_close(np.asarray(got, np.float64), np.asarray(reference.ragged_paged_attention(*case, sm_scale=SM_SCALE), np.float64),
                 F32_TOL)


def test_odd_kv_head_count_needs_no_padding():
    """SmolLM2's shape: 9 query heads over 3 KV heads of 64, a combined row of 3 x 128 lanes."""
    rng = np.random.default_rng(1)
    case = make_case(rng, [12, 1, 3], [12, 30, 9], Hq=9, Hkv=3, D=64, page_size=16, pad_tokens=3)
    case = tuple(jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else x for x in case)
    got, want = run_kernel_and_reference(case, num_queries_per_block=4, num_kv_pages_per_block=2)
    assert_close(got, want, BF16_TOL)


def test_pages_that_do_not_hold_whole_heads_are_rejected():
    q, k, v, *rest = make_case(np.random.default_rng(5), [2], [2], Hq=6, Hkv=3, D=64, page_size=4)
    kv_pages = combined.combine_kv(jnp.asarray(k), jnp.asarray(v))[..., :-64]
    with pytest.raises(ValueError, match="whole heads"):
        tpu.ragged_paged_attention(jnp.asarray(q), kv_pages, *map(jnp.asarray, rest), interpret=True)


def test_bfloat16_queries_and_pages():
    rng = np.random.default_rng(2)
    case = make_case(rng, [12, 1, 3, 0], [12, 30, 9, 0], Hq=8, Hkv=2, D=128, page_size=8, pad_tokens=3)
    case = tuple(jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else x for x in case)
    got, want = run_kernel_and_reference(case, num_queries_per_block=4, num_kv_pages_per_block=2)
    assert_close(got, want, BF16_TOL)


@pytest.mark.parametrize(
    "option", [{"sliding_window": 7}, {"soft_cap": 5.0, "sm_scale": 1.0}, {"attention_chunk": 8}],
    ids=["sliding_window", "soft_cap", "attention_chunk"],
)
def test_sliding_window_soft_cap_and_chunks(option):
    rng = np.random.default_rng(3)
    case = make_case(rng, [30, 1, 5, 1], [30, 40, 25, 3], Hq=4, Hkv=2, D=64, page_size=4, pad_seqs=1)
    got, want = run_kernel_and_reference(case, num_queries_per_block=8, num_kv_pages_per_block=2, **option)
    assert_close(got, want, F32_TOL)


def test_attention_sinks_with_a_window():
    """GPT-OSS: one sink logit per query head (4 query heads per KV head here, so each row of a
    program's block finds its own head's sink), a sliding window; rows that see nothing stay 0."""
    rng = np.random.default_rng(4)
    case = make_case(rng, [30, 1, 5, 1], [30, 40, 25, 3], Hq=8, Hkv=2, D=64, page_size=4, pad_seqs=1)
    sinks = jnp.asarray(rng.normal(0, 2, 8), jnp.float32)
    got, want = run_kernel_and_reference(case, num_queries_per_block=8, num_kv_pages_per_block=2, sliding_window=7,
                                         sinks=sinks)
    assert_close(got, want, F32_TOL)
    got_without, _ = run_kernel_and_reference(case, num_queries_per_block=8, num_kv_pages_per_block=2, sliding_window=7)
    assert np.abs(got - got_without).max() > 1e-2  # the sinks took their share of the weights


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_pages_are_dequantized_in_the_kernel(kv_dtype):
    rng = np.random.default_rng(4)
    q, k, v, *rest = make_case(rng, [9, 1, 4], [9, 21, 13], Hq=4, Hkv=2, D=64, page_size=4, pad_tokens=2)
    k_scale, v_scale = 0.05, 0.02
    if kv_dtype == jnp.int8:
        k_q = np.clip(np.round(k / k_scale), -127, 127).astype(np.int8)
        v_q = np.clip(np.round(v / v_scale), -127, 127).astype(np.int8)
    else:
        k_q, v_q = jnp.asarray(k / k_scale, kv_dtype), jnp.asarray(v / v_scale, kv_dtype)
    case = (q, k_q, v_q, *rest)
    got, want = run_kernel_and_reference(
        case, k_scale=k_scale, v_scale=v_scale, num_queries_per_block=4, num_kv_pages_per_block=2
    )
    assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("kv_dtype,pages_per_block", [(jnp.int8, 1), (jnp.float8_e4m3fn, 2)], ids=["int8", "fp8-2-pages"])
def test_a_quantized_pool_with_a_scale_per_token_and_head_is_read_in_the_kernel(kv_dtype, pages_per_block):
    """What a TPU serving a quantized cache stores (jaxinfer.ops.kv_cache): combined int8 / e4m3
    entries (e4m3 as bytes) and one scale pool, (head, K|V, token) within a page, pages of 128
    tokens. Scales multiply the scores' columns (K) and the softmax weights (V)."""
    rng = np.random.default_rng(8)
    q, k, v, *rest = map(jnp.asarray, make_case(rng, [130, 1, 3, 0], [130, 300, 140, 0], Hq=4, Hkv=2, D=64, page_size=128,
                                                pad_tokens=2))
    stored = reference.storage_dtype(kv_dtype)
    (k_q, k_s), (v_q, v_s) = reference.quantize_kv(k, stored), reference.quantize_kv(v, stored)
    got = tpu.ragged_paged_attention(q, combined.combine_kv(k_q, v_q), *rest, combined.combine_scales(k_s, v_s),
                                     sm_scale=SM_SCALE, num_queries_per_block=8, num_kv_pages_per_block=pages_per_block,
                                     interpret=True)
    want = reference.ragged_paged_attention(q, k_q, v_q, *rest, sm_scale=SM_SCALE, k_scale=k_s, v_scale=v_s)
    assert_close(np.asarray(got, np.float64), np.asarray(want, np.float64), F32_TOL)
    with pytest.raises(ValueError, match="page_size 4: a scale pool"):
        small = make_case(rng, [2], [2], Hq=2, Hkv=1, D=64, page_size=4)
        (e, s_) = reference.quantize_kv(jnp.asarray(small[1]), jnp.int8)
        tpu.ragged_paged_attention(jnp.asarray(small[0]), combined.combine_kv(e, e), *map(jnp.asarray, small[3:]),
                                   combined.combine_scales(s_, s_), interpret=True)


@pytest.mark.parametrize(
    "span,want_kv_blocks",
    [({}, [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3, 4], []]), ({"sliding_window": 6}, [[0], [0, 1], [1, 2], [3, 4], []]),
     ({"attention_chunk": 16}, [[0], [0, 1], [2], [4], []])],
)
def test_query_blocks_visit_only_the_kv_blocks_they_can_see(span, want_kv_blocks):
    # a 20-token prefill (3 query blocks of 8: positions 0-7, 8-15, 16-19) and a decode at position
    # 36, KV blocks of 8 tokens; the last query block is padding and must visit none
    kv_lens, cu_q_lens, num_seqs = np.array([20, 37]), np.array([0, 20, 21]), np.array([2])
    block_seq, block_q_start = np.array([0, 0, 0, 1, 1]), np.array([0, 8, 16, 0, 8])
    refs = (kv_lens, cu_q_lens, num_seqs, block_seq, block_q_start)
    got = []
    for b in range(5):
        blk = tpu.query_block(b, refs, Bq=8, kv_block=8, sliding_window=span.get("sliding_window"),
                              attention_chunk=span.get("attention_chunk"))
        got.append(list(range(int(blk.kv_lo), int(blk.kv_hi))))
    assert got == want_kv_blocks


def test_quantized_pages_without_a_scale_are_rejected():
    q, k, v, *rest = make_case(np.random.default_rng(5), [2], [2], Hq=2, Hkv=1, D=64, page_size=4)
    args = [jnp.asarray(q), combined.combine_kv(jnp.asarray(k, jnp.int8), jnp.asarray(v, jnp.int8)), *map(jnp.asarray, rest)]
    with pytest.raises(ValueError, match="k_scale"):
        tpu.ragged_paged_attention(*args, sm_scale=SM_SCALE, interpret=True)


def test_blocks_too_large_for_the_vmem_limit_are_rejected():
    q, k, v, *rest = map(jnp.asarray, make_case(np.random.default_rng(6), [2], [2], Hq=2, Hkv=1, D=64, page_size=4))
    with pytest.raises(ValueError, match="VMEM"):
        tpu.ragged_paged_attention(q, combined.combine_kv(k, v), *rest, num_queries_per_block=8, vmem_limit_bytes=64 * 1024,
                                   interpret=True)


def test_vmem_working_set_of_a_llama_prefill_block_fits_the_smallest_chip():
    # Bq=32, G=4 (R=128 rows per KV head), 8 KV heads of 128 (a combined row of 2048 lanes), bf16, 8 pages of 16 tokens
    need = tpu.vmem_working_set_bytes(rows=128, num_kv_heads=8, row_width=2048, lanes=128, kv_tokens=128,
                                      q_itemsize=2, kv_itemsize=2)
    q_and_out, kv_slots, scores, one_head, softmax = 1024, 1024, 128, 256, 8 * (64 + 2 * 64)  # KiB; m, l lane-padded
    assert need == (q_and_out + kv_slots + scores + one_head + softmax) * 1024
    assert need < tpu_chip.FALLBACK_VMEM_LIMIT_BYTES


def test_tpu_simulator_finds_no_race_and_no_unneeded_page_is_read(capfd):
    """Under the TPU simulator every page id the kernel should never fetch is out of range.

    `InterpretParams` raises on an out-of-bounds DMA and fills uninitialised VMEM with NaN, so the
    test fails if the kernel fetches a page past a sequence's last needed position, before its
    sliding window, of a padding sequence, or for a padding query block, or if it reads a slot
    before its DMA landed (the race detector checks the double-buffered DMA pipeline). DMAs run
    "eager"ly, when started, so that one started but never waited for leaves its semaphore
    non-zero, which the simulator reports at exit.
    """
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # private: the race detector state

    page_size, window = 4, 6
    case = make_case(
        np.random.default_rng(7), [5, 1, 0, 2], [5, 23, 0, 14], Hq=4, Hkv=2, D=64, page_size=page_size, pad_seqs=1, pad_tokens=2
    )
    q, k, v, kv_lens, page_indices, cu, num_seqs = case
    poisoned = page_indices.copy()
    never = 10**6  # far past the pool
    for s, kv_len in enumerate(kv_lens):
        poisoned[s, -(-kv_len // page_size) :] = never  # past the sequence (all of it for empty / padding rows)
    poisoned[1, : (23 - window) // page_size] = never  # the decode at position 22 sees 17..22: pages 0-3 unused
    try:
        got = tpu.ragged_paged_attention(
            jnp.asarray(q), combined.combine_kv(jnp.asarray(k), jnp.asarray(v)), *map(jnp.asarray, (kv_lens, poisoned, cu, num_seqs)),
            sm_scale=SM_SCALE, sliding_window=window, num_queries_per_block=2, num_kv_pages_per_block=1,
            interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        )
        got = np.asarray(got, np.float64)
    finally:
        races_found = interpret_pallas_call.races.races_found if interpret_pallas_call.races else None
        pltpu.reset_tpu_interpret_mode_state()
    assert races_found is False
    assert "non-zero count" not in capfd.readouterr().out
    want = reference.ragged_paged_attention(*map(jnp.asarray, case), sm_scale=SM_SCALE, sliding_window=window)
    want = np.asarray(want, np.float64)
    assert_close(got, want, F32_TOL)


# ---- random ragged batches, all padded to one shape so that they share one compile
MAX_SEQS, MAX_TOKENS, PAGES_PER_SEQ, NUM_PAGES = 6, 56, 10, 48


@hypothesis.settings(max_examples=12, deadline=None, database=None)
@hypothesis.given(
    seqs=st.lists(st.tuples(st.integers(0, 10), st.integers(0, 24)), min_size=1, max_size=MAX_SEQS - 1),
    drop_last_seq=st.booleans(),
    sliding_window=st.sampled_from([None, 6]),
    heads=st.sampled_from([(4, 2, 64), (8, 1, 128)]),  # (Hq, Hkv, D): GQA 2 and 8, both head dims
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_random_ragged_batches(seqs, drop_last_seq, sliding_window, heads, dtype, seed):
    q_lens = [q for q, _ in seqs]
    kv_lens = [q + context if q else context for q, context in seqs]  # zero-length queries may have a cache
    Hq, Hkv, D = heads
    case = make_case(
        np.random.default_rng(seed), q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=D, page_size=4,
        num_pages=NUM_PAGES, pad_seqs=MAX_SEQS - len(seqs), pad_tokens=MAX_TOKENS - sum(q_lens),
    )
    q, k, v, kv, page_indices, cu, num_seqs = case
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    page_indices = np.pad(page_indices, ((0, 0), (0, PAGES_PER_SEQ - page_indices.shape[1])))
    if drop_last_seq:  # the last sequence becomes padding: its rows must come out zero
        num_seqs = num_seqs - 1
    case = (q, k, v, kv, page_indices, cu, num_seqs)
    got, want = run_kernel_and_reference(case, sliding_window=sliding_window, num_queries_per_block=4, num_kv_pages_per_block=2)
    assert_close(got, want, F32_TOL if dtype == np.float32 else BF16_TOL)
    assert np.all(got[real_rows(case) :] == 0)

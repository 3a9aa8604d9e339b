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

from pallas_kernels.ragged_paged_attention import reference, tpu
from test_ragged_attention_reference import make_case

SM_SCALE = 0.125
F32_TOL = 1e-5  # relative to the largest output entry
BF16_TOL = 2e-2


def run_kernel_and_reference(case, **kw):
    """(kernel output, reference output) as float64 numpy arrays."""
    args = [jnp.asarray(x) for x in case]
    kw = {"sm_scale": SM_SCALE, **kw}
    got = tpu.ragged_paged_attention(*args, interpret=kw.pop("interpret", True), **kw)
    kw.pop("vmem_limit_bytes", None)
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


# (Hq, Hkv, head_dim, page_size): GQA ratios 1/2/4/8, head_dim 64 and 128, three page sizes
CONFIGS = [(2, 2, 64, 4), (4, 2, 128, 16), (8, 2, 64, 8), (8, 1, 128, 16)]


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


def test_bfloat16_queries_and_pages():
    rng = np.random.default_rng(2)
    case = make_case(rng, [12, 1, 3, 0], [12, 30, 9, 0], Hq=8, Hkv=2, D=128, page_size=8, pad_tokens=3)
    case = tuple(jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else x for x in case)
    got, want = run_kernel_and_reference(case, num_queries_per_block=4, num_kv_pages_per_block=2)
    assert_close(got, want, BF16_TOL)


@pytest.mark.parametrize(
    "option", [{"sliding_window": 7}, {"soft_cap": 5.0, "sm_scale": 1.0}], ids=["sliding_window", "soft_cap"]
)
def test_sliding_window_and_soft_cap(option):
    rng = np.random.default_rng(3)
    case = make_case(rng, [30, 1, 5, 1], [30, 40, 25, 3], Hq=4, Hkv=2, D=64, page_size=4, pad_seqs=1)
    got, want = run_kernel_and_reference(case, num_queries_per_block=8, num_kv_pages_per_block=2, **option)
    assert_close(got, want, F32_TOL)


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


@pytest.mark.parametrize(
    "sliding_window,want_kv_blocks",
    [(None, [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3, 4], []]), (6, [[0], [0, 1], [1, 2], [3, 4], []])],
)
def test_query_blocks_visit_only_the_kv_blocks_they_can_see(sliding_window, want_kv_blocks):
    # a 20-token prefill (3 query blocks of 8: positions 0-7, 8-15, 16-19) and a decode at position
    # 36, KV blocks of 8 tokens; the last query block is padding and must visit none
    kv_lens, cu_q_lens, num_seqs = np.array([20, 37]), np.array([0, 20, 21]), np.array([2])
    block_seq, block_q_start = np.array([0, 0, 0, 1, 1]), np.array([0, 8, 16, 0, 8])
    refs = (kv_lens, cu_q_lens, num_seqs, block_seq, block_q_start)
    got = []
    for b in range(5):
        blk = tpu.query_block(b, refs, Bq=8, kv_block=8, sliding_window=sliding_window)
        got.append(list(range(int(blk.kv_lo), int(blk.kv_hi))))
    assert got == want_kv_blocks


def test_quantized_pages_without_a_scale_are_rejected():
    q, k, v, *rest = make_case(np.random.default_rng(5), [2], [2], Hq=2, Hkv=1, D=64, page_size=4)
    args = [jnp.asarray(q), jnp.asarray(k, jnp.int8), jnp.asarray(v, jnp.int8), *map(jnp.asarray, rest)]
    with pytest.raises(ValueError, match="k_scale"):
        tpu.ragged_paged_attention(*args, sm_scale=SM_SCALE, interpret=True)


def test_blocks_too_large_for_the_vmem_limit_are_rejected():
    case = make_case(np.random.default_rng(6), [2], [2], Hq=2, Hkv=1, D=64, page_size=4)
    with pytest.raises(ValueError, match="VMEM"):
        tpu.ragged_paged_attention(*map(jnp.asarray, case), num_queries_per_block=8, vmem_limit_bytes=64 * 1024, interpret=True)


def test_vmem_working_set_matches_the_documented_example():
    # Bq=32, G=8, D=128, bf16, 8 pages of 16 tokens: 256+128+256+128+128+256 KiB (module docstring)
    need = tpu.vmem_working_set_bytes(rows=256, head_dim=128, kv_tokens=128, q_itemsize=2, kv_itemsize=2)
    assert need == (256 + 128 + 256 + 128 + 128 + 256) * 1024
    assert need < tpu.DEFAULT_VMEM_LIMIT_BYTES


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
            *map(jnp.asarray, (q, k, v, kv_lens, poisoned, cu, num_seqs)),
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


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
def test_kernel_lowers_to_mosaic_for_a_real_tpu(kv_dtype, monkeypatch):
    """jax.export for platform "tpu" runs the Pallas -> Mosaic lowering on this CPU machine.

    It catches primitives without a Mosaic lowering and illegal block shapes; Mosaic's own layout
    passes run only on a TPU. The lowering asks for the chip's parameters, so the (private) chip
    registry is told that this "cpu" device is a TPU v5e for the duration of the test.
    """
    from jax._src.pallas.mosaic import tpu_info

    v5e = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)  # noqa: E731
    monkeypatch.setitem(tpu_info.registry, "cpu", v5e)
    tpu_info.get_tpu_info.cache_clear()
    T, Hq, Hkv, D, page_size, P, S, pages_per_seq = 64, 8, 2, 128, 16, 64, 8, 16
    scales = {"k_scale": 0.1, "v_scale": 0.1} if kv_dtype == jnp.int8 else {}
    spec = jax.ShapeDtypeStruct
    pages = spec((P, page_size, Hkv, D), kv_dtype)
    q = spec((T, Hq, D), jnp.bfloat16)
    kv_lens, cu_q_lens, num_seqs = spec((S,), jnp.int32), spec((S + 1,), jnp.int32), spec((1,), jnp.int32)
    page_indices = spec((S, pages_per_seq), jnp.int32)
    options = dict(sm_scale=0.1, sliding_window=64, soft_cap=30.0, num_queries_per_block=16, num_kv_pages_per_block=8)
    attention = jax.jit(functools.partial(tpu.ragged_paged_attention, **options, **scales))
    try:
        exported = jax.export.export(attention, platforms=["tpu"])(q, pages, pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    finally:
        tpu_info.get_tpu_info.cache_clear()
    assert "tpu_custom_call" in exported.mlir_module()


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

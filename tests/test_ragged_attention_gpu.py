"""The GPU ragged paged attention kernel (Pallas, Triton lowering) against the reference.

Everything runs in interpret mode on the CPU. Each distinct shape or option compiles the kernel
anew (seconds each), so the cases share shapes where they can. The last test lowers the kernel
for a CUDA GPU without running it: that checks the Triton lowering rules (power-of-two blocks,
supported ops and casts) on a machine that has no GPU.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_attention_reference import make_case, numpy_attention

from pallas_kernels.ragged_paged_attention import gpu, reference

F32_TOL = 1e-5  # max error relative to the largest output value
BF16_TOL = 2e-2


def kernel(case, **kw):
    return gpu.ragged_paged_attention(*map(jnp.asarray, case), interpret=True, **kw)


def truth(case, *, sm_scale, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, sinks=None, attention_chunk=None):
    """The per-sequence numpy loop in float64, on exactly the values the inputs stand for
    (bfloat16 upcast, quantized pages times their scale). The reference's own tests hold
    reference.py to this same loop; it costs no compile, which is what this file's time goes on."""
    q, k, v, kv_lens, page_indices, cu, num_seqs = case
    as_f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    k = as_f32(k) * (1.0 if k_scale is None else k_scale)
    v = as_f32(v) * (1.0 if v_scale is None else v_scale)
    return numpy_attention(as_f32(q), k, v, kv_lens, page_indices, cu, int(num_seqs[0]), sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk,
                           sinks=None if sinks is None else np.asarray(sinks))


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err <= tol * max(np.abs(want).max(), 1.0), f"max error {err:.3g}"


def check(case, *, tol=F32_TOL, sm_scale=0.125, num_queries_per_block=4, num_kv_pages_per_block=2, num_kv_splits=2, **opts):
    got = kernel(case, sm_scale=sm_scale, num_queries_per_block=num_queries_per_block,
                 num_kv_pages_per_block=num_kv_pages_per_block, num_kv_splits=num_kv_splits, **opts)
    assert got.dtype == case[0].dtype
    assert_close(got, truth(case, sm_scale=sm_scale, **opts), tol)
    return np.asarray(got, np.float32)


# (Hq, Hkv, page_size, query rows per block, KV pages per tile, KV splits): GQA ratios 1/2/4/8,
# several page sizes, tiles narrower than 16 tokens (padded), more splits than a short sequence has tiles
@pytest.mark.parametrize(
    "Hq,Hkv,page_size,bq,pages,splits",
    [(4, 4, 1, 4, 3, 2), (4, 2, 4, 4, 4, 1), (8, 2, 16, 2, 1, 4), (8, 1, 8, 1, 2, 8)],
    ids=["G1-page1", "G2-page4", "G4-page16", "G8-page8"],
)
def test_mixed_batch_matches_reference(Hq, Hkv, page_size, bq, pages, splits):
    # a fresh prefill, a decode, a chunk continuing a prefill, a one-token prompt, a zero-length
    # slot, a sequence with context but no query this step; then 2 padding slots and 5 padding rows
    q_lens, kv_lens = [20, 1, 8, 1, 0, 0], [20, 37, 50, 1, 0, 12]
    case = make_case(np.random.default_rng(0), q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=64, page_size=page_size, pad_seqs=2, pad_tokens=5)
    out = check(case, num_queries_per_block=bq, num_kv_pages_per_block=pages, num_kv_splits=splits)
    assert np.all(out[sum(q_lens):] == 0), "padding rows must come out zero"


def test_lengths_at_and_across_page_boundaries():
    # one-page tiles (16 tokens), head_dim 128; lengths 16, 17, 32, 33 land on and just past pages
    case = make_case(np.random.default_rng(1), [16, 1, 17, 15, 1], [16, 17, 33, 32, 16], Hq=4, Hkv=2, D=128, page_size=16)
    check(case, num_kv_pages_per_block=1, num_kv_splits=3)


def test_head_dim_not_a_power_of_two_is_padded_and_masked():
    case = make_case(np.random.default_rng(2), [9, 1, 3], [9, 21, 30], Hq=4, Hkv=2, D=48, page_size=4)
    check(case)


WINDOW_CASE = dict(q_lens=[30, 1, 5], kv_lens=[30, 40, 25], Hq=4, Hkv=2, D=64, page_size=4)


def test_sliding_window():
    c = dict(WINDOW_CASE)
    case = make_case(np.random.default_rng(3), c.pop("q_lens"), c.pop("kv_lens"), **c)
    check(case, sliding_window=7)
    check(case, attention_chunk=8)  # Llama 4's chunks: a query sees only its own chunk of 8


def test_soft_cap():
    c = dict(WINDOW_CASE)
    case = make_case(np.random.default_rng(4), c.pop("q_lens"), c.pop("kv_lens"), **c)
    check(case, soft_cap=5.0, sm_scale=1.0)  # large scores, so the cap matters


def test_attention_sinks_are_added_when_the_splits_merge():
    c = dict(WINDOW_CASE)
    case = make_case(np.random.default_rng(6), c.pop("q_lens"), c.pop("kv_lens"), **c)
    Hq = case[0].shape[1]
    check(case, sinks=jnp.linspace(-1.0, 4.0, Hq, dtype=jnp.float32), sliding_window=7)


def test_bfloat16_inputs():
    case = make_case(np.random.default_rng(5), [12, 1, 3], [12, 30, 9], Hq=8, Hkv=2, D=128, page_size=8)
    case16 = tuple(np.asarray(jnp.asarray(x, jnp.bfloat16)) if x.dtype == np.float32 else x for x in case)
    check(case16, tol=BF16_TOL)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_pages_are_dequantized_with_their_scales(kv_dtype):
    q, k, v, *rest = make_case(np.random.default_rng(6), [9, 1, 4], [9, 21, 13], Hq=4, Hkv=2, D=64, page_size=4)
    k_scale, v_scale = 0.05, 0.02
    if kv_dtype == jnp.int8:
        k_q = np.clip(np.round(k / k_scale), -127, 127).astype(np.int8)
        v_q = np.clip(np.round(v / v_scale), -127, 127).astype(np.int8)
    else:
        k_q, v_q = np.asarray(jnp.asarray(k / k_scale, kv_dtype)), np.asarray(jnp.asarray(v / v_scale, kv_dtype))
    check((q, k_q, v_q, *rest), k_scale=k_scale, v_scale=v_scale)


def test_quantized_pages_without_a_scale_and_uneven_heads_are_rejected():
    q, k, v, *rest = make_case(np.random.default_rng(7), [2], [2], Hq=4, Hkv=2, D=16, page_size=4)
    with pytest.raises(ValueError, match="k_scale"):
        kernel((q, k.astype(np.int8), v.astype(np.int8), *rest))
    with pytest.raises(ValueError, match="multiple"):
        kernel((q[:, :3], k, v, *rest))


# ---- random ragged batches, padded to a few fixed shapes (one compile per head shape and dtype)
MAX_SEQS, MAX_TOKENS, PAGE, PAGES_PER_SEQ = 4, 24, 4, 9


def padded_case(seed, q_lens, kv_lens, *, Hq, Hkv, D, dtype):
    """make_case padded to the fixed shape: MAX_SEQS slots, MAX_TOKENS rows, a fixed page table and pool."""
    case = make_case(np.random.default_rng(seed), q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=D, page_size=PAGE,
                     num_pages=MAX_SEQS * (PAGES_PER_SEQ - 1) + 2, pad_seqs=MAX_SEQS - len(q_lens),
                     pad_tokens=MAX_TOKENS - sum(q_lens))
    q, k, v, kv, page_indices, cu, n = case
    page_indices = np.pad(page_indices, ((0, 0), (0, PAGES_PER_SEQ - page_indices.shape[1])))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, kv, page_indices, cu, n


@hypothesis.settings(max_examples=12, deadline=None, database=None)
@hypothesis.given(
    seqs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 24)), min_size=1, max_size=MAX_SEQS),
    heads=st.sampled_from([(4, 2, 64), (8, 1, 128)]),  # (Hq, Hkv, D): GQA 2 and 8, both head dims
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    sliding_window=st.sampled_from([None, 5]),
    seed=st.integers(0, 2**16),
)
def test_random_ragged_batches_match_reference(seqs, heads, dtype, sliding_window, seed):
    q_lens = [q for q, _ in seqs]
    kv_lens = [q + ctx if q else ctx for q, ctx in seqs]  # a sequence may have context but no query
    Hq, Hkv, D = heads
    case = padded_case(seed, q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    opts = dict(sm_scale=0.125, sliding_window=sliding_window)
    got = kernel(case, num_queries_per_block=2, num_kv_pages_per_block=2, num_kv_splits=3, **opts)
    # here the truth is reference.py itself: few shapes, so it compiles once per shape for all examples
    want = reference.ragged_paged_attention(*map(jnp.asarray, case), **opts)
    assert_close(got, want, F32_TOL if dtype == jnp.float32 else BF16_TOL)
    assert np.all(np.asarray(got, np.float32)[sum(q_lens):] == 0)


# ---- the GPU lowering, checked without a GPU
@pytest.mark.parametrize(
    "dtype,kv_dtype,D,opts",
    [
        (jnp.float32, jnp.float32, 64, dict(sliding_window=8, soft_cap=30.0, sinks=jnp.zeros(8, jnp.float32))),
        (jnp.bfloat16, jnp.bfloat16, 128, {}),
        (jnp.float32, jnp.int8, 48, dict(k_scale=0.1, v_scale=0.1)),
        (jnp.bfloat16, jnp.float8_e4m3fn, 128, dict(k_scale=0.1, v_scale=0.1)),
    ],
    ids=["f32-window-cap", "bf16", "int8-d48", "fp8"],
)
def test_kernel_lowers_to_triton_for_a_cuda_gpu(dtype, kv_dtype, D, opts):
    q, k, v, *rest = make_case(np.random.default_rng(8), [5, 1], [5, 40], Hq=8, Hkv=2, D=D, page_size=16)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype), *map(jnp.asarray, rest))
    traced = gpu.ragged_paged_attention.trace(*args, sm_scale=0.125, **opts)
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in hlo  # the kernel became a Triton custom call

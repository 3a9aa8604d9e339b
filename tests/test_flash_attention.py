"""Flash attention over packed segments: the reference against a float64 numpy loop, and the TPU
(Mosaic) and GPU (Triton) Pallas kernels against the reference, in interpret mode on the CPU.

Shapes are tiny and shared between tests so each kernel compiles few variants. Blocks are
block_q=16, block_k=8: segments cross block edges, query and KV blocks differ in size, and the
sliding window (4) is shorter than a block, so all three reasons to skip a KV block occur.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (
    common,
    flash_attention_gpu,
    flash_attention_reference,
    flash_attention_tpu,
)
from pallas_kernels.flash_attention.reference import token_segments

T = 40  # rows; the segments below use 32, the rest is padding
SEGMENT_LENS = [5, 0, 17, 1, 9]  # an empty segment, a single token, lengths that are not block multiples
UNUSED_CU_ENTRIES = [999, 3]  # cu_seq_lens slots past num_seqs may hold anything
BLOCKS = dict(block_q=16, block_k=8)
KERNELS = {
    "tpu": functools.partial(flash_attention_tpu, interpret=True, **BLOCKS),
    "gpu": functools.partial(flash_attention_gpu, interpret=True, **BLOCKS),
}


def make_batch(seed, lens, *, num_heads, num_kv_heads, head_dim, dtype=jnp.float32, num_tokens=T):
    """Random q/k/v for the segment lengths `lens`, plus cu_seq_lens (with unused slots) and num_seqs."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((num_tokens, num_heads, head_dim))
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    cu = np.concatenate([[0], np.cumsum(lens), UNUSED_CU_ENTRIES]).astype(np.int32)
    num_seqs = np.array([len(lens)], np.int32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(cu), jnp.asarray(num_seqs)


def numpy_attention(q, k, v, cu, num_seqs, *, sm_scale, causal=True, sliding_window=None, soft_cap=None, attention_chunk=None):
    """Float64 loop, one query and head at a time: the definition written out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros((T, Hq, D))
    for s in range(int(num_seqs[0])):
        start, end = int(cu[s]), int(cu[s + 1])
        for i in range(start, end):
            keys = np.arange(start, i + 1) if causal else np.arange(start, end)
            if sliding_window is not None:
                keys = keys[keys > i - sliding_window]
            if attention_chunk is not None:  # the query's own chunk of its sequence's positions
                keys = keys[(keys - start) // attention_chunk == (i - start) // attention_chunk]
            for h in range(Hq):
                scores = k[keys, h // G] @ q[i, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                w = np.exp(scores - scores.max())
                out[i, h] = (w / w.sum()) @ v[keys, h // G]
    return out


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)
    assert err <= tol, f"max error {err:.3g} relative to max |expected| (tolerance {tol})"


# (Hq, Hkv, head_dim): GQA ratios 1, 2, 4, 8 and both head dims
HEAD_SHAPES = [(2, 2, 128), (4, 2, 64), (4, 1, 128), (8, 1, 64)]
OPTIONS = {
    "causal": dict(),
    "sliding_window": dict(sliding_window=4),
    "soft_cap": dict(soft_cap=2.0),
    "attention_chunk": dict(attention_chunk=4),
    "non_causal": dict(causal=False),
}


# ---- the reference is the definition ------------------------------------------------------------


@pytest.mark.parametrize("option", OPTIONS)
def test_reference_matches_numpy_loop(option):
    Hq, Hkv, D = 4, 2, 64
    q, k, v, cu, ns = make_batch(0, SEGMENT_LENS, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    kw = dict(sm_scale=D**-0.5, **OPTIONS[option])
    expected = numpy_attention(q, k, v, cu, ns, **kw)
    assert_close(flash_attention_reference(q, k, v, cu, ns, **kw), expected, jnp.float32)


def test_reference_gqa_uses_kv_head_of_each_query_head():
    Hq, Hkv, D = 8, 2, 64
    q, k, v, cu, ns = make_batch(1, SEGMENT_LENS, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    expected = numpy_attention(q, k, v, cu, ns, sm_scale=0.1)
    assert_close(flash_attention_reference(q, k, v, cu, ns, sm_scale=0.1), expected, jnp.float32)


def test_token_segments_skip_empty_segments_and_mark_padding():
    cu = jnp.array([0, 2, 2, 5, 77], jnp.int32)  # segment 1 is empty; the last slot is unused
    segment, start, end = token_segments(cu, jnp.array([3], jnp.int32), 7)
    np.testing.assert_array_equal(segment, [0, 0, 2, 2, 2, -1, -1])
    np.testing.assert_array_equal(start[:5], [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(end[:5], [2, 2, 5, 5, 5])


# ---- block skipping: only fully masked KV blocks are skipped -------------------------------------


def check_kv_block_ranges(lens, num_tokens, *, block_q, block_k, causal, sliding_window, attention_chunk=None):
    """Every (query block, KV block) pair outside [kv_lo, kv_hi) has no visible key, and every
    pair inside has at least one."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = np.pad(cu, (0, 8 - len(cu)), mode="edge")  # one shape for up to 7 segments
    q = k = v = jnp.zeros((num_tokens, 1, 8), jnp.float32)
    x = common.prepare_inputs(q, k, v, jnp.asarray(cu), jnp.array([len(lens)], jnp.int32),
                              block_q=block_q, block_k=block_k, causal=causal, sliding_window=sliding_window,
                              attention_chunk=attention_chunk)
    rows = np.arange(x.q_segment.shape[0])
    visible = np.asarray(common.visible_keys(rows[:, None], rows[None, :], np.asarray(x.q_segment)[:, None],
                                             np.asarray(x.kv_segment)[None, :], causal=causal,
                                             sliding_window=sliding_window, attention_chunk=attention_chunk,
                                             q_start=np.asarray(x.q_start)[:, None]))
    for i, (lo, hi) in enumerate(zip(np.asarray(x.kv_lo), np.asarray(x.kv_hi))):
        for j in range(x.k.shape[1] // block_k):
            has_work = visible[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()
            assert has_work == (lo <= j < hi), (i, j, lo, hi)


@pytest.mark.parametrize("causal, sliding_window", [(True, None), (True, 4), (False, None)])
def test_kv_block_range_is_exactly_the_blocks_with_visible_keys(causal, sliding_window):
    check_kv_block_ranges(SEGMENT_LENS, T, **BLOCKS, causal=causal, sliding_window=sliding_window)


@hypothesis.settings(max_examples=25, deadline=None, database=None)
@hypothesis.given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=6).filter(lambda ls: sum(ls) <= 64),
    blocks=st.sampled_from([(8, 8), (16, 8), (8, 32)]),
    mode=st.sampled_from([(True, None, None), (True, 1, None), (True, 5, None), (False, None, None), (True, None, 6),
                          (True, None, 8)]),
)
def test_kv_block_range_property(lens, blocks, mode):
    (block_q, block_k), (causal, window, chunk) = blocks, mode
    check_kv_block_ranges(lens, 64, block_q=block_q, block_k=block_k, causal=causal, sliding_window=window,
                          attention_chunk=chunk)


# ---- kernels against the reference --------------------------------------------------------------


def check_kernel(kernel, q, k, v, cu, ns, **kw):
    out = KERNELS[kernel](q, k, v, cu, ns, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = flash_attention_reference(q, k, v, cu, ns, **kw)
    assert_close(out, expected, q.dtype)
    used = int(cu[int(ns[0])])
    np.testing.assert_array_equal(np.asarray(out[used:], np.float32), 0.0)  # padding rows
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: f"Hq{h[0]}_Hkv{h[1]}_D{h[2]}")
def test_kernel_matches_reference_for_gqa_ratios_and_head_dims(kernel, heads):
    Hq, Hkv, D = heads
    q, k, v, cu, ns = make_batch(2, SEGMENT_LENS, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    check_kernel(kernel, q, k, v, cu, ns, sm_scale=D**-0.5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("option", ["sliding_window", "soft_cap", "non_causal", "attention_chunk"])
def test_kernel_matches_reference_with_option(kernel, option):
    q, k, v, cu, ns = make_batch(3, SEGMENT_LENS, num_heads=4, num_kv_heads=2, head_dim=64)
    check_kernel(kernel, q, k, v, cu, ns, sm_scale=64**-0.5, **OPTIONS[option])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_head_dim_of_96_with_a_window(kernel):
    """Phi-3's heads: the GPU kernel pads them to 128 (Triton's blocks are powers of two)."""
    q, k, v, cu, ns = make_batch(5, SEGMENT_LENS, num_heads=4, num_kv_heads=2, head_dim=96)
    check_kernel(kernel, q, k, v, cu, ns, sm_scale=96**-0.5, sliding_window=9)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_bfloat16_within_bf16_tolerance(kernel):
    q, k, v, cu, ns = make_batch(4, SEGMENT_LENS, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    check_kernel(kernel, q, k, v, cu, ns, sm_scale=64**-0.5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_padding_rows_are_zero_and_do_not_leak(kernel):
    """Large values in padding rows change neither the real rows nor the zeros of the padding."""
    q, k, v, cu, ns = make_batch(5, SEGMENT_LENS, num_heads=4, num_kv_heads=2, head_dim=64)
    used = int(cu[len(SEGMENT_LENS)])
    out = check_kernel(kernel, q, k, v, cu, ns, sm_scale=64**-0.5)
    q2, k2, v2 = (x.at[used:].set(1e4) for x in (q, k, v))
    out2 = check_kernel(kernel, q2, k2, v2, cu, ns, sm_scale=64**-0.5)
    np.testing.assert_array_equal(out2, out)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_property_random_segments(kernel):
    """Any segment lengths (some empty), any number of segments in use, two head shapes, both
    dtypes, with or without a sliding window (a few compiled variants)."""

    @hypothesis.settings(max_examples=10, deadline=None, database=None)
    @hypothesis.given(
        lens=st.lists(st.integers(0, 14), min_size=1, max_size=5).filter(lambda ls: sum(ls) <= T),
        num_seqs=st.integers(0, 5),
        heads=st.sampled_from([(4, 2, 64), (8, 1, 128)]),  # (Hq, Hkv, D): GQA 2 and 8
        dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
        sliding_window=st.sampled_from([None, 5]),
        seed=st.integers(0, 2**16),
    )
    def run(lens, num_seqs, heads, dtype, sliding_window, seed):
        lens = (lens + [0] * 5)[:5]  # fixed S = 5 so shapes stay the same
        Hq, Hkv, D = heads
        q, k, v, cu, _ = make_batch(seed, lens, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, dtype=dtype)
        ns = jnp.array([num_seqs], jnp.int32)
        opts = dict(sm_scale=D**-0.5, sliding_window=sliding_window)
        out = check_kernel(kernel, q, k, v, cu, ns, **opts)
        assert_close(out, numpy_attention(q, k, v, cu, ns, **opts), dtype)

    run()


# ---- default block sizes and rejected inputs ----------------------------------------------------


@pytest.mark.parametrize("kernel", [flash_attention_tpu, flash_attention_gpu], ids=["tpu", "gpu"])
def test_kernel_with_its_default_blocks_matches_reference(kernel):
    # one query block and one KV block hold all T rows, segments and padding alike
    q, k, v, cu, ns = make_batch(6, SEGMENT_LENS, num_heads=4, num_kv_heads=2, head_dim=64)
    out = kernel(q, k, v, cu, ns, sm_scale=0.125, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, flash_attention_reference(q, k, v, cu, ns, sm_scale=0.125), q.dtype)
    np.testing.assert_array_equal(np.asarray(out[sum(SEGMENT_LENS):]), 0.0)  # padding rows


@pytest.mark.parametrize(
    "kwargs, shapes",
    [
        (dict(sliding_window=4, causal=False), ((8, 4, 64), (8, 2, 64))),  # window needs causal
        (dict(), ((8, 3, 64), (8, 2, 64))),  # Hq not a multiple of Hkv
        (dict(), ((8, 4, 64), (9, 2, 64))),  # k is not the tokens of q
    ],
)
def test_invalid_inputs_raise(kwargs, shapes):
    (qs, ks) = shapes
    q, k = jnp.zeros(qs), jnp.zeros(ks)
    cu, ns = jnp.array([0, 8], jnp.int32), jnp.array([1], jnp.int32)
    for fn in (flash_attention_reference, KERNELS["tpu"], KERNELS["gpu"]):
        with pytest.raises(ValueError):
            fn(q, k, k, cu, ns, sm_scale=1.0, **kwargs)


def test_kernel_block_sizes_are_checked():
    q, k, v, cu, ns = make_batch(7, [3], num_heads=2, num_kv_heads=1, head_dim=64, num_tokens=8)
    with pytest.raises(ValueError):
        flash_attention_tpu(q, k, v, cu, ns, sm_scale=1.0, block_q=8, block_k=64)  # TPU lanes: 128
    with pytest.raises(ValueError):
        flash_attention_gpu(q, k, v, cu, ns, sm_scale=1.0, block_q=24, block_k=16, interpret=True)  # not a power of 2

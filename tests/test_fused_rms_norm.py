"""Residual add + RMSNorm: the reference against `layers.rms_norm` of the sum and a float64 numpy
formula, and the TPU (Mosaic) and GPU (Triton) Pallas kernels against the reference, in
interpret mode on the CPU.

Shapes are few and tiny so each kernel compiles few variants. H = 576 (SmolLM2) is not a power of
two, so the GPU kernel pads it to 1024 and masks. The TPU row block (48) does not divide T = 64,
so its last block is partial; T = 7 is smaller than either kernel's block.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import rms_norm
from pallas_kernels.fused_rms_norm import (
    add_rms_norm_gpu,
    add_rms_norm_reference,
    add_rms_norm_tpu,
)

EPS = 1e-6
KERNELS = {
    "tpu": functools.partial(add_rms_norm_tpu, block_rows=48, interpret=True),
    "gpu": functools.partial(add_rms_norm_gpu, block_rows=16, interpret=True),
}
# Largest error allowed, relative to the largest |value| of the expected result.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
CASES = [  # (T, H, dtype)
    (1, 64, jnp.float32),
    (7, 576, jnp.bfloat16),
    (64, 1024, jnp.float32),
    (64, 576, jnp.bfloat16),
]
CASE_IDS = [f"T{T}-H{H}-{jnp.dtype(dt).name}" for T, H, dt in CASES]
ZERO_ROW = 2  # make_inputs makes this row of x + residual exactly 0 (when T > 2)


def make_inputs(seed, T, H, dtype, *, scale=1.0, with_residual=True):
    """x, residual (or None) [T, H] and weight [H] in `dtype`; row ZERO_ROW of x + residual is 0."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(scale * rng.standard_normal((T, H)), dtype)
    weight = jnp.asarray(1.0 + 0.5 * rng.standard_normal(H), dtype)
    if not with_residual:
        return x, None, weight
    residual = jnp.asarray(scale * rng.standard_normal((T, H)), dtype)
    if T > ZERO_ROW:
        residual = residual.at[ZERO_ROW].set(-x[ZERO_ROW])  # an all-zero row: normed must be 0, not NaN
    return x, residual, weight


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all()
    scale = max(np.abs(expected).max(), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[jnp.dtype(dtype).name] * scale)


def assert_matches_reference(out, x, residual, weight):
    normed, new_residual = out
    expected_normed, expected_residual = add_rms_norm_reference(x, residual, weight, eps=EPS)
    assert normed.shape == new_residual.shape == x.shape
    assert normed.dtype == new_residual.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(new_residual, np.float32), np.asarray(expected_residual, np.float32))
    assert_close(normed, expected_normed, x.dtype)


# ----------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("T,H,dtype", CASES, ids=CASE_IDS)
def test_reference_is_layers_rms_norm_of_the_sum(T, H, dtype):
    x, residual, weight = make_inputs(0, T, H, dtype)
    normed, new_residual = add_rms_norm_reference(x, residual, weight, eps=EPS)
    np.testing.assert_array_equal(np.asarray(new_residual, np.float32), np.asarray(x + residual, np.float32))
    assert_close(normed, rms_norm(x + residual, weight, EPS), dtype)


@pytest.mark.parametrize("T,H,dtype", CASES[:2], ids=CASE_IDS[:2])
def test_reference_without_residual_normalises_x_and_returns_it(T, H, dtype):
    x, _, weight = make_inputs(0, T, H, dtype, with_residual=False)
    normed, new_residual = add_rms_norm_reference(x, None, weight, eps=EPS)
    assert new_residual is x or np.array_equal(np.asarray(new_residual), np.asarray(x))
    assert_close(normed, rms_norm(x, weight, EPS), dtype)


def test_reference_matches_the_float64_formula():
    x, residual, weight = make_inputs(1, 7, 576, jnp.float32)
    s = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
    expected = np.asarray(weight, np.float64) * s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
    normed, _ = add_rms_norm_reference(x, residual, weight, eps=EPS)
    assert_close(normed, expected, jnp.float32)
    assert not np.asarray(normed)[ZERO_ROW].any()


# ----------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T,H,dtype", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(kernel, T, H, dtype):
    x, residual, weight = make_inputs(0, T, H, dtype)
    assert_matches_reference(KERNELS[kernel](x, residual, weight, eps=EPS), x, residual, weight)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T,H,dtype", [CASES[1], CASES[2]], ids=[CASE_IDS[1], CASE_IDS[2]])
def test_kernel_without_residual_normalises_x_and_returns_it(kernel, T, H, dtype):
    x, _, weight = make_inputs(0, T, H, dtype, with_residual=False)
    assert_matches_reference(KERNELS[kernel](x, None, weight, eps=EPS), x, None, weight)


@hypothesis.settings(max_examples=6, deadline=None, database=None)
@hypothesis.given(
    kernel=st.sampled_from(sorted(KERNELS)),
    T=st.integers(1, 40),
    H=st.sampled_from([64, 576]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_for_any_row_count_and_scale(kernel, T, H, dtype, scale, with_residual, seed):
    x, residual, weight = make_inputs(seed, T, H, dtype, scale=scale, with_residual=with_residual)
    assert_matches_reference(KERNELS[kernel](x, residual, weight, eps=EPS), x, residual, weight)


# ----------------------------------------------------------------------------- default blocks and checks
@pytest.mark.parametrize("kernel", [add_rms_norm_tpu, add_rms_norm_gpu], ids=["tpu", "gpu"])
def test_kernel_with_its_default_block_rows_matches_reference(kernel):
    x, residual, weight = make_inputs(0, *CASES[1])
    assert_matches_reference(kernel(x, residual, weight, eps=EPS, interpret=True), x, residual, weight)


@pytest.mark.parametrize("fn", [add_rms_norm_reference, KERNELS["tpu"], KERNELS["gpu"]], ids=["ref", "tpu", "gpu"])
def test_mismatched_inputs_are_rejected(fn):
    x, residual, weight = make_inputs(0, 7, 64, jnp.float32)
    with pytest.raises(ValueError, match="residual must match x"):
        fn(x, residual.astype(jnp.bfloat16), weight, eps=EPS)
    with pytest.raises(ValueError, match="residual must match x"):
        fn(x, residual[:3], weight, eps=EPS)
    with pytest.raises(ValueError, match="weight"):
        fn(x, residual, weight[:32], eps=EPS)


def test_block_rows_must_fit_the_hardware_tiles():
    x, residual, weight = make_inputs(0, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        add_rms_norm_gpu(x, residual, weight, eps=EPS, block_rows=24, interpret=True)
    with pytest.raises(ValueError, match="multiple of 16"):  # bf16 rows pack two to a sublane
        add_rms_norm_tpu(x, residual, weight, eps=EPS, block_rows=8)

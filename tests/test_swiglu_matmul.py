"""SwiGLU matmul: the reference against a float64 numpy formula and the model's unfused path, and
the TPU (Mosaic) and GPU (Triton) Pallas kernels against the reference, in interpret mode on the CPU.

Read as a specification: each kernel returns what `reference.swiglu_matmul` returns for decode-
sized and larger M, f32 and bf16, with blocks small enough that every grid axis (and the GPU K loop)
takes several steps; it rejects what the reference rejects (and the TPU kernel an N it cannot
tile); it never slices the [K, N] gate or up half out of the weight outside the kernel; and it
lowers for its real backend (Mosaic TPU / Triton IR), which needs no device.

Shapes are few and tiny so each kernel compiles few variants. K = 576 (SmolLM2's hidden size) is
not a power of two: the GPU kernel's last K tile is half masked, and no multiple of 128 up to the
TPU block_k of 128 divides it, so the TPU kernel takes all of K in one step.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.models.layers import linear, swiglu
from pallas_kernels.swiglu_matmul import (
    swiglu_matmul_gpu,
    swiglu_matmul_reference,
    swiglu_matmul_tpu,
)

# Blocks small enough that these shapes take several M, N and K steps (TPU: bm rounds up to 16 for bf16).
SMALL_BLOCKS = {
    "tpu": dict(block_m=8, block_n=128, block_k=128),
    "gpu": dict(block_m=16, block_n=64, block_k=128),
}
KERNELS = {
    "tpu": functools.partial(swiglu_matmul_tpu, interpret=True),
    "gpu": functools.partial(swiglu_matmul_gpu, interpret=True),
}
# Largest error allowed, relative to the largest |value| of the expected result.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
CASES = [  # (M, K, N, dtype): every M in {1, 5, 64}, both (K, N), both dtypes
    (1, 256, 256, jnp.float32),
    (5, 256, 256, jnp.float32),
    (64, 576, 384, jnp.float32),
    (1, 576, 384, jnp.bfloat16),
    (5, 576, 384, jnp.bfloat16),
    (64, 256, 256, jnp.bfloat16),
]
CASE_IDS = [f"M{M}-K{K}-N{N}-{jnp.dtype(dt).name}" for M, K, N, dt in CASES]


def make_inputs(seed, M, K, N, dtype, w_dtype=None):
    """x [M, K] ~ N(0, 1) and w_gate_up [K, 2N] ~ N(0, 1/K), so g and u are about N(0, 1) and silu
    sees both signs."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((K, 2 * N)) / np.sqrt(K), w_dtype or dtype)
    return x, w


def numpy_swiglu(x, w):
    """float64 silu(x @ gate) * (x @ up), with x rounded to w's dtype first as the operation does."""
    x64 = np.asarray(x.astype(w.dtype), np.float64)
    y = x64 @ np.asarray(w, np.float64)  # [M, 2N]
    N = w.shape[1] // 2
    g, u = y[:, :N], y[:, N:]
    return g / (1 + np.exp(-g)) * u


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all()
    scale = max(np.abs(expected).max(), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCE[jnp.dtype(dtype).name] * scale)


def assert_matches_reference(out, x, w):
    expected = swiglu_matmul_reference(x, w)
    assert out.shape == expected.shape == (x.shape[0], w.shape[1] // 2)
    assert out.dtype == x.dtype
    assert_close(out, expected, x.dtype)


# ----------------------------------------------------------------------------- the reference
@pytest.mark.parametrize(
    "dtype, w_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)],
    ids=["f32", "bf16", "f32-x-bf16-w"],
)
def test_reference_matches_the_float64_formula(dtype, w_dtype):
    x, w = make_inputs(1, 7, 576, 384, dtype, w_dtype)
    out = swiglu_matmul_reference(x, w)
    assert out.shape == (7, 384) and out.dtype == x.dtype
    assert_close(out, numpy_swiglu(x, w), dtype if dtype == w_dtype else w_dtype)


def test_reference_is_the_models_unfused_path_in_f32():
    x, w = make_inputs(2, 5, 256, 256, jnp.float32)
    assert_close(swiglu_matmul_reference(x, w), swiglu(linear(x, w)), jnp.float32)


# ----------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("M, K, N, dtype", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(backend, M, K, N, dtype):
    x, w = make_inputs(M + K, M, K, N, dtype)
    assert_matches_reference(KERNELS[backend](x, w, **SMALL_BLOCKS[backend]), x, w)


def test_gpu_kernel_masks_every_dimension():
    # N = 72 is not a multiple of bn = 64 (so the last gate tile's masked columns sit next to the
    # first up columns), K = 200 not of bk = 64, M = 19 not of bm = 16.
    x, w = make_inputs(3, 19, 200, 72, jnp.float32)
    assert_matches_reference(KERNELS["gpu"](x, w, block_m=16, block_n=64, block_k=64), x, w)


def test_f32_activations_meet_a_bf16_weight_in_bf16():
    x, w = make_inputs(4, 5, 256, 256, jnp.float32, jnp.bfloat16)
    for backend, kernel in KERNELS.items():
        out = kernel(x, w, **SMALL_BLOCKS[backend])
        assert out.dtype == jnp.float32
        assert_close(out, swiglu_matmul_reference(x, w), jnp.bfloat16)


def test_tpu_kernel_runs_in_the_tpu_simulator():
    # pltpu.InterpretParams() simulates HBM, VMEM and the block DMAs (the interpreter above
    # discharges them): the two windows on the one weight array really fetch different columns.
    x, w = make_inputs(5, 3, 256, 256, jnp.float32)
    out = swiglu_matmul_tpu(x, w, block_n=128, block_k=128, interpret=pltpu.InterpretParams())
    assert_matches_reference(out, x, w)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@hypothesis.settings(max_examples=6, deadline=None, database=None)
@hypothesis.given(
    M=st.integers(1, 40),
    n_lanes=st.integers(1, 3),
    k_lanes=st.integers(1, 3),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    small_blocks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_kernel_matches_reference_for_any_shape(backend, M, n_lanes, k_lanes, dtype, small_blocks, seed):
    x, w = make_inputs(seed, M, 128 * k_lanes, 128 * n_lanes, dtype)
    blocks = SMALL_BLOCKS[backend] if small_blocks else {}
    assert_matches_reference(KERNELS[backend](x, w, **blocks), x, w)


# ----------------------------------------------------------------------------- a bf16 decode batch, rejected inputs
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_matches_reference_on_a_bf16_decode_batch(backend):
    x, w = make_inputs(0, 5, 256, 256, jnp.bfloat16)
    assert_matches_reference(KERNELS[backend](x, w, **SMALL_BLOCKS[backend]), x, w)


BAD_INPUTS = [  # (what is wrong, x shape, w shape, message)
    ("mismatched K", (4, 128), (256, 512), "x has K = 128 but w_gate_up has K = 256"),
    ("odd columns", (4, 128), (128, 257), "even number of columns"),
    ("x not 2-D", (1, 4, 128), (128, 256), "x must be"),
    ("w not 2-D", (4, 128), (2, 128, 256), "w_gate_up must be"),
]


@pytest.mark.parametrize("fn", [swiglu_matmul_reference, KERNELS["tpu"], KERNELS["gpu"]], ids=["ref", "tpu", "gpu"])
@pytest.mark.parametrize("what, x_shape, w_shape, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_mismatched_inputs_are_rejected(fn, what, x_shape, w_shape, message):
    with pytest.raises(ValueError, match=message):
        fn(jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, jnp.float32))


def test_kernels_reject_what_their_hardware_cannot_tile():
    x = jnp.zeros((4, 128), jnp.float32)
    with pytest.raises(ValueError, match="N = 100"):  # an up block must start exactly at column N
        KERNELS["tpu"](x, jnp.zeros((128, 200), jnp.float32))
    with pytest.raises(ValueError, match="block_n at least 128"):  # TPU lanes
        KERNELS["tpu"](x, jnp.zeros((128, 256), jnp.float32), block_n=64)
    with pytest.raises(ValueError, match="power of two"):  # Triton tiles
        KERNELS["gpu"](x, jnp.zeros((128, 256), jnp.float32), block_k=96)


# ----------------------------------------------------------------------------- the weight is never sliced
def _eqns_outside_kernels(jaxpr):
    """Every equation of a jaxpr and its sub-jaxprs (jit, loops), not descending into pallas_call kernels."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns_outside_kernels(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns_outside_kernels(sub)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_no_half_of_the_weight_is_built_outside_the_kernel(backend):
    M, K, N = 2, 256, 256
    x, w = make_inputs(0, M, K, N, jnp.bfloat16)
    eqns = list(_eqns_outside_kernels(jax.make_jaxpr(KERNELS[backend])(x, w).jaxpr))
    assert any(e.primitive.name == "pallas_call" for e in eqns)
    for eqn in eqns:
        for var in eqn.outvars:
            # x [M, K] (cast, padded) and the output are far smaller than a [K, N] half of the weight.
            assert getattr(var.aval, "size", 0) < K * N, f"{eqn.primitive.name} builds {var.aval} outside the kernel"


# ----------------------------------------------------------------------------- lowering for the real backends
@pytest.mark.parametrize(
    "backend, platform, K, marker",
    [("tpu", "tpu", 512, "tpu_custom_call"), ("gpu", "cuda", 576, "triton")],
    ids=["tpu-mosaic", "gpu-triton"],
)
def test_kernel_lowers_for_its_backend(backend, platform, K, marker):
    # Lowering emits Mosaic / Triton IR without a device: it catches operations or shapes the real
    # compiler front end refuses (illegal block shapes, non-power-of-two Triton tiles). bf16 decode
    # shape with SmolLM2's intermediate size N = 1536 (TPU: K = 512 takes whole 128-lane K blocks).
    x = jax.ShapeDtypeStruct((1, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((K, 2 * 1536), jnp.bfloat16)
    kernel = {"tpu": swiglu_matmul_tpu, "gpu": swiglu_matmul_gpu}[backend]
    lowered = jax.jit(kernel).trace(x, w).lower(lowering_platforms=(platform,))
    assert marker in lowered.as_text()

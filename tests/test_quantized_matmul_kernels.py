"""The fused quantized-matmul kernels (Pallas TPU and Pallas Triton), run in interpret mode on the CPU.

Read as a specification: each kernel returns what `reference.quantized_matmul` returns, for every
mode (int8 per column and per group, fp8, int4 with groups of 32/64/128, symmetric and with
offsets, scales in f32 / bf16 / f16, K padded to whole groups), f32 and bf16
activations, decode-sized and larger M, and shapes that are not multiples of the blocks; it
rejects the layouts the reference rejects; it never builds the float [K, N] weight outside the
kernel; and it lowers for its real backend (Mosaic TPU / Triton IR), which needs no device.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.ops import quantization as qz
from pallas_kernels.quantized_matmul import gpu, reference, tpu

KERNELS = {"tpu": tpu.quantized_matmul, "gpu": gpu.quantized_matmul}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |error| relative to max |reference|


def make_case(M, K, N, mode, group_size=None, dtype=jnp.float32, seed=0, symmetric=True, scale_dtype=None):
    """x [M, K] and a quantized weight (qweight, scales, offsets) for a Gaussian [K, N] with a few
    outliers (as checkpoints have), off-centre when asymmetric; scales cast to scale_dtype if given."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0 if symmetric else 0.01, 0.02, (K, N))
    w.flat[rng.integers(0, w.size, 4)] *= 20
    qw = qz.quantize(jnp.asarray(w, jnp.float32), mode, group_size, symmetric)
    x = jnp.asarray(rng.normal(0.0, 1.0, (M, K)), dtype)
    cast = (lambda a: a) if scale_dtype is None else (lambda a: None if a is None else a.astype(scale_dtype))
    return x, qw.qweight, cast(qw.scales), cast(qw.offsets)


def check(kernel, case, mode, group_size=None, interpret=True, **blocks):
    x, qweight, scales, offsets = case
    got = kernel(x, qweight, scales, offsets, mode=mode, group_size=group_size, interpret=interpret, **blocks)
    want = reference.quantized_matmul(x, qweight, scales, offsets, mode=mode, group_size=group_size)
    assert got.shape == want.shape and got.dtype == x.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOLERANCE[x.dtype.type], f"relative error {err:.2e}"


# ----------------------------------------------------------------------------- agreement with the reference
# (mode, group_size, K, N, M, dtype). N and K are not multiples of the blocks below; M in {1, 5, 64}.
# int4 g128 with K = 576 is SmolLM2's hidden size: the weight is stored padded to Kp = 640.
CASES = [
    ("int8", 16, 384, 200, 5, jnp.float32),
    ("int8", 32, 576, 72, 1, jnp.bfloat16),
    ("int8", None, 384, 200, 5, jnp.float32),
    ("int8", None, 384, 200, 1, jnp.bfloat16),
    ("fp8", None, 256, 72, 64, jnp.float32),
    ("fp8", None, 256, 72, 1, jnp.bfloat16),
    ("fp8", 128, 320, 72, 5, jnp.bfloat16),  # block-scaled (DeepSeek-V3's 128 x 128), K padded to 384
    ("int4", 32, 512, 136, 5, jnp.float32),
    ("int4", 32, 512, 136, 64, jnp.bfloat16),
    ("int4", 64, 768, 40, 64, jnp.float32),
    ("int4", 64, 768, 40, 1, jnp.bfloat16),
    ("int4", 128, 576, 24, 1, jnp.float32),
    ("int4", 128, 576, 24, 5, jnp.bfloat16),
]

# Blocks small enough that every grid axis (and the K loop) takes several steps on these shapes.
SMALL_BLOCKS = {
    "tpu": lambda mode: dict(block_m=32, block_n=128, block_k=256 if mode == "int4" else 128),
    "gpu": lambda mode: dict(block_n=64, block_k=128),  # block_m: the default (16 for M <= 16, else 64)
}


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize(
    "mode, group_size, K, N, M, dtype", CASES, ids=[f"{c[0]}{f'-g{c[1]}' if c[1] else ''}-K{c[2]}-M{c[4]}-{c[5].__name__}" for c in CASES]
)
def test_kernel_matches_reference(backend, mode, group_size, K, N, M, dtype):
    case = make_case(M, K, N, mode, group_size, dtype, seed=K + M)
    check(KERNELS[backend], case, mode, group_size, **SMALL_BLOCKS[backend](mode))


# Asymmetric groups (offsets), and the scale dtypes checkpoints bring: GGUF's float16 (Q4_0 / Q4_1 /
# Q8_0), float32 (Q4_K's sub-block scales), bfloat16 (the RTN quantizer's int4 scales).
ASYMMETRIC_CASES = [
    ("int4", 32, 576, 136, 1, jnp.float32, jnp.float16),
    ("int4", 32, 512, 72, 5, jnp.bfloat16, None),
    ("int4", 128, 576, 24, 64, jnp.float32, jnp.float32),
    ("int8", 32, 384, 72, 1, jnp.bfloat16, jnp.float16),
    ("int8", 16, 256, 40, 5, jnp.float32, None),
]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("mode, group_size, K, N, M, dtype, scale_dtype", ASYMMETRIC_CASES,
                         ids=[f"{c[0]}-g{c[1]}-M{c[4]}-{c[5].__name__}-{c[6].__name__ if c[6] else 'stored'}" for c in ASYMMETRIC_CASES])
def test_kernel_with_offsets_matches_reference(backend, mode, group_size, K, N, M, dtype, scale_dtype):
    case = make_case(M, K, N, mode, group_size, dtype, seed=K + M + 1, symmetric=False, scale_dtype=scale_dtype)
    assert case[3] is not None
    check(KERNELS[backend], case, mode, group_size, **SMALL_BLOCKS[backend](mode))


def test_int4_padded_groups_accumulate_over_several_k_steps():
    # K = 448 with groups of 128: Kp = 512, two K steps of 256 on the TPU grid, the second holding
    # 64 zero rows of the weight that meet x's missing columns; 4 single-group steps on the GPU.
    case = make_case(3, 448, 40, "int4", 128, jnp.float32, seed=7)
    check(tpu.quantized_matmul, case, "int4", 128, block_k=256)
    check(gpu.quantized_matmul, case, "int4", 128, block_k=128)


def test_tpu_kernel_runs_in_the_tpu_simulator():
    # pltpu.InterpretParams() simulates HBM, VMEM and the block DMAs (the interpreter the
    # other tests use discharges them), including the partial last N block.
    case = make_case(3, 448, 200, "int4", 128, jnp.float32, seed=8)
    check(tpu.quantized_matmul, case, "int4", 128, interpret=pltpu.InterpretParams(), block_n=128, block_k=256)


@hypothesis.settings(max_examples=4, deadline=None, database=None)
@hypothesis.given(
    mode_group=st.sampled_from([("int8", None), ("int8", 32), ("fp8", None), ("int4", 32), ("int4", 64), ("int4", 128)]),
    M=st.integers(1, 9),
    N=st.integers(1, 150),
    k_units=st.integers(1, 4),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_property_default_blocks_match_reference_for_any_shape(mode_group, M, N, k_units, dtype, seed):
    mode, group_size = mode_group
    # grouped: K anywhere in the last group (the weight pads the rest); others: any multiple of 16.
    K = k_units * group_size - seed % group_size if group_size else 16 * k_units + seed % 16
    case = make_case(M, K, N, mode, group_size, dtype, seed, symmetric=group_size is None or seed % 2 == 0)
    for kernel in KERNELS.values():
        check(kernel, case, mode, group_size)


# ----------------------------------------------------------------------------- rejected inputs
BAD_INPUTS = [  # (what is wrong, mode, group_size, x, qweight, scales, message)
    ("unknown mode", "int2", None, (1, 64), jnp.zeros((64, 8), jnp.int8), jnp.ones(8), "mode must be"),
    ("int4 group size", "int4", 16, (1, 64), jnp.zeros((32, 8), jnp.uint8), jnp.ones((4, 8)), "group_size must be"),
    ("int8 group size", "int8", 48, (1, 96), jnp.zeros((96, 8), jnp.int8), jnp.ones((2, 8)), "group_size must be"),
    ("group size for fp8", "fp8", 32, (1, 64), jnp.zeros((64, 8), jnp.float8_e4m3fn), jnp.ones(8), "group_size must be"),
    ("int8 per-column scales for groups", "int8", 32, (1, 64), jnp.zeros((64, 8), jnp.int8), jnp.ones(8), "scales must have shape"),
    ("int8 stored as uint8", "int8", None, (1, 64), jnp.zeros((64, 8), jnp.uint8), jnp.ones(8), "qweight must be int8"),
    ("fp8 scales per group", "fp8", None, (1, 64), jnp.zeros((64, 8), jnp.float8_e4m3fn), jnp.ones((2, 8)), "scales must have shape"),
    ("int4 scales per column", "int4", 32, (1, 64), jnp.zeros((32, 8), jnp.uint8), jnp.ones(8, jnp.bfloat16), "scales must have shape"),
    ("int4 scales as integers", "int4", 32, (1, 64), jnp.zeros((32, 8), jnp.uint8), jnp.ones((2, 8), jnp.int32), "scales must be float32"),
    ("int4 K not whole groups", "int4", 64, (1, 96), jnp.zeros((48, 8), jnp.uint8), jnp.ones((1, 8), jnp.bfloat16), "not a multiple of group_size"),
    ("x shorter than weight", "int8", None, (1, 48), jnp.zeros((64, 8), jnp.int8), jnp.ones(8), "x has K"),
    ("x beyond int4 padding", "int4", 32, (1, 32), jnp.zeros((32, 8), jnp.uint8), jnp.ones((2, 8), jnp.bfloat16), "x has K"),
    ("x not 2-D", "int8", None, (1, 1, 64), jnp.zeros((64, 8), jnp.int8), jnp.ones(8), "x must be"),
]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("what, mode, group_size, x_shape, qweight, scales, message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_kernel_rejects_what_the_reference_rejects(backend, what, mode, group_size, x_shape, qweight, scales, message):
    x = jnp.zeros(x_shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        reference.quantized_matmul(x, qweight, scales, mode=mode, group_size=group_size)
    with pytest.raises(ValueError, match=message):
        KERNELS[backend](x, qweight, scales, mode=mode, group_size=group_size, interpret=True)


def test_kernels_reject_blocks_their_hardware_cannot_tile():
    x, qweight, scales, _ = make_case(1, 256, 8, "int4", 128)
    with pytest.raises(ValueError, match="block_n a multiple of 128"):  # TPU lanes
        tpu.quantized_matmul(x, qweight, scales, mode="int4", group_size=128, block_n=100, interpret=True)
    with pytest.raises(ValueError, match="power of two"):  # Triton tiles
        gpu.quantized_matmul(x, qweight, scales, mode="int4", group_size=128, block_k=96, interpret=True)
    with pytest.raises(ValueError, match="multiple of group_size"):  # a group's scale applies to whole groups
        gpu.quantized_matmul(x, qweight, scales, mode="int4", group_size=128, block_k=64, interpret=True)


# ----------------------------------------------------------------------------- the float weight stays inside the kernel
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
@pytest.mark.parametrize("mode, group_size, symmetric", [("int8", None, True), ("int4", 64, True), ("int4", 32, False),
                                                          ("int8", 32, False)])
def test_no_float_weight_is_built_outside_the_kernel(backend, mode, group_size, symmetric):
    M, K, N = 2, 256, 128
    x, qweight, scales, offsets = make_case(M, K, N, mode, group_size, jnp.bfloat16, symmetric=symmetric)
    kernel = functools.partial(KERNELS[backend], mode=mode, group_size=group_size, interpret=True)
    eqns = list(_eqns_outside_kernels(jax.make_jaxpr(kernel)(x, qweight, scales, offsets).jaxpr))
    assert any(e.primitive.name == "pallas_call" for e in eqns)
    for eqn in eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                # x [M, K], its even/odd halves, the scales and the output are all far smaller than K * N.
                assert aval.size < K * N, f"{eqn.primitive.name} builds a float {aval.shape} outside the kernel"


# ----------------------------------------------------------------------------- lowering for the real backends
@pytest.mark.parametrize(
    "backend, platform", [("tpu", "tpu"), ("gpu", "cuda")], ids=["tpu-mosaic", "gpu-triton"]
)
@pytest.mark.parametrize("mode, group_size, symmetric", [("int8", None, True), ("fp8", None, True), ("int4", 128, True),
                                                          ("int4", 32, False), ("int8", 32, False)])
def test_kernel_lowers_for_its_backend(backend, platform, mode, group_size, symmetric):
    # Lowering emits Mosaic / Triton IR without a device: it catches operations or shapes the real
    # compiler front end refuses (non-power-of-two Triton tiles, casts it cannot express). Decode
    # shape; asymmetric cases with GGUF's float16 scales and offsets.
    x, qweight, scales, offsets = make_case(1, 576, 256, mode, group_size, jnp.bfloat16, symmetric=symmetric,
                                            scale_dtype=None if symmetric else jnp.float16)
    kernel = functools.partial(KERNELS[backend], mode=mode, group_size=group_size)
    jax.jit(kernel).trace(x, qweight, scales, offsets).lower(lowering_platforms=(platform,))


# ----------------------------------------------------------------------------- mxfp4 (GPT-OSS's experts)
def mxfp4_case(M, K, N, dtype, seed=0):
    """x [M, K] and an MXFP4 weight as GPT-OSS's checkpoint stores it, HF [N, K / 32, 16] blocks and
    [N, K / 32] exponent bytes, with the same weight in this file's layout (qweight [K / 2, N],
    scales [K / 32, N]): every nibble value, exponents around 2 ** 0."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    exponents = rng.integers(120, 132, (N, K // 32), dtype=np.uint8)
    qweight = jnp.asarray(blocks.reshape(N, K // 2).T)
    scales = jnp.asarray(exponents.T)
    return jnp.asarray(rng.normal(0.0, 1.0, (M, K)), dtype), qweight, scales, (blocks, exponents)


def test_mxfp4_dequantizes_bit_for_bit_as_transformers_and_the_kernels_multiply_it():
    """The reference's MXFP4 weight equals the one transformers' conversion makes of GPT-OSS's blocks
    (checkpoints_conv.views.dequantize_mxfp4), bit for bit; both kernels multiply by it as the
    reference does (decode and larger M, f32 and bf16 x, several K steps); both lower for their
    hardware's compiler front end."""
    from checkpoints_conv.views import dequantize_mxfp4

    x, qweight, scales, (blocks, exponents) = mxfp4_case(5, 256, 136, jnp.float32)
    ours = np.asarray(reference.dequantize(qweight, scales, mode="mxfp4", group_size=32))  # [K, N]
    np.testing.assert_array_equal(ours, dequantize_mxfp4(blocks, exponents).T)
    for backend, blocks_ in (("tpu", dict(block_m=32, block_n=128, block_k=128)), ("gpu", dict(block_n=64, block_k=64))):
        for M, dtype in ((5, jnp.float32), (64, jnp.bfloat16)):
            x, qweight, scales, _ = mxfp4_case(M, 256, 136, dtype, seed=M)
            check(KERNELS[backend], (x, qweight, scales, None), "mxfp4", 32, **blocks_)
    for backend, platform in (("tpu", "tpu"), ("gpu", "cuda")):
        kernel = functools.partial(KERNELS[backend], mode="mxfp4", group_size=32)
        x, qweight, scales, _ = mxfp4_case(1, 512, 256, jnp.bfloat16)
        jax.jit(kernel).trace(x, qweight, scales, None).lower(lowering_platforms=(platform,))

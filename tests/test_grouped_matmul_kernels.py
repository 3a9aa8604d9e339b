"""The grouped quantized-matmul kernels (Pallas TPU and Pallas Triton), run in interpret mode on the CPU.

Read as a specification: row r of the result is x[r] times the dequantized matrix of its group
(0 for a row of no group), for rows in any order, groups with no rows, decode-sized and larger
batches, and the modes a stack of experts comes in (mxfp4 as GPT-OSS ships it, int4 with groups,
int8 per column); each kernel returns what the reference returns.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import quantization as qz
from pallas_kernels.grouped_matmul import gpu, reference, tpu
from pallas_kernels.quantized_matmul.reference import dequantize

KERNELS = {"tpu": tpu.grouped_quantized_matmul, "gpu": gpu.grouped_quantized_matmul}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |error| relative to max |reference|


def mxfp4_stack(G, K, N, rng):
    """A random mxfp4 stack: E2M1 nibbles, exponents around 2 ** -6."""
    qweight = jnp.asarray(rng.integers(0, 256, (G, K // 2, N)), jnp.uint8)
    scales = jnp.asarray(rng.integers(118, 124, (G, K // 32, N)), jnp.uint8)
    return qweight, scales, None


def quantized_stack(G, K, N, mode, group_size, rng):
    if mode == "mxfp4":
        return mxfp4_stack(G, K, N, rng)
    qw = qz.quantize(jnp.asarray(rng.normal(0.0, 0.02, (G, K, N)), jnp.float32), mode, group_size)
    return qw.qweight, qw.scales, qw.offsets


def rows_and_groups(M, K, G, dtype, rng):
    """x [M, K] and each row's group: group 1 gets no row, a fifth of the rows are empty (G)."""
    groups = rng.choice([g for g in range(G) if g != 1], M)
    groups[rng.random(M) < 0.2] = G
    return jnp.asarray(rng.normal(0.0, 1.0, (M, K)), dtype), jnp.asarray(groups, jnp.int32)


def test_reference_is_each_row_times_its_matrix():
    rng = np.random.default_rng(0)
    x, groups = rows_and_groups(7, 64, 3, jnp.float32, rng)
    stack = quantized_stack(3, 64, 24, "mxfp4", 32, rng)
    w = np.asarray(dequantize(*stack, mode="mxfp4", group_size=32))      # [G, K, N]
    want = np.stack([np.asarray(x[r]) @ w[g] if g < 3 else np.zeros(24) for r, g in enumerate(np.asarray(groups))])
    got = reference.grouped_quantized_matmul(x, groups, *stack, mode="mxfp4", group_size=32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# (mode, group_size, K, N, G, M, dtype): M = 5 is a decode step's pairs, 40 gives blocks of more rows.
CASES = [
    ("mxfp4", 32, 256, 136, 4, 5, jnp.bfloat16),
    ("mxfp4", 32, 512, 128, 4, 40, jnp.float32),
    ("int4", 32, 256, 72, 3, 40, jnp.bfloat16),
    ("int8", None, 128, 200, 3, 5, jnp.float32),
    ("fp8", 128, 256, 128, 3, 5, jnp.bfloat16),  # block-scaled experts (DeepSeek-V3)
]


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("mode,group_size,K,N,G,M,dtype", CASES,
                         ids=[f"{c[0]}-K{c[2]}-G{c[4]}-M{c[5]}-{jnp.dtype(c[6]).name}" for c in CASES])
def test_kernel_matches_reference(platform, mode, group_size, K, N, G, M, dtype):
    rng = np.random.default_rng(M + K)
    x, groups = rows_and_groups(M, K, G, dtype, rng)
    stack = quantized_stack(G, K, N, mode, group_size, rng)
    got = KERNELS[platform](x, groups, *stack, mode=mode, group_size=group_size, interpret=True)
    want = reference.grouped_quantized_matmul(x, groups, *stack, mode=mode, group_size=group_size)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    assert not np.any(got[np.asarray(groups) == G]), "rows of no group must come out 0"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("platform", sorted(KERNELS))
def test_rows_of_no_group_only(platform):
    """An expert-parallel device may receive no pair at all: every row empty, all zeros out."""
    rng = np.random.default_rng(1)
    stack = quantized_stack(2, 256, 128, "mxfp4", 32, rng)
    x = jnp.ones((6, 256), jnp.float32)
    got = KERNELS[platform](x, jnp.full((6,), 2, jnp.int32), *stack, mode="mxfp4", group_size=32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_block_rows_follow_rows_per_group():
    assert tpu.block_rows(M=8, G=32, sublanes=16, limit=128) == 16   # decode: the smallest tile
    assert tpu.block_rows(M=4096, G=8, sublanes=16, limit=128) == 128  # prefill: the largest
    assert tpu.block_rows(M=256, G=8, sublanes=8, limit=128) == 32


def test_refuses_a_stack_that_does_not_fit():
    rng = np.random.default_rng(2)
    stack = quantized_stack(2, 256, 128, "mxfp4", 32, rng)
    with pytest.raises(ValueError, match="K = 128"):
        reference.grouped_quantized_matmul(jnp.ones((3, 128)), jnp.zeros(3, jnp.int32), *stack, mode="mxfp4", group_size=32)
    with pytest.raises(ValueError, match="group_of_row"):
        tpu.grouped_quantized_matmul(jnp.ones((3, 256)), jnp.zeros(4, jnp.int32), *stack, mode="mxfp4", group_size=32,
                                     interpret=True)

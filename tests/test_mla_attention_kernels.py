"""Ragged paged MLA attention (pallas_kernels.mla_attention): the TPU and GPU kernels against the
jnp reference, in interpret mode, on one mixed batch (a prefill chunk over a cached prefix, a
fresh prompt, decodes, a padding sequence and padding rows); and the GPU kernel lowered for a CUDA
GPU at DeepSeek-V3's shapes (128 heads, latent 512, rope 64). (The TPU kernel is compiled by libtpu
at those shapes in tests/test_kernel_check.py's MLA case.)

Shapes are small: value_dim 128 (the TPU kernel wants whole 128-lane rows of values), rope 64."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_attention_reference import make_case

from pallas_kernels.mla_attention import gpu, reference, tpu

R, ROPE = 128, 64  # value (latent) dims, rope dims: D = 192
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def mla_case(dtype, *, Hq, page_size=8, row_width=R + ROPE):
    """(q [T, Hq, R + ROPE], latent pages [P, page_size, row_width] zero past D, kv_lens, page table, cu, num_seqs)."""
    q, k, _, kv_lens, table, cu, num_seqs = make_case(np.random.default_rng(3), [7, 5, 1, 1], [19, 5, 33, 9], Hq=Hq, Hkv=1,
                                                      D=R + ROPE, page_size=page_size, pad_seqs=1, pad_tokens=3)
    rows = np.pad(k[:, :, 0, :], ((0, 0), (0, 0), (0, row_width - R - ROPE)))
    return (jnp.asarray(q, dtype), jnp.asarray(rows, dtype), *map(jnp.asarray, (kv_lens, table, cu, num_seqs)))


def assert_close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL[dtype] * max(np.abs(want).max(), 1.0)


# programs of 4 of the 8 heads for one query, or of all 8 for 2 queries; tiles of 2 pages shared by 3 splits
@pytest.mark.parametrize("dtype,max_rows", [(jnp.float32, 4), (jnp.bfloat16, 16)])
def test_gpu_kernel_equals_the_reference(dtype, max_rows):
    case = mla_case(dtype, Hq=8)
    want = reference.mla_attention(*case, value_dim=R, sm_scale=0.1)
    got = gpu.mla_attention(*case, value_dim=R, sm_scale=0.1, num_queries_per_block=2, num_kv_pages_per_block=2,
                            num_kv_splits=3, max_rows=max_rows, interpret=True)
    assert got.shape == (case[0].shape[0], 8, R)
    assert_close(got, want, dtype)
    assert np.all(np.asarray(got, np.float32)[14:] == 0)  # padding rows


def test_gpu_kernel_splits_the_heads_into_blocks_that_fit():
    assert gpu.head_block(128, gpu.MAX_ROWS_X_VALUE // 512) == 64  # DeepSeek-V3: 2 programs of 64 heads per query
    assert gpu.head_block(16, 32) == 16 and gpu.head_block(12, 8) == 6


def test_tpu_kernel_equals_the_reference():
    case = mla_case(jnp.float32, Hq=4, row_width=tpu.padded_row(R + ROPE))  # rows padded to 256 lanes
    want = reference.mla_attention(*case, value_dim=R, sm_scale=0.1)
    got = tpu.mla_attention(*case, value_dim=R, sm_scale=0.1, num_queries_per_block=4, num_kv_pages_per_block=2,
                            interpret=True)
    assert_close(got, want, jnp.float32)


def test_gpu_kernel_lowers_to_triton_at_deepseek_v3_shapes():
    q, rows, *rest = mla_case(jnp.bfloat16, Hq=1)
    q = jnp.zeros((8, 128, 512 + 64), jnp.bfloat16)
    rows = jnp.zeros((rows.shape[0], 8, 512 + 64), jnp.bfloat16)
    kv_lens, table, cu, num_seqs = rest
    cu = jnp.asarray([0, 5, 6, 7, 8, 8], jnp.int32)
    hlo = gpu.mla_attention.trace(q, rows, kv_lens, table, cu, num_seqs, value_dim=512, sm_scale=0.1).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in hlo

"""The causal conv's Pallas kernels (pallas_kernels.causal_conv: Mosaic TPU and Triton GPU), in
interpret mode on the CPU, against the jnp reference: T not a multiple of the token block, C not
one of the channel block (several channel programs, padding lanes), a saved `before`, bfloat16 and
float32, a chunk shorter than its rows (valid_len, traced) down to none of its own inputs in
`last`; the block sizes each kernel refuses; then the kernel table's entry where Gated DeltaNet
layers call it (`ragged_causal_conv`: decodes, short and verifying chunks on the vectorised path,
each long chunk through one kernel call) and the on-device check's case for it
(jaxinfer.runtime.kernel_selfcheck). (libtpu and the CUDA plugin compile the kernels at Qwen3.5's
shapes in tests/test_aot.py; the tiny Qwen3.5 of tests/test_gated_delta_rule_kernels.py runs both
Gated DeltaNet kernels.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.kernels import OPERATIONS, Kernels
from pallas_kernels.causal_conv import gpu, reference, tpu
from test_gated_delta_rule_kernels import pallas_calls

K = 4
# small blocks, so a few rows and channels make several of each: TPU (16 rows, 128 lanes), GPU (16 x 32)
KERNELS = {"tpu": functools.partial(tpu.causal_conv, block_t=16, block_c=128, interpret=True),
           "gpu": functools.partial(gpu.causal_conv, block_t=16, block_c=32, interpret=True)}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # of the largest |value| (at least 1): the sums' rounding


def inputs(T, C, dtype, seed=0):
    """x [T, C], before [K - 1, C] (a saved state: not zeros), weight [K, C]."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    return normal(T, C), normal(K - 1, C), normal(K, C)


def assert_conv_equal(got, want, dtype):
    """out within the dtype's rounding, `last` (copied inputs) exactly."""
    (out, last), (want_out, want_last) = got, want
    assert out.shape == want_out.shape and out.dtype == want_out.dtype and last.dtype == want_last.dtype
    out, want_out = np.asarray(out, np.float64), np.asarray(want_out, np.float64)
    assert np.abs(out - want_out).max() <= TOLERANCE[dtype] * max(1.0, np.abs(want_out).max())
    np.testing.assert_array_equal(np.asarray(last, np.float64), np.asarray(want_last, np.float64))


# (T, C, dtype, valid_len): 3 token blocks, the last partial, 2 TPU channel blocks (200: padded to 256) /
# 7 GPU ones; bf16 with a shorter chunk; a chunk of 2 tokens (last reaches into before); one of none
CASES = [(37, 200, jnp.float32, None), (45, 130, jnp.bfloat16, 29), (9, 6, jnp.float32, 2), (20, 40, jnp.bfloat16, 0)]


@pytest.mark.parametrize("T,C,dtype,valid_len", CASES, ids=[f"T{c[0]}-C{c[1]}-{c[2].__name__}-valid{c[3]}" for c in CASES])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernel_equals_the_reference(platform, T, C, dtype, valid_len):
    x, before, weight = inputs(T, C, dtype)
    valid = None if valid_len is None else jnp.int32(valid_len)  # traced, as the ragged step passes it
    got = jax.jit(KERNELS[platform])(x, before, weight, valid)
    assert got[0].shape == (T, C) and got[1].shape == (K - 1, C)
    assert_conv_equal(got, reference.causal_conv(x, before, weight, valid), dtype)
    ext = np.concatenate([np.asarray(before, np.float32), np.asarray(x, np.float32)])  # the definition, by numpy
    end = T if valid_len is None else valid_len
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), ext[end : end + K - 1])


def test_the_default_blocks_take_a_chunk_in_one_block():
    """The defaults (TPU 512 x 512, GPU 32 x 64) capped at a small chunk's size."""
    x, before, weight = inputs(21, 70, jnp.float32, seed=1)
    want = reference.causal_conv(x, before, weight, 17)
    for kernel in (tpu.causal_conv, gpu.causal_conv):
        assert_conv_equal(kernel(x, before, weight, 17, interpret=True), want, jnp.float32)


def test_block_sizes_the_kernels_cannot_take_are_refused():
    args = inputs(8, 8, jnp.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        tpu.causal_conv(*args, block_t=12, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128 lanes"):
        tpu.causal_conv(*args, block_c=64, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        gpu.causal_conv(*args, block_c=48, interpret=True)


def test_the_kernel_table_runs_the_platforms_kernel_or_the_reference():
    assert "causal_conv" in OPERATIONS
    assert Kernels().causal_conv is reference.causal_conv
    assert Kernels("tpu", interpret=True).causal_conv.func is tpu.causal_conv
    assert Kernels("gpu", interpret=True).causal_conv.func is gpu.causal_conv
    assert Kernels("tpu", interpret=True, xla=("causal_conv",)).causal_conv is reference.causal_conv


def ragged_step(spec_block: int):
    """A decode, a verifying chunk of 4 (speculation) or a short prefill of 4, a fresh chunk of 9 and
    one of 12 continuing its saved inputs, packed into 32 rows: (batch, x [32, C], saved [5, K - 1, C],
    weight [K, C], drafts [5, 4, C] or None)."""
    from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch

    C = 20
    chunks = [SequenceChunk([0], 6, [[1, 2]], [0], state_slot=1),
              SequenceChunk([0] * 4, 5, [[3, 4, 5]], [0, 1, 2, 3], state_slot=2, verifies=spec_block > 0),
              SequenceChunk([0] * 9, 0, [[6, 7, 8]], [8], state_slot=3),
              SequenceChunk([0] * 12, 7, [[9, 10, 11, 12, 13]], [11], state_slot=4)]
    _, batch, _ = pack_batch(chunks, Buckets((32,), max_num_seqs=4, pages_per_seq=5, spec_block=spec_block), page_size=4)
    x, _, weight = inputs(32, C, jnp.float32, seed=2)
    saved = jnp.asarray(np.random.default_rng(3).normal(size=(5, K - 1, C)), jnp.float32)
    return batch, x, saved, weight, jnp.zeros((5, 4, C), jnp.float32) if spec_block else None


@pytest.mark.parametrize("spec_block", [0, 4])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_a_ragged_step_runs_its_long_chunks_through_the_kernel_table(platform, spec_block):
    """With a platform's table the chunks of 9 and 12 tokens (more than max(1, spec_block)) run its
    kernel (one pallas_call, inside the loop over the step's chunks, declaring its cost) and the
    outputs of every real row, the slots' saved inputs and the drafts equal the reference path's;
    the chunk of 4 (with speculation: verifying drafts, its inputs kept in `drafts`) and the decode
    take the vectorised rows. The reference table is the reference path, bit for bit."""
    from jaxinfer.ops.linear_attention import ragged_causal_conv

    batch, x, saved, weight, drafts = ragged_step(spec_block)
    real = 1 + 4 + 9 + 12

    def run(kernels):
        def conv(x, saved, weight, drafts):
            out, saved, drafts = ragged_causal_conv(x, saved, weight, batch, drafts, chunks=True, spec_block=spec_block,
                                                    kernels=kernels)
            return out[:real], saved, drafts
        return conv

    kernels = Kernels(platform, interpret=True)
    assert pallas_calls(jax.make_jaxpr(run(kernels))(x, saved, weight, drafts).jaxpr) == [("causal_conv", True)]
    want = run(None)(x, saved, weight, drafts)
    got = run(kernels)(x, saved, weight, drafts)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    if spec_block:
        np.testing.assert_array_equal(np.asarray(got[1][2]), np.asarray(saved[2]))  # the verifying chunk's slot: kept
        np.testing.assert_array_equal(np.asarray(got[2][2]), np.asarray(x[1:5]))  # its inputs: in drafts
    for g, w in zip(jax.tree.leaves(run(Kernels())(x, saved, weight, drafts)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_check_sees_a_hybrid_models_conv_channels_on_one_device():
    """step_shapes of a tiny Qwen3.5: the conv's q | k | v channels (2 Hk Dk + Hv Dv) and taps,
    halved on each of two tensor-parallel shards."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.runtime.kernel_selfcheck import step_shapes
    from jaxinfer.runtime.loading import abstract_model
    from sharding.mesh import ParallelConfig

    config = ModelConfig.from_hf_dict(dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=K, vocab_size=256, max_position_embeddings=256), source="test")
    _, state = abstract_model(config, jnp.float32, jnp.float32)
    channels = 2 * config.linear_key_heads * config.linear_key_head_dim + config.linear_value_heads * config.linear_value_head_dim
    for tp in (1, 2):
        shapes = step_shapes(config, state, parallel=ParallelConfig(tp=tp), dtype=jnp.float32, kv_dtype=jnp.float32,
                             page_size=4, max_tokens=128)
        assert shapes.conv == (channels // tp, K) and channels == 2 * 2 * 16 + 4 * 8


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_on_device_check_passes_the_kernel_and_fails_a_wrong_one(platform):
    """jaxinfer.runtime.kernel_selfcheck: a hybrid model's step shapes hold its conv's channels,
    whose one case (a prefill chunk of 130 of 135 rows from saved inputs) the kernel passes and a
    kernel with a wrong `last` fails."""
    from jaxinfer.runtime.kernel_selfcheck import StepShapes, run_checks

    shapes = StepShapes(num_heads=2, num_kv_heads=1, head_dim=64, hidden=128, dtype="float32", norm_dtype="float32",
                        rms_norm_eps=1e-5, page_size=4, kv_dtype="float32", linear=(2, 16, 16), conv=(96, K))
    kernels = Kernels(platform, interpret=True)
    [verdict] = run_checks(kernels, shapes, operations=["causal_conv"])
    assert verdict.verdict == "pass" and "T=135 valid 130 C=96 K=4" in verdict.case, verdict

    def wrong(*args, **kw):
        out, last = kernels.causal_conv(*args, **kw)
        return out, jnp.roll(last, 1, axis=0)

    [verdict] = run_checks(Kernels(platform, interpret=True, causal_conv=wrong), shapes, operations=["causal_conv"])
    assert verdict.failed

"""GPT-OSS checkpoints as released: experts in MXFP4 (4-bit E2M1 values, a power-of-two scale per
32), read through checkpoints_conv.views: dequantized bit for bit as transformers does when loaded
as floats (the CPU's default), or kept 4-bit as stored (on TPU / GPU, or asked for) and run by
the grouped matmul, with the same log-probabilities."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from checkpoints_conv.views import dequantize_mxfp4
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.quantization import QuantizedWeight
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from pallas_kernels.grouped_matmul import tpu as grouped_tpu
from tiny_models import VOCAB, save_mxfp4_gpt_oss


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """The tiny GPT-OSS model saved with its experts in MXFP4 (as the released checkpoints are)."""
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return directory, save_mxfp4_gpt_oss(directory)


def test_dequantization_equals_transformers_bit_for_bit(mxfp4_folder):
    _, tensors = mxfp4_folder
    blocks, scales = tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"], tensors["model.layers.1.mlp.experts.gate_up_proj_scales"]
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)  # [E, H, 2I]
    got = np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2)
    assert got.tobytes() == want.numpy().tobytes()
    bf16 = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales))  # the reference's own dtype
    assert torch.equal(torch.from_numpy(got).to(torch.bfloat16), bf16)


def test_mxfp4_experts_load_as_the_reference_dequantizes_them(mxfp4_folder):
    directory, tensors = mxfp4_folder
    source = resolve_model(directory)
    config = read_config(source)
    _, params = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    layers = params["layers"]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = convert_moe_packed_tensors(torch.from_numpy(tensors[f"{prefix}.gate_up_proj_blocks"]),
                                             torch.from_numpy(tensors[f"{prefix}.gate_up_proj_scales"]), dtype=torch.float32).numpy()
        down = convert_moe_packed_tensors(torch.from_numpy(tensors[f"{prefix}.down_proj_blocks"]),
                                          torch.from_numpy(tensors[f"{prefix}.down_proj_scales"]), dtype=torch.float32).numpy()
        # ours: [gate | up] (the reference interleaves them: gate = even columns)
        want_gate_up = np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1)
        assert np.asarray(layers["experts_gate_up"][...][layer]).tobytes() == want_gate_up.tobytes()
        assert np.asarray(layers["experts_down"][...][layer]).tobytes() == down.tobytes()


@pytest.fixture(scope="module")
def float_load(mxfp4_folder):
    source = resolve_model(mxfp4_folder[0])
    config = read_config(source)
    return config, *load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)


# (the GPU kernel against the reference: tests/test_grouped_matmul_kernels.py)
GROUPED = {"reference": Kernels(),  # the CPU's XLA path: the stack dequantized, jax.lax.ragged_dot
           "tpu": Kernels(grouped_matmul=functools.partial(grouped_tpu.grouped_quantized_matmul, interpret=True))}


@pytest.mark.parametrize("grouped", sorted(GROUPED))
def test_mxfp4_experts_kept_4_bit_give_the_float_logprobs(mxfp4_folder, float_load, grouped):
    config, f_graphdef, f_params = float_load
    assert config.stored_quantization == "mxfp4"
    source = resolve_model(mxfp4_folder[0])
    q_graphdef, q_params = load_params(source, config, jnp.float32, jnp.float32, kernels=GROUPED[grouped], progress=False)
    flat, floats = nested_to_flat(nnx_dict(q_params)), nested_to_flat(nnx_dict(f_params))
    for name in ("layers.experts_gate_up", "layers.experts_down"):
        w = flat[name]
        assert isinstance(w, QuantizedWeight) and w.mode == "mxfp4" and w.group_size == 32, name
        assert w.nbytes * 7 < floats[name].nbytes, name  # 4.25 bits a weight against float32's 32
        assert np.asarray(w.dequantize()).tobytes() == np.asarray(floats[name]).tobytes(), name  # the same numbers
    ids = list(np.random.default_rng(0).integers(3, VOCAB, 24))
    np.testing.assert_allclose(prompt_log_softmax(config, q_graphdef, q_params, ids),
                               prompt_log_softmax(config, f_graphdef, f_params, ids), atol=2e-5)


def nnx_dict(state):
    from flax import nnx

    return nnx.to_pure_dict(state)


def test_a_tensor_split_that_cuts_the_exponent_groups_is_refused(mxfp4_folder):
    """Tensor parallelism splits each expert's down projection on its inputs: 32 per expert over
    2 shards leaves 16, not whole groups of 32."""
    from sharding.mesh import ParallelConfig, make_mesh

    source = resolve_model(mxfp4_folder[0])
    config = read_config(source)
    parallel = ParallelConfig(tp=2)
    with pytest.raises(ValueError, match="layers.experts_down has 32 input rows, 16 per shard"):
        load_params(source, config, jnp.float32, jnp.float32, parallel=parallel, mesh=make_mesh(parallel, jax.devices()[:2]),
                    progress=False)

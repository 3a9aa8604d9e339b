"""Checkpoints with block-scaled fp8 weights (quant_method "fp8": DeepSeek-V3, the FP8 releases):
e4m3 values with a float32 scale per block of 128 x 128, read through checkpoints_conv.hf_fp8.

Dequantized at load (the CPU's default) they equal transformers' own dequantization bit for bit;
kept as stored (TPU / GPU, or asked for) they run as fp8 with groups of 128 and give the same
log-probabilities. The tiny model's widths (64 and 160) leave partial blocks on both axes.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from checkpoints_conv import CheckpointError
from jaxinfer.ops.quantization import QuantizedWeight
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from tiny_models import VOCAB, save_hf_model

BLOCK = [128, 128]


def quantize_fp8_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv float32 [ceil(N / bn), ceil(K / bk)]): each block's absmax to 448."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:N, :K] = w
    absmax = padded.reshape(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = torch.where(absmax > 0, absmax / 448.0, torch.ones_like(absmax))
    q = (padded.reshape(nb, bn, kb, bk) / scale[:, None, :, None]).reshape(nb * bn, kb * bk)[:N, :K]
    return q.to(torch.float8_e4m3fn), scale.float()


def write_fp8_folder(directory, family: str = "qwen3", **config_overrides) -> dict[str, torch.Tensor]:
    """A tiny model saved as an FP8 release is: every linear layer's weight e4m3 with its
    weight_scale_inv blocks (the embedding, the LM head, the norms and a router's gate stay floats)."""
    from safetensors.torch import load_file

    save_hf_model(family, directory, **(dict(intermediate_size=160) if family == "qwen3" else {}))
    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    for name in [n for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2 and "norm" not in n
                 and not n.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))]:
        tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(tensors[name].float())
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK, **config_overrides}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_fp8")
    return directory, write_fp8_folder(directory)


def test_fp8_weights_dequantize_as_transformers_does(fp8_folder):
    from checkpoints_conv import open_checkpoint, read_checkpoint_config

    directory, tensors = fp8_folder
    source = open_checkpoint(directory, read_checkpoint_config(directory))
    quantized = source.quantized()
    assert len(quantized) == 2 * 7 and {layout.mode for layout in quantized.values()} == {"fp8"}  # q k v o gate up down
    for name in quantized:
        want = _dequantize_fp8_weight(tensors[name], tensors[f"{name}_scale_inv"], BLOCK, torch.float32)
        assert source.read(name).tobytes() == want.numpy().tobytes(), name


def test_fp8_kept_as_stored_gives_the_float_logprobs(fp8_folder):
    source = resolve_model(fp8_folder[0])
    config = read_config(source)
    f_graphdef, f_params = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    q_graphdef, q_params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    flat, floats = nested_to_flat(nnx.to_pure_dict(q_params)), nested_to_flat(nnx.to_pure_dict(f_params))
    for name in ("layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj"):
        w = flat[name]
        assert isinstance(w, QuantizedWeight) and w.mode == "fp8" and w.group_size == 128, name
        assert w.qweight.dtype == jnp.float8_e4m3fn and w.qweight.shape[-2] % 128 == 0  # K padded to whole groups
        assert np.asarray(w.dequantize()).tobytes() == np.asarray(floats[name]).tobytes(), name  # the same numbers
    ids = list(np.random.default_rng(0).integers(3, VOCAB, 24))
    np.testing.assert_allclose(prompt_log_softmax(config, q_graphdef, q_params, ids),
                               prompt_log_softmax(config, f_graphdef, f_params, ids), atol=2e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(weight_block_size=[128, 64]), "weight_block_size=\\[128, 64\\]"),
    (dict(activation_scheme="static"), "activation_scheme 'static'"),
])
def test_fp8_configs_not_read_here_are_refused_by_name(tmp_path, overrides, message):
    write_fp8_folder(tmp_path, **overrides)
    source = resolve_model(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False)


def test_deepseek_fp8_keeps_its_experts_and_projections_fp8_with_the_float_logprobs(tmp_path):
    """DeepSeek-V3's FP8 release: the attention's low-rank projections, the dense MLP, the shared
    and routed experts stay fp8 in groups of 128 (the experts as stacks for the grouped matmul);
    kv_b_proj, which the absorbed attention reads per head, loads as floats."""
    write_fp8_folder(tmp_path, "deepseek_v3")
    source = resolve_model(tmp_path)
    config = read_config(source)
    f_graphdef, f_params = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    q_graphdef, q_params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    flat = nested_to_flat(nnx.to_pure_dict(q_params))
    for name in ("layers.q_a_proj", "layers.q_b_proj", "layers.kv_a_proj", "layers.o_proj", "layers.gate_up_proj",
                 "layers.shared_gate_up", "layers.experts_gate_up", "layers.experts_down"):
        assert isinstance(flat[name], QuantizedWeight) and flat[name].mode == "fp8", name
    assert not isinstance(flat["layers.kv_b_proj"], QuantizedWeight)
    ids = list(np.random.default_rng(1).integers(3, VOCAB, 20))
    np.testing.assert_allclose(prompt_log_softmax(config, q_graphdef, q_params, ids),
                               prompt_log_softmax(config, f_graphdef, f_params, ids), atol=2e-5)

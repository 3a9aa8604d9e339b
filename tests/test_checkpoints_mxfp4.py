"""GPT-OSS checkpoints as released: experts in MXFP4 (4-bit E2M1 values, a power-of-two scale per
32), read through checkpoints_conv.views and dequantized bit for bit as transformers does."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from checkpoints_conv.views import FP4_VALUES, dequantize_mxfp4
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from tiny_models import save_hf_model


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8):
    each 32 values share 2^s with s the smallest exponent that fits their absmax in E2M1's 6."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    absmax = np.abs(groups).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)  # nearest E2M1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)  # (save_file writes raw memory)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """The tiny GPT-OSS model saved with its experts in MXFP4 (as the released checkpoints are)."""
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = save_hf_model("gpt_oss", directory)
    tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name)  # [E, in, out]: blocks hold [E, out, in / 32, 16]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(np.swapaxes(stored, 1, 2))
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, tensors


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
    _, params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
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

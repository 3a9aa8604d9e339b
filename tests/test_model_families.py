"""The newer families through the engine, as a user runs them: `LLM(<folder>)` and `jaxinfer
generate --model <folder>` on a tiny random Gemma 3 (windows of 6 tokens, far shorter than the
prompts; the other families' logits are tests/test_model_parity.py's). Greedy text equals transformers' `generate`, a prompt batched with
others equals it alone, and a pool too small for the batch preempts and still gives the same
tokens (the recomputed prefill crosses the windows again)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxinfer import LLM, SamplingParams
from tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LENGTHS = (5, 13, 21)  # within, across and well past a 6-token window


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    return directory, save_hf_model("gemma3", directory)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in PROMPT_LENGTHS]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_greedy_generation_equals_transformers_batched_alone_and_preempted(family_dir):
    directory, hf = family_dir
    # chunks of 8 tokens: prefills cross the windows in pieces. Layers S S F S make three KV layer
    # groups (the pattern's period is 3: S S F, then S), two sliding (window 6) and one full: at
    # their full length (13, 21, 29 tokens) the sequences hold 4 + 2 * 3, 6 + 2 * 3 and 8 + 2 * 3
    # pages of 4 tokens; 26 pages hold two of them, so the third is preempted and recomputed
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=27, max_num_batched_tokens=8, max_num_seqs=4,
              progress=False)
    assert llm.runner.kv_windows == (6, 6, None)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert llm.engine.get_stats().num_preemptions > 0
    assert batched == [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts()]
    alone = [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts()]
    assert alone == batched


def test_a_long_sequence_holds_a_window_of_pages_in_each_sliding_group(family_dir):
    """80 tokens through pages of 4: the full group's row grows to 20 pages while each sliding
    group (window 6) holds at most a window and a chunk of 8, its pages recycled as it goes; the
    tokens are still transformers'."""
    directory, hf = family_dir
    llm = LLM(str(directory), max_model_len=96, page_size=4, max_num_batched_tokens=8, max_num_seqs=2, progress=False)
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 250, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("long", prompt, params)
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        held += [bm.pages_held(sid) for sid in bm.seqs]
    full = [h[2] for h in held]  # groups (6, 6, None)
    sliding = [h[g] for h in held for g in (0, 1)]
    assert max(full) == 20 and max(sliding) <= (6 + 8 - 2) // 4 + 2
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    assert engine.get_stats().kv_pages_in_use_by_group == (0, 0, 0)


def test_prefix_caching_on_a_windowed_model_gives_the_same_tokens(family_dir):
    """Prompts sharing a 28-token prefix, one after another: later ones reuse its full pages and
    the sliding groups' pages in the window of the hit (the rest of theirs were given back), and
    decode exactly what transformers does from the whole prompt."""
    directory, hf = family_dir
    llm = LLM(str(directory), max_model_len=64, page_size=4, max_num_batched_tokens=16, max_num_seqs=2, progress=False,
              enable_prefix_caching=True)
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(3, 250, 28)]
    tails = [[int(t) for t in rng.integers(3, 250, n)] for n in (3, 7, 1)]
    got = [llm.generate([shared + tail], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for tail in tails]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hit_rate > 0.5  # every later prompt found its 7 shared pages
    assert got == [hf_greedy(hf, shared + tail, GREEDY.max_tokens) for tail in tails]


def test_cli_generate_runs_a_gemma3_folder(family_dir, capsys):
    from jaxinfer.cli import main

    directory, hf = family_dir
    assert main(["generate", "--model", str(directory), "--max-tokens", "4", "--max-model-len", "64", "a prompt"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.encode("a prompt")
    with torch.no_grad():  # greedy, stopping at EOS as the CLI does
        want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert capsys.readouterr().out == tokenizer.decode(want, skip_special_tokens=True) + "\n"



def test_a_multimodal_gemma3_folder_runs_its_text_decoder(tmp_path):
    """Gemma 3's released folders are Gemma3ForConditionalGeneration: the text decoder's config in
    text_config, its tensors under model.language_model (language_model.model in the older
    exports), a vision tower beside it. The text decoder loads (the tower is skipped) and gives
    transformers' text-only logits, under either naming."""
    from safetensors.numpy import load_file, save_file

    from test_model_parity import TOL, PagedModel, hf_logprobs
    from tiny_models import FAMILIES, byte_tokenizer

    _, text_kw = FAMILIES["gemma3"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text_kw, vision_config=vision, mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 250, 20)]
    truth = hf_logprobs(hf, ids, [len(ids)])

    def logprobs(directory):
        from jaxinfer.ops.batch import SequenceChunk

        model = PagedModel(directory, page_size=4)
        assert model.config.model_type == "gemma3" and model.config.layer_kind(0).rope == "local"
        return model.run([SequenceChunk(ids, 0, model.allocate(len(ids)), list(range(len(ids))))])[0]

    np.testing.assert_array_less(np.abs(logprobs(tmp_path) - truth).max(), TOL)
    # the older naming: language_model.model.*, vision_tower.*, multi_modal_projector.*
    old = tmp_path / "old"
    old.mkdir()
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."))
    tensors = {}
    for f in tmp_path.glob("*.safetensors"):
        for name, array in load_file(f).items():
            tensors[next((o + name[len(n):] for n, o in renames if name.startswith(n)), name)] = array
    save_file(tensors, old / "model.safetensors")
    (old / "config.json").write_text(json.dumps(json.loads((tmp_path / "config.json").read_text())))
    byte_tokenizer().save_pretrained(old)
    np.testing.assert_array_less(np.abs(logprobs(old) - truth).max(), TOL)


def test_attention_sinks_with_ring_attention_are_refused_by_name():
    from jaxinfer.aot.presets import read_model_config
    from jaxinfer.config import ConfigError
    from jaxinfer.runtime.loading import abstract_model
    from sharding.mesh import ParallelConfig

    config = read_model_config("gpt-oss-20b")
    with pytest.raises(ConfigError, match="attention sinks with ring attention"):
        abstract_model(config, jnp.bfloat16, jnp.bfloat16, parallel=ParallelConfig(sp=2, sp_attention="ring"))


def test_what_needs_one_full_page_table_row_is_refused_by_name_with_sliding_layers(family_dir):
    """Swapping a sequence out keeps its one page-table row, and a draft model reads its K/V at the
    target's page ids: neither holds with a sliding group's given-back pages."""
    directory, _ = family_dir
    with pytest.raises(ValueError, match="preemption_mode='swap' with gemma3_text's sliding-window or chunked layers"):
        LLM(str(directory), max_model_len=32, preemption_mode="swap", progress=False)
    with pytest.raises(ValueError, match="'draft_model': the target model .gemma3_text. has sliding-window or chunked layers"):
        LLM(str(directory), max_model_len=32, progress=False,
            speculative_config={"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 2})


def test_minimax_m2s_released_config_fields_are_read_or_refused_by_name():
    """The released config.json names the rotary dims (`rotary_dim`, no partial_rotary_factor) and
    each layer's attention type (1 = full); a linear-attention layer (0) is not implemented."""
    from jaxinfer.config import ConfigError, ModelConfig

    d = dict(model_type="minimax_m2", vocab_size=8, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8, rope_theta=5e6,
             num_local_experts=4, num_experts_per_tok=2, attn_type_list=[1, 1], use_qk_norm=True, qk_norm_type="per_layer",
             scoring_func="sigmoid", use_routing_bias=True)
    c = ModelConfig.from_hf_dict(d)
    assert (c.rotary_dim, c.router_scoring, c.router_correction_bias, c.qk_norm_scope) == (8, "sigmoid", True, "projection")
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ConfigError, match="attn_type_list"):
        ModelConfig.from_hf_dict({**d, "attn_type_list": [0, 1]})
    with pytest.raises(ConfigError, match="qk_norm_type='per_head' is not supported for minimax_m2"):
        ModelConfig.from_hf_dict({**d, "qk_norm_type": "per_head"})


def test_glm45s_multi_token_prediction_layer_is_skipped_and_bad_groups_are_refused(tmp_path):
    """GLM-4.5's checkpoints carry a multi-token-prediction module as one layer past
    num_hidden_layers (not run here): its tensors are left out and the logits stay transformers'.
    A config whose expert groups do not divide the experts is refused by name."""
    from safetensors.numpy import load_file, save_file

    from jaxinfer.config import ConfigError, ModelConfig
    from jaxinfer.ops.batch import SequenceChunk
    from test_model_parity import TOL, PagedModel, hf_logprobs

    hf = save_hf_model("glm4_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight"):  # the MTP layer's own
        tensors[name.replace("layers.1.", "layers.3.")] = tensors[name]
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 250, 20)]
    model = PagedModel(tmp_path, 16)
    [out] = model.run([SequenceChunk(ids, 0, model.allocate(len(ids)), list(range(len(ids))))])
    np.testing.assert_array_less(np.abs(out - hf_logprobs(hf, ids, [len(ids)])).max(), TOL)

    d = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="n_group=3"):
        ModelConfig.from_hf_dict({**d, "n_group": 3})


def test_a_multimodal_llama4_folder_generates_transformers_tokens_holding_a_chunk_of_pages(tmp_path):
    """Llama 4's released folders are Llama4ForConditionalGeneration (text_config, the decoder under
    language_model.*, a vision tower beside it). Its text decoder runs: greedy tokens equal
    transformers' for prompts within and past a chunk of 8 (prefill chunks of 6 straddle the chunk
    starts), batched as alone, and a 40-token prompt decoding 24 tokens holds at most a chunk and a
    step's tokens of pages in each chunked group while the full group grows."""
    from jaxinfer.kv_groups import Chunk, window_pages
    from tiny_models import FAMILIES, build_hf_model, byte_tokenizer

    text = build_hf_model("llama4")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    multimodal = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=FAMILIES["llama4"][1], vision_config=vision)).eval()
    multimodal.language_model.load_state_dict(text.state_dict())
    multimodal.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)

    llm = LLM(str(tmp_path), max_model_len=96, page_size=4, max_num_batched_tokens=6, max_num_seqs=4, progress=False)
    assert llm.runner.kv_windows == (Chunk(8),) * 3 + (None,)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert batched == [hf_greedy(text, ids, GREEDY.max_tokens) for ids in prompts()]
    assert llm.generate([prompts()[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == batched[1]

    engine, bm = llm.engine, llm.engine.block_manager
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 250, 40)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        held += [bm.pages_held(sid) for sid in bm.seqs]
    assert max(h[3] for h in held) == 16  # the full group: every page of 64 tokens
    assert max(h[g] for h in held for g in range(3)) <= window_pages(Chunk(8), 64, 4, 6)
    assert out.outputs[0].token_ids == hf_greedy(text, prompt, 24)

    # transformers 5's naming of the same folder (model.language_model.*) loads the same parameters
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from jaxinfer.runtime.loading import load_params, read_config, resolve_model
    from jaxinfer.tree import nested_to_flat

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    tensors = {("model.language_model." + k[len("language_model.model."):] if k.startswith("language_model.model.") else k): v
               for k, v in load_file(tmp_path / "model.safetensors").items()}
    save_file(tensors, renamed / "model.safetensors")
    (renamed / "config.json").write_text((tmp_path / "config.json").read_text())
    params = []
    for folder in (tmp_path, renamed):
        source = resolve_model(folder)
        params.append(nested_to_flat(nnx.to_pure_dict(load_params(source, read_config(source), jnp.float32, jnp.float32,
                                                                   progress=False)[1])))
    assert params[0].keys() == params[1].keys()
    assert all(np.array_equal(np.asarray(params[0][k]), np.asarray(params[1][k])) for k in params[0])


def test_llama4_config_switches_it_does_not_implement_are_refused_by_name():
    from jaxinfer.config import ConfigError, ModelConfig

    d = dict(model_type="llama4_text", vocab_size=8, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
             num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8)
    c = ModelConfig.from_hf_dict(d)
    assert (c.intermediate_size, c.moe_intermediate_size, c.moe_layer_step, c.nope_layers) == (96, 32, 2, (3,))
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    with pytest.raises(ConfigError, match=r"moe_layers=\[0, 3\]: only every interleave_moe_layer_step-th layer"):
        ModelConfig.from_hf_dict({**d, "moe_layers": [0, 3]})
    with pytest.raises(ConfigError, match="chunked_attention layers but attention_chunk_size=None"):
        ModelConfig.from_hf_dict({**d, "attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4})
    assert ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "attention_chunk_size"}).attention_chunk_size == 8192


def test_a_quantized_llama4_checkpoint_is_refused_by_name(tmp_path):
    """GPTQ / AWQ / compressed-tensors store q/k as packed integers, which the load-time reorder of
    Llama 4's RoPE pairs does not reach: refused rather than loaded wrong."""
    from checkpoints_conv import CheckpointError
    from checkpoints_conv.source import open_checkpoint

    config = dict(model_type="llama4_text", quantization_config=dict(quant_method="gptq", bits=4, group_size=128,
                                                                     desc_act=False, sym=True))
    with pytest.raises(CheckpointError, match="llama4_text checkpoint quantized by gptq is not supported"):
        open_checkpoint(tmp_path, config)


def test_a_multimodal_gemma4_folder_generates_transformers_tokens_on_pages_of_two_sizes(tmp_path):
    """Gemma 4's released folders are Gemma4ForConditionalGeneration (text_config; the decoder
    under model.language_model.*, a vision tower beside it). The tiny text decoder (tests/tiny_models:
    global layers with twice the sliding layers' K/V row, so the sliding groups' pages hold 8 tokens
    and the global group's 4; two KV-shared layers, per-layer inputs, experts beside the MLP) gives
    transformers' greedy tokens batched, alone, and preempted by a pool too small for the batch;
    a prompt sharing a prefix then hits whole pages of both sizes and decodes the same tokens."""
    from tiny_models import FAMILIES, build_hf_model, byte_tokenizer

    text = build_hf_model("gemma4")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16)
    multimodal = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=FAMILIES["gemma4"][1], vision_config=vision, audio_config=None)).eval()
    multimodal.model.language_model.load_state_dict(text.model.state_dict())
    multimodal.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)

    # 3 groups (sliding, sliding, global) of 2 slots; the sequences (13, 21, 29 tokens) end holding
    # 4, 6 and 8 global pages of 4 and 2 sliding pages of 8 in each sliding group: 17 pages hold
    # two of them, not three, so the batch preempts
    llm = LLM(str(tmp_path), max_model_len=48, page_size=4, num_pages=18, max_num_batched_tokens=8, max_num_seqs=4,
              progress=False, enable_prefix_caching=True)
    assert llm.runner.kv_windows == (6, 6, None) and llm.runner.kv_page_factors == (2, 2, 1)
    want = [hf_greedy(text, ids, GREEDY.max_tokens) for ids in prompts()]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.get_stats().num_preemptions > 0
    assert llm.generate([prompts()[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want[2]
    shared = prompts()[2][:19] + [7, 8]  # its first 16 tokens: four global pages of 4 and the sliding pages of 8 in the window
    hits_before = llm.engine.block_manager.stats.hits
    assert llm.generate([shared], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(text, shared, GREEDY.max_tokens)
    assert llm.engine.block_manager.stats.hits - hits_before == 4

"""The newer families through the engine, as a user runs them: `LLM(<folder>)` and `jaxinfer
generate --model <folder>` on a tiny random Gemma 3 (windows of 6 tokens, far shorter than the
prompts; the other families' logits are tests/test_model_parity.py's). Greedy text equals transformers' `generate`, a prompt batched with
others equals it alone, and a pool too small for the batch preempts and still gives the same
tokens (the recomputed prefill crosses the windows again)."""

from __future__ import annotations

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
    # chunks of 8 tokens: prefills cross the windows in pieces; 12 pages of 4 tokens hold two of
    # the three sequences at their full length, so the third is preempted and recomputed
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=13, max_num_batched_tokens=8, max_num_seqs=4,
              progress=False)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert llm.engine.get_stats().num_preemptions > 0
    assert batched == [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts()]
    alone = [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts()]
    assert alone == batched


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
    import json

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

"""Qwen2.5-VL's text decoder with M-RoPE (jaxinfer.models.mrope, models.rope) against transformers,
on a tiny random Qwen2_5_VLForConditionalGeneration saved locally (float32, nothing downloaded):

- `mrope_positions` equals transformers' `get_rope_index` on a prompt with two images of different
  grids between text (positions and delta), and is 1-D on text alone;
- the folder's config (text_config, mrope_section) and the older flat form with rope_scaling
  {"type": "mrope"} read alike; the vision tower's tensors are skipped by the loader and
  model.language_model.* names read as model.*;
- the decoder through the paged step, given the prompt's (t, h, w) positions and then decode
  positions p + delta, gives transformers' logits (position_ids [3, 1, n]) at every token;
- a text-only prompt through `LLM(folder)`: greedy tokens and their logprobs are transformers'.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.models.mrope import decode_rope_positions, mrope_positions
from jaxinfer.ops.batch import SequenceChunk, pack_batch, stack_replicas
from test_model_parity import PagedModel
from tiny_models import byte_tokenizer

IMAGE, MERGE = 299, 2
SECTION = [2, 3, 3]  # of head_dim / 2 = 8 frequencies
TOL = 1e-4


def tiny_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": SECTION, "rope_theta": 10000.0}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4, temporal_patch_size=2,
                           spatial_merge_size=MERGE, window_size=16, out_hidden_size=64, fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, transformers model): random weights scaled as tests/tiny_models.py does (norms
    near 1, biases non-zero) so the logits are far from uniform."""
    torch.manual_seed(0)
    config = tiny_config()
    config._attn_implementation = "eager"
    hf = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (2.0 if "embed" in name or "lm_head" in name else 1.0))
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    hf.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=MERGE, temporal_patch_size=2, min_pixels=8 * 8,
                             max_pixels=48 * 48).save_pretrained(folder)  # (a released folder has one)
    return folder, hf


GRIDS = [(1, 4, 6), (1, 6, 2)]  # patch grids: 2 x 3 and 3 x 1 merged tokens


def prompt() -> list[int]:
    rng = np.random.default_rng(0)

    def text(n):
        return [int(t) for t in rng.integers(3, 250, n)]

    return text(5) + [297] + [IMAGE] * 6 + [296] + text(3) + [297] + [IMAGE] * 3 + [296] + text(4)


def hf_rope_index(hf, ids: list[int]) -> tuple[np.ndarray, int]:
    input_ids = torch.tensor([ids])
    position_ids, delta = hf.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), image_grid_thw=torch.tensor(GRIDS))
    return position_ids[:, 0].numpy(), int(delta[0, 0])  # [3, n]


def test_mrope_positions_equal_transformers_rope_index(saved):
    _, hf = saved
    ids = prompt()
    positions, delta = mrope_positions(ids, GRIDS, image_token_id=IMAGE, spatial_merge_size=MERGE)
    want, want_delta = hf_rope_index(hf, ids)
    assert positions.dtype == np.int32 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, want)
    assert delta == want_delta < 0  # the images' tokens share positions
    text = list(range(3, 20))
    positions, delta = mrope_positions(text, [], image_token_id=IMAGE, spatial_merge_size=MERGE)
    np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(len(text)), (3, len(text))))
    assert delta == 0
    np.testing.assert_array_equal(decode_rope_positions(7, 2, -3), [[4, 5]] * 3)
    with pytest.raises(ValueError, match="no image grid left"):
        mrope_positions(ids, GRIDS[:1], image_token_id=IMAGE, spatial_merge_size=MERGE)
    with pytest.raises(ValueError, match="have no image tokens"):
        mrope_positions(ids, GRIDS + [(1, 2, 2)], image_token_id=IMAGE, spatial_merge_size=MERGE)


def test_config_reads_the_nested_and_the_released_flat_form(saved):
    folder, _ = saved
    d = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf_dict(d)
    assert (config.model_type, config.mrope_section, config.qkv_bias, config.o_bias, config.sliding_window) == (
        "qwen2_5_vl", (2, 3, 3), True, False, None)
    assert config.rope_scaling.rope_type == "default" and config.head_dim == 16
    # the released configs: the text fields at the top, rope_scaling {"type": "mrope"}, a sliding window left off
    flat = {**d.pop("text_config"), **d, "rope_theta": 10000.0, "sliding_window": 32768, "use_sliding_window": False,
            "rope_scaling": {"type": "mrope", "mrope_section": SECTION}}
    flat.pop("rope_parameters")
    assert ModelConfig.from_hf_dict(flat) == config
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config  # (a converted folder)


def run_with_rope(model: PagedModel, chunks: list[SequenceChunk], rope: np.ndarray) -> list[np.ndarray]:
    """One step with the chunks' tokens' M-RoPE positions rope [3, tokens]; each chunk's logits rows."""
    key, batch, rows = pack_batch(chunks, model.buckets, model.page_sizes)
    rope_positions = np.zeros((3, batch.token_ids.shape[0]), np.int32)  # [3, T]: padding rows at 0
    rope_positions[:, :rope.shape[1]] = rope
    batch = model.step.place_inputs(stack_replicas([dataclasses.replace(batch, rope_positions=rope_positions)]))
    logits, model.kv = model.step.forward(model.params, model.kv, batch, query_block=key.query_block)
    logits = np.asarray(jax.device_get(logits[0]), np.float64)
    return [logits[r] for r in rows]


def hf_logits(hf, ids: list[int], position_ids: np.ndarray | None) -> np.ndarray:
    """[n, V] float64 over the whole sequence in one forward; position_ids [3, n] or None."""
    with torch.no_grad():
        pos = None if position_ids is None else torch.from_numpy(position_ids.astype(np.int64))[:, None]  # [3, 1, n]
        return hf(torch.tensor([ids]), position_ids=pos).logits[0].double().numpy()


def test_decoder_with_mrope_positions_equals_transformers(saved):
    """Prefill with the prompt's (t, h, w) positions (image tokens embedded as their id: the
    positions are what is tested), then two decodes at p + delta; every row against transformers
    given the same positions, and M-RoPE's effect checked to be far above the tolerance."""
    folder, hf = saved
    ids = prompt()
    n = len(ids)
    positions, delta = mrope_positions(ids, GRIDS, image_token_id=IMAGE, spatial_merge_size=MERGE)
    tail = [17, 41]  # two decoded tokens
    every = np.concatenate([positions, decode_rope_positions(n, len(tail), delta)], axis=1)  # [3, n + 2]
    truth = hf_logits(hf, ids + tail, every)

    model = PagedModel(folder, page_size=4)
    assert model.config.model_type == "qwen2_5_vl" and model.config.mrope_section == (2, 3, 3)
    pages = model.allocate(n + len(tail))
    got = [run_with_rope(model, [SequenceChunk(ids, 0, pages, list(range(n)))], positions)[0]]
    for i, token in enumerate(tail):
        got += run_with_rope(model, [SequenceChunk([token], n + i, pages, [0])], decode_rope_positions(n + i, 1, delta))
    got = np.concatenate(got)  # [n + 2, V]
    np.testing.assert_array_less(np.abs(got - truth).max(), TOL)
    plain = np.broadcast_to(np.arange(n + len(tail)), (3, n + len(tail)))  # 1-D positions give other logits
    assert np.abs(hf_logits(hf, ids + tail, plain) - truth).max() > 100 * TOL


def test_model_language_model_names_and_model_visual_names_load_the_same(saved, tmp_path):
    """transformers saves the decoder as model.* and the tower as visual.*; the module names
    (model.language_model.*, model.visual.*) load to the same parameters."""
    folder, _ = saved
    tensors = {}
    for f in folder.glob("*.safetensors"):
        for name, array in load_file(f).items():
            renamed = ("model.language_model." + name[len("model."):] if name.startswith("model.")
                       else "model." + name if name.startswith("visual.") else name)
            tensors[renamed] = array
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours, theirs = PagedModel(folder, page_size=4).params, PagedModel(tmp_path, page_size=4).params
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_text_only_prompt_through_llm_equals_transformers(saved):
    """On text alone transformers' M-RoPE positions are 1-D (position_ids left out equals arange in
    all three), and so are ours: LLM(folder) without rope_positions gives its greedy tokens and
    their logprobs."""
    folder, hf = saved
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 250, 11)]
    arange = np.broadcast_to(np.arange(len(ids)), (3, len(ids)))
    np.testing.assert_array_equal(hf_logits(hf, ids, None), hf_logits(hf, ids, arange))

    llm = LLM(str(folder), max_model_len=32, page_size=4, max_num_seqs=2, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    assert list(out.token_ids) == want
    full = ids + want
    logprobs = torch.log_softmax(torch.from_numpy(hf_logits(hf, full, None)), dim=-1).numpy()  # [n + 5, V]
    got = np.array([out.logprobs[i][t].logprob for i, t in enumerate(want)])
    np.testing.assert_array_less(np.abs(got - logprobs[np.arange(len(ids) - 1, len(full) - 1), want]).max(), TOL)

"""Images in the engine, Qwen3-VL: a tiny random Qwen3VLForConditionalGeneration saved with its image
processor and a tokenizer holding the vision tokens; a prompt with two images of different sizes
runs through `LLM` with interleaved M-RoPE positions, chunked prefill cutting through the image
tokens, and the deepstack features added to the image tokens after the first decoder layers; its
prompt logprobs and greedy continuation equal transformers float32. Nothing is downloaded."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.models.mrope import section_of_frequency
from tiny_models import byte_tokenizer

PATCH, MERGE = 4, 2
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=8 * 8,
                                    max_pixels=48 * 48)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, transformers model): 3 decoder layers, deepstack after vision layers 0 and 1 (added
    after decoder layers 0 and 1)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, pad, end, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tok), rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH,
                           temporal_patch_size=2, spatial_merge_size=MERGE, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # scaled so the logits are far from uniform
            if "visual" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (2.0 if "embed" in name or "lm_head" in name else 1.0))
    folder = tmp_path_factory.mktemp("qwen3_vl_images")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    processor().save_pretrained(folder)
    return folder, model


def picture(seed: int, size) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def hf_inputs(model, ids: list[int], images: list) -> dict:
    """transformers' inputs: mm_token_type_ids marks the image tokens (without it the positions are 1-D)."""
    pixels = processor()(images=images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(input_ids == model.config.image_token_id).int())


def hf_logits(model, ids: list[int], images: list) -> torch.Tensor:
    with torch.no_grad():
        return model(**hf_inputs(model, ids, images)).logits[0].float()


def test_config_reads_qwen3_decoder_with_interleaved_mrope(qwen):
    folder, _ = qwen
    config = ModelConfig.from_json_file(folder / "config.json")
    assert (config.model_type, config.qk_norm, config.qkv_bias, config.num_layers) == ("qwen3_vl", True, False, 3)
    assert config.mrope_section == (2, 3, 3) and config.mrope_interleaved
    assert section_of_frequency(config.mrope_section, config.mrope_interleaved).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    released = {"model_type": "qwen3_vl", "tie_word_embeddings": True,  # Qwen3-VL-4B's text_config, in short
                "text_config": {"head_dim": 128, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                                "num_hidden_layers": 36, "num_key_value_heads": 8, "vocab_size": 151936,
                                "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                                 "rope_type": "default"}, "rope_theta": 5000000}}
    config = ModelConfig.from_hf_dict(released)
    assert (config.mrope_section, config.rope_theta, config.tie_word_embeddings) == ((24, 20, 20), 5e6, True)


def test_images_of_two_sizes_with_chunks_and_deepstack_equal_transformers(qwen):
    """Prompt logprobs of a prompt with two images of different sizes (15 and 12 image tokens), in
    16-token chunks that cut through both (each piece with its deepstack rows), and the greedy
    continuation with its logprobs, equal transformers'. Deepstack matters: without it
    transformers' logits move by more than the tolerance."""
    folder, model = qwen
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, num_pages=40, page_size=4)
    images = [picture(1, (40, 24)), picture(2, (20, 50))]
    prompt = {"prompt": "Left <|vision_start|><|image_pad|><|vision_end|> right <|vision_start|><|image_pad|>"
                        "<|vision_end|> same?", "multi_modal_data": {"image": images}}
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, logprobs=0),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    pad = model.config.image_token_id
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, np.equal(ids, pad).astype(int), 0])))[::2]
    assert list(runs) == [15, 12]
    logits = hf_logits(model, ids, images)
    logprobs = torch.log_softmax(logits, -1).numpy()
    ours = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    np.testing.assert_allclose(ours, logprobs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)

    with torch.no_grad():
        hf = model.generate(**hf_inputs(model, ids, images), max_new_tokens=4, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    want = hf.sequences[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == want
    hf_lp = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(hf.logits, want)]
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)], hf_lp, atol=1e-4)

    mergers = model.model.visual.deepstack_merger_list
    saved = [(m.linear_fc2.weight.clone(), m.linear_fc2.bias.clone()) for m in mergers]
    try:
        with torch.no_grad():
            for m in mergers:  # deepstack features of zero
                m.linear_fc2.weight.zero_()
                m.linear_fc2.bias.zero_()
        assert (hf_logits(model, ids, images) - logits).abs().max() > 1e-3
    finally:
        with torch.no_grad():
            for m, (w, b) in zip(mergers, saved):
                m.linear_fc2.weight.copy_(w)
                m.linear_fc2.bias.copy_(b)

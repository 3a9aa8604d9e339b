"""Images in the engine, Qwen2.5-VL (issue 39): a tiny random Qwen2_5_VLForConditionalGeneration
saved with its image processor and a tokenizer holding the vision tokens; prompts with images of
different sizes (dynamic resolution: a different number of image tokens each) run through `LLM`
with M-RoPE positions, chunked prefill cutting through the image tokens (Qwen attends causally),
and their prompt logprobs and greedy continuations equal transformers float32. Nothing is
downloaded."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

from jaxinfer import LLM, SamplingParams
from tiny_models import byte_tokenizer

PATCH, MERGE = 4, 2
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Qwen2.5-VL's chat template, shortened: each image part becomes <|vision_start|><|image_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=8 * 8,
                                    max_pixels=48 * 48)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, transformers model)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    start, pad, end, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH,
                           temporal_patch_size=2, spatial_merge_size=MERGE, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # scaled so the logits are far from uniform
            if "visual" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (2.0 if "embed" in name or "lm_head" in name else 1.0))
    folder = tmp_path_factory.mktemp("qwen2_5_vl_images")
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


def test_images_of_two_sizes_with_chunks_through_them_equal_transformers(qwen):
    """Prompt logprobs of a prompt with two images of different sizes (15 and 12 image tokens), in
    16-token chunks that cut through both, and the greedy continuation (decode tokens at M-RoPE
    position p + delta) with its logprobs, equal transformers'."""
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
    logprobs = torch.log_softmax(hf_logits(model, ids, images), -1).numpy()
    ours = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    np.testing.assert_allclose(ours, logprobs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)

    with torch.no_grad():
        hf = model.generate(**hf_inputs(model, ids, images), max_new_tokens=4, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    want = hf.sequences[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == want
    hf_lp = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(hf.logits, want)]
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want)], hf_lp, atol=1e-4)


def test_chat_with_an_image_part(qwen):
    """llm.chat with an image part: the template's placeholder expands to the image's merged
    patches (grid 1 x 6 x 10 -> 15 tokens), and the text after it equals transformers'."""
    folder, model = qwen
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2, num_pages=40, page_size=4)
    image = picture(3, (40, 24))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    out = llm.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids.count(model.config.image_token_id) == 15
    logprobs = torch.log_softmax(hf_logits(model, ids, [image]), -1).numpy()
    ours = np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    np.testing.assert_allclose(ours, logprobs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)

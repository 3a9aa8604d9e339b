"""Images in the engine, Gemma 3 (issue 39): a tiny random Gemma3ForConditionalGeneration saved
with its image processor and a tokenizer holding the image tokens; prompts with images run through
`LLM` and their text tokens' prompt logprobs equal transformers float32 (image tokens attend to
their whole image both ways, as transformers' token_type_ids mask says); one and two images,
batched, chunked, prefix-cached; a corrupt image fails only its request. Nothing is downloaded."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.multimodal import PromptImage, prompt_key_ids
from tiny_models import byte_tokenizer

IMAGE = 32  # pixels per side, patches of 4: 8 x 8, pooled to 2 x 2 = 4 image tokens
TOKENS_PER_IMAGE = 4
# a Gemma-like chat template: content lists with image parts become <start_of_image>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tokenizer():
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<image_soft_token>", "<end_of_image>",
                                                          "<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, transformers model)."""
    tok = tokenizer()
    boi, soft, eoi = tok.convert_tokens_to_ids(["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
    config = Gemma3Config(
        text_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=len(tok), sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256),
        vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                           image_size=IMAGE, patch_size=4, vision_use_head=False),
        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("gemma3_images")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}).save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def llm(gemma3):
    return LLM(str(gemma3[0]), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, num_pages=48, page_size=4)


def picture(seed: int, size=(40, 24)) -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def hf_prompt_logprobs(model, ids: list[int], images: list) -> np.ndarray:
    """transformers' log-probability of each prompt token after the first, float32 [n - 1]."""
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
    pixel_values = torch.tensor(processor(images=images, return_tensors="np")["pixel_values"]) if images else None
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == model.config.image_token_index).long()
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixel_values, token_type_ids=token_type_ids).logits[0].float()
    logprobs = torch.log_softmax(logits, -1).numpy()
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def our_prompt_logprobs(out) -> np.ndarray:
    ids = out.prompt_token_ids
    return np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def test_one_and_two_images_equal_transformers_with_images_whole_in_a_chunk(llm, gemma3):
    """Prompt logprobs with one image, and with two images of other sizes in one prompt, equal
    transformers' (the step's 16-token budget cuts the prompts into chunks, never inside an image:
    the first prompt's image tokens lie at 13..16, across the first chunk's end)."""
    _, model = gemma3
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    one = {"prompt": "0123456789<start_of_image>What is in the picture?", "multi_modal_data": {"image": picture(1)}}
    two = {"prompt": "A: <start_of_image> and B: <start_of_image>, the same?",
           "multi_modal_data": {"image": [picture(2, (64, 64)), picture(3, (20, 50))]}}
    outs = llm.generate([one, two], params, use_tqdm=False)
    soft = model.config.image_token_index
    assert outs[0].prompt_token_ids.index(soft) == 13
    for out, images in zip(outs, ([picture(1)], [picture(2, (64, 64)), picture(3, (20, 50))])):
        ids = out.prompt_token_ids
        assert sum(t == soft for t in ids) == TOKENS_PER_IMAGE * len(images)
        np.testing.assert_allclose(our_prompt_logprobs(out), hf_prompt_logprobs(model, ids, images), atol=1e-4)
    # each alone equals both batched
    alone = llm.generate(two, params, use_tqdm=False)[0]
    np.testing.assert_allclose(our_prompt_logprobs(alone), our_prompt_logprobs(outs[1]), atol=1e-5)


def test_the_image_is_attended_both_ways(llm, gemma3):
    """The mask matters: causal attention over the image tokens gives other logprobs (so the test
    above can fail), and the text model with images equals transformers only with token_type_ids."""
    _, model = gemma3
    out = llm.generate({"prompt": "<start_of_image>Hi", "multi_modal_data": {"image": picture(4)}},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
    pixel_values = torch.tensor(processor(images=[picture(4)], return_tensors="np")["pixel_values"])
    with torch.no_grad():
        causal = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values,
                       token_type_ids=torch.zeros(1, len(ids), dtype=torch.long)).logits[0].float()
    causal = torch.log_softmax(causal, -1).numpy()[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(our_prompt_logprobs(out) - causal).max() > 1e-3


def test_chat_with_image_parts_and_prefix_caching_keys_on_the_image(llm, gemma3):
    """llm.chat takes OpenAI image_url parts (a data: URI) and the template places the image; a
    second identical chat hits the prefix cache past the image, the same text with another image
    does not (its pages are keyed by the image's hash), and every answer equals transformers (a
    request with prompt logprobs computes its whole prompt: those are the uncached truth)."""
    _, model = gemma3

    def data_uri(image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        import base64
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def chat(image):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                             {"type": "text", "text": "Describe it in two words."}]}]

    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    bm = llm.engine.block_manager
    first = llm.chat(chat(picture(5)), params, use_tqdm=False)[0]
    hits = bm.stats.hits
    again = llm.chat(chat(picture(5)), greedy, use_tqdm=False)[0]
    hits_same, hits = bm.stats.hits - hits, bm.stats.hits
    other_cached = llm.chat(chat(picture(6)), greedy, use_tqdm=False)[0]
    hits_other = bm.stats.hits - hits
    other = llm.chat(chat(picture(6)), params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other_cached.outputs[0].token_ids == other.outputs[0].token_ids
    ids = first.prompt_token_ids
    image_end = max(i for i, t in enumerate(ids) if t == model.config.image_token_index) + 1
    assert hits_same >= image_end // 4  # every full page through the image came from the cache
    assert hits_other < ids.index(model.config.image_token_index) // 4 + 1  # none past the image's first page
    for out, image in ((first, picture(5)), (other, picture(6))):
        np.testing.assert_allclose(our_prompt_logprobs(out), hf_prompt_logprobs(model, out.prompt_token_ids, [image]),
                                   atol=1e-4)


def test_a_corrupt_image_fails_its_request_alone(llm):
    """A corrupt image or a placeholder count that does not match is a ValueError naming it; the
    engine runs the next request."""
    with pytest.raises(ValueError, match=r"prompt 0: image 0 \(7 bytes\): not a decodable image"):
        llm.generate({"prompt": "<start_of_image>x", "multi_modal_data": {"image": b"garbage"}}, use_tqdm=False)
    with pytest.raises(ValueError, match="holds 0 image placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": picture(7)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="remote image URL on 'example.com' refused"):
        llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": "https://example.com/a.png"}},
                     use_tqdm=False)
    out = llm.generate({"prompt": "<start_of_image>ok", "multi_modal_data": {"image": picture(7)}},
                       SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_prefix_keys_of_image_tokens_come_from_the_image_hash():
    """An image's tokens (256 for Gemma 3) stand as distinct negative ids derived from its hash in
    the prefix-cache keys: the same image gives the same ids, another image other ids."""
    a, b = (PromptImage(bytes([i]) * 16, 2, 256, np.zeros(1)) for i in (1, 2))
    ids = prompt_key_ids([5] * 260, [a])
    assert ids[:2] == [5, 5] and ids[258:] == [5, 5] and len(ids) == 260
    assert all(k < 0 for k in ids[2:258]) and len(set(ids[2:258])) == 256
    assert a.key_ids() == ids[2:258] and not set(b.key_ids()) & set(a.key_ids())


def test_warmup_compiles_the_image_steps(gemma3):
    """With warmup, each prefill bucket's image variant (and the encoder) is compiled at start-up:
    a prompt with an image then compiles no step program."""
    llm = LLM(str(gemma3[0]), max_model_len=64, max_num_batched_tokens=8, max_num_seqs=2, num_pages=24, page_size=4,
              warmup=True, progress=False)
    compiles = llm.engine.runner.step_fn.num_compiles
    out = llm.generate({"prompt": "0123456789<start_of_image>ab", "multi_modal_data": {"image": picture(8)}},
                       SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.engine.runner.step_fn.num_compiles == compiles

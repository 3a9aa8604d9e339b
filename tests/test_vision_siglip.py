"""Gemma 3's vision encoder (jaxinfer.models.vision) against transformers: a tiny random
Gemma3ForConditionalGeneration saved with its image processor, loaded by our loader, compared in
float32 with `get_image_features(...).pooler_output`; the preprocessing of each kind of image input
against transformers' Gemma3ImageProcessor (numpy / Pillow); corrupt images named in the error.
Nothing is downloaded."""

from __future__ import annotations

import base64
import io
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

from checkpoints_conv import CheckpointError
from jaxinfer.models.vision import (
    Gemma3VisionConfig,
    image_features,
    load_gemma3_vision,
    load_image_processor,
    preprocess_images,
)

IMAGE = 32  # pixels per side; patches of 4: an 8 x 8 grid, pooled 4 x 4 -> 2 x 2 = 4 soft tokens
TEXT_HIDDEN = 48


def tiny_config() -> Gemma3Config:
    return Gemma3Config(
        text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=300, sliding_window=16),
        vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE, patch_size=4, vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, transformers model): random weights, every vision and projector parameter (norms
    and biases included, which start at 0 or 1) perturbed so that each one shows in the output."""
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}).save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def encoder(saved):
    return load_gemma3_vision(saved[0])


def two_images():
    """Two images of different content, sizes and modes."""
    rng = np.random.default_rng(1)
    a = PIL.Image.fromarray(rng.integers(0, 256, (45, 37, 3), dtype=np.uint8))
    b = PIL.Image.fromarray(np.linspace(0, 255, 20 * 50).reshape(20, 50).astype(np.uint8), mode="L")
    return a, b


def reference(model, pixel_values: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.get_image_features(torch.from_numpy(pixel_values)).pooler_output.numpy()


@pytest.mark.parametrize("count", [1, 2])
def test_image_features_match_transformers(saved, encoder, count):
    folder, model = saved
    pixel_values = preprocess_images(list(two_images()[:count]), load_image_processor(folder))
    assert pixel_values.shape == (count, 3, IMAGE, IMAGE)
    ref = reference(model, pixel_values)
    ours = np.asarray(image_features(encoder, pixel_values))
    assert ours.shape == ref.shape == (count, 4, TEXT_HIDDEN)
    assert np.abs(ref).max() > 0.1  # not a degenerate (all-zero) comparison
    assert np.abs(ours - ref).max() < 1e-4
    if count == 2:  # the two images differ, and each is encoded on its own
        assert np.abs(ours[0] - ours[1]).max() > 0.1
        assert np.abs(ours[1:] - np.asarray(image_features(encoder, pixel_values[1:]))).max() < 1e-5


def test_older_names_load_the_same(saved, encoder, tmp_path):
    """transformers 4 and the released checkpoints: model.vision_tower.vision_model.* (or without
    model.), multi_modal_projector.* under model."""
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {("model." + n.replace("vision_tower.", "vision_tower.vision_model.", 1)
                if n.startswith(("vision_tower.", "multi_modal_projector.")) else n): t for n, t in tensors.items()}
    assert "model.vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight" in renamed
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    other = load_gemma3_vision(tmp_path)
    pixel_values = np.random.default_rng(2).uniform(-1, 1, (1, 3, IMAGE, IMAGE)).astype(np.float32)
    assert np.array_equal(np.asarray(image_features(other, pixel_values)), np.asarray(image_features(encoder, pixel_values)))


def test_missing_or_misshapen_tensors_are_named(saved, tmp_path):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["vision_tower.encoder.layers.1.self_attn.k_proj.bias"]
    tensors["multi_modal_projector.mm_input_projection_weight"] = np.zeros((32, 7), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as e:
        load_gemma3_vision(tmp_path)
    assert "vision_tower.encoder.layers.1.self_attn.k_proj.bias" in str(e.value)
    assert "'multi_modal_projector.mm_input_projection_weight' has shape [32, 7], expected [32, 48]" in str(e.value)


def test_config_from_a_released_config():
    """google/gemma-3-4b-it's config.json leaves SigLIP's defaults out."""
    hf = {"model_type": "gemma3", "mm_tokens_per_image": 256, "text_config": {"hidden_size": 2560},
          "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                            "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    cfg = Gemma3VisionConfig.from_hf_dict(hf)
    assert (cfg.vision.grid, cfg.tokens_per_side, cfg.pool, cfg.vision.head_dim) == (64, 16, 4, 72)
    assert (cfg.vision.hidden_act, cfg.vision.layer_norm_eps, cfg.text_hidden_size) == ("gelu_pytorch_tanh", 1e-6, 2560)
    with pytest.raises(ValueError, match="mm_tokens_per_image=200"):
        Gemma3VisionConfig.from_hf_dict({**hf, "mm_tokens_per_image": 200})
    with pytest.raises(ValueError, match="hidden_act"):
        Gemma3VisionConfig.from_hf_dict({**hf, "vision_config": {**hf["vision_config"], "hidden_act": "relu"}})


def png_bytes(image: PIL.Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_preprocessing_matches_transformers(saved, tmp_path):
    folder, _ = saved
    processor = load_image_processor(folder)
    truth = Gemma3ImageProcessorPil.from_pretrained(folder)
    pil, gray = two_images()
    array = np.asarray(pil)  # [H, W, 3] uint8
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(pil)).decode()
    path = tmp_path / "image.png"
    path.write_bytes(png_bytes(gray))
    expected = truth(images=[pil, array, pil, gray, gray], return_tensors="np")["pixel_values"]
    got = preprocess_images([pil, array, uri, path, png_bytes(gray)], processor)
    assert got.dtype == np.float32 and got.shape == (5, 3, IMAGE, IMAGE)
    assert np.array_equal(got, expected)
    assert np.array_equal(preprocess_images(str(path), processor), expected[3:4])  # one image, as a str path


def test_corrupt_images_raise_naming_the_image(saved, tmp_path):
    processor = load_image_processor(saved[0])
    good = two_images()[0]
    broken = tmp_path / "broken.png"
    broken.write_bytes(png_bytes(good)[:60])  # a PNG header, then the data cut off
    with pytest.raises(ValueError, match=r"image 1 \(file '.*broken\.png'\): not a decodable image"):
        preprocess_images([good, broken], processor)
    with pytest.raises(ValueError, match=r"image 0 \(data URI \(image/png;base64, .*\): not a decodable image"):
        preprocess_images(["data:image/png;base64," + base64.b64encode(b"not an image at all").decode()], processor)
    with pytest.raises(ValueError, match=r"image 0 \(data URI .*invalid base64"):
        preprocess_images(["data:image/png;base64,@@@"], processor)
    with pytest.raises(ValueError, match=r"image 2 \(file 'missing\.jpg'\): no such file"):
        preprocess_images([good, good, "missing.jpg"], processor)
    with pytest.raises(ValueError, match=r"image 0 \(numpy array \[2, 5, 5, 3\] uint8\)"):
        preprocess_images([np.zeros((2, 5, 5, 3), np.uint8)], processor)
    with pytest.raises(ValueError, match="URLs are not fetched"):
        preprocess_images(["https://example.com/cat.png"], processor)


def test_pixel_values_of_the_wrong_size_are_refused(encoder):
    with pytest.raises(ValueError, match=r"pixel_values of shape \(1, 3, 16, 16\)"):
        image_features(encoder, np.zeros((1, 3, 16, 16), np.float32))

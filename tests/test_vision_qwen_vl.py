"""Qwen2.5-VL's vision tower (jaxinfer.models.vision.qwen_vl) against transformers: a tiny random
Qwen2_5_VLForConditionalGeneration saved with its image processor, loaded by our loader, compared in
float32 with `get_image_features` / `visual` on one image and on two of different sizes (windows cut
short at the edges, one full-attention layer); the preprocessing against transformers'
Qwen2VLImageProcessor (numpy / Pillow); missing or misshapen tensors named. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

from checkpoints_conv import CheckpointError
from jaxinfer.models.vision.qwen_vl import (
    Qwen2_5_VisionConfig,
    grid_indices,
    image_features,
    load_qwen2_5_vl_vision,
    load_qwen_image_processor,
    preprocess_qwen_images,
)

TEXT_HIDDEN = 48
PATCH, MERGE = 4, 2  # resize factor 8 pixels; window_size 16: windows of 2 x 2 merged tokens


def tiny_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH,
                           temporal_patch_size=2, spatial_merge_size=MERGE, window_size=16,
                           out_hidden_size=TEXT_HIDDEN, fullatt_block_indexes=[2]),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, transformers model): random weights, every vision parameter (norms and biases
    included, which start at 1 or 0) perturbed so that each one shows in the output."""
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("qwen2_5_vl_vision")
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                             min_pixels=8 * 8, max_pixels=48 * 48).save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def encoder(saved):
    return load_qwen2_5_vl_vision(saved[0])


def two_images():
    """Two images of different content, sizes (grids 10 x 8 and 4 x 12 patches) and modes."""
    rng = np.random.default_rng(1)
    a = PIL.Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    b = PIL.Image.fromarray(np.linspace(0, 255, 16 * 47).reshape(16, 47).astype(np.uint8), mode="L")
    return a, b


def reference(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        pv, grid = torch.from_numpy(pixel_values), torch.from_numpy(grid_thw)
        split = model.get_image_features(pv, grid).pooler_output
        whole = model.model.visual(pv, grid_thw=grid).pooler_output.numpy()
    assert np.array_equal(np.concatenate([s.numpy() for s in split]), whole)
    return whole


@pytest.mark.parametrize("count", [1, 2])
def test_image_features_match_transformers(saved, encoder, count):
    folder, model = saved
    pixel_values, grid_thw = preprocess_qwen_images(list(two_images()[:count]), load_qwen_image_processor(folder))
    assert grid_thw.tolist() == [[1, 10, 8], [1, 4, 12]][:count]
    assert pixel_values.shape == (int(grid_thw.prod(-1).sum()), 3 * 2 * PATCH * PATCH)
    ref = reference(model, pixel_values, grid_thw)
    ours = np.asarray(image_features(encoder, pixel_values, grid_thw))
    assert ours.shape == ref.shape == (int(grid_thw.prod(-1).sum()) // MERGE**2, TEXT_HIDDEN)
    assert np.abs(ref).max() > 0.1  # not a degenerate (all-zero) comparison
    print(f"{count} image(s): max abs diff {np.abs(ours - ref).max():.2e}")
    assert np.abs(ours - ref).max() < 1e-4
    if count == 2:  # each image is encoded on its own
        alone = np.asarray(image_features(encoder, pixel_values[80:], grid_thw[1:]))
        assert np.abs(ours[20:] - alone).max() < 1e-5


def test_windows_matter(saved, encoder):
    """A 10 x 8 grid has 3 x 2 windows, the last row cut short, and the tower's output differs from
    one where every layer attends to the whole image."""
    cfg = encoder.cfg
    perm, inverse, rows, cols, window, frame = grid_indices(cfg, 1, 10, 8)
    assert np.bincount(window).tolist() == [16, 16, 16, 16, 8, 8]
    assert sorted(perm.tolist()) == list(range(80)) and (frame == 0).all()
    pixel_values, grid_thw = preprocess_qwen_images([two_images()[0]], load_qwen_image_processor(saved[0]))
    ours = np.asarray(image_features(encoder, pixel_values, grid_thw))
    encoder.cfg = dataclasses.replace(cfg, fullatt_block_indexes=tuple(range(cfg.depth)))
    try:
        full = np.asarray(image_features(encoder, pixel_values, grid_thw))
    finally:
        encoder.cfg = cfg
    assert np.abs(ours - full).max() > 1e-3


def test_model_prefixed_names_load_the_same(saved, encoder, tmp_path):
    """model.visual.* (the in-memory names) loads like the saved visual.*."""
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    assert "visual.blocks.3.mlp.down_proj.weight" in tensors
    renamed = {("model." + n if n.startswith("visual.") else n): t for n, t in tensors.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    other = load_qwen2_5_vl_vision(tmp_path)
    rng = np.random.default_rng(2)
    pixel_values, grid = rng.normal(size=(32, 96)).astype(np.float32), np.array([[1, 4, 8]])
    assert np.array_equal(np.asarray(image_features(other, pixel_values, grid)),
                          np.asarray(image_features(encoder, pixel_values, grid)))


def test_missing_or_misshapen_tensors_are_named(saved, tmp_path):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["visual.blocks.1.attn.qkv.bias"]
    tensors["visual.merger.mlp.2.weight"] = np.zeros((7, 128), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as e:
        load_qwen2_5_vl_vision(tmp_path)
    assert "visual.blocks.1.attn.qkv.bias" in str(e.value)
    assert "'visual.merger.mlp.2.weight' has shape [7, 128], expected [48, 128]" in str(e.value)


def test_config_from_a_released_config():
    """Qwen/Qwen2.5-VL-7B-Instruct's vision_config: `in_chans`, old model_type, no rope_parameters."""
    hf = {"model_type": "qwen2_5_vl", "hidden_size": 3584,
          "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                            "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                            "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                            "temporal_patch_size": 2, "model_type": "qwen2_5_vl"}}
    cfg = Qwen2_5_VisionConfig.from_hf_dict(hf)
    assert (cfg.head_dim, cfg.window_tokens, cfg.patch_dim, cfg.rope_theta) == (80, 4, 1176, 10000.0)
    with pytest.raises(ValueError, match="fullatt_block_indexes"):
        Qwen2_5_VisionConfig.from_hf_dict({**hf, "vision_config": {**hf["vision_config"], "fullatt_block_indexes": [32]}})
    with pytest.raises(ValueError, match="hidden_act"):
        Qwen2_5_VisionConfig.from_hf_dict({**hf, "vision_config": {**hf["vision_config"], "hidden_act": "relu"}})


def test_preprocessing_matches_transformers(saved):
    folder, _ = saved
    truth = Qwen2VLImageProcessorPil.from_pretrained(folder)
    pil, gray = two_images()
    expected = truth(images=[pil, np.asarray(pil), gray], return_tensors="np")
    pixel_values, grid_thw = preprocess_qwen_images([pil, np.asarray(pil), gray], load_qwen_image_processor(folder))
    assert pixel_values.dtype == np.float32 and grid_thw.dtype == np.int64
    assert np.array_equal(pixel_values, expected["pixel_values"])
    assert np.array_equal(grid_thw, expected["image_grid_thw"])
    with pytest.raises(ValueError, match=r"image 1 \(file 'missing\.jpg'\): no such file"):
        preprocess_qwen_images([pil, "missing.jpg"], load_qwen_image_processor(folder))

"""Qwen3-VL's vision tower (jaxinfer.models.vision.qwen3_vl) against transformers: a tiny random
Qwen3VLForConditionalGeneration saved with its image processor, loaded by our loader, compared in
float32 with `get_image_features` / `visual` (the merged features and the deepstack features) on
one image and on two of different sizes (the learned position grid resampled to each); missing or
misshapen tensors named. Nothing is downloaded."""

from __future__ import annotations

import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from checkpoints_conv import CheckpointError
from jaxinfer.models.vision.qwen3_vl import Qwen3VisionConfig, image_features, load_qwen3_vl_vision
from jaxinfer.models.vision.qwen_vl import load_qwen_image_processor, preprocess_qwen_images

TEXT_HIDDEN = 48
PATCH, MERGE = 4, 2


def tiny_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(
        text_config=dict(hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=24, vocab_size=300,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0}),
        # deepstack listed out of layer order: transformers gives the features in layer order, each
        # through its own merger
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH,
                           temporal_patch_size=2, spatial_merge_size=MERGE, out_hidden_size=TEXT_HIDDEN,
                           num_position_embeddings=25, deepstack_visual_indexes=[2, 0]),
        image_token_id=299, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, transformers model): every vision parameter (norms and biases included) perturbed."""
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("qwen3_vl_vision")
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                             min_pixels=8 * 8, max_pixels=48 * 48).save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def encoder(saved):
    return load_qwen3_vl_vision(saved[0])


def two_images():
    """Two images of different content, sizes (grids 10 x 8 and 4 x 12 patches) and modes."""
    rng = np.random.default_rng(1)
    a = PIL.Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    b = PIL.Image.fromarray(np.linspace(0, 255, 16 * 47).reshape(16, 47).astype(np.uint8), mode="L")
    return a, b


def reference(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        pv, grid = torch.from_numpy(pixel_values), torch.from_numpy(grid_thw)
        split = model.get_image_features(pv, grid)
        whole = model.model.visual(pv, grid_thw=grid)
    rows, deepstack = whole.pooler_output.numpy(), np.stack([d.numpy() for d in whole.deepstack_features])
    assert np.array_equal(np.concatenate([s.numpy() for s in split.pooler_output]), rows)
    assert np.array_equal(np.stack([np.concatenate([s.numpy() for s in d]) for d in split.deepstack_features]), deepstack)
    return rows, deepstack


@pytest.mark.parametrize("count", [1, 2])
def test_image_features_and_deepstack_match_transformers(saved, encoder, count):
    folder, model = saved
    pixel_values, grid_thw = preprocess_qwen_images(list(two_images()[:count]), load_qwen_image_processor(folder))
    assert grid_thw.tolist() == [[1, 10, 8], [1, 4, 12]][:count]
    ref, ref_deepstack = reference(model, pixel_values, grid_thw)
    ours, deepstack = (np.asarray(a) for a in image_features(encoder, pixel_values, grid_thw))
    n = int(grid_thw.prod(-1).sum()) // MERGE**2
    assert ours.shape == ref.shape == (n, TEXT_HIDDEN) and deepstack.shape == ref_deepstack.shape == (2, n, TEXT_HIDDEN)
    assert min(np.abs(ref).max(), np.abs(ref_deepstack).max()) > 0.1  # not a degenerate comparison
    assert np.abs(ref_deepstack[0] - ref_deepstack[1]).max() > 0.1
    print(f"{count} image(s): max abs diff {np.abs(ours - ref).max():.2e}, "
          f"deepstack {np.abs(deepstack - ref_deepstack).max():.2e}")
    assert np.abs(ours - ref).max() < 1e-5
    assert np.abs(deepstack - ref_deepstack).max() < 1e-5
    if count == 2:  # each image is encoded on its own
        alone, alone_deepstack = image_features(encoder, pixel_values[80:], grid_thw[1:])
        assert np.abs(ours[20:] - np.asarray(alone)).max() < 1e-5
        assert np.abs(deepstack[:, 20:] - np.asarray(alone_deepstack)).max() < 1e-5


def test_missing_or_misshapen_tensors_are_named(saved, tmp_path):
    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.visual.deepstack_merger_list.1.norm.bias"]
    tensors["model.visual.pos_embed.weight"] = np.zeros((16, 32), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as e:
        load_qwen3_vl_vision(tmp_path)
    assert "visual.deepstack_merger_list.1.norm.bias" in str(e.value)
    assert "'model.visual.pos_embed.weight' has shape [16, 32], expected [25, 32]" in str(e.value)


def test_config_from_a_released_config():
    """Qwen/Qwen3-VL-4B-Instruct's vision_config (model_type "qwen3_vl", no rope_parameters)."""
    hf = {"model_type": "qwen3_vl",
          "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                            "hidden_size": 1024, "in_channels": 3, "intermediate_size": 4096, "model_type": "qwen3_vl",
                            "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16,
                            "spatial_merge_size": 2, "temporal_patch_size": 2}}
    cfg = Qwen3VisionConfig.from_hf_dict(hf)
    assert (cfg.head_dim, cfg.grid_side, cfg.patch_dim, cfg.deepstack_visual_indexes) == (64, 48, 1536, (5, 11, 17))
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        Qwen3VisionConfig.from_hf_dict({**hf, "vision_config": {**hf["vision_config"], "deepstack_visual_indexes": [24]}})

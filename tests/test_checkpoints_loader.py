"""checkpoints_conv.loader: HF names -> stacked jaxinfer params, and every error it must report."""

import re

import ml_dtypes
import numpy as np
import pytest

from checkpoints_conv import CheckpointError, load_params, map_hf_name

H, I, V, HQ, HKV, D, L = 8, 12, 16, 2, 1, 4, 2
BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(1)


QKV_PARTS = (("q", HQ * D), ("k", HKV * D), ("v", HKV * D))
GATE_UP_PARTS = (("gate", I), ("up", I))
QKV = HQ * D + 2 * HKV * D


def make_spec(*, bias=False, tied=False, dtype=np.float32):
    """A jaxinfer-style spec (what the model would pass) for a tiny Llama/Qwen2: Q/K/V and
    gate/up fused, each fused param with its parts."""
    spec = {
        "embed": (V, H),
        "layers.attn_norm": (L, H),
        "layers.qkv_proj": (L, H, QKV),
        "layers.o_proj": (L, HQ * D, H),
        "layers.mlp_norm": (L, H),
        "layers.gate_up_proj": (L, H, 2 * I),
        "layers.down_proj": (L, I, H),
        "final_norm": (H,),
    }
    if bias:
        spec["layers.qkv_bias"] = (L, QKV)
    if not tied:
        spec["lm_head"] = (H, V)
    parts = {"layers.qkv_proj": QKV_PARTS, "layers.qkv_bias": QKV_PARTS, "layers.gate_up_proj": GATE_UP_PARTS}
    return {name: (shape, np.dtype(dtype), parts.get(name, ())) for name, shape in spec.items()}


def make_hf_tensors(*, bias=False, lm_head=True):
    """HF-named random tensors ([out, in] linear weights) matching make_spec."""
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if lm_head:
        t["lm_head.weight"] = (V, H)
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HQ * D, H),
            p + "self_attn.k_proj.weight": (HKV * D, H),
            p + "self_attn.v_proj.weight": (HKV * D, H),
            p + "self_attn.o_proj.weight": (H, HQ * D),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            p + "self_attn.rotary_emb.inv_freq": (D // 2,),  # a buffer some checkpoints carry
        }
        if bias:
            t |= {p + "self_attn.q_proj.bias": (HQ * D,), p + "self_attn.k_proj.bias": (HKV * D,), p + "self_attn.v_proj.bias": (HKV * D,)}
    return {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


def load(tensors, spec, model_type="llama"):
    return load_params(tensors.items() if isinstance(tensors, dict) else tensors, spec,
                       model_type=model_type, source="ckpt", progress=False)


def test_maps_transposes_stacks_and_casts():
    hf = make_hf_tensors(bias=True)
    params = load(hf, make_spec(bias=True, dtype=BF16), model_type="qwen2")
    assert {k: v.shape for k, v in params.items()} == {k: s for k, (s, *_) in make_spec(bias=True).items()}
    assert all(v.dtype == BF16 for v in params.values())
    np.testing.assert_array_equal(params["embed"], hf["model.embed_tokens.weight"].astype(BF16))
    np.testing.assert_array_equal(params["lm_head"], hf["lm_head.weight"].T.astype(BF16))
    for i in range(L):
        np.testing.assert_array_equal(params["layers.down_proj"][i], hf[f"model.layers.{i}.mlp.down_proj.weight"].T.astype(BF16))
        np.testing.assert_array_equal(params["layers.mlp_norm"][i], hf[f"model.layers.{i}.post_attention_layernorm.weight"].astype(BF16))


def test_fused_params_hold_their_parts_side_by_side():
    """layers.qkv_proj = [q | k | v] and layers.gate_up_proj = [gate | up] on the last axis, each
    part transposed like an unfused weight; the fused bias likewise."""
    hf = make_hf_tensors(bias=True)
    params = load(hf, make_spec(bias=True), model_type="qwen2")
    for i in range(L):
        attn = lambda name, kind="weight": hf[f"model.layers.{i}.self_attn.{name}.{kind}"]  # noqa: E731
        mlp = lambda name: hf[f"model.layers.{i}.mlp.{name}.weight"]  # noqa: E731
        want_qkv = np.concatenate([attn("q_proj").T, attn("k_proj").T, attn("v_proj").T], axis=1)
        np.testing.assert_array_equal(params["layers.qkv_proj"][i], want_qkv)
        want_bias = np.concatenate([attn("q_proj", "bias"), attn("k_proj", "bias"), attn("v_proj", "bias")])
        np.testing.assert_array_equal(params["layers.qkv_bias"][i], want_bias)
        np.testing.assert_array_equal(params["layers.gate_up_proj"][i], np.concatenate([mlp("gate_proj").T, mlp("up_proj").T], axis=1))


def test_bf16_source_into_f32_spec_is_exact():
    hf = {k: v.astype(BF16) for k, v in make_hf_tensors().items()}
    params = load(hf, make_spec(dtype=np.float32))
    np.testing.assert_array_equal(params["layers.gate_up_proj"][1][:, I:], hf["model.layers.1.mlp.up_proj.weight"].T.astype(np.float32))


def test_tied_spec_drops_a_stored_lm_head():
    params = load(make_hf_tensors(lm_head=True), make_spec(tied=True))
    assert "lm_head" not in params


def test_qwen3_qk_norms_map():
    assert map_hf_name("qwen3", "model.layers.5.self_attn.k_norm.weight") == ("layers.k_norm", 5, False, None, None)
    assert map_hf_name("qwen3", "model.layers.5.self_attn.k_proj.weight") == ("layers.qkv_proj", 5, True, "k", None)
    assert map_hf_name("llama", "lm_head.weight") == ("lm_head", None, True, None, None)
    assert map_hf_name("llama", "model.layers.0.mlp.experts.0.w1.weight") is None


def test_expert_weights_map_to_a_layer_and_an_expert():
    """Mixtral names its experts w1 (gate), w3 (up), w2 (down); the Qwen MoEs gate/up/down_proj."""
    assert map_hf_name("mixtral", "model.layers.3.block_sparse_moe.experts.7.w3.weight") == ("layers.experts_gate_up", 3, True, "up", 7)
    assert map_hf_name("mixtral", "model.layers.3.block_sparse_moe.gate.weight") == ("layers.router", 3, True, None, None)
    assert map_hf_name("qwen3_moe", "model.layers.0.mlp.experts.12.down_proj.weight") == ("layers.experts_down", 0, True, None, 12)
    assert map_hf_name("qwen2_moe", "model.layers.1.mlp.shared_expert.up_proj.weight") == ("layers.shared_gate_up", 1, True, "up", None)
    assert map_hf_name("qwen3_moe", "model.layers.1.mlp.gate_proj.weight") is None  # no dense MLP in an MoE layer


def test_missing_tensor_names_it_and_its_param_and_layer():
    hf = make_hf_tensors()
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=re.escape("'model.layers.1.mlp.up_proj.weight' (param 'layers.gate_up_proj' layer 1 part 'up')")):
        load(hf, make_spec())


def test_spec_parts_must_cover_the_fused_axis():
    spec = make_spec()
    spec["layers.gate_up_proj"] = ((L, H, 2 * I), np.dtype(np.float32), (("gate", I), ("up", I - 1)))
    with pytest.raises(ValueError, match=r"'layers\.gate_up_proj': parts .* do not add up to its last dim"):
        load(make_hf_tensors(), spec)


def test_missing_untied_lm_head():
    with pytest.raises(CheckpointError, match=re.escape("'lm_head.weight' (param 'lm_head')")):
        load(make_hf_tensors(lm_head=False), make_spec())


def test_unexpected_tensor_is_named():
    hf = make_hf_tensors() | {"model.layers.0.mlp.experts.0.w1.weight": np.zeros((I, H), np.float32)}
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor 'model.layers.0.mlp.experts.0.w1.weight'")):
        load(hf, make_spec())


def test_bias_for_a_model_without_biases_is_unexpected():
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias'.*'layers\.qkv_bias'"):
        load(make_hf_tensors(bias=True), make_spec(bias=False))


def test_wrong_shape_gives_both_shapes():
    hf = make_hf_tensors()
    hf["model.layers.0.self_attn.k_proj.weight"] = np.zeros((HQ * D, H), np.float32)
    expected = f"'model.layers.0.self_attn.k_proj.weight' has shape {(HQ * D, H)}, expected {(HKV * D, H)} (param 'layers.qkv_proj' layer 0 part 'k'"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        load(hf, make_spec())


def test_slot_filled_twice():
    hf = list(make_hf_tensors().items())
    hf.append(("model.layers.0.input_layernorm.weight", np.ones(H, np.float32)))
    with pytest.raises(CheckpointError, match=r"'layers\.attn_norm' layer 0, which 'model\.layers\.0\.input_layernorm\.weight' already filled"):
        load(iter(hf), make_spec())


def test_layer_index_beyond_the_spec():
    hf = make_hf_tensors() | {f"model.layers.{L}.input_layernorm.weight": np.ones(H, np.float32)}
    with pytest.raises(CheckpointError, match=rf"layer {L}, but param 'layers\.attn_norm' has {L} layers"):
        load(hf, make_spec())


def test_unknown_model_type():
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'"):
        load(make_hf_tensors(), make_spec(), model_type="gpt2")

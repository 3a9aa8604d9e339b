"""GGUF files of Qwen3-Next ("qwen3next"), Qwen3.5 ("qwen35") and Qwen3.5-MoE ("qwen35moe"), written
from tiny random HF models the way llama.cpp's convert_hf_to_gguf.py writes them, load into the HF
model's config and parameters and give transformers' float32 logits.

`llama_cpp_hybrid_gguf` below re-implements the converter's rules for these three architectures
(Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel / Qwen3_5MoeTextModel), apart from
jaxinfer's reader: the tensors are renamed by the gguf package's own tensor map (not ours), and

- ssm_a = -exp(A_log); dt_bias renamed dt_proj.bias (ssm_dt.bias); the convolution [C, 1, K] squeezed;
- every `*norm.weight` but the Gated DeltaNet's own (linear_attn.norm) stored as 1 + w;
- Qwen3-Next's in_proj_qkvz ([q_g | k_g | v_g | z_g] per key head g) split into attn_qkv (q | k | v
  over all heads) and attn_gate (z) — or, as llama.cpp files older than PR #18683, kept whole (ssm_in);
- Qwen3.5 (fewer key heads than value heads): the value heads of in_proj_qkv's v rows, in_proj_z,
  in_proj_b / in_proj_a, A_log, dt_bias, the convolution's v channels and out_proj's columns moved
  from grouped by key head to tiled order;
- each layer's experts stacked [E, out, in] (or, --fuse-gate-up-exps, gate and up as one [E, 2I, H]);
- the metadata of TextModel / Qwen2MoeModel / Qwen3NextModel.set_gguf_parameters: ssm.conv_kernel,
  ssm.state_size, ssm.group_count, ssm.time_step_rank, ssm.inner_size, full_attention_interval,
  rope.dimension_count (the rotated share of head_dim), and Qwen3.5's rope.dimension_sections; a
  Qwen3.5 file with its multi-token-prediction block after the model's layers (nextn_predict_layers).

The tiny models have 2 key heads serving 4 value heads, so the reorder is not the identity.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize

from checkpoints_conv import CheckpointError, GgufSource, open_checkpoint, read_gguf_config
from jaxinfer.runtime.loading import read_config, resolve_model

Q8_0 = GGMLQuantizationType.Q8_0


# ---- the converter's rules, applied to an HF state dict -----------------------------------------

def _heads(hp: dict) -> tuple[int, int, int, int]:
    return hp["linear_num_key_heads"], hp["linear_num_value_heads"], hp["linear_key_head_dim"], hp["linear_value_head_dim"]


def grouped_to_tiled(a: np.ndarray, axis: int, hp: dict, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value head g r + j (key head g's j-th) -> j hk + g."""
    hk, hv, _, _ = _heads(hp)
    moved = np.moveaxis(a, axis, 0)
    tiled = moved.reshape(hk, hv // hk, head_dim, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(tiled, 0, axis)


def _reorder_value_heads(name: str, a: np.ndarray, hp: dict) -> np.ndarray:
    hk, hv, dk, dv = _heads(hp)
    qk = 2 * hk * dk
    if ".in_proj_qkv." in name:
        return np.concatenate([a[:qk], grouped_to_tiled(a[qk:], 0, hp, dv)])
    if ".in_proj_z." in name:
        return grouped_to_tiled(a, 0, hp, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return grouped_to_tiled(a, 0, hp, 1)
    if ".conv1d" in name:
        a = a.squeeze()
        return np.concatenate([a[:qk], grouped_to_tiled(a[qk:], 0, hp, dv)])
    if ".out_proj." in name:
        return grouped_to_tiled(a, 1, hp, dv)
    return a


def converter_tensors(state: dict[str, np.ndarray], hp: dict, arch: str, *, legacy_ssm_in: bool = False):
    """(HF-style name for the tensor map, array), or (GGUF name, array) for the ones the converter
    names itself, as Qwen3NextModel.modify_tensors (and for Qwen3.5 the V-head reorder before it)
    hands them on; each layer's experts merged as Qwen2MoeModel merges them."""
    hk, hv, dk, dv = _heads(hp)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, a in state.items():
        if arch != "qwen3next" and hk != hv and "linear_attn." in name:
            a = _reorder_value_heads(name, a, hp)
        if name.endswith(".A_log"):
            a = -np.exp(a)
        elif name.endswith(".dt_bias"):
            name = name[: -len(".dt_bias")] + ".dt_proj.bias"
        elif "conv1d" in name:
            a = a.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            a = a + np.float32(1)
        if "in_proj_qkvz.weight" in name and not legacy_ssm_in:
            layer = int(name.split(".")[2])
            H, r = a.shape[1], hv // hk
            grouped = a.T.reshape(H, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = np.split(grouped, np.cumsum([dk, dk, r * dv]), axis=-1)
            yield f"blk.{layer}.attn_qkv.weight", np.concatenate([x.reshape(H, -1) for x in (q, k, v)], -1).T
            yield f"blk.{layer}.attn_gate.weight", z.reshape(H, -1).T
            continue
        parts = name.split(".")
        if len(parts) == 8 and parts[4] == "experts":  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
            experts.setdefault(f"model.layers.{parts[2]}.mlp.experts.{parts[6]}.weight", {})[int(parts[5])] = a
            continue
        yield name, a
    for name, by_expert in experts.items():
        yield name, np.stack([by_expert[e] for e in sorted(by_expert)])


def llama_cpp_hybrid_gguf(path, hf_dir, arch: str, *, qtype=None, legacy_ssm_in=False, fuse_gate_up_exps=False,
                          mtp_layer=False, recurrent_layers=False, fuse_attention_qkv=False, drop=(), reshape=None):
    """The GGUF llama.cpp's converter makes of the HF folder `hf_dir` (module docstring); `qtype`:
    every matrix whose rows are whole blocks stored in it (but the convolution and the router, which
    llama.cpp keeps in F32). Test switches: `mtp_layer` appends a multi-token-prediction block as
    Qwen3.5's converter writes it (a few of its tensors), `recurrent_layers` writes
    attention.recurrent_layers, `fuse_attention_qkv` stores each full-attention layer's attn_q, attn_k
    and attn_v as one attn_qkv, `drop` leaves GGUF tensors out, `reshape` ({name: shape}) stores one
    misshapen."""
    from safetensors.numpy import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    n, heads, head_dim = hp["num_hidden_layers"], hp["num_attention_heads"], hp["head_dim"]
    blocks = n + (1 if mtp_layer else 0)
    w = GGUFWriter(path, arch)
    w.add_block_count(blocks)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_experts"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    hk, hv, dk, dv = _heads(hp)
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch != "qwen3next":  # _Qwen35MRopeMixin, _Qwen35MtpMixin
        w.add_rope_dimension_sections([11, 11, 10, 0])
        if mtp_layer:
            w.add_nextn_predict_layers(1)
    if recurrent_layers:
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in hp["layer_types"]])
    w.add_token_list([f"<{i}>" for i in range(hp["vocab_size"])])
    w.add_bos_token_id(hp["bos_token_id"])
    w.add_eos_token_id(hp["eos_token_id"])

    names = get_tensor_name_map({v: k for k, v in MODEL_ARCH_NAMES.items()}[arch], blocks)
    out: list[tuple[str, np.ndarray]] = []
    gate_up: dict[str, np.ndarray] = {}
    for name, a in converter_tensors(load_file(hf_dir / "model.safetensors"), hp, arch, legacy_ssm_in=legacy_ssm_in):
        gguf_name = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if fuse_gate_up_exps and gguf_name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            layer = gguf_name.split(".")[1]
            gate_up[gguf_name.split(".")[2]] = a
            if len(gate_up) == 2:  # ModelBase.modify_tensors: cat([gate, up], dim=1)
                out.append((f"blk.{layer}.ffn_gate_up_exps.weight", np.concatenate([gate_up["ffn_gate_exps"], gate_up["ffn_up_exps"]], 1)))
                gate_up.clear()
            continue
        out.append((gguf_name, a))
    if fuse_attention_qkv:
        parts = {name: a for name, a in out if name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v")}
        out = [(name, a) for name, a in out if name not in parts]
        for i in sorted({int(name.split(".")[1]) for name in parts}):
            out.append((f"blk.{i}.attn_qkv.weight", np.concatenate([parts[f"blk.{i}.attn_{x}.weight"] for x in "qkv"])))
    if mtp_layer:  # (not run: the reader hides it)
        H = hp["hidden_size"]
        out += [(f"blk.{n}.attn_norm.weight", np.ones(H, np.float32)), (f"blk.{n}.nextn.eh_proj.weight", np.zeros((H, 2 * H), np.float32)),
                (f"blk.{n}.attn_q.weight", np.zeros((2 * heads * head_dim, H), np.float32))]
    for gguf_name, a in out:
        if gguf_name in drop:
            continue
        a = np.ascontiguousarray(a, np.float32)
        if reshape and gguf_name in reshape:
            a = np.zeros(reshape[gguf_name], np.float32)
        if qtype is not None and _quantized_in_file(gguf_name, a):
            w.add_tensor(gguf_name, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantized_in_file(gguf_name: str, a: np.ndarray) -> bool:
    return a.ndim >= 2 and a.shape[-1] % 32 == 0 and not gguf_name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight"))


def round_like_q8_0(model, hp: dict) -> None:
    """Give the HF model the values a Q8_0 file of it holds (so that its logits are the file's):
    each matrix the writer quantizes, through Q8_0 and back in the order it is stored in (out_proj's
    columns tiled: Q8_0 blocks run along them; the other reorders move whole rows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            a = p.detach().numpy()
            if a.ndim != 2 or a.shape[1] % 32 or name.endswith("mlp.gate.weight"):
                continue
            tiled = name.endswith("linear_attn.out_proj.weight") and hp["linear_num_key_heads"] != hp["linear_num_value_heads"]
            stored = grouped_to_tiled(a, 1, hp, hp["linear_value_head_dim"]) if tiled else a
            back = dequantize(quantize(np.ascontiguousarray(stored, np.float32), Q8_0), Q8_0)
            if tiled:  # (tiled -> grouped: the inverse permutation)
                perm = grouped_to_tiled(np.arange(a.shape[1])[None], 1, hp, hp["linear_value_head_dim"])[0]
                back = back[:, np.argsort(perm)]
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))


# ---- the files ----------------------------------------------------------------------------------

# family -> (GGUF architecture, tiny-model overrides, writer switches)
CASES = {
    "qwen3_next": ("qwen3next", {}, {}),
    # Q8_0 matrices, a multi-token-prediction block after the model's layers
    "qwen3_5_text": ("qwen35", {}, {"qtype": Q8_0, "mtp_layer": True}),
    # no dense width (a Qwen3.5-MoE config.json has no intermediate_size), experts' gate and up fused
    "qwen3_5_moe_text": ("qwen35moe", {"intermediate_size": None}, {"fuse_gate_up_exps": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(family, HF folder, GGUF file, HF model with the file's values)."""
    from tiny_models import build_hf_model

    family = request.param
    arch, overrides, switches = CASES[family]
    directory = tmp_path_factory.mktemp(family)
    model = build_hf_model(family, **overrides)
    if switches.get("qtype") == Q8_0:
        round_like_q8_0(model, model.config.to_dict())
    model.save_pretrained(directory / "hf")
    config = json.loads((directory / "hf" / "config.json").read_text())
    (directory / "hf" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None or k not in overrides}))
    return family, directory / "hf", llama_cpp_hybrid_gguf(directory / f"{family}.gguf", directory / "hf", arch, **switches), model


def _flat_params(path):
    from flax import nnx

    from jaxinfer.runtime.loading import load_params
    from jaxinfer.tree import nested_to_flat

    source = resolve_model(path)
    _, state = load_params(source, read_config(source), jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    return {k: np.asarray(v) for k, v in nested_to_flat(nnx.to_pure_dict(state)).items()}


def assert_same_params(gguf_path, hf_dir, family: str) -> None:
    """Every parameter equal; the norms and A_log to float32's rounding of the 1 + w and -exp(A_log)
    the file stores."""
    ours, theirs = _flat_params(gguf_path), _flat_params(hf_dir)
    assert set(ours) == set(theirs)
    for name, want in theirs.items():
        if name.endswith(("norm", "lin_a_log")) and not name.endswith("lin_norm"):
            np.testing.assert_allclose(ours[name], want, rtol=1e-6, atol=1e-7, err_msg=f"{family}: {name}")
        else:
            np.testing.assert_array_equal(ours[name], want, err_msg=f"{family}: {name}")


def test_config_equals_the_hf_folders(case):
    family, hf_dir, gguf_path, _ = case
    ours, theirs = read_config(resolve_model(gguf_path)), read_config(resolve_model(hf_dir))
    assert ours == theirs
    assert ours.has_linear_layers and ours.linear_value_heads == 4 and ours.rotary_dim == 4


def test_params_equal_the_hf_folders(case):
    """The Gated DeltaNet's projections, convolution, decay and gate back in HF's value-head order,
    the norms shifted back, the fused tensors split, the MTP block left out."""
    family, hf_dir, gguf_path, _ = case
    assert_same_params(gguf_path, hf_dir, family)


def test_logprobs_match_transformers(case):
    """Our log-softmax at every position of a 20-token prompt, prefilled in two chunks (the second
    continuing the first's recurrent states), against transformers' float32 on the same weights."""
    from test_model_parity import TOL, PagedModel, hf_logprobs

    from jaxinfer.ops.batch import SequenceChunk

    _, _, gguf_path, hf = case
    model = PagedModel(gguf_path, page_size=16)
    tokens = list(map(int, np.random.default_rng(3).integers(3, 259, 20)))
    pages = model.allocate(len(tokens))
    [first] = model.run([SequenceChunk(tokens[:12], 0, pages, list(range(12)), state_slot=1)])
    [second] = model.run([SequenceChunk(tokens[12:], 12, pages, list(range(8)), state_slot=1)])
    want = hf_logprobs(hf, tokens, [len(tokens)])
    assert np.std(want) > 0.1
    np.testing.assert_array_less(np.abs(np.concatenate([first, second]) - want).max(), TOL)


@pytest.mark.parametrize("case", ["qwen3_5_text"], indirect=True)
def test_the_q8_0_file_keeps_the_plain_matrices_as_blocks(case):
    """What is stored as read (o_proj, the MLP, the embedding, the LM head) is offered as its Q8_0
    grid and runs so (the logprobs above); what the reader reorders or rebuilds (the value heads,
    A_log) is read as floats only. The MTP block is not listed."""
    from flax import nnx

    from jaxinfer.ops.quantization import QuantizedWeight
    from jaxinfer.runtime.loading import load_params
    from jaxinfer.tree import nested_to_flat

    _, _, gguf_path, _ = case
    source = GgufSource(gguf_path, read_gguf_config(gguf_path))
    stored = set(source.quantized())
    assert {"model.layers.3.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight",
            "lm_head.weight", "model.layers.3.self_attn.q_proj.weight"} <= stored
    assert not stored & {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
                         "model.layers.0.linear_attn.out_proj.weight", "model.layers.0.linear_attn.in_proj_b.weight"}
    assert not any(name.startswith(("model.layers.4.", "blk.4.")) for name, _ in source.listing())
    resolved = resolve_model(gguf_path)
    _, state = load_params(resolved, read_config(resolved), jnp.float32, jnp.float32, progress=False)
    flat = nested_to_flat(nnx.to_pure_dict(state))
    assert {name for name, w in flat.items() if isinstance(w, QuantizedWeight)} == {
        "embed", "lm_head", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj"}


# ---- older and rarer layouts, errors (no compiles) ----------------------------------------------

@pytest.fixture(scope="module")
def qwen3_next_folder(tmp_path_factory):
    from tiny_models import save_hf_model

    directory = tmp_path_factory.mktemp("qwen3_next_variants")
    save_hf_model("qwen3_next", directory / "hf")
    return directory


def test_older_and_rarer_layouts(qwen3_next_folder):
    """Files converted before llama.cpp split in_proj_qkvz (PR #18683) keep it whole as ssm_in; the
    layer kinds may come as attention.recurrent_layers flags instead of full_attention_interval; a
    full-attention layer's q (query and gate), k and v may be one attn_qkv (llama.cpp's
    create_tensor_qkv takes either)."""
    path = llama_cpp_hybrid_gguf(qwen3_next_folder / "legacy.gguf", qwen3_next_folder / "hf", "qwen3next",
                                 legacy_ssm_in=True, recurrent_layers=True, fuse_attention_qkv=True)
    config = read_gguf_config(path)
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and "full_attention_interval" not in config
    names = {name for name, _ in GgufSource(path, config).listing()}
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names and "model.layers.3.self_attn.k_proj.weight" in names
    assert read_config(resolve_model(path)) == read_config(resolve_model(qwen3_next_folder / "hf"))
    assert_same_params(path, qwen3_next_folder / "hf", "qwen3_next (ssm_in, attn_qkv)")


def test_a_misshapen_or_missing_tensor_is_named(qwen3_next_folder, tmp_path):
    hf = qwen3_next_folder / "hf"
    bad = llama_cpp_hybrid_gguf(tmp_path / "bad.gguf", hf, "qwen3next", reshape={"blk.1.ssm_out.weight": (64, 16)})
    with pytest.raises(CheckpointError, match=r"bad\.gguf: tensor 'blk\.1\.ssm_out\.weight' has shape \(64, 16\), expected \(64, 32\)"):
        open_checkpoint(bad, read_gguf_config(bad))
    gone = llama_cpp_hybrid_gguf(tmp_path / "gone.gguf", hf, "qwen3next", drop=("blk.2.ssm_a", "blk.0.attn_gate.weight"))
    with pytest.raises(CheckpointError, match=r"gone\.gguf: 2 tensor\(s\) missing: blk\.0\.attn_gate\.weight, blk\.2\.ssm_a"):
        open_checkpoint(gone, read_gguf_config(gone))


def test_missing_gated_deltanet_metadata_is_named(qwen3_next_folder, tmp_path):
    path = llama_cpp_hybrid_gguf(tmp_path / "ok.gguf", qwen3_next_folder / "hf", "qwen3next")
    data = path.read_bytes().replace(b"qwen3next.ssm.group_count", b"qwen3next.ssm.group_cXunt")
    (tmp_path / "nokey.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match=r"nokey\.gguf: GGUF metadata lacks qwen3next\.ssm\.group_count"):
        read_gguf_config(tmp_path / "nokey.gguf")

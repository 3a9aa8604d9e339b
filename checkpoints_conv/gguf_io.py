"""Read GGUF files (llama.cpp): an HF-style config dict and HF-named float32 tensors.

Named `gguf_io` so it never shadows the `gguf` package it uses. The header is parsed by
`gguf_file`; dequantization is `gguf.quants.dequantize`.

GGUF stores a [out, in] matrix with dims (in, out); `gguf_file` reverses them, so the
arrays here already have HF's layout ([out, in] for linear weights, [V, H] for token_embd).
llama.cpp's converter permuted the rows of attn_q / attn_k of llama-arch models (interleaved
rotary pairs); `unpermute_qk` undoes that, as transformers' GGUF loader does, so the tensors equal
the original HF ones up to quantization error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.gguf_file import GgufHeader, GgufTensorInfo, read_gguf_header, read_tensor_bytes
from checkpoints_conv.gguf_grid import GRID_TYPES, TYPE_LAYOUTS, read_grid
from checkpoints_conv.name_maps import GgufArch, gguf_arch
from checkpoints_conv.quantized import Grid, QuantLayout
from checkpoints_conv.tensor_source import TensorSource

Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4})

# llama.cpp writes llama3-style rope scaling as per-dimension factors in this tensor: not a model
# parameter, read into the config (rope_type "freq_factors") instead.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _architecture(header: GgufHeader) -> tuple[str, GgufArch]:
    arch_name = header.metadata.get("general.architecture")
    if arch_name is None:
        raise CheckpointError(f"{header.path}: GGUF metadata has no general.architecture")
    return arch_name, gguf_arch(arch_name, source=str(header.path))


def _rope_parameters(meta: dict, arch_name: str) -> dict:
    """HF `rope_parameters` from `{arch}.rope.freq_base` and `{arch}.rope.scaling.*`."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get(f"{arch_name}.rope.freq_base", 10000.0))}
    scaling_type = meta.get(f"{arch_name}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        params["rope_type"] = scaling_type
        renames = {
            "factor": ("factor", _f32),
            "original_context_length": ("original_max_position_embeddings", int),
            "attn_factor": ("attention_factor", _f32),
            "yarn_beta_fast": ("beta_fast", _f32),
            "yarn_beta_slow": ("beta_slow", _f32),
        }
        for gguf_key, (hf_key, convert) in renames.items():
            value = meta.get(f"{arch_name}.rope.scaling.{gguf_key}")
            if value is not None:
                params[hf_key] = convert(value)
    return params


def read_gguf_config(path: str | Path) -> dict:
    """An HF config.json-style dict from the metadata of the GGUF file at `path`.

    Keys: model_type, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, intermediate_size, vocab_size, rms_norm_eps, rope_parameters {rope_type, rope_theta,
    ...}, max_position_embeddings, tie_word_embeddings, bos_token_id, eos_token_id (the last two
    only when the file has them); for gemma2 / gemma3 / olmo2 files also what their HF config says
    of the attention kinds (layer_types, sliding_window, rope_parameters per layer type,
    query_pre_attn_scalar, soft caps, hidden_activation: `_FAMILY_CONFIG`). Unknown
    general.architecture -> CheckpointError naming it.
    """
    header = read_gguf_header(path)
    meta = header.metadata
    arch_name, arch = _architecture(header)

    def need(key: str) -> Any:
        value = meta.get(f"{arch_name}.{key}")
        if value is None:
            raise CheckpointError(f"{header.path}: GGUF metadata lacks {arch_name}.{key}")
        return value

    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = meta.get(f"{arch_name}.attention.key_length") or meta.get(f"{arch_name}.rope.dimension_count")
    first = lambda value: value[0] if isinstance(value, list) else value  # noqa: E731  (per-layer arrays: Gemma 4's family reads them)
    tensor_names = {t.name for t in header.tensors}
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(first(meta.get(f"{arch_name}.attention.head_count_kv", n_heads))),
        "head_dim": int(head_dim) if head_dim else hidden // n_heads,
        "intermediate_size": int(first(need("feed_forward_length"))),
        "vocab_size": _vocab_size(header, arch_name),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope_parameters(meta, arch_name),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if meta.get(f"{arch_name}.expert_count"):
        config.update(_moe_config(meta, arch_name, arch))
    family = _FAMILY_CONFIG.get(arch_name)
    if family is not None:
        try:
            config.update(family(meta, arch_name, config, tensor_names, header))
        except CheckpointError as e:
            raise CheckpointError(f"{header.path}: {e}") from None
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    if ROPE_FREQS_TENSOR in tensor_names and arch_name != "gemma4":  # llama3-style scaling as llama.cpp stores it: a divisor per frequency
        info = next(t for t in header.tensors if t.name == ROPE_FREQS_TENSOR)
        factors = _dequantize(header.path, info).reshape(-1)
        config["rope_parameters"] = {"rope_type": "freq_factors", "rope_theta": config["rope_parameters"]["rope_theta"],
                                     "freq_factors": [float(f) for f in factors]}
    return config


# ---- the families with per-layer attention kinds ---------------------------------------------
#
# What llama.cpp's converter (convert_hf_to_gguf.py) writes for them, and what llama.cpp
# (src/llama-model.cpp, src/models/*.cpp) assumes when a key is absent; the HF keys below are the
# ones ModelConfig.from_hf_dict reads. Neither side stores Gemma's query_pre_attn_scalar or
# activation: llama.cpp derives the first from the shapes (see _gemma_scalar) and hard-codes GeGLU
# with the tanh GELU for Gemma, SwiGLU for OLMo.


def _layer_types(meta: dict, arch_name: str, n_layers: int, period: int) -> list[str]:
    """Per-layer HF layer_types from `{arch}.attention.sliding_window_pattern`: one flag per layer
    (True: sliding), or a period p, of which each p-th layer is global (llama.cpp's
    `set_swa_pattern`: layer i slides when i % p < p - 1; p = 0: every layer slides). Absent:
    `period`, the arch's own default in llama.cpp."""
    pattern = meta.get(f"{arch_name}.attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise CheckpointError(f"GGUF metadata {arch_name}.attention.sliding_window_pattern has {len(pattern)} "
                                  f"flags for {n_layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        p = int(pattern)
        sliding = [p == 0 or i % p < p - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _rope_per_layer_type(meta: dict, arch_name: str, local_theta: float) -> dict:
    """HF rope_parameters per layer type: the global layers' from `{arch}.rope.*`, the sliding
    layers' plain RoPE at `{arch}.rope.freq_base_swa` (else `local_theta`). llama.cpp runs the
    sliding layers of gemma3 and olmo2 (OLMo 3) without the global layers' scaling."""
    theta = meta.get(f"{arch_name}.rope.freq_base_swa", local_theta)
    return {"full_attention": _rope_parameters(meta, arch_name),
            "sliding_attention": {"rope_type": "default", "rope_theta": _f32(theta)}}


def _gemma_scalar(config: dict, n_layers_27b: int) -> int:
    """query_pre_attn_scalar as llama.cpp computes it (it is not in the file): hidden_size /
    num_attention_heads for the 27B model (told by its layer count), else head_dim, which is what
    every released Gemma 2 / 3 config.json says."""
    if config["num_hidden_layers"] == n_layers_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma2_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """Gemma 2: sliding and global layers alternating (llama.cpp's default period 2), the window
    4096 and the soft caps 50 / 30 unless the file says otherwise (llama.cpp's defaults, which are
    Gemma 2's own); one RoPE for every layer (the converter writes no rope.freq_base: 10000)."""
    n = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(config, n_layers_27b=46),
        "sliding_window": int(meta.get(f"{arch_name}.attention.sliding_window", 4096)),
        "layer_types": _layer_types(meta, arch_name, n, period=2),
        "attn_logit_softcapping": _f32(meta.get(f"{arch_name}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _f32(meta.get(f"{arch_name}.final_logit_softcapping", 30.0)),
    }


def _gemma3_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """Gemma 3 (text): five sliding layers per global one (llama.cpp's default period 6; the
    converter writes no pattern), the sliding layers on their own RoPE base (10000 unless
    `rope.freq_base_swa` says otherwise, as in llama.cpp) without the global layers' scaling; no
    sliding window in the file: every layer global. No attention soft cap."""
    n = config["num_hidden_layers"]
    window = meta.get(f"{arch_name}.attention.sliding_window")
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(config, n_layers_27b=62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": _optional_f32(meta.get(f"{arch_name}.final_logit_softcapping")),
    }
    if window:
        out.update(sliding_window=int(window), layer_types=_layer_types(meta, arch_name, n, period=6),
                   rope_parameters=_rope_per_layer_type(meta, arch_name, 10000.0))
    else:
        out.update(sliding_window=None, layer_types=["full_attention"] * n)
    return out


def _olmo2_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """OLMo 2, or OLMo 3 when the file has a sliding window (llama.cpp writes both as "olmo2"):
    then three sliding layers per global one unless the pattern says otherwise, the sliding layers
    on plain RoPE (the global ones may have YaRN)."""
    window = meta.get(f"{arch_name}.attention.sliding_window")
    if not window:
        return {}
    return {
        "model_type": "olmo3",
        "sliding_window": int(window),
        "layer_types": _layer_types(meta, arch_name, config["num_hidden_layers"], period=4),
        "rope_parameters": _rope_per_layer_type(meta, arch_name, config["rope_parameters"]["rope_theta"]),
    }


def _moe_config(meta: dict, arch_name: str, arch: GgufArch) -> dict:
    """A mixture of experts' HF keys from `{arch}.expert_*`: the expert count and width, the k
    picked, a shared expert's width; whether the k weights are renormalised is llama.cpp's choice
    per architecture (Mixtral and Qwen3-MoE yes, Qwen2-MoE no, GPT-OSS a softmax over the k)."""
    experts = int(meta[f"{arch_name}.expert_count"])
    out: dict[str, Any] = {"model_type": arch.moe_model_type or arch.model_type, "num_local_experts": experts,
                           "num_experts": experts, "num_experts_per_tok": int(meta[f"{arch_name}.expert_used_count"])}
    width = meta.get(f"{arch_name}.expert_feed_forward_length")
    if width is not None and out["model_type"] in ("mixtral", "gpt_oss", "minimax_m2"):  # an expert as wide as intermediate_size
        out["intermediate_size"] = int(width)
    elif width is not None:
        out["moe_intermediate_size"] = int(width)
    shared = meta.get(f"{arch_name}.expert_shared_feed_forward_length")
    if shared is not None:
        out["shared_expert_intermediate_size"] = int(shared)
    if out["model_type"] in ("qwen2_moe", "qwen3_moe"):
        out["norm_topk_prob"] = bool(meta.get(f"{arch_name}.expert_weights_norm", out["model_type"] == "qwen3_moe"))
    return out


def _gpt_oss_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """GPT-OSS: a window on every other layer from the first (llama.cpp's fixed pattern), the
    experts' SwiGLU clamped at 7 (llama.cpp's constant), YaRN without truncated ramp bounds (the
    released config's)."""
    rope = dict(config["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope["truncate"] = False
    return {"sliding_window": int(meta.get(f"{arch_name}.attention.sliding_window", 128)), "swiglu_limit": 7.0,
            "attention_bias": True, "rope_parameters": rope}


def _rotary_factor(meta: dict, arch_name: str, config: dict) -> float:
    """The share of each head RoPE turns: `{arch}.rope.dimension_count` over head_dim."""
    return meta.get(f"{arch_name}.rope.dimension_count", config["head_dim"]) / config["head_dim"]


def _glm4_moe_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """GLM-4.5: block_count includes the multi-token-prediction layers (nextn_predict_layers) after
    the model's; dense first layers, sigmoid routing scaled by expert_weights_scale, shared experts;
    q/k norms and q/k/v biases when the file has them; partial RoPE from rope.dimension_count."""
    nextn = int(meta.get(f"{arch_name}.nextn_predict_layers", 0))
    return {"num_hidden_layers": config["num_hidden_layers"] - nextn, "num_nextn_predict_layers": nextn,
            "n_routed_experts": config["num_local_experts"], "n_shared_experts": int(meta.get(f"{arch_name}.expert_shared_count", 1)),
            "first_k_dense_replace": int(meta.get(f"{arch_name}.leading_dense_block_count", 0)),
            "n_group": int(meta.get(f"{arch_name}.expert_group_count", 1)),
            "topk_group": int(meta.get(f"{arch_name}.expert_group_used_count", 1)),
            "routed_scaling_factor": _f32(meta.get(f"{arch_name}.expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(meta.get(f"{arch_name}.expert_weights_norm", True)),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names, "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "partial_rotary_factor": _rotary_factor(meta, arch_name, config)}


def _minimax_m2_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """MiniMax-M2: sigmoid routing (the only gating it implements: another is refused), the rotary
    dims from rope.dimension_count."""
    gating = meta.get(f"{arch_name}.expert_gating_func", 2)
    if int(gating) != 2:
        raise CheckpointError(f"{arch_name}.expert_gating_func={gating}: only sigmoid (2) routing is supported for minimax-m2")
    return {"rotary_dim": int(meta.get(f"{arch_name}.rope.dimension_count", config["head_dim"]))}


def _llama4_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """Llama 4 as llama.cpp runs it: chunks of 8192 on three layers of four (the fourth NoPE), L2
    q/k norms except in the 128-expert model, experts every interleave_moe_layer_step-th layer;
    feed_forward_length is the dense layers' width (HF's intermediate_size_mlp), the experts' is
    expert_feed_forward_length (HF's intermediate_size)."""
    experts = config.get("num_local_experts", 0)
    return {"intermediate_size_mlp": config["intermediate_size"],
            "intermediate_size": int(meta.get(f"{arch_name}.expert_feed_forward_length", config["intermediate_size"])),
            "interleave_moe_layer_step": int(meta.get(f"{arch_name}.interleave_moe_layer_step", 1)),
            "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": experts != 128}


def _gemma4_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """Gemma 4 as Gemma4Model.set_gguf_parameters writes it: per-layer flags of the sliding layers,
    the global layers' head dim (key_length; the sliding ones' key_length_swa) and KV heads (a
    per-layer head_count_kv), the feed-forward width per layer (twice on the KV-shared layers of a
    double-wide MLP), the KV-shared layer count, the per-layer input width; values from the key
    projection where a global layer has no attn_v; "proportional" RoPE as a rope_freqs tensor of
    1 for each turned pair and 1e30 for the still ones (their share is partial_rotary_factor)."""
    n = config["num_hidden_layers"]
    types = _layer_types(meta, arch_name, n, period=6)
    types[-1] = "full_attention"
    first_global = types.index("full_attention")
    kv = meta.get(f"{arch_name}.attention.head_count_kv", config["num_key_value_heads"])
    kv = kv if isinstance(kv, list) else [kv] * n
    ff = meta.get(f"{arch_name}.feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * n
    shared = int(meta.get(f"{arch_name}.attention.shared_kv_layers", 0))
    global_dim = int(meta.get(f"{arch_name}.attention.key_length", config["head_dim"]))
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": int(meta.get(f"{arch_name}.attention.sliding_window", 512)),
        "head_dim": int(meta.get(f"{arch_name}.attention.key_length_swa", global_dim)),
        "global_head_dim": global_dim,
        "num_key_value_heads": int(kv[types.index("sliding_attention")] if "sliding_attention" in types else kv[0]),
        "num_global_key_value_heads": int(kv[first_global]),
        "attention_k_eq_v": f"blk.{first_global}.attn_v.weight" not in tensor_names,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": shared > 0 and int(ff[-1]) == 2 * int(ff[0]),
        "hidden_size_per_layer_input": int(meta.get(f"{arch_name}.embedding_length_per_layer_input", 0)),
        "final_logit_softcapping": _optional_f32(meta.get(f"{arch_name}.final_logit_softcapping")),
        "intermediate_size": int(ff[0]),
    }
    if out["hidden_size_per_layer_input"]:
        table = next(t for t in header.tensors if t.name == "per_layer_token_embd.weight")
        out["vocab_size_per_layer_input"] = int(table.shape[0])
    if config.get("num_experts"):
        out.update(enable_moe_block=True, top_k_experts=config["num_experts_per_tok"])
    rotated = 1.0
    if ROPE_FREQS_TENSOR in tensor_names:  # 1 for each pair the global layers turn, 1e30 for the others
        factors = _dequantize(header.path, next(t for t in header.tensors if t.name == ROPE_FREQS_TENSOR)).reshape(-1)
        rotated = float(np.count_nonzero(factors == 1.0)) / len(factors)
    full = _rope_parameters(meta, arch_name)
    out["rope_parameters"] = {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": rotated, "rope_theta": full["rope_theta"]},
        "sliding_attention": {"rope_type": "default", "rope_theta": _f32(meta.get(f"{arch_name}.rope.freq_base_swa", 10000.0))},
    }
    return out


_FAMILY_CONFIG = {"gemma2": _gemma2_config, "gemma3": _gemma3_config, "olmo2": _olmo2_config, "gpt-oss": _gpt_oss_config,
                  "glm4moe": _glm4_moe_config, "minimax-m2": _minimax_m2_config, "llama4": _llama4_config,
                  "gemma4": _gemma4_config}


def _optional_f32(value) -> float | None:
    return None if value is None else _f32(value)


def _vocab_size(header: GgufHeader, arch_name: str) -> int:
    """`{arch}.vocab_size`, else the number of `tokenizer.ggml.tokens`, else token_embd's rows."""
    value = header.metadata.get(f"{arch_name}.vocab_size")
    if value is not None:
        return int(value)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    for tensor in header.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[0])
    raise CheckpointError(f"{header.path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")


def unpermute_qk(weight: np.ndarray, n_heads: int, name: str = "") -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection.

    `weight` is [n_heads*D, ...] (a [out, in] weight or an [out] bias). Within each head llama.cpp
    stored rows in interleaved pair order (0, D/2, 1, D/2+1, ...); this restores HF's half-split
    order (0, 1, ..., D-1). `n_heads` is num_attention_heads for q, num_key_value_heads for k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise CheckpointError(f"GGUF tensor {name!r}: {rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# HF row vectors [1, H] that llama.cpp stores as [H] (Qwen2-MoE's shared expert gate).
_ROW_VECTORS = (".mlp.shared_expert_gate.weight",)


class GgufSource(TensorSource):
    """The tensors of a GGUF file under their HF names, as float32 in HF layout, or (the matrices
    in Q4_0, Q4_1, Q4_K, Q8_0, Q5_K, Q6_K blocks) as their integer grids: `quantized()`,
    `read_grid()` (checkpoints_conv.gguf_grid).

    `config` is the dict read_gguf_config returned (its head counts undo the llama Q/K
    permutation). A mixture of experts' stacked tensors (`ffn_*_exps` [E, ...]) are listed one per
    expert, under the per-expert HF names, each read as its slice of the stacked tensor. A tensor whose name has no HF equivalent is listed under its GGUF name, for the
    loader to report as unexpected. Quantized blocks run along rows, so a read dequantizes the
    whole tensor and slices it; the last few tensors are kept, so the blocks of several devices
    cost one dequantization. A type outside SUPPORTED_TYPES raises CheckpointError naming the
    tensor and the type when it is read.
    """

    CACHED_TENSORS = 4  # enough for q, k and v of one layer

    def __init__(self, path: str | Path, config: dict):
        self.header = read_gguf_header(path)
        _, self.arch = _architecture(self.header)
        self.q_heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads", self.q_heads))
        self._info: dict[str, GgufTensorInfo] = {}
        self._expert: dict[str, int] = {}  # a stacked experts tensor's per-expert names -> the expert
        for info in self.header.tensors:
            if info.name == ROPE_FREQS_TENSOR:
                continue
            name = self.arch.hf_name(info.name) or info.name
            if name != info.name and info.name.split(".")[-2] in self.arch.stacked_experts:
                # [E, ...] -> one tensor per expert: model.layers.i.mlp.experts.gate_proj.weight -> ...experts.{e}.gate_proj.weight
                module, proj, suffix = name.rsplit(".", 2)
                for e in range(info.shape[0]):
                    self._info[f"{module}.{e}.{proj}.{suffix}"] = info
                    self._expert[f"{module}.{e}.{proj}.{suffix}"] = e
            else:
                self._info[name] = info
        self._cache: dict[str, np.ndarray] = {}

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, self._shape(name)) for name in self._info]

    def _shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._info[name].shape)
        if name in self._expert:
            return shape[1:]
        return (1, *shape) if name.endswith(_ROW_VECTORS) and len(shape) == 1 else shape

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        info = self._info[name]
        if info.name not in self._cache:  # keyed by the stored tensor: a stacked one serves every expert
            if len(self._cache) >= self.CACHED_TENSORS:
                del self._cache[next(iter(self._cache))]  # the oldest
            self._cache[info.name] = self._load(name)
        array = self._cache[info.name]
        array = array[self._expert[name]] if name in self._expert else array.reshape(self._shape(name))
        return array if index is None else array[index]

    def quantized(self) -> dict[str, QuantLayout]:
        return {name: TYPE_LAYOUTS[info.ggml_type] for name, info in self._info.items()
                if info.ggml_type in GRID_TYPES and len(info.shape) == 2 and name not in self._expert}

    def read_grid(self, name: str) -> Grid:
        info = self._info[name]
        try:
            grid = read_grid(read_tensor_bytes(self.header.path, info), info.ggml_type, tuple(info.shape))
        except ValueError as e:
            raise CheckpointError(f"{self.header.path}: tensor {info.name!r}: {e}") from e
        unpermute = lambda a: None if a is None else self._unpermute(name, info, a)  # noqa: E731
        return Grid(unpermute(grid.values), unpermute(grid.scales), unpermute(grid.offsets), grid.layout)

    def _load(self, name: str) -> np.ndarray:
        info = self._info[name]
        array = self._unpermute(name, info, _dequantize(self.header.path, info))
        if self.arch.norm_shift and name != info.name and name.endswith("norm.weight"):
            array = array - np.float32(self.arch.norm_shift)  # Gemma: the file holds 1 + w (GgufArch.norm_shift)
        return array

    def _unpermute(self, name: str, info: GgufTensorInfo, rows: np.ndarray) -> np.ndarray:
        """The rows of a q / k projection (weights, or their per-row scales) back in HF's order."""
        if self.arch.permuted_qk and name != info.name:
            if ".self_attn.q_proj." in name:
                return unpermute_qk(rows, self.q_heads, info.name)
            if ".self_attn.k_proj." in name:
                return unpermute_qk(rows, self.kv_heads, info.name)
        return rows

    def close(self) -> None:
        self._cache.clear()


def iter_gguf_tensors(path: str | Path, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for each tensor of the GGUF file, read and dequantized one
    at a time (HF layout; names as `GgufSource` lists them)."""
    source = GgufSource(path, config)
    for name, _ in source.listing():
        yield name, source.read(name)


def _dequantize(path: Path, info: GgufTensorInfo) -> np.ndarray:
    """The tensor as float32 with its logical shape `info.shape`."""
    if info.ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise CheckpointError(
            f"{path}: tensor {info.name!r} has GGUF type {info.type_name}, which is not supported (supported: {supported})"
        )
    raw = read_tensor_bytes(path, info)
    try:
        array = dequantize(raw, info.ggml_type)
    except ValueError as e:
        raise CheckpointError(f"{path}: cannot dequantize tensor {info.name!r} ({info.type_name}): {e}") from e
    return np.asarray(array, dtype=np.float32).reshape(info.shape)

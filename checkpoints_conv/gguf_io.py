"""Read GGUF files (llama.cpp): an HF-style config dict and HF-named float32 tensors.

Named `gguf_io` so it never shadows the `gguf` package it uses. The header is parsed by
`gguf_file`; dequantization is `gguf.quants.dequantize`.

GGUF stores a [out, in] matrix with dims (in, out); `gguf_file` reverses them, so the
arrays here already have HF's layout ([out, in] for linear weights, [V, H] for token_embd).
llama.cpp's converter permuted the rows of attn_q / attn_k of llama-arch models (interleaved
rotary pairs); `unpermute_qk` undoes that, as transformers' GGUF loader does, so the tensors equal
the original HF ones up to quantization error. Likewise the norms stored as 1 + w (Gemma, Qwen3-Next,
Qwen3.5) and what the converter did to the Gated DeltaNet layers of Qwen3-Next and Qwen3.5
(`_GatedDeltaNetLayout`).
"""

from __future__ import annotations

import re
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
    query_pre_attn_scalar, soft caps, hidden_activation: `_FAMILY_CONFIG`); for qwen3next / qwen35
    / qwen35moe the Gated DeltaNet's heads, dims and taps and the layer kinds (`_gated_deltanet_config`).
    Unknown general.architecture -> CheckpointError naming it.
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
        "intermediate_size": int(first(_feed_forward_length(meta, arch_name, need))),
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


def _feed_forward_length(meta: dict, arch_name: str, need) -> Any:
    """`{arch}.feed_forward_length`; a mixture of experts without a dense width (Qwen3.5-MoE's config
    has no intermediate_size, so its converter writes none) takes its experts' width."""
    width = meta.get(f"{arch_name}.feed_forward_length")
    if width is None and meta.get(f"{arch_name}.expert_count"):
        width = meta.get(f"{arch_name}.expert_feed_forward_length")
    return need("feed_forward_length") if width is None else width


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


def _gated_deltanet_config(meta: dict, arch_name: str, config: dict, tensor_names: set[str], header: GgufHeader) -> dict:
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE as Qwen3NextModel.set_gguf_parameters writes them: the
    Gated DeltaNet's shapes under llama.cpp's Mamba names (ssm.group_count: key heads, ssm.state_size:
    the key head dim, ssm.time_step_rank: value heads, ssm.inner_size: value heads x their dim,
    ssm.conv_kernel: the convolution's taps); which layers are linear from attention.recurrent_layers
    (one flag per layer) or else full_attention_interval (4 unless the file says); the rotated share
    of each head from rope.dimension_count; block_count counting the multi-token-prediction layers
    (nextn_predict_layers, after the model's: not run here). The experts' top-k weights are
    renormalised (llama.cpp's fixed choice for these, as in their HF configs). Qwen3.5's M-RoPE
    sections (rope.dimension_sections) need no key: text positions turn every section alike."""
    def ssm(key: str) -> int:
        value = meta.get(f"{arch_name}.ssm.{key}")
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch_name}.ssm.{key}")
        return int(value)

    nextn = int(meta.get(f"{arch_name}.nextn_predict_layers", 0) or 0)
    n = config["num_hidden_layers"] - nextn
    value_heads, inner = ssm("time_step_rank"), ssm("inner_size")
    if value_heads <= 0 or inner % value_heads:
        raise CheckpointError(f"GGUF metadata {arch_name}.ssm.inner_size={inner} does not split into "
                              f"{arch_name}.ssm.time_step_rank={value_heads} value heads")
    out: dict[str, Any] = {
        "num_hidden_layers": n,
        "linear_num_key_heads": ssm("group_count"), "linear_key_head_dim": ssm("state_size"),
        "linear_num_value_heads": value_heads, "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": ssm("conv_kernel"),
        "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": _rotary_factor(meta, arch_name, config)},
    }
    recurrent = meta.get(f"{arch_name}.attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < n:
            raise CheckpointError(f"GGUF metadata {arch_name}.attention.recurrent_layers has "
                                  f"{len(recurrent) if isinstance(recurrent, list) else 'no list of'} flags for {n} layers")
        out["layer_types"] = ["linear_attention" if flag else "full_attention" for flag in recurrent[:n]]
    else:
        interval = int(meta.get(f"{arch_name}.full_attention_interval", 4))
        out["full_attention_interval"] = interval
        out["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if nextn:
        out["mtp_num_hidden_layers"] = nextn
    if config.get("num_experts"):
        out["norm_topk_prob"] = True
    return out


_FAMILY_CONFIG = {"gemma2": _gemma2_config, "gemma3": _gemma3_config, "olmo2": _olmo2_config, "gpt-oss": _gpt_oss_config,
                  "glm4moe": _glm4_moe_config, "minimax-m2": _minimax_m2_config, "llama4": _llama4_config,
                  "gemma4": _gemma4_config, "qwen3next": _gated_deltanet_config, "qwen35": _gated_deltanet_config,
                  "qwen35moe": _gated_deltanet_config}


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
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def tiled_to_grouped(array: np.ndarray, axis: int, key_heads: int, value_heads: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's value-head reorder of Qwen3.5's Gated DeltaNet along `axis` (value heads of
    `head_dim` entries each). HF groups the value heads by the key head they share, head g r + j
    being key head g's j-th (r = value_heads / key_heads); the converter
    (_LinearAttentionVReorderBase._reorder_v_heads) stores them tiled, j hk + g, so that ggml can
    broadcast the key heads. This puts them back in HF's order."""
    r = value_heads // key_heads
    moved = np.moveaxis(array, axis, 0)
    grouped = moved.reshape(r, key_heads, head_dim, *moved.shape[1:]).swapaxes(0, 1).reshape(moved.shape)
    return np.moveaxis(grouped, 0, axis)


class _GatedDeltaNetLayout:
    """What llama.cpp's converter did to a Qwen3-Next / Qwen3.5 file's tensors, and how to undo it
    (convert_hf_to_gguf.py: Qwen3NextModel.modify_tensors, _LinearAttentionVReorderBase):

    - A_log stored as ssm_a = -exp(A_log): read back as log(-ssm_a);
    - the convolution [C, 1, K] squeezed to [C, K]: listed as [C, 1, K] again;
    - every norm but the gated one (ssm_norm) stored as 1 + w: GgufArch.norm_shift;
    - Qwen3-Next's in_proj_qkvz split into attn_qkv (q | k | v, each over all heads) and attn_gate (z):
      read as Qwen3.5's in_proj_qkv and in_proj_z (an older file's whole ssm_in as HF's in_proj_qkvz);
    - Qwen3.5 with fewer key heads than value heads (GgufArch.tiled_value_heads): the value heads
      of attn_qkv's v rows, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the convolution's v
      channels and ssm_out's columns reordered from grouped to tiled: `tiled_to_grouped`.

    Its multi-token-prediction layers (block_count past num_hidden_layers) are hidden; a
    full-attention layer's fused attn_qkv (llama.cpp's create_tensor_qkv takes one) reads as its q
    (query and gate), k and v projections; `check` names a missing or misshapen tensor."""

    def __init__(self, config: dict, tiled: bool):
        c = config
        self.layers = int(c["num_hidden_layers"])
        self.types = list(c["layer_types"])
        self.hidden = int(c["hidden_size"])
        self.heads, self.kv_heads = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.hk, self.hv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
        self.dk, self.dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
        self.kernel = int(c["linear_conv_kernel_dim"])
        self.experts = int(c.get("num_experts") or 0)
        self.reorder = tiled and self.hk != self.hv

    def layer(self, gguf_name: str) -> tuple[int, str] | None:
        m = _BLOCK.fullmatch(gguf_name)
        return None if m is None else (int(m.group(1)), m.group(2))

    def is_mtp(self, gguf_name: str) -> bool:
        where = self.layer(gguf_name)
        return where is not None and where[0] >= self.layers

    def attention_qkv_rows(self) -> list[tuple[str, slice]]:
        """A full-attention layer's fused attn_qkv: [q_proj (Hq x 2D: query | gate per head) | k | v] rows."""
        q, kv = self.heads * 2 * self.head_dim, self.kv_heads * self.head_dim
        return [("self_attn.q_proj.weight", slice(0, q)), ("self_attn.k_proj.weight", slice(q, q + kv)),
                ("self_attn.v_proj.weight", slice(q + kv, q + 2 * kv))]

    def expected(self) -> dict[str, tuple[int, ...]]:
        """The linear layers' tensors (numpy shapes, GGUF names without the layer) and their shapes."""
        H, kd, vd = self.hidden, self.hk * self.dk, self.hv * self.dv
        return {"attn_qkv.weight": (2 * kd + vd, H), "attn_gate.weight": (vd, H), "ssm_in.weight": (2 * kd + 2 * vd, H),
                "ssm_ba.weight": (2 * self.hv, H), "ssm_beta.weight": (self.hv, H), "ssm_alpha.weight": (self.hv, H),
                "ssm_conv1d.weight": (2 * kd + vd, self.kernel), "ssm_a": (self.hv,), "ssm_dt.bias": (self.hv,),
                "ssm_norm.weight": (self.dv,), "ssm_out.weight": (H, vd)}

    def check(self, path: Path, tensors: dict[str, GgufTensorInfo]) -> None:
        """CheckpointError naming the first misshapen or missing tensor of the model's layers."""
        expected = self.expected()
        for name, info in tensors.items():
            where = self.layer(name)
            if where is None or where[0] >= self.layers:
                continue
            layer, rest = where
            shape = tuple(info.shape)
            if self.types[layer] == "linear_attention" and rest in expected:
                want = expected[rest]
                if rest == "ssm_conv1d.weight" and shape == (want[0], 1, want[1]):
                    continue  # (not squeezed)
            elif self.types[layer] == "full_attention" and rest == "attn_qkv.weight":
                want = (self.attention_qkv_rows()[-1][1].stop, self.hidden)
            else:
                continue  # (the loader checks the others' shapes, under their HF names)
            if shape != want:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {shape}, expected {want} (layer {layer}, a {self.types[layer]} "
                    f"layer: {self.hk} key heads of {self.dk}, {self.hv} value heads of {self.dv}, {self.kernel} taps, "
                    f"hidden size {self.hidden}, from the file's metadata)")
        missing = [name for layer in range(self.layers) for name in self._required(layer, tensors)]
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing: {', '.join(missing[:8])}{more}")

    def _required(self, layer: int, tensors: dict) -> list[str]:
        """The tensors of `layer` that are not in `tensors` (one of each alternative llama.cpp takes)."""
        def have(*names: str) -> bool:
            return all(f"blk.{layer}.{n}" in tensors for n in names)

        need = ["attn_norm.weight", "post_attention_norm.weight"]
        if self.types[layer] == "linear_attention":
            need += ["ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight", "ssm_out.weight"]
            need += [] if have("ssm_in.weight") else ["attn_qkv.weight", "attn_gate.weight"]
            need += [] if have("ssm_ba.weight") else ["ssm_beta.weight", "ssm_alpha.weight"]
        else:
            need += ["attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight"]
            need += [] if have("attn_qkv.weight") else ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
        if self.experts:
            need += ["ffn_gate_inp.weight", "ffn_down_exps.weight"]
            need += [] if have("ffn_gate_up_exps.weight") else ["ffn_gate_exps.weight", "ffn_up_exps.weight"]
        else:
            need += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        return [f"blk.{layer}.{n}" for n in need if f"blk.{layer}.{n}" not in tensors]

    def transforms(self, gguf_name: str) -> bool:
        """Whether `fix` changes this tensor (it is then read as floats, never as its stored grid)."""
        where = self.layer(gguf_name)
        if where is None or where[0] >= self.layers or self.types[where[0]] != "linear_attention":
            return False
        rest = where[1]
        return rest in ("ssm_a", "ssm_conv1d.weight") or (self.reorder and rest in (
            "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_out.weight"))

    def fix(self, gguf_name: str, array: np.ndarray) -> np.ndarray:
        """The stored (float) tensor `gguf_name` as HF has it, but for its name and the squeeze."""
        if not self.transforms(gguf_name):
            return array
        rest = self.layer(gguf_name)[1]
        if rest == "ssm_a":  # -exp(A_log)
            with np.errstate(divide="ignore", invalid="ignore"):
                array = np.log(-array).astype(np.float32)
        if not self.reorder:
            return array
        qk = 2 * self.hk * self.dk
        if rest in ("attn_qkv.weight", "ssm_conv1d.weight"):  # only the v rows / channels
            return np.concatenate([array[:qk], tiled_to_grouped(array[qk:], 0, self.hk, self.hv, self.dv)])
        if rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            return tiled_to_grouped(array, 0, self.hk, self.hv, 1)
        return tiled_to_grouped(array, 1 if rest == "ssm_out.weight" else 0, self.hk, self.hv, self.dv)


class GgufSource(TensorSource):
    """The tensors of a GGUF file under their HF names, as float32 in HF layout, or (the matrices
    in Q4_0, Q4_1, Q4_K, Q8_0, Q5_K, Q6_K blocks) as their integer grids: `quantized()`,
    `read_grid()` (checkpoints_conv.gguf_grid).

    `config` is the dict read_gguf_config returned (its head counts undo the llama Q/K
    permutation). A mixture of experts' stacked tensors (`ffn_*_exps` [E, ...]) are listed one per
    expert, under the per-expert HF names, each read as its slice of the stacked tensor (a fused
    `ffn_gate_up_exps` [E, 2I, H], as the converter's --fuse-gate-up-exps writes it, as each expert's
    gate and up rows). Qwen3-Next's and Qwen3.5's Gated DeltaNet tensors are read as HF has them
    (`_GatedDeltaNetLayout`). A tensor whose name has no HF equivalent is listed under its GGUF
    name, for the loader to report as unexpected. Quantized blocks run along rows, so a read
    dequantizes the whole tensor and slices it; the last few tensors are kept, so the blocks of
    several devices cost one dequantization. A type outside SUPPORTED_TYPES raises CheckpointError
    naming the tensor and the type when it is read.
    """

    CACHED_TENSORS = 4  # enough for q, k and v of one layer

    def __init__(self, path: str | Path, config: dict):
        self.header = read_gguf_header(path)
        _, self.arch = _architecture(self.header)
        self.q_heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads", self.q_heads))
        self.hybrid: _GatedDeltaNetLayout | None = None
        if self.arch.gated_deltanet:
            full = config if "linear_num_key_heads" in config and "layer_types" in config else read_gguf_config(path)
            self.hybrid = _GatedDeltaNetLayout(full, self.arch.tiled_value_heads)
            self.hybrid.check(self.header.path, {t.name: t for t in self.header.tensors})
        self._info: dict[str, GgufTensorInfo] = {}
        self._expert: dict[str, int] = {}  # a stacked experts tensor's per-expert names -> the expert
        self._rows: dict[str, slice] = {}  # a fused tensor's parts -> its rows (of the expert's matrix, for experts)
        for info in self.header.tensors:
            if info.name == ROPE_FREQS_TENSOR or (self.hybrid is not None and self.hybrid.is_mtp(info.name)):
                continue
            name = self.arch.hf_name(info.name) or info.name
            block = _BLOCK.fullmatch(info.name)
            rest = block.group(2) if block else ""
            if block and rest == "ffn_gate_up_exps.weight" and "ffn_gate_exps" in self.arch.stacked_experts:
                # [E, 2I, H]: gate the first I rows of each expert, up the rest
                width = info.shape[1] // 2
                for part, rows in (("ffn_gate_exps", slice(0, width)), ("ffn_up_exps", slice(width, 2 * width))):
                    module, proj = self.arch.per_layer[part].rsplit(".", 1)
                    for e in range(info.shape[0]):
                        expert_name = f"model.layers.{block.group(1)}.{module}.{e}.{proj}.weight"
                        self._info[expert_name], self._expert[expert_name], self._rows[expert_name] = info, e, rows
            elif (block and rest == "attn_qkv.weight" and self.hybrid is not None
                  and self.hybrid.types[int(block.group(1))] == "full_attention"):
                for hf, rows in self.hybrid.attention_qkv_rows():
                    self._info[f"model.layers.{block.group(1)}.{hf}"], self._rows[f"model.layers.{block.group(1)}.{hf}"] = info, rows
            elif name != info.name and info.name.split(".")[-2] in self.arch.stacked_experts:
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
            shape = shape[1:]
        if name in self._rows:
            rows = self._rows[name]
            return (rows.stop - rows.start, *shape[1:])
        if self.hybrid is not None and name.endswith(".linear_attn.conv1d.weight") and len(shape) == 2:
            return (shape[0], 1, shape[1])  # HF's [C, 1, K], squeezed by the converter
        return (1, *shape) if name.endswith(_ROW_VECTORS) and len(shape) == 1 else shape

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        info = self._info[name]
        if info.name not in self._cache:  # keyed by the stored tensor: a stacked one serves every expert
            if len(self._cache) >= self.CACHED_TENSORS:
                del self._cache[next(iter(self._cache))]  # the oldest
            self._cache[info.name] = self._load(name)
        array = self._cache[info.name]
        if name in self._expert:
            array = array[self._expert[name]]
        array = array[self._rows[name]] if name in self._rows else array.reshape(self._shape(name))
        return array if index is None else array[index]

    def quantized(self) -> dict[str, QuantLayout]:
        return {name: TYPE_LAYOUTS[info.ggml_type] for name, info in self._info.items()
                if info.ggml_type in GRID_TYPES and len(info.shape) == 2 and name not in self._expert
                and name not in self._rows and not (self.hybrid is not None and self.hybrid.transforms(info.name))}

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
        if (self.arch.norm_shift and name != info.name and name.endswith("norm.weight")
                and not name.endswith(self.arch.norm_shift_skip)):
            array = array - np.float32(self.arch.norm_shift)  # Gemma, Qwen3-Next: the file holds 1 + w (GgufArch.norm_shift)
        if self.hybrid is not None:
            array = self.hybrid.fix(info.name, array)
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

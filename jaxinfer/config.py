"""Model configuration: one `ModelConfig` for every Llama-family decoder.

A `ModelConfig` is built from a Hugging Face `config.json` dict (`ModelConfig.from_hf_dict`).
GGUF metadata is first translated into the same HF-style dict by `checkpoints_conv.gguf`, so
there is one parser for both sources.

Supported families and what distinguishes them:

| model_type | q/k/v bias | o bias | q/k RMSNorm | notes                                   |
|------------|-----------|--------|-------------|-----------------------------------------|
| llama      | attention_bias | attention_bias | no | Llama 2 / 3 / 3.1 / 3.2, SmolLM2       |
| mistral    | no        | no     | no          | sliding_window                          |
| qwen2      | yes       | no     | no          | Qwen2 / 2.5; optional sliding window    |
| qwen3      | attention_bias | attention_bias | yes | explicit head_dim                  |
| mixtral    | no        | no     | no          | MoE: num_local_experts, top-k renormalised |
| qwen2_moe  | qkv_bias (yes) | no | no          | MoE + a shared expert behind a sigmoid gate |
| qwen3_moe  | attention_bias | attention_bias | yes | MoE                                |

Mixture-of-experts models replace every layer's MLP by `num_experts` SwiGLU experts of width
`moe_intermediate_size`; a router picks `num_experts_per_tok` of them per token (softmax over all
experts, top-k, renormalised over the k when `norm_topk_prob`). Configs that mix dense and
sparse layers (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

_ARCHITECTURE_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class ConfigError(ValueError):
    """A model configuration jaxinfer cannot run; the message names the offending field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF's `rope_parameters` / `rope_scaling` describe it."""

    rope_type: str = "default"  # default | linear | dynamic | llama3
    factor: float = 1.0
    # llama3 only:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts (num_experts == 0: a dense SwiGLU MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (1: MHA, num_heads: MQA, in between: GQA)."""
        return self.num_heads // self.num_kv_heads

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or []
            mapped = [_ARCHITECTURE_TO_MODEL_TYPE[a] for a in archs if a in _ARCHITECTURE_TO_MODEL_TYPE]
            if mapped:
                model_type = mapped[0]
            else:
                raise ConfigError(
                    f"unknown architecture in {source}: model_type={d.get('model_type')!r}, "
                    f"architectures={archs!r}; jaxinfer supports model_type in {SUPPORTED_MODEL_TYPES}"
                )

        def need(key: str):
            if key not in d or d[key] is None:
                raise ConfigError(f"{source} is missing required field {key!r} (model_type={model_type})")
            return d[key]

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"{source}: hidden_act={hidden_act!r} is not supported (only 'silu')")

        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        hidden_size = int(need("hidden_size"))
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )

        rope_theta, rope_scaling = _parse_rope(d, source)
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias = {"qwen2": True, "mistral": False, "mixtral": False, "qwen2_moe": bool(d.get("qkv_bias", True))}.get(
            model_type, attention_bias
        )
        o_bias = attention_bias if model_type in ("llama", "qwen3", "qwen3_moe") else False
        moe = _parse_moe(d, model_type, source) if model_type in MOE_MODEL_TYPES else {}

        sliding_window = d.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            layer_types = d.get("layer_types")
            if layer_types is not None:
                kinds = set(layer_types)
                if kinds == {"full_attention"}:
                    sliding_window = None
                elif kinds != {"sliding_attention"}:
                    raise ConfigError(
                        f"{source}: layer_types mixes {sorted(kinds)}; per-layer attention kinds are not supported"
                    )
            elif not d.get("use_sliding_window", False):
                sliding_window = None

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **moe,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style config dict that `from_hf_dict` reads back to an equal config."""
        rs = self.rope_scaling
        rope = {"rope_type": rs.rope_type, "rope_theta": self.rope_theta}
        if rs.rope_type != "default":
            rope["factor"] = rs.factor
        if rs.rope_type == "llama3":
            rope.update(
                low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings,
            )
        d = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias or (self.qkv_bias and self.model_type != "qwen2"),
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.sliding_window:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
        if self.model_type == "qwen2_moe":
            d["qkv_bias"] = self.qkv_bias
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
            )
            if self.model_type == "mixtral":
                d["intermediate_size"] = self.moe_intermediate_size
        return d


def _parse_moe(d: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    num_experts = d.get("num_local_experts") if model_type == "mixtral" else d.get("num_experts", d.get("num_local_experts"))
    top_k = d.get("num_experts_per_tok")
    if not num_experts or not top_k:
        raise ConfigError(f"{source}: a {model_type} model needs num_experts (num_local_experts) and num_experts_per_tok")
    if not 0 < int(top_k) <= int(num_experts):
        raise ConfigError(f"{source}: num_experts_per_tok={top_k} must be in [1, {num_experts}]")
    if int(d.get("decoder_sparse_step", 1)) != 1 or d.get("mlp_only_layers"):
        raise ConfigError(
            f"{source}: decoder_sparse_step={d.get('decoder_sparse_step')} / mlp_only_layers={d.get('mlp_only_layers')}: "
            "models mixing dense and mixture-of-experts layers are not supported (every layer must be sparse)"
        )
    if model_type == "mixtral":
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True)
    width = d.get("moe_intermediate_size")
    if not width:
        raise ConfigError(f"{source} is missing required field 'moe_intermediate_size' (model_type={model_type})")
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(width),
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
    )


def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    """Reads both the transformers>=5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    spec = dict(scaling)
    spec.update(params)
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, RopeScaling()
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(spec.get("factor", 1.0)),
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            spec.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )

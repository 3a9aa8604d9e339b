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
| qwen2_5_vl | yes       | no     | no          | Qwen2.5-VL's text decoder: Qwen2 with M-RoPE (mrope_section) |
| qwen3      | attention_bias | attention_bias | yes | explicit head_dim                  |
| qwen3_vl   | attention_bias | attention_bias | yes | Qwen3-VL's text decoder: Qwen3 with interleaved M-RoPE |
| mixtral    | no        | no     | no          | MoE: num_local_experts, top-k renormalised |
| qwen2_moe  | qkv_bias (yes) | no | no          | MoE + a shared expert behind a sigmoid gate |
| qwen3_moe  | attention_bias | attention_bias | yes | MoE                                |

Mixture-of-experts models replace every layer's MLP by `num_experts` SwiGLU experts of width
`moe_intermediate_size`; a router picks `num_experts_per_tok` of them per token (softmax over all
experts, top-k, renormalised over the k when `norm_topk_prob`). Configs that mix dense and
sparse layers (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused.

Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) runs its text decoder here: `text_config`
(transformers 5) or the top-level fields (the released configs), the rope's `mrope_section` kept as
`ModelConfig.mrope_section` (jaxinfer.models.mrope); its vision tower is jaxinfer.models.vision.qwen_vl.
Qwen3-VL (`Qwen3VLForConditionalGeneration`) likewise, its sections interleaved
(`ModelConfig.mrope_interleaved`); its vision tower (and deepstack) is jaxinfer.models.vision.qwen3_vl.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from checkpoints_conv.views import gemma4_layer_plan

LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "qwen2_5_vl",
                     "qwen3_vl")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "minimax_m2", "glm4_moe", "llama4_text", "llama4",
                   "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
# multi-head latent attention (jaxinfer.models.deepseek); the last two with DeepSeek sparse attention
# (an indexer picks the index_topk past tokens each query attends to)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
SPARSE_ATTENTION_MODEL_TYPES = {"deepseek_v32": "DeepSeek-V3.2", "glm_moe_dsa": "GLM-5"}
# The families of issue 35, each with its own model file (jaxinfer.models.registry).
NEW_FAMILY_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3", "smollm3", "olmo2", "olmo3", "gpt_oss", "phi3", "minimax_m2",
                          "glm4_moe", "llama4_text", "llama4", "gemma4_text", "gemma4", "deepseek_v2", "deepseek_v3",
                          "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text",
                          "qwen3_5_moe")
# hybrids of Gated DeltaNet (linear attention) layers and full-attention ones (jaxinfer.models.qwen3_next)
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
SUPPORTED_MODEL_TYPES = LLAMA_MODEL_TYPES + NEW_FAMILY_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors", "proportional")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3", "gemma4_text", "gemma4")

_ARCHITECTURE_TO_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "GptOssForCausalLM": "gpt_oss",
    "Phi3ForCausalLM": "phi3",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Llama4ForCausalLM": "llama4_text",
    "Llama4ForConditionalGeneration": "llama4",
    "Gemma4ForCausalLM": "gemma4_text",
    "Gemma4ForConditionalGeneration": "gemma4",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}


class ConfigError(ValueError):
    """A model configuration jaxinfer cannot run; the message names the offending field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF's `rope_parameters` / `rope_scaling` describe it."""

    rope_type: str = "default"  # default | linear | dynamic | llama3 | yarn | longrope
    factor: float = 1.0
    # llama3 only:
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and extrapolated frequencies, and cos / sin's scale
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # yarn / longrope: None = from factor (and mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # longrope (Phi-3): one factor per frequency, short below original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # freq_factors (a GGUF's rope_freqs tensor: llama.cpp's form of llama3 scaling): frequency i divided by factor i
    freq_factors: tuple[float, ...] = ()
    # proportional (Gemma 4's global layers): the first rotated_fraction of a head's frequency pairs
    # turn, at base ** (-2i / head_dim) / factor; the other pairs stay still (frequency 0)
    rotated_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class KVEviction:
    """KV eviction for unbounded streams (jaxinfer.ops.kv_eviction): which tokens a full-attention
    layer keeps. Set by the engine (`LLM(kv_eviction=...)`), never read from a config.json.

    method "streaming" (StreamingLLM): the first `keep` tokens (attention sinks) and the last
    `window`, RoPE on positions inside that cache; "h2o" (Heavy-Hitter Oracle): `keep` slots of
    the tokens with the largest accumulated attention (per layer and KV head) and the last
    `window`. `window` counts the query's own token, as a sliding window does."""

    method: str
    keep: int
    window: int

    def describe(self) -> str:
        if self.method == "streaming":
            return f"streaming ({self.keep} sinks + window {self.window})"
        return f"h2o ({self.keep} heavy + window {self.window})"


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """What one decoder layer's attention is: the keys it sees and its RoPE table.

    window: a query at position p sees keys p - window + 1 .. p (None: every earlier key).
    chunk: a query sees only the keys of its own chunk, floor(p / chunk) * chunk .. p (Llama 4).
    rope: "global" (the model's RoPE), "local" (the sliding layers' own base, Gemma 3) or None
    (no position embedding at all: a NoPE layer).
    head_dim, kv_heads: the layer's own when they differ from the model's (Gemma 4's global layers;
    None: the model's). k_eq_v: its values come from the key projection (Gemma 4's global layers).
    linear: a Gated DeltaNet layer (Qwen3-Next, Qwen3.5): no keys are kept, a recurrent state per
    sequence instead (jaxinfer.models.qwen3_next)."""

    window: int | None = None
    rope: str | None = "global"
    chunk: int | None = None
    head_dim: int | None = None
    kv_heads: int | None = None
    k_eq_v: bool = False
    linear: bool = False


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
    # ---- per-layer attention kinds and the switches of the newer families (defaults: Llama's)
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; () = every layer alike (sliding_window or not)
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    local_rope_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3); None: the global one
    local_rope_scaling: RopeScaling = RopeScaling()  # sliding layers' own scaling when local_rope_theta is set
    rotary_dim: int = 0  # RoPE turns the first rotary_dim dims of a head (partial_rotary_factor); 0 = all
    # M-RoPE (Qwen2.5-VL): the rotary frequencies in sections (temporal, height, width) of these sizes,
    # summing to rope_dim // 2, each turned by its own position (jaxinfer.models.mrope); None: plain RoPE
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: frequency i turns by position i % 3 (within the h / w sections' reach)
    attention_scale: float | None = None  # the score scale (Gemma: query_pre_attn_scalar ** -0.5); None: D ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits likewise
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), rounded to the weights' dtype (Gemma)
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma stores w - 1
    norm_layout: str = "pre"  # "pre": norm before each branch (Llama); "sandwich": before and after (Gemma); "post": after (OLMo 2)
    qk_norm_scope: str = "head"  # q/k RMSNorm over each head ("head", Qwen3 / Gemma 3) or the whole projection (OLMo 2)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    attention_sinks: bool = False  # one learned sink logit per query head (GPT-OSS)
    router_bias: bool = False  # the MoE router has a bias (GPT-OSS)
    router_scoring: str = "softmax"  # expert scores: "softmax" over all experts, or "sigmoid" per expert (MiniMax-M2)
    router_correction_bias: bool = False  # a learned bias added to the scores to pick experts only (MiniMax-M2, GLM-4.5)
    router_groups: int = 1  # experts in this many groups; the k picked from the router_top_groups best (GLM-4.5)
    router_top_groups: int = 1
    router_group_score: str = "top2"  # a group's score: its two best experts' sum ("top2", GLM-4.5, DeepSeek-V3) or its best ("max", V2)
    routed_scaling_factor: float = 1.0  # the picked experts' weights times this
    shared_expert_gated: bool = True  # Qwen2-MoE's shared expert sits behind a sigmoid gate; GLM-4.5's does not
    first_dense_layers: int = 0  # a MoE model's first layers with a dense MLP of intermediate_size (GLM-4.5)
    moe_layer_step: int = 1  # past those, every moe_layer_step-th layer has experts, the others a dense MLP (Llama 4)
    router_scales_inputs: bool = False  # an expert runs on its token times the routing weight, summed unweighted (Llama 4)
    attention_chunk_size: int | None = None  # "chunked_attention" layers see only their query's chunk (Llama 4)
    qk_l2_norm: bool = False  # q and k RMS-normalised per head, without a weight, on RoPE layers (Llama 4)
    attn_temperature_scale: float | None = None  # NoPE layers scale q by 1 + this * log1p(floor((pos + 1) / floor)) (Llama 4)
    attn_temperature_floor: int = 8192
    expert_bias: bool = False  # each expert's gate/up and down projections have biases (GPT-OSS)
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU: (clip(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (DeepSeek): K and V from a latent of kv_lora_rank values per token
    # plus one shared RoPE key of qk_rope_head_dim; the cache holds that row (head_dim = kv_lora_rank
    # + qk_rope_head_dim, one KV head, its last rotary_dim dims rotated: models.deepseek)
    kv_lora_rank: int = 0  # 0: not MLA
    q_lora_rank: int = 0  # queries through a low-rank projection and a norm; 0: one q_proj
    qk_nope_head_dim: int = 0  # each query / key head's dims without RoPE
    v_head_dim: int = 0  # each value head's dims
    rope_interleave: bool = False  # the rope dims come as interleaved pairs (x0, x1), (x2, x3) ... (DeepSeek-V3)
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): each query attends to the index_topk past tokens an
    # indexer scores highest (index_heads heads of index_head_dim, keyed by one key per token kept in the
    # latent row after [latent | rope]); 0: dense attention
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False  # the indexer's rope dims as interleaved pairs (GLM-5), else halves (V3.2)
    # Gated DeltaNet layers (layer_types "linear_attention": Qwen3-Next, Qwen3.5): q and k in linear_key_heads
    # heads of linear_key_head_dim, v in linear_value_heads of linear_value_head_dim, a causal depthwise
    # convolution of linear_conv_kernel taps over q | k | v; 0: none
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attn_output_gate: bool = False  # full attention's output times sigmoid(a gate the q projection also gives) (Qwen3-Next)
    # DeepSeek-V3's multi-token-prediction module (the checkpoint's layer num_hidden_layers), run as
    # a one-layer model that also reads the target's hidden states (models.deepseek_mtp); set by
    # the engine for speculative method "mtp", never read from a config.json
    mtp_module: bool = False
    # How the checkpoint stores its weights, where a TPU / GPU load keeps them so (`jaxinfer aot` plans
    # them so): "mxfp4" (GPT-OSS's experts), "fp8" (block-scaled: DeepSeek-V3, the FP8 releases); None: floats
    stored_quantization: str | None = None
    # Gemma 4
    global_head_dim: int = 0  # full-attention layers' head dim (512); 0: head_dim
    global_kv_heads: int = 0  # their KV heads; 0: num_kv_heads
    global_k_eq_v: bool = False  # their values are the key projection (no v_proj), normed apart from the keys
    value_norm: bool = False  # values RMS-normalised per head, without a weight
    kv_shared_layers: int = 0  # the last N layers attend over the K/V of the last earlier layer of their kind
    wide_shared_mlp: bool = False  # those N layers' dense MLP is 2 * intermediate_size wide
    per_layer_input_size: int = 0  # per-layer input embeddings (PLE): each layer's extra input width; 0: none
    per_layer_vocab_size: int = 0  # the PLE table's rows
    dense_and_experts: bool = False  # every layer runs its dense MLP and the experts side by side, summed
    layer_scalar: bool = False  # each layer's output times a learned scalar
    # KV eviction (jaxinfer.ops.kv_eviction): set by the engine (LLM(kv_eviction=...)), never read from a config.json
    kv_eviction: KVEviction | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_linear_layers(self) -> bool:
        """Some layers are Gated DeltaNet (linear attention): each sequence also carries a recurrent state."""
        return self.linear_conv_kernel > 0

    @property
    def num_linear_layers(self) -> int:
        return sum(kind.linear for kind in self.layer_kinds())

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): the cache holds one latent row per token."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE turns (head_dim unless partial)."""
        return self.rotary_dim or self.head_dim

    @property
    def sm_scale(self) -> float:
        """The attention score scale."""
        return self.attention_scale if self.attention_scale is not None else float(self.head_dim) ** -0.5

    def layer_kind(self, layer: int) -> LayerKind:
        """Layer `layer`'s attention kind (its window and RoPE table)."""
        layer_type = self.layer_types[layer] if self.layer_types else None
        if layer_type == "linear_attention":
            return LayerKind(rope=None, linear=True)
        sliding = layer_type == "sliding_attention" if layer_type else self.sliding_window is not None
        window = self.sliding_window if sliding else None
        chunk = self.attention_chunk_size if layer_type == "chunked_attention" else None
        if layer in self.nope_layers:
            rope = None
        else:
            rope = "local" if sliding and self.local_rope_theta is not None else "global"
        if window is None and chunk is None and (self.global_head_dim or self.global_kv_heads or self.global_k_eq_v):
            return LayerKind(window=None, rope=rope, head_dim=self.global_head_dim or self.head_dim,
                             kv_heads=self.global_kv_heads or self.num_kv_heads, k_eq_v=self.global_k_eq_v)
        return LayerKind(window=window, rope=rope, chunk=chunk)

    def kind_head_dim(self, kind: LayerKind) -> int:
        return kind.head_dim or self.head_dim

    def kind_kv_heads(self, kind: LayerKind) -> int:
        return kind.kv_heads or self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over: itself, or for one of the last kv_shared_layers
        (Gemma 4) the last earlier layer of its kind."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_kind(layer)
        return max(i for i in range(first_shared) if self.layer_kind(i) == kind)

    def is_kv_shared(self, layer: int) -> bool:
        return layer >= self.num_layers - self.kv_shared_layers

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

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

        if (model_type in ("gemma3", "llama4", "gemma4", "qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl")
                and isinstance(d.get("text_config"), dict)):
            # Gemma 3's, Llama 4's, Qwen2.5-VL's, Qwen3-VL's multimodal folders: the text decoder's config nests in text_config
            # (the vision tower is not run here; the checkpoint's vision tensors are skipped)
            top = {k: d[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in d}
            d = {**d["text_config"], **top, "model_type": model_type}
        if model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):  # every layer's MLP is experts: no dense width,
            d = {"intermediate_size": d.get("moe_intermediate_size"), "norm_topk_prob": True, **d}  # the top k renormalised
        if model_type in ("llama4_text", "llama4") and "intermediate_size_mlp" in d:
            # Llama 4 names the experts' width intermediate_size and the dense layers' intermediate_size_mlp
            d = {**d, "intermediate_size": d["intermediate_size_mlp"], "moe_intermediate_size": d["intermediate_size"]}

        def need(key: str):
            if key not in d or d[key] is None:
                raise ConfigError(f"{source} is missing required field {key!r} (model_type={model_type})")
            return d[key]

        if model_type in MLA_MODEL_TYPES:  # MLA: the cache's one "KV head" is the latent row [latent | rope (| index key)]
            index_dim = int(need("index_head_dim")) if model_type in SPARSE_ATTENTION_MODEL_TYPES else 0
            d = {**d, "num_key_value_heads": 1,
                 "head_dim": int(need("kv_lora_rank")) + int(need("qk_rope_head_dim")) + index_dim}
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        hidden_size = int(need("hidden_size"))
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        _refuse_unsupported_switches(d, model_type, source)
        if model_type == "glm4_moe":  # transformers' default for GLM-4.5: half of each head rotated
            d = {"partial_rotary_factor": 0.5, **d}
        num_layers = int(need("num_hidden_layers"))

        mrope_section = None
        if model_type in ("qwen2_5_vl", "qwen3_vl"):  # M-RoPE: its sections beside an otherwise default rope
            d, mrope_section = _pop_mrope_section(d, default=(16, 24, 24) if model_type == "qwen2_5_vl" else (24, 20, 20))
        rope_theta, rope_scaling, rotary_factor, local_rope = _parse_rope(d, source)
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias = {"qwen2": True, "qwen2_5_vl": True, "mistral": False, "mixtral": False, "qwen2_moe": bool(d.get("qkv_bias", True)),
                    "phi3": False, **{t: False for t in GEMMA_MODEL_TYPES}}.get(model_type, attention_bias)
        o_bias = attention_bias if model_type in ("llama", "qwen3", "qwen3_vl", "qwen3_moe", "smollm3", "olmo2", "olmo3", "gpt_oss", "llama4_text",
                                                  "llama4") else False
        moe = _parse_moe(d, model_type, source) if model_type in MOE_MODEL_TYPES else {}
        family = _FAMILY_FIELDS.get(model_type, lambda d: {})(d)
        hidden_act = _parse_activation(d, model_type, source)

        sliding_window = d.get("sliding_window")
        default_layer_types = family.pop("default_layer_types", None)  # the family's pattern when the config gives none
        layer_types = tuple(family.pop("layer_types", None) or d.get("layer_types")  # (a family may settle them: Gemma 4)
                            or (default_layer_types(num_layers) if default_layer_types else ()))
        has_sliding_layers = "sliding_attention" in layer_types  # before an all-sliding list collapses to ()
        if layer_types:
            if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
                raise ConfigError(f"{source}: layer_types={list(layer_types)} must name one of {LAYER_TYPES} for each of the "
                                  f"{num_layers} layers")
            chunk_size = family.get("attention_chunk_size", d.get("attention_chunk_size"))  # (Llama 4's default: 8192)
            if "chunked_attention" in layer_types and not chunk_size:
                raise ConfigError(f"{source}: layer_types has chunked_attention layers but attention_chunk_size={chunk_size!r}")
            if "sliding_attention" in layer_types and not sliding_window:
                raise ConfigError(f"{source}: layer_types has sliding_attention layers but sliding_window={sliding_window!r}")
            if model_type in ("qwen2", "qwen2_5_vl", "qwen3", "qwen3_vl", "qwen2_moe", "qwen3_moe", "mistral") and len(set(layer_types)) > 1:
                raise ConfigError(f"{source}: layer_types mixes {sorted(set(layer_types))}; a {model_type} model with "
                                  "per-layer attention kinds is not supported")
            if set(layer_types) == {"full_attention"}:
                sliding_window, layer_types = None, ()
            elif set(layer_types) == {"sliding_attention"}:
                layer_types = ()
        elif model_type in ("qwen2", "qwen2_5_vl", "qwen3", "qwen3_vl", "qwen2_moe", "qwen3_moe", "smollm3") and not d.get("use_sliding_window", False):
            sliding_window = None

        if local_rope is not None and not has_sliding_layers:
            local_rope = None  # no sliding layer reads it
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        config = cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in GEMMA_MODEL_TYPES)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=(model_type in ("qwen3", "qwen3_vl", "qwen3_moe", "gemma3_text", "gemma3", "gemma4_text", "gemma4", "olmo2", "olmo3",
                                    "minimax_m2", *LINEAR_ATTENTION_MODEL_TYPES)
                     or (model_type == "glm4_moe" and bool(d.get("use_qk_norm", False)))),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            layer_types=layer_types,
            local_rope_theta=local_rope[0] if local_rope else None,
            local_rope_scaling=local_rope[1] if local_rope else RopeScaling(),
            rotary_dim=int(head_dim * rotary_factor) if rotary_factor != 1.0 else 0,
            mrope_section=mrope_section,
            mrope_interleaved=model_type == "qwen3_vl",  # (transformers 5 interleaves whatever mrope_interleaved says)
            hidden_act=hidden_act,
            **moe,
            **family,
        )
        method = (d.get("quantization_config") or {}).get("quant_method")
        if method == "fp8" or (method == "mxfp4" and model_type == "gpt_oss"):
            config = dataclasses.replace(config, stored_quantization=method)
        if config.is_mla:  # RoPE turns qk_rope_head_dim dims of the row (models.deepseek: its last ones)
            config = dataclasses.replace(config, rotary_dim=int(d["qk_rope_head_dim"]))
        if JAXINFER_FIELDS in d:  # written by to_hf_dict (a converted folder)
            config = dataclasses.replace(config, **{name: _from_json(name, v) for name, v in d[JAXINFER_FIELDS].items()})
        if config.rotary_dim % 2:
            raise ConfigError(f"{source}: partial_rotary_factor={rotary_factor} turns an odd number of dims ({config.rotary_dim})")
        if config.mrope_section is not None and sum(config.mrope_section) != config.rope_dim // 2:
            raise ConfigError(f"{source}: mrope_section={list(config.mrope_section)} must sum to half the rotary dims "
                              f"({config.rope_dim // 2})")
        for name, rs in (("rope", config.rope_scaling), ("local rope", config.local_rope_scaling)):
            for factors in (rs.short_factor, rs.long_factor, rs.freq_factors):
                if factors and len(factors) != config.rope_dim // 2:
                    raise ConfigError(f"{source}: {name} {rs.rope_type} factors have {len(factors)} entries; "
                                      f"the rotary dims need {config.rope_dim // 2}")
        return config

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
            rope.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(rs).items()})
        if self.mrope_section is not None:
            rope["mrope_section"] = list(self.mrope_section)
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
            "attention_bias": self.o_bias or (self.qkv_bias and self.model_type not in ("qwen2", "qwen2_5_vl")),
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
        if self.model_type in NEW_FAMILY_MODEL_TYPES:  # the newer switches, read back exactly by from_hf_dict
            d[JAXINFER_FIELDS] = {name: _to_json(getattr(self, name)) for name in _NEWER_FIELDS}
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
            )
            if self.model_type in ("mixtral", "gpt_oss", "minimax_m2"):
                d["intermediate_size"] = self.moe_intermediate_size
        if self.is_mla:  # the latent attention's HF fields (and DeepSeek's shared experts, counted in experts)
            d.update(kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank or None, qk_nope_head_dim=self.qk_nope_head_dim,
                     qk_rope_head_dim=self.rotary_dim, v_head_dim=self.v_head_dim, first_k_dense_replace=self.first_dense_layers,
                     n_shared_experts=self.shared_expert_intermediate_size // max(self.moe_intermediate_size, 1))
        if self.index_topk:
            d.update(index_topk=self.index_topk, index_n_heads=self.index_heads, index_head_dim=self.index_head_dim)
        if self.has_linear_layers:
            d.update(linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
                     linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
                     linear_conv_kernel_dim=self.linear_conv_kernel)
        return d


def _parse_moe(d: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    num_experts = (d.get("num_local_experts") if model_type in ("mixtral", "gpt_oss", "minimax_m2")
                   else d.get("n_routed_experts", d.get("num_local_experts")) if model_type in ("glm4_moe", *MLA_MODEL_TYPES)
                   else d.get("num_experts", d.get("num_local_experts")))
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
    if model_type in ("mixtral", "gpt_oss", "minimax_m2"):  # each expert as wide as intermediate_size; the top k renormalised
        # (GPT-OSS takes a softmax over the k largest logits: the same as renormalising their probabilities)
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True)
    width = d.get("moe_intermediate_size")
    if not width:
        raise ConfigError(f"{source} is missing required field 'moe_intermediate_size' (model_type={model_type})")
    shared = 0
    if model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"):
        shared = int(d.get("shared_expert_intermediate_size") or 0)
    elif model_type in ("glm4_moe", *MLA_MODEL_TYPES):  # n_shared_experts experts' worth of width, always on
        shared = int(width) * int(d.get("n_shared_experts", 1))
    elif model_type in ("llama4_text", "llama4"):  # one shared expert as wide as a routed one
        shared = int(width)
    return dict(
        num_experts=int(num_experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(width),
        shared_expert_intermediate_size=shared,
        # (DeepSeek-V2's router never renormalises, whatever its config says)
        norm_topk_prob=bool(d.get("norm_topk_prob", model_type in ("glm4_moe", "deepseek_v3"))) and model_type != "deepseek_v2",
    )


JAXINFER_FIELDS = "jaxinfer_fields"
_NEWER_FIELDS = ("layer_types", "nope_layers", "local_rope_theta", "local_rope_scaling", "rotary_dim", "attention_scale",
                 "attn_logit_softcap", "final_logit_softcap", "scale_embeddings", "norm_weight_offset", "norm_layout",
                 "qk_norm", "qk_norm_scope", "hidden_act", "sliding_window", "qkv_bias", "o_bias", "attention_sinks",
                 "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha", "router_scoring", "router_correction_bias",
                 "router_groups", "router_top_groups", "router_group_score", "routed_scaling_factor", "shared_expert_gated", "first_dense_layers",
                 "moe_layer_step", "router_scales_inputs", "attention_chunk_size", "qk_l2_norm", "attn_temperature_scale",
                 "attn_temperature_floor", "global_head_dim", "global_kv_heads", "global_k_eq_v", "value_norm",
                 "kv_shared_layers", "wide_shared_mlp", "per_layer_input_size", "per_layer_vocab_size", "dense_and_experts",
                 "layer_scalar", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                 "index_topk", "index_heads", "index_head_dim", "index_rope_interleave", "linear_key_heads",
                 "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel", "attn_output_gate")


def _to_json(value):
    if isinstance(value, RopeScaling):
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(value).items()}
    return list(value) if isinstance(value, tuple) else value


def _from_json(name: str, value):
    if name == "local_rope_scaling":
        return RopeScaling(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in value.items()})
    return tuple(value) if isinstance(value, list) else value


def _gemma_fields(d: dict[str, Any], pattern: int) -> dict[str, Any]:
    """Gemma 2 / 3: (1 + w) norms before and after each branch, scaled embeddings and scores;
    a sliding layer and then a global one every `pattern` layers when layer_types is absent."""
    scalar = d.get("query_pre_attn_scalar", 256)
    return dict(
        attention_scale=float(scalar) ** -0.5,
        attn_logit_softcap=_optional_float(d.get("attn_logit_softcapping")),
        final_logit_softcap=_optional_float(d.get("final_logit_softcapping")),
        scale_embeddings=True,
        norm_weight_offset=1.0,
        norm_layout="sandwich",
        default_layer_types=lambda n: ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)],
    )


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    return _gemma_fields(d, int(d.get("sliding_window_pattern", 6)))


def _smollm3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3: every `no_rope_layer_interval`-th layer has no RoPE (no_rope_layers[i] == 0)."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(int(d["num_hidden_layers"]))]
    return dict(nope_layers=tuple(i for i, has_rope in enumerate(flags) if not has_rope))


def _minimax_m2_fields(d: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2: q/k RMSNorm over the whole projection, sigmoid routing with a correction bias;
    every layer full attention (its configs' attn_type_list, 1 = full, says so)."""
    if any(int(t) != 1 for t in d.get("attn_type_list") or ()):
        raise ConfigError(f"attn_type_list={d['attn_type_list']}: only full-attention layers (1) are supported for minimax_m2")
    return dict(qk_norm_scope="projection", router_scoring="sigmoid", router_correction_bias=True)


def _glm4_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5: its first `first_k_dense_replace` layers dense; the others route by sigmoid scores
    plus a correction bias, the k experts from the `topk_group` best of `n_group` groups (a group
    scored by its two best experts), their weights renormalised and scaled, beside ungated shared
    experts."""
    groups, top_groups = int(d.get("n_group", 1)), int(d.get("topk_group", 1))
    return dict(router_scoring="sigmoid", router_correction_bias=True, **_grouped_routing(d, groups, top_groups))


def _grouped_routing(d: dict[str, Any], groups: int, top_groups: int) -> dict[str, Any]:
    """The routing fields GLM-4.5 and DeepSeek share, checked: k experts from the `top_groups` best of
    `groups` groups, weights scaled, ungated shared experts, first_k_dense_replace dense layers."""
    experts = int(d.get("n_routed_experts", d.get("num_local_experts", 0)))
    if groups < 1 or experts % groups or not 1 <= top_groups <= groups:
        raise ConfigError(f"n_group={groups}, topk_group={top_groups}: n_group must divide n_routed_experts={experts} "
                          f"and topk_group lie in [1, n_group]")
    if int(d.get("num_experts_per_tok", 1)) > top_groups * (experts // groups):
        raise ConfigError(f"num_experts_per_tok={d.get('num_experts_per_tok')} exceeds the {top_groups * (experts // groups)} "
                          f"experts of topk_group={top_groups} groups")
    first_dense = int(d.get("first_k_dense_replace", 0))
    if not 0 <= first_dense < int(d["num_hidden_layers"]):
        raise ConfigError(f"first_k_dense_replace={first_dense}: must be in [0, num_hidden_layers)")
    return dict(router_groups=groups, router_top_groups=top_groups, routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_expert_gated=False, first_dense_layers=first_dense)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original: 0.1 m ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _mla_fields(d: dict[str, Any], interleaved: bool) -> dict[str, Any]:
    """Multi-head latent attention's fields (DeepSeek-V2 / V3): queries through q_lora_rank (or one
    q_proj without it), keys and values from the kv_lora_rank latent plus a shared RoPE key, scored
    with (nope + rope) ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared."""
    nope, rope = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default" and rp.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"])) ** 2
    return dict(kv_lora_rank=int(d["kv_lora_rank"]), q_lora_rank=int(d.get("q_lora_rank") or 0), qk_nope_head_dim=nope,
                v_head_dim=int(d["v_head_dim"]), rope_interleave=interleaved, attention_scale=scale)


def _deepseek_v3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 / R1, Kimi K2: MLA (its rope dims interleaved unless rope_interleave is false)
    and GLM-4.5's routing (DeepSeekMoE: sigmoid scores, a correction bias, groups of experts,
    shared experts, first_k_dense_replace dense layers)."""
    return dict(_glm4_moe_fields(d), **_mla_fields(d, bool(d.get("rope_interleave", True))))


def _sparse_attention_fields(d: dict[str, Any], index_rope_interleave: bool) -> dict[str, Any]:
    """DeepSeek-V3.2 and GLM-5: DeepSeek-V3's fields and the indexer of DeepSeek sparse attention,
    run in every layer (GLM's "shared" layers, which reuse an earlier layer's picks, are refused)."""
    model_type = d.get("model_type")
    if not d.get("q_lora_rank"):
        raise ConfigError(f"{model_type}: the sparse-attention indexer reads the low-rank query (q_lora_rank); it is missing")
    pattern = d.get("index_topk_pattern")
    kinds = list(d.get("indexer_types") or ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if pattern else []))
    if "shared" in kinds or int(d.get("index_topk_freq") or 1) > 1:
        raise ConfigError(f"{model_type}: indexer_types / index_topk_freq with \"shared\" layers (reusing an earlier "
                          "layer's top-k picks) are not supported; every layer must run its own indexer")
    mlp_kinds = d.get("mlp_layer_types")
    first_dense = int(d.get("first_k_dense_replace", 0))
    if mlp_kinds and list(mlp_kinds) != ["dense"] * first_dense + ["sparse"] * (len(mlp_kinds) - first_dense):
        raise ConfigError(f"{model_type}: mlp_layer_types={mlp_kinds}: only first_k_dense_replace dense layers, then "
                          "experts, are supported")
    kinds = list(d.get("layer_types") or [])
    if set(kinds) - {"indexed_attention"}:
        raise ConfigError(f"{model_type}: layer_types={kinds}: every layer must be \"indexed_attention\"")
    rope = int(d["qk_rope_head_dim"])
    fields = dict(layer_types=("full_attention",) * int(d["num_hidden_layers"]), index_topk=int(d["index_topk"]), index_heads=int(d["index_n_heads"]),
                  index_head_dim=int(d["index_head_dim"]), index_rope_interleave=index_rope_interleave)
    if fields["index_head_dim"] < rope or fields["index_topk"] < 1:
        raise ConfigError(f"{model_type}: index_head_dim={fields['index_head_dim']} must hold the qk_rope_head_dim={rope} "
                          f"rotary dims and index_topk={fields['index_topk']} be positive")
    return dict(_deepseek_v3_fields(d), **fields)


def _gated_deltanet_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers between full-attention ones (every
    full_attention_interval-th layer unless layer_types says), norms as 1 + w, q/k norms per head, a
    sigmoid gate on full attention's output."""
    heads = {name: int(d[key]) for name, key in (
        ("linear_key_heads", "linear_num_key_heads"), ("linear_value_heads", "linear_num_value_heads"),
        ("linear_key_head_dim", "linear_key_head_dim"), ("linear_value_head_dim", "linear_value_head_dim"),
        ("linear_conv_kernel", "linear_conv_kernel_dim"))}
    if heads["linear_value_heads"] % heads["linear_key_heads"]:
        raise ConfigError(f"linear_num_value_heads={heads['linear_value_heads']} is not a multiple of "
                          f"linear_num_key_heads={heads['linear_key_heads']}")
    interval = int(d.get("full_attention_interval") or 4)
    return dict(heads, norm_weight_offset=1.0, attn_output_gate=True, default_layer_types=lambda n: [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)])


def _deepseek_v2_fields(d: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite: MLA (rope dims as interleaved pairs, transformers' complex rotation)
    and softmax routing: the k best experts ("greedy"), or the k best of the topk_group groups
    whose best expert scores highest ("group_limited_greedy"); weights scaled, never renormalised;
    shared experts; first_k_dense_replace dense layers."""
    limited = (d.get("topk_method") or "greedy") == "group_limited_greedy"
    groups, top_groups = (int(d.get("n_group") or 1), int(d.get("topk_group") or 1)) if limited else (1, 1)
    return dict(router_group_score="max", **_grouped_routing(d, groups, top_groups), **_mla_fields(d, True))


def _llama4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Llama 4 (text): NoPE every `no_rope_layer_interval`-th layer (no_rope_layers[i] == 0), whose
    queries are scaled up with the position (attention temperature tuning); chunked local attention
    and L2 q/k norms on the RoPE layers; sigmoid routing whose weights scale the experts' inputs,
    beside an ungated shared expert; experts in every `interleave_moe_layer_step`-th layer."""
    num_layers = int(d["num_hidden_layers"])
    flags = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0) for i in range(num_layers)]
    step = int(d.get("interleave_moe_layer_step", 1))
    if d.get("moe_layers") is not None and list(d["moe_layers"]) != list(range(step - 1, num_layers, step)):
        raise ConfigError(f"moe_layers={list(d['moe_layers'])}: only every interleave_moe_layer_step-th layer "
                          f"({list(range(step - 1, num_layers, step))}) with experts is supported for llama4")
    chunk = d.get("attention_chunk_size", 8192)  # (transformers' default; an explicit null: no chunks)
    tuning = bool(d.get("attn_temperature_tuning", True))
    return dict(nope_layers=tuple(i for i, has_rope in enumerate(flags) if not has_rope), moe_layer_step=step,
                attention_chunk_size=int(chunk) if chunk else None, router_scoring="sigmoid", router_scales_inputs=True,
                shared_expert_gated=False, qk_l2_norm=bool(d.get("use_qk_norm", True)),
                attn_temperature_scale=float(d.get("attn_scale", 0.1)) if tuning else None,
                attn_temperature_floor=int(d.get("floor_scale", 8192)),
                default_layer_types=lambda n: ["chunked_attention" if flags[i] and chunk else "full_attention" for i in range(n)])


def _gemma4_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (text): sliding and global layers whose global ones have their own head dim (512),
    KV heads and, with attention_k_eq_v, values from the key projection; q, k and v RMS-normed per
    head (v without a weight) and scores unscaled; plain-w norms on both sides of each branch;
    optional per-layer input embeddings, KV shared by the last layers, and a MoE block beside the
    dense MLP. (HF reads a per_layer_config of the global layers' overrides, or global_head_dim and
    num_global_key_value_heads.)"""
    num_layers = int(d["num_hidden_layers"])
    layer_types, shared, wide = gemma4_layer_plan(d)  # (the last layer always full attention, as transformers forces it)
    overrides = {int(k): dict(v) for k, v in (d.get("per_layer_config") or {}).items()}
    global_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    if overrides:
        if set(overrides) != set(global_layers) or any(set(o) - {"head_dim", "num_key_value_heads"} for o in overrides.values()) \
                or len({tuple(sorted(o.items())) for o in overrides.values()}) != 1:
            raise ConfigError(f"per_layer_config={d['per_layer_config']}: only one head_dim / num_key_value_heads override "
                              "shared by every full_attention layer is supported for gemma4")
        o = overrides[global_layers[0]]
        global_head_dim, global_kv_heads = o.get("head_dim", 0), o.get("num_key_value_heads", 0)
    else:
        global_head_dim = d.get("global_head_dim", 512)
        global_kv_heads = d.get("num_global_key_value_heads") if k_eq_v else None
    # 0: the model's own (a saved per_layer_config leaves out what equals it)
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    kv_heads = int(d.get("num_key_value_heads") or d["num_attention_heads"])
    global_head_dim = 0 if int(global_head_dim or 0) == head_dim else global_head_dim
    global_kv_heads = 0 if int(global_kv_heads or 0) == kv_heads else global_kv_heads
    if not 0 <= shared < num_layers:
        raise ConfigError(f"num_kv_shared_layers={shared}: must lie in [0, num_hidden_layers)")
    if shared and set(layer_types[num_layers - shared:]) - set(layer_types[: num_layers - shared]):
        raise ConfigError(f"num_kv_shared_layers={shared}: a shared layer's kind has no earlier layer to share K/V with")
    moe = {}
    if d.get("enable_moe_block"):
        moe = dict(num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["top_k_experts"]),
                   moe_intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=True, dense_and_experts=True)
    ple = int(d.get("hidden_size_per_layer_input") or 0)
    return dict(
        attention_scale=1.0, final_logit_softcap=_optional_float(d.get("final_logit_softcapping")), scale_embeddings=True,
        norm_layout="sandwich", value_norm=True, layer_scalar=True,
        global_head_dim=int(global_head_dim or 0), global_kv_heads=int(global_kv_heads or 0), global_k_eq_v=k_eq_v,
        kv_shared_layers=shared, wide_shared_mlp=wide,
        per_layer_input_size=ple, per_layer_vocab_size=int(d.get("vocab_size_per_layer_input") or d["vocab_size"]) if ple else 0,
        layer_types=layer_types, **moe)


def _olmo_fields(d: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2 / 3: norms after each branch only; q/k RMSNorm over the whole projection."""
    return dict(norm_layout="post", qk_norm_scope="projection")


_FAMILY_FIELDS = {
    "gemma2": lambda d: _gemma_fields(d, 2),
    "gemma3_text": _gemma3_fields,
    "gemma3": _gemma3_fields,
    "smollm3": _smollm3_fields,
    "olmo2": _olmo_fields,
    "olmo3": lambda d: dict(_olmo_fields(d), default_layer_types=lambda n: [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]),
    # MiniMax-M2: q/k RMSNorm over the whole projection, sigmoid routing with a correction bias
    "minimax_m2": lambda d: _minimax_m2_fields(d),
    "glm4_moe": lambda d: _glm4_moe_fields(d),
    "deepseek_v2": lambda d: _deepseek_v2_fields(d),
    "deepseek_v3": lambda d: _deepseek_v3_fields(d),
    "deepseek_v32": lambda d: _sparse_attention_fields(d, index_rope_interleave=False),
    "glm_moe_dsa": lambda d: _sparse_attention_fields(d, index_rope_interleave=True),
    **{t: _gated_deltanet_fields for t in LINEAR_ATTENTION_MODEL_TYPES},
    "llama4_text": lambda d: _llama4_fields(d),
    "llama4": lambda d: _llama4_fields(d),
    "gemma4_text": _gemma4_fields,
    "gemma4": _gemma4_fields,
    "gpt_oss": lambda d: dict(attention_sinks=True, router_bias=True, expert_bias=True,
                              swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                              default_layer_types=lambda n: ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                             for i in range(n)]),
}

# Config switches a family's file does not implement: key -> the values it accepts.
_REFUSED_SWITCHES = {
    "gemma2": {"use_bidirectional_attention": (None, False)},
    "gemma3_text": {"use_bidirectional_attention": (None, False)},
    "gemma3": {"use_bidirectional_attention": (None, False)},
    # "vision": image tokens see each other both ways, which a text prompt never has
    **{t: {"use_bidirectional_attention": (None, False, "vision"), "attention_bias": (None, False)} for t in ("gemma4_text", "gemma4")},
    # the released configs name the q/k norm "per_layer" (over the whole projection, as implemented)
    "deepseek_v3": {"attention_bias": (None, False)},
    "deepseek_v2": {"attention_bias": (None, False), "mlp_bias": (None, False),
                    "topk_method": (None, "greedy", "group_limited_greedy")},
    "minimax_m2": {"use_qk_norm": (None, True), "qk_norm_type": (None, "per_layer"), "use_routing_bias": (None, True),
                   "scoring_func": (None, "sigmoid"), "shared_intermediate_size": (None, 0)},
}


def _refuse_unsupported_switches(d: dict[str, Any], model_type: str, source: str) -> None:
    for key, accepted in _REFUSED_SWITCHES.get(model_type, {}).items():
        if d.get(key) not in accepted:
            raise ConfigError(f"{source}: {key}={d.get(key)!r} is not supported for {model_type} (supported: {accepted})")


def _parse_activation(d: dict[str, Any], model_type: str, source: str) -> str:
    """The MLP gate's activation: Gemma names it hidden_activation, the others hidden_act."""
    name = d.get("hidden_activation") if model_type in GEMMA_MODEL_TYPES else None
    name = name or d.get("hidden_act", "silu")
    act = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(name)
    if act is None:
        raise ConfigError(f"{source}: hidden_act={name!r} is not supported (supported: silu, gelu_pytorch_tanh)")
    return act


def _optional_float(x) -> float | None:
    return None if x is None else float(x)


def _pop_mrope_section(d: dict[str, Any], default: tuple[int, ...]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(d without M-RoPE's marks, mrope_section) from `rope_parameters` (transformers 5) or
    `rope_scaling` (the released configs: {"type": "mrope", "mrope_section": [16, 24, 24]}; Qwen3-VL's
    {"mrope_interleaved": true, "mrope_section": [24, 20, 20]}); a config without one has
    transformers' `default` (Qwen2.5-VL [16, 24, 24], Qwen3-VL [24, 20, 20])."""
    section, d = None, dict(d)
    for key in ("rope_scaling", "rope_parameters"):  # (the latter wins, as in _parse_rope)
        spec = d.get(key)
        if isinstance(spec, dict) and ("mrope_section" in spec or "mrope" in (spec.get("rope_type"), spec.get("type"))):
            spec = dict(spec)
            section = spec.pop("mrope_section", section)
            spec.pop("mrope_interleaved", None)
            for name in ("rope_type", "type"):
                if spec.get(name) == "mrope":  # M-RoPE over otherwise default frequencies
                    spec[name] = "default"
            d[key] = spec
    return d, tuple(int(x) for x in (section or default))


def _parse_rope(d: dict[str, Any], source: str):
    """(theta, scaling, partial_rotary_factor, local) from the transformers>=5 `rope_parameters`
    (one dict, or one per layer type) or the older `rope_theta` + `rope_scaling`. `local` is
    (theta, scaling) of the sliding layers when they have their own RoPE (Gemma 3), else None."""
    params = d.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # one dict per layer type
        full = dict(params.get("full_attention") or {})
        sliding = params.get("sliding_attention")
        theta, scaling, factor = _parse_rope_spec(full, d, source)
        local = None
        if sliding is not None:
            local_theta, local_scaling, local_factor = _parse_rope_spec(dict(sliding), d, source)
            if local_factor != factor:
                raise ConfigError(f"{source}: the layer types' partial_rotary_factor differ ({factor}, {local_factor})")
            if (local_theta, local_scaling) != (theta, scaling):
                local = (local_theta, local_scaling)
        return theta, scaling, factor, local
    spec = dict(d.get("rope_scaling") or {})
    spec.update(params)
    theta, scaling, factor = _parse_rope_spec(spec, d, source)
    local = None
    if d.get("rope_local_base_freq") is not None and float(d["rope_local_base_freq"]) != theta:  # Gemma 3, older configs
        local = (float(d["rope_local_base_freq"]), RopeScaling())
    return theta, scaling, factor, local


def _parse_rope_spec(spec: dict[str, Any], d: dict[str, Any], source: str) -> tuple[float, RopeScaling, float]:
    theta = float(spec.get("rope_theta", d.get("rope_theta", 10000.0)))
    default = d.get("partial_rotary_factor")
    if default is None and d.get("rotary_dim"):  # MiniMax-M2's released configs name the rotary dims
        default = int(d["rotary_dim"]) / int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    factor = float(spec.get("partial_rotary_factor", default if default is not None else 1.0) or 1.0)
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type in ("su",):  # Phi-3's old name
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, RopeScaling(), factor
    if rope_type == "proportional":  # partial_rotary_factor keeps the whole head here (RopeScaling.rotated_fraction)
        return theta, RopeScaling(rope_type="proportional", factor=float(spec.get("factor") or 1.0), rotated_fraction=factor), 1.0
    max_pos = d.get("max_position_embeddings", 8192)
    original = int(spec.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or max_pos)
    scale = spec.get("factor")
    if scale is None and rope_type in ("yarn", "longrope"):
        scale = max_pos / original  # Phi-3 gives the two lengths, not the factor
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scale if scale is not None else 1.0),
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(spec.get("beta_fast") or 32.0),
        beta_slow=float(spec.get("beta_slow") or 1.0),
        truncate=bool(spec.get("truncate", True)),
        attention_factor=_optional_float(spec.get("attention_factor")),
        mscale=_optional_float(spec.get("mscale")),
        mscale_all_dim=_optional_float(spec.get("mscale_all_dim")),
        short_factor=tuple(float(x) for x in spec.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in spec.get("long_factor") or ()),
        freq_factors=tuple(float(x) for x in spec.get("freq_factors") or ()),
    ), factor

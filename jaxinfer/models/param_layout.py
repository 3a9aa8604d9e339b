"""The parameter layout of the decoder: every parameter's shape, its logical axes, and which HF
projection fills which columns of a fused parameter, for a tensor-parallel degree `tp`.

Flat names; linear weights are [in, out]; per-layer weights stack on a leading [L] axis, expert
weights on [L, E]:

    embed [V, H]   final_norm [H]   lm_head [H, V] (absent with tied embeddings)
    layers.attn_norm [L, H]   layers.mlp_norm [L, H]      (norm_layout "pre": before each branch)
    "sandwich" (Gemma) adds layers.post_attn_norm [L, H], layers.post_mlp_norm [L, H] (after each
    branch); "post" (OLMo 2) has only those two
    layers.qkv_proj [L, H, (Hq + 2*Hkv')*D]                    layers.o_proj [L, Hq*D, H]
    dense MLP:  layers.gate_up_proj [L, H, 2*I]                 layers.down_proj [L, I, H]
    MoE:        layers.router [L, H, E]
                layers.experts_gate_up [L, E, H, 2*Ie]          layers.experts_down [L, E, Ie, H]
                shared experts: layers.shared_gate_up [L, H, 2*Is], layers.shared_down [L, Is, H],
                           behind a gate (Qwen2-MoE): layers.shared_expert_gate [L, H, 1]
    GLM-4.5's first `first_dense_layers` (k) layers are dense, and Llama 4 Maverick gives experts to
    every `moe_layer_step`-th layer only (`has_experts`): the MoE parameters stack over the MoE
    layers, the dense MLP's over the dense ones, attention's over all [L] (`stack_slots`).
    optional: layers.qkv_bias [L, (Hq + 2*Hkv')*D], layers.o_bias [L, H],
              layers.gate_up_bias [L, 2*I], layers.down_bias [L, H], layers.{q,k}_norm [L, D]
              (over the whole projection, OLMo 2: layers.q_norm [L, Hq*D], layers.k_norm [L, Hkv'*D])
    MiniMax-M2: layers.router_correction_bias [L, E] (picks the experts, does not weigh them)
    GPT-OSS:    layers.sinks [L, Hq], layers.router_bias [L, E],
                layers.experts_gate_up_bias [L, E, 2*Ie], layers.experts_down_bias [L, E, H]

**Fused columns, shard-major.** Tensor parallelism splits the last axis of a fused parameter into
`tp` equal, contiguous shards, and each shard must hold whole heads and matching gate/up
columns. So the columns are laid out shard by shard: `qkv_proj` is
`[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]` (shard t: its Hq/tp query heads and the KV heads they
use) and `gate_up_proj` is `[gate_0 | up_0 | gate_1 | up_1 | ...]`. With tp = 1 that is plain
`[q | k | v]` and `[gate | up]`, the layout checkpoints are converted to.

**Replicated KV heads.** With more shards than KV heads (tp > Hkv) every shard still needs the
KV head its query heads use, so each KV head is stored tp / Hkv times (Hkv' = tp, one per shard),
and the KV cache has tp heads. Otherwise Hkv' = Hkv. `sharding.mesh.kv_heads_per_shard` decides.

Logical axis names (`param_axes`) say what each dimension is; `sharding.rules` maps them to mesh
axes (tensor parallelism shards "qkv", "heads", "mlp" and "embed_tp", expert parallelism "experts").

**Checkpoints stored quantized** (GGUF blocks, AWQ, GPTQ) load as `QuantizedWeight`s: the loader
fills `<param>:qweight`, `<param>:scales` and `<param>:offsets` (`quantized_loader_spec`), each
with the param's axes, in [..., K, N] orientation. A quantized embedding is stored as the tied LM
head reads it, [H, V] (`QUANTIZED_EMBED_AXES`): the LM head is then a quantized matmul, and a
token's embedding is a column of it.

**The LM head's split** (`lm_head_parallel`): "hidden" (the default) splits the embedding table and
the LM head on the hidden dimension ("embed_tp"); "vocab" splits them on the vocabulary
("vocab_tp", `VOCAB_SPLIT_AXES`: vLLM's VocabParallelEmbedding / ParallelLMHead), so the step's
logits stay split on the vocabulary and are sampled there (`jaxinfer.ops.sampling.Vocab`).
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from sharding.mesh import kv_heads_per_shard

Segment = tuple[str, int, int]  # (part, first row of that part's HF tensor, width)


def num_kv_heads_stored(config: ModelConfig, tp: int = 1) -> int:
    """KV heads in the cache and in qkv_proj: Hkv, or tp when KV heads are replicated."""
    return kv_heads_per_shard(config.num_kv_heads, tp) * tp


# The parameters of a MoE layer's MLP: stacked over the MoE layers only; a dense MLP's over the
# dense layers (`stack_slots`).
MOE_PARAMS = frozenset(f"layers.{n}" for n in (
    "router", "router_bias", "router_correction_bias", "experts_gate_up", "experts_down", "experts_gate_up_bias",
    "experts_down_bias", "shared_gate_up", "shared_down", "shared_expert_gate"))
DENSE_MLP_PARAMS = frozenset(f"layers.{n}" for n in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"))


# Gemma 4's layers of another shape keep those weights in stacks of their own, under a prefix:
# the global layers' attention ("global_": their own head dim and KV heads) and the KV-shared
# layers' double-wide dense MLP ("wide_").
GLOBAL_ATTENTION_PARAMS = ("qkv_proj", "o_proj", "q_norm", "k_norm")
WIDE_MLP_PARAMS = ("gate_up_proj", "down_proj")
# Hybrid models (Qwen3-Next, Qwen3.5): attention's weights stack over the full-attention layers, a
# Gated DeltaNet's over the linear-attention layers
ATTENTION_PARAMS = frozenset(f"layers.{n}" for n in ("qkv_proj", "o_proj", "q_norm", "k_norm", "qkv_bias", "o_bias", "attn_gate"))
LINEAR_ATTENTION_PARAMS = frozenset(f"layers.{n}" for n in (
    "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv", "lin_dt_bias", "lin_a_log", "lin_norm", "lin_out"))


def has_experts(config: ModelConfig, layer: int) -> bool:
    """Whether the layer's MLP is a mixture of experts: in a MoE model, every moe_layer_step-th layer
    from first_dense_layers on (GLM-4.5's first layers and Llama 4 Maverick's odd ones are dense)."""
    start = config.first_dense_layers
    return config.is_moe and layer >= start and (layer - start + 1) % config.moe_layer_step == 0


def num_moe_layers(config: ModelConfig) -> int:
    """Layers whose MLP is a mixture of experts."""
    return sum(has_experts(config, i) for i in range(config.num_layers))


def has_global_attention_shape(config: ModelConfig, layer: int) -> bool:
    """Whether the layer's attention weights are a global layer's of their own shape (Gemma 4)."""
    return config.layer_kind(layer).head_dim is not None


def has_wide_mlp(config: ModelConfig, layer: int) -> bool:
    return config.wide_shared_mlp and config.is_kv_shared(layer)


def stack_of(config: ModelConfig, name: str, layer: int) -> str | None:
    """The stacked parameter holding layer `layer`'s weight `name` ("qkv_proj", "router", ...), or
    None when the layer has no such weight: a MoE parameter stacks over the MoE layers, a dense
    MLP's over the dense ones (every layer where experts run beside it: Gemma 4), Gemma 4's global
    attention and wide MLPs over those layers, every other one over all layers."""
    if f"layers.{name}" in LINEAR_ATTENTION_PARAMS:
        return f"layers.{name}" if config.layer_kind(layer).linear else None
    if f"layers.{name}" in ATTENTION_PARAMS and config.layer_kind(layer).linear:
        return None
    if f"layers.{name}" in MOE_PARAMS:
        return f"layers.{name}" if has_experts(config, layer) else None
    if f"layers.{name}" in DENSE_MLP_PARAMS:
        if has_experts(config, layer) and not config.dense_and_experts:
            return None
        return f"layers.wide_{name}" if name in WIDE_MLP_PARAMS and has_wide_mlp(config, layer) else f"layers.{name}"
    if name in GLOBAL_ATTENTION_PARAMS and has_global_attention_shape(config, layer):
        return f"layers.global_{name}"
    return f"layers.{name}"


def base_name(stacked: str) -> str:
    """"layers.global_qkv_proj" -> "qkv_proj": the weight a layer reads from a stacked parameter."""
    name = stacked.split(".", 1)[1]
    for prefix, names in (("global_", GLOBAL_ATTENTION_PARAMS), ("wide_", WIDE_MLP_PARAMS)):
        if name.startswith(prefix) and name[len(prefix):] in names:
            return name[len(prefix):]
    return name


def stack_slots(config: ModelConfig, name: str) -> tuple[int, ...]:
    """Per layer: its slot on the stacked axis of parameter `name` (-1: the layer has no such
    weight), `stack_of`'s layers in order."""
    mine = [stack_of(config, base_name(name), i) == name for i in range(config.num_layers)]
    return tuple(sum(mine[:i]) if m else -1 for i, m in enumerate(mine))


def _stack_size(config: ModelConfig, name: str) -> int:
    return sum(slot >= 0 for slot in stack_slots(config, name))


def param_shapes(config: ModelConfig, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Flat parameter name -> global shape, for exactly the parameters this config has."""
    c = config
    L, H, V = c.num_layers, c.hidden_size, c.vocab_size
    norms = {"pre": ("attn_norm", "mlp_norm"), "sandwich": ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"),
             "post": ("post_attn_norm", "post_mlp_norm")}[c.norm_layout]
    shapes = {"embed": (V, H), "final_norm": (H,), **{f"layers.{name}": (L, H) for name in norms}}
    kinds = c.layer_kinds()
    if c.is_mla:  # DeepSeek's latent attention instead of qkv_proj (models.deepseek)
        shapes.update(_mla_shapes(c))
        kinds = ()
    for prefix, kind in (("", next((k for k in kinds if k.head_dim is None), None)),
                         ("global_", next((k for k in kinds if k.head_dim is not None), None))):
        if kind is None:
            continue
        n, D = _stack_size(c, f"layers.{prefix}qkv_proj"), c.kind_head_dim(kind)
        q_dim, kv_dim = c.num_heads * D, kv_heads_per_shard(c.kind_kv_heads(kind), tp) * tp * D
        qkv_dim = q_dim + (1 if kind.k_eq_v else 2) * kv_dim  # Gemma 4's global layers: [q | k], the values are k
        shapes.update({f"layers.{prefix}qkv_proj": (n, H, qkv_dim), f"layers.{prefix}o_proj": (n, q_dim, H)})
        if c.qk_norm and c.qk_norm_scope == "head":
            shapes.update({f"layers.{prefix}q_norm": (n, D), f"layers.{prefix}k_norm": (n, D)})
        elif c.qk_norm:  # over the whole projection (OLMo 2): sharded with the heads
            shapes.update({f"layers.{prefix}q_norm": (n, q_dim), f"layers.{prefix}k_norm": (n, kv_dim)})
        if c.qkv_bias and not prefix:
            shapes["layers.qkv_bias"] = (L, qkv_dim)
    M = num_moe_layers(c)  # the layers with experts (GLM-4.5's first few and Llama 4 Maverick's odd ones are dense)
    if c.is_moe:
        E, Ie, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        shapes.update({
            "layers.router": (M, H, E),
            "layers.experts_gate_up": (M, E, H, 2 * Ie),
            "layers.experts_down": (M, E, Ie, H),
        })
        if Is:
            shapes.update({"layers.shared_gate_up": (M, H, 2 * Is), "layers.shared_down": (M, Is, H)})
            if c.shared_expert_gated:
                shapes["layers.shared_expert_gate"] = (M, H, 1)
    for prefix, width in (("", c.intermediate_size), ("wide_", 2 * c.intermediate_size)):
        n = _stack_size(c, f"layers.{prefix}gate_up_proj")  # the dense layers: every layer of a dense model, ...
        if n:
            shapes.update({f"layers.{prefix}gate_up_proj": (n, H, 2 * width), f"layers.{prefix}down_proj": (n, width, H)})
            if c.mlp_bias and not prefix:
                shapes.update({"layers.gate_up_bias": (n, 2 * width), "layers.down_bias": (n, H)})
    if c.attention_sinks:
        shapes["layers.sinks"] = (L, c.num_heads)
    if c.router_bias:
        shapes["layers.router_bias"] = (M, c.num_experts)
    if c.router_correction_bias:
        shapes["layers.router_correction_bias"] = (M, c.num_experts)
    if c.expert_bias:
        shapes.update({"layers.experts_gate_up_bias": (M, c.num_experts, 2 * c.moe_intermediate_size),
                       "layers.experts_down_bias": (M, c.num_experts, H)})
    if c.dense_and_experts:  # Gemma 4's MoE block: router scales and the norms around the experts
        shapes.update({"layers.router_scale": (M, H), "layers.expert_scale": (M, c.num_experts),
                       "layers.post_dense_norm": (M, H), "layers.experts_norm": (M, H), "layers.post_experts_norm": (M, H)})
    if c.per_layer_input_size:  # Gemma 4's per-layer input embeddings
        P = c.per_layer_input_size
        shapes.update({"embed_per_layer": (c.per_layer_vocab_size, L * P), "per_layer_proj": (H, L * P),
                       "per_layer_proj_norm": (P,), "layers.ple_gate": (L, H, P), "layers.ple_proj": (L, P, H),
                       "layers.ple_norm": (L, H)})
    if c.layer_scalar:
        shapes["layers.layer_scalar"] = (L, 1)
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    if c.attn_output_gate:  # the gate of full attention's output, per query head
        shapes["layers.attn_gate"] = (_stack_size(c, "layers.qkv_proj"), H, c.num_heads * c.head_dim)
    if c.has_linear_layers:
        shapes.update(_linear_attention_shapes(c))
    if c.mtp_module:  # the MTP module's input: eh_proj([enorm(embedding) | hnorm(target's hidden state)])
        shapes.update({"layers.mtp_enorm": (L, H), "layers.mtp_hnorm": (L, H), "layers.mtp_eh_proj": (L, 2 * H, H)})
    if c.o_bias:
        shapes["layers.o_bias"] = (L, H)
    return shapes


def _linear_attention_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet's weights (Qwen3-Next, Qwen3.5), over the n linear layers:

        lin_qkv [n, H, 2*Kd + Vd]   q | k | v, the convolution's channels (Kd = key heads x key dim,
                                    Vd = value heads x value dim)
        lin_z [n, H, Vd]            the output gate      lin_b, lin_a [n, H, Hv]: beta's and the decay's
        lin_conv [n, K, 2*Kd + Vd]  the depthwise causal convolution's K taps per channel
        lin_dt_bias, lin_a_log [n, Hv]    lin_norm [n, Dv] (the gated RMSNorm's weight)    lin_out [n, Vd, H]"""
    n, H, Hv = _stack_size(c, "layers.lin_qkv"), c.hidden_size, c.linear_value_heads
    kd, vd = c.linear_key_heads * c.linear_key_head_dim, Hv * c.linear_value_head_dim
    return {"layers.lin_qkv": (n, H, 2 * kd + vd), "layers.lin_z": (n, H, vd), "layers.lin_b": (n, H, Hv),
            "layers.lin_a": (n, H, Hv), "layers.lin_conv": (n, c.linear_conv_kernel, 2 * kd + vd), "layers.lin_dt_bias": (n, Hv),
            "layers.lin_a_log": (n, Hv), "layers.lin_norm": (n, c.linear_value_head_dim), "layers.lin_out": (n, vd, H)}


def _mla_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's weights (DeepSeek), [in, out] like every linear here:

        q_proj [L, H, Hq*(nope + rope)]  or  q_a_proj [L, H, q_rank], q_a_norm [L, q_rank],
                                             q_b_proj [L, q_rank, Hq*(nope + rope)]
        kv_a_proj [L, H, r + rope]   the latent and the shared RoPE key (HF's kv_a_proj_with_mqa)
        kv_a_norm [L, r]
        kv_b_proj [L, r, Hq*(nope + v)]   each head's key (nope) and value up-projections
        o_proj [L, Hq*v, H]
        with sparse attention, the indexer: index_wq [L, q_rank, Hi*Di], index_wk [L, H, Di],
        index_k_norm and index_k_norm_bias [L, Di] (a LayerNorm), index_weights [L, H, Hi]

    The head-major columns of q and kv_b (and o_proj's rows) split over the tensor shards by heads."""
    L, H, Hq, r = c.num_layers, c.hidden_size, c.num_heads, c.kv_lora_rank
    rope, qk = c.rotary_dim, c.qk_nope_head_dim + c.rotary_dim
    shapes = {"layers.kv_a_proj": (L, H, r + rope), "layers.kv_a_norm": (L, r),
              "layers.kv_b_proj": (L, r, Hq * (c.qk_nope_head_dim + c.v_head_dim)), "layers.o_proj": (L, Hq * c.v_head_dim, H)}
    if c.q_lora_rank:
        shapes.update({"layers.q_a_proj": (L, H, c.q_lora_rank), "layers.q_a_norm": (L, c.q_lora_rank),
                       "layers.q_b_proj": (L, c.q_lora_rank, Hq * qk)})
    else:
        shapes["layers.q_proj"] = (L, H, Hq * qk)
    if c.index_topk:  # DeepSeek sparse attention's indexer, whole on every tensor shard
        Hi, Di = c.index_heads, c.index_head_dim
        shapes.update({"layers.index_wq": (L, c.q_lora_rank, Hi * Di), "layers.index_wk": (L, H, Di),
                       "layers.index_k_norm": (L, Di), "layers.index_k_norm_bias": (L, Di),
                       "layers.index_weights": (L, H, Hi)})
    return shapes


# What each dimension of each parameter is. Names ending in "norm" are [L, H] or [L, D] vectors.
_AXES = {
    "embed": ("vocab", "embed_tp"),
    "lm_head": ("embed_tp", "vocab"),
    "final_norm": ("embed",),
    "layers.attn_norm": ("layers", "embed"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.post_attn_norm": ("layers", "embed"),
    "layers.post_mlp_norm": ("layers", "embed"),
    "layers.qkv_proj": ("layers", "embed", "qkv"),
    "layers.qkv_bias": ("layers", "qkv"),
    "layers.o_proj": ("layers", "heads", "embed"),
    "layers.o_bias": ("layers", "embed"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.gate_up_proj": ("layers", "embed", "mlp"),
    "layers.gate_up_bias": ("layers", "mlp"),
    "layers.down_proj": ("layers", "mlp", "embed"),
    "layers.down_bias": ("layers", "embed"),
    "layers.router": ("layers", "embed", "num_experts"),
    "layers.experts_gate_up": ("layers", "experts", "embed", "mlp"),
    "layers.experts_down": ("layers", "experts", "mlp", "embed"),
    "layers.shared_gate_up": ("layers", "embed", "mlp"),
    "layers.shared_down": ("layers", "mlp", "embed"),
    "layers.shared_expert_gate": ("layers", "embed", None),
    "layers.sinks": ("layers", "q_heads"),
    "layers.router_bias": ("layers", "num_experts"),
    "layers.router_correction_bias": ("layers", "num_experts"),
    "layers.experts_gate_up_bias": ("layers", "experts", "mlp"),
    "layers.experts_down_bias": ("layers", "num_experts", "embed"),  # every device: added once, after the experts
    "layers.global_qkv_proj": ("layers", "embed", "qkv"),
    "layers.global_o_proj": ("layers", "heads", "embed"),
    "layers.global_q_norm": ("layers", "head_dim"),
    "layers.global_k_norm": ("layers", "head_dim"),
    "layers.wide_gate_up_proj": ("layers", "embed", "mlp"),
    "layers.wide_down_proj": ("layers", "mlp", "embed"),
    "layers.router_scale": ("layers", "embed"),
    "layers.expert_scale": ("layers", "num_experts"),
    "layers.post_dense_norm": ("layers", "embed"),
    "layers.experts_norm": ("layers", "embed"),
    "layers.post_experts_norm": ("layers", "embed"),
    "embed_per_layer": ("vocab", None),
    "per_layer_proj": ("embed", None),
    "per_layer_proj_norm": (None,),
    "layers.ple_gate": ("layers", "embed", None),
    "layers.ple_proj": ("layers", None, "embed"),
    "layers.ple_norm": ("layers", "embed"),
    "layers.layer_scalar": ("layers", None),
    "layers.q_proj": ("layers", "embed", "heads"),
    "layers.q_a_proj": ("layers", "embed", None),
    "layers.q_a_norm": ("layers", None),
    "layers.q_b_proj": ("layers", None, "heads"),
    "layers.kv_a_proj": ("layers", "embed", None),
    "layers.kv_a_norm": ("layers", None),
    "layers.kv_b_proj": ("layers", None, "heads"),
    "layers.index_wq": ("layers", None, None),
    "layers.index_wk": ("layers", "embed", None),
    "layers.index_k_norm": ("layers", None),
    "layers.index_k_norm_bias": ("layers", None),
    "layers.index_weights": ("layers", "embed", None),
    "layers.attn_gate": ("layers", "embed", "heads"),
    # a Gated DeltaNet's key and value heads split over the tensor shards (its channels shard-major)
    "layers.lin_qkv": ("layers", "embed", "qkv"),
    "layers.lin_z": ("layers", "embed", "heads"),
    "layers.lin_b": ("layers", "embed", "heads"),
    "layers.lin_a": ("layers", "embed", "heads"),
    "layers.lin_conv": ("layers", None, "qkv"),
    "layers.lin_dt_bias": ("layers", "heads"),
    "layers.lin_a_log": ("layers", "heads"),
    "layers.lin_norm": ("layers", None),
    "layers.lin_out": ("layers", "heads", "embed"),
    "layers.mtp_enorm": ("layers", "embed"),
    "layers.mtp_hnorm": ("layers", "embed"),
    "layers.mtp_eh_proj": ("layers", None, "embed"),
}


LM_HEAD_PARALLEL = ("hidden", "vocab")  # how the embedding table and LM head split over "tensor"
# lm_head_parallel="vocab": the embedding table and LM head split on the vocabulary instead
VOCAB_SPLIT_AXES = {"embed": ("vocab_tp", None), "lm_head": (None, "vocab_tp")}
QUANTIZED_EMBED_VOCAB_SPLIT_AXES = (None, "vocab_tp")  # a quantized embedding [H, V], vocabulary split


def param_axes(config: ModelConfig, lm_head_parallel: str = "hidden") -> dict[str, tuple[str | None, ...]]:
    """Flat parameter name -> logical axis name of each of its dimensions (the embedding table and
    LM head split as `lm_head_parallel` says: LM_HEAD_PARALLEL)."""
    split = VOCAB_SPLIT_AXES if lm_head_parallel == "vocab" else {}
    axes = {name: split.get(name, _AXES[name]) for name in param_shapes(config)}
    if config.qk_norm and config.qk_norm_scope == "projection":  # [L, heads * D]: split with the heads
        axes.update({"layers.q_norm": ("layers", "heads"), "layers.k_norm": ("layers", "heads")})
    return axes


QUANTIZED_EMBED_AXES = ("embed_tp", "vocab")  # a quantized embedding: [H, V], the LM head's orientation


def quantized_axes(name: str, lm_head_parallel: str = "hidden") -> tuple[str | None, ...]:
    """The logical axes of the arrays of a quantized parameter ([..., K or K/2 or K/g, N])."""
    if lm_head_parallel == "vocab" and name in ("embed", "lm_head"):
        return QUANTIZED_EMBED_VOCAB_SPLIT_AXES
    return QUANTIZED_EMBED_AXES if name == "embed" else _AXES[name]


def quantized_in_out(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(K, N) of a parameter stored quantized: its last two dims ([V, H] embed: (H, V))."""
    return (shape[-1], shape[-2]) if name == "embed" else (shape[-2], shape[-1])


def _qkv_columns(num_heads: int, kv_heads: int, D: int, tp: int, parts=("q", "k", "v")) -> tuple[Segment, ...]:
    q_local = num_heads // tp * D
    kv_local = kv_heads_per_shard(kv_heads, tp)
    shards_per_kv_head = max(1, tp // kv_heads)  # > 1: KV heads replicated
    qkv = []
    for t in range(tp):
        first_kv = t // shards_per_kv_head if shards_per_kv_head > 1 else t * kv_local
        qkv += [("q", t * q_local, q_local)] + [(p, first_kv * D, kv_local * D) for p in parts[1:]]
    return tuple(qkv)


def param_columns(config: ModelConfig, tp: int = 1) -> dict[str, tuple[Segment, ...]]:
    """Fused parameter -> the HF rows on its last axis, shard by shard (see the module docstring)."""
    c = config

    def gate_up(width: int) -> list[Segment]:
        local = width // tp
        return [seg for t in range(tp) for seg in (("gate", t * local, local), ("up", t * local, local))]

    qkv = _qkv_columns(c.num_heads, c.num_kv_heads, c.head_dim, tp)
    columns = {"layers.qkv_proj": qkv, "layers.qkv_bias": qkv}
    glob = next((k for k in c.layer_kinds() if k.head_dim is not None), None)
    if glob is not None:
        columns["layers.global_qkv_proj"] = _qkv_columns(c.num_heads, c.kind_kv_heads(glob), c.kind_head_dim(glob), tp,
                                                         ("q", "k") if glob.k_eq_v else ("q", "k", "v"))
    if c.is_moe:
        columns["layers.experts_gate_up"] = columns["layers.experts_gate_up_bias"] = tuple(gate_up(c.moe_intermediate_size))
        if c.shared_expert_intermediate_size:
            columns["layers.shared_gate_up"] = tuple(gate_up(c.shared_expert_intermediate_size))
    if c.has_linear_layers:  # a Gated DeltaNet's q | k | v channels: each shard its key and value heads'
        kd, vd = c.linear_key_heads * c.linear_key_head_dim // tp, c.linear_value_heads * c.linear_value_head_dim // tp
        channels = tuple(seg for t in range(tp) for seg in (("q", t * kd, kd), ("k", t * kd, kd), ("v", t * vd, vd)))
        columns["layers.lin_qkv"] = columns["layers.lin_conv"] = channels
    columns["layers.gate_up_proj"] = columns["layers.gate_up_bias"] = tuple(gate_up(c.intermediate_size))
    columns["layers.wide_gate_up_proj"] = tuple(gate_up(2 * c.intermediate_size))
    shapes = param_shapes(c, tp)
    return {name: segs for name, segs in columns.items() if name in shapes}


def loader_spec(config: ModelConfig, dtype, tp: int = 1) -> dict[str, tuple]:
    """The spec `checkpoints_conv.load_params` fills: name -> (shape, numpy dtype, columns)."""
    columns = param_columns(config, tp)
    np_dtype = np.dtype(dtype)
    return {name: (shape, np_dtype, columns.get(name, ())) for name, shape in param_shapes(config, tp).items()}


def quantized_loader_spec(config: ModelConfig, dtype, tp: int, layouts: dict) -> dict[str, tuple]:
    """`loader_spec` with each parameter of `layouts` (name -> checkpoints_conv.quantized.QuantLayout)
    replaced by its stored arrays `<name>:<field>` ([..., K / 2 or K, N] and [..., K / g, N], the
    same fused columns; K padded to whole groups)."""
    spec = loader_spec(config, dtype, tp)
    for name, layout in layouts.items():
        shape, _, columns = spec.pop(name)
        K, N = quantized_in_out(name, shape)
        for field, ((rows, cols), field_dtype) in layout.field_shapes(N, K).items():
            spec[f"{name}:{field}"] = ((*shape[:-2], cols, rows), field_dtype, columns)
    return spec


def relayout_indices(config: ModelConfig, tp_from: int, tp_to: int) -> dict[str, np.ndarray]:
    """For each fused parameter, the columns of its tp_from layout that make its tp_to layout
    (`new = old[..., idx]`): how params saved under one tensor-parallel degree are restored
    under another. Empty when both layouts are the same."""
    if tp_from == tp_to:
        return {}
    out = {}
    src_cols, dst_cols = param_columns(config, tp_from), param_columns(config, tp_to)
    for name, dst in dst_cols.items():
        where = {}  # (part, HF row) -> a column of the tp_from layout holding it
        col = 0
        for part, start, width in src_cols[name]:
            for r in range(width):
                where.setdefault((part, start + r), col + r)
            col += width
        out[name] = np.array([where[part, start + r] for part, start, width in dst for r in range(width)], np.int32)
    return out

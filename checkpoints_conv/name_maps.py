"""Per-architecture tensor names: HF checkpoint name -> jaxinfer parameter, and GGUF name -> HF name.

jaxinfer's parameters are flat names; every per-layer tensor is stacked on a leading layer axis L
(`layers.o_proj` is [L, Hq*D, H]). Linear weights are stored [in, out], while HF stores [out, in],
so those entries say `transpose=True`.

Some parameters are *fused*: several HF tensors side by side on the last axis. `layers.qkv_proj`
is [L, H, (Hq + 2*Hkv)*D] = [q | k | v] and `layers.gate_up_proj` is [L, H, 2*I] = [gate | up],
so each runs as one matmul. Their entries name the `part` an HF tensor fills; how wide each part
is comes with the caller's spec (it depends on the model's config, which this module does not
read).

Adding an architecture is adding an entry: an `ArchNames` to `HF_NAME_MAPS` (keyed by HF
`model_type`) and, if it ships as GGUF, a `GgufArch` to `GGUF_ARCHS` (keyed by `general.architecture`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple

from checkpoints_conv.errors import CheckpointError


class Dest(NamedTuple):
    """Where an HF tensor goes, without the layer (and expert): `param` (flat name), whether the HF
    array is transposed ([out, in] -> [in, out]) and, for a fused param, the `part` it fills."""

    param: str
    transpose: bool
    part: str | None = None


class Target(NamedTuple):
    """Where one HF tensor goes: `param` (flat name), `layer` (slot on the stacked axis, or None
    for an unstacked param), whether the HF array is transposed ([out, in] -> [in, out]), for a
    fused param the `part` (a range of its last axis) it fills, and for a mixture-of-experts
    weight the `expert` (slot on the second stacked axis: `[L, E, ...]`)."""

    param: str
    layer: int | None
    transpose: bool
    part: str | None = None
    expert: int | None = None

    @property
    def slot(self) -> tuple[int, ...]:
        """Indices on the param's leading stacked axes: (), (layer,) or (layer, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


@dataclass(frozen=True)
class ArchNames:
    """How one architecture names its HF tensors.

    `globals` maps a full HF name to its `Dest`; `per_layer` maps the part after
    `{layer_prefix}{i}.` to its `Dest`; `per_expert` maps the part after
    `{layer_prefix}{i}.{expert_prefix}{e}.` to its `Dest` (mixture-of-experts weights, stacked
    [L, E, ...]). Names ending in one of `ignored_suffixes` are buffers that are not parameters
    (e.g. rotary `inv_freq`) and are skipped by the loader.
    """

    globals: Mapping[str, Dest]
    per_layer: Mapping[str, Dest]
    per_expert: Mapping[str, Dest] = field(default_factory=dict)
    expert_prefix: str = "mlp.experts."
    layer_prefix: str = "model.layers."
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    ignored_prefixes: tuple[str, ...] = ()  # whole towers not run here (Gemma 3's vision encoder)
    _layer_re: re.Pattern = field(init=False, repr=False, compare=False)
    _expert_re: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_layer_re", re.compile(re.escape(self.layer_prefix) + r"(\d+)\.(.+)"))
        object.__setattr__(self, "_expert_re", re.compile(re.escape(self.expert_prefix) + r"(\d+)\.(.+)"))

    def target(self, hf_name: str) -> Target | None:
        """The `Target` of `hf_name`, or None when this architecture has no such tensor."""
        if hf_name in self.globals:
            dest = self.globals[hf_name]
            return Target(dest.param, None, dest.transpose, dest.part)
        m = self._layer_re.fullmatch(hf_name)
        if m is None:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        if rest in self.per_layer:
            dest = self.per_layer[rest]
            return Target(dest.param, layer, dest.transpose, dest.part)
        e = self._expert_re.fullmatch(rest)
        if e and e.group(2) in self.per_expert:
            dest = self.per_expert[e.group(2)]
            return Target(dest.param, layer, dest.transpose, dest.part, int(e.group(1)))
        return None

    def is_ignored(self, hf_name: str) -> bool:
        """True for non-parameter buffers that checkpoints sometimes carry."""
        return hf_name.endswith(self.ignored_suffixes) or hf_name.startswith(self.ignored_prefixes)

    def num_slot_axes(self, param: str) -> int:
        """How many leading stacked axes `param` has: 0 (global), 1 (per layer), 2 (per layer and expert)."""
        if any(dest.param == param for dest in self.per_expert.values()):
            return 2
        return 1 if any(dest.param == param for dest in self.per_layer.values()) else 0

    def hf_name(self, param: str, slot: tuple[int, ...], part: str | None = None) -> str:
        """The HF tensor name that fills `param` at `slot` ((), (layer,) or (layer, expert)) and
        `part` (when fused); for error messages."""
        table = {0: self.globals, 1: self.per_layer, 2: self.per_expert}[len(slot)]
        for key, dest in table.items():
            if (dest.param, dest.part) == (param, part):
                if len(slot) == 0:
                    return key
                if len(slot) == 1:
                    return f"{self.layer_prefix}{slot[0]}.{key}"
                return f"{self.layer_prefix}{slot[0]}.{self.expert_prefix}{slot[1]}.{key}"
        return f"<no HF name known for param {param!r}{'' if part is None else f' part {part!r}'}>"


def _linear(hf_module: str, param: str, bias_param: str, part: str | None = None) -> dict[str, Dest]:
    """Weight ([out, in], transposed) and bias entries of one HF linear layer (`part` of a fused param)."""
    return {f"{hf_module}.weight": Dest(param, True, part), f"{hf_module}.bias": Dest(bias_param, False, part)}


LLAMA_NAMES = ArchNames(
    globals={
        "model.embed_tokens.weight": Dest("embed", False),  # [V, H]
        "model.norm.weight": Dest("final_norm", False),  # [H]
        "lm_head.weight": Dest("lm_head", True),  # HF [V, H] -> [H, V]
    },
    per_layer={
        "input_layernorm.weight": Dest("layers.attn_norm", False),
        **_linear("self_attn.q_proj", "layers.qkv_proj", "layers.qkv_bias", part="q"),
        **_linear("self_attn.k_proj", "layers.qkv_proj", "layers.qkv_bias", part="k"),
        **_linear("self_attn.v_proj", "layers.qkv_proj", "layers.qkv_bias", part="v"),
        **_linear("self_attn.o_proj", "layers.o_proj", "layers.o_bias"),
        "self_attn.q_norm.weight": Dest("layers.q_norm", False),  # Qwen3
        "self_attn.k_norm.weight": Dest("layers.k_norm", False),  # Qwen3
        "post_attention_layernorm.weight": Dest("layers.mlp_norm", False),
        **_linear("mlp.gate_proj", "layers.gate_up_proj", "layers.gate_up_bias", part="gate"),
        **_linear("mlp.up_proj", "layers.gate_up_proj", "layers.gate_up_bias", part="up"),
        **_linear("mlp.down_proj", "layers.down_proj", "layers.down_bias"),
    },
)

_ATTENTION = {k: v for k, v in LLAMA_NAMES.per_layer.items() if not k.startswith("mlp.")}


def _moe_names(router: str, expert_prefix: str, gate: str, up: str, down: str, shared: bool = False) -> ArchNames:
    """A mixture-of-experts decoder: Llama attention, a router, per-expert SwiGLU weights (HF
    stores each expert apart; here they stack on [L, E, ...]) and optionally a shared expert."""
    per_layer = dict(_ATTENTION)
    per_layer[f"{router}.weight"] = Dest("layers.router", True)  # HF [E, H] -> [H, E]
    if shared:  # Qwen2-MoE: one always-on expert, scaled by sigmoid(x @ shared_expert_gate)
        per_layer.update({
            "mlp.shared_expert.gate_proj.weight": Dest("layers.shared_gate_up", True, "gate"),
            "mlp.shared_expert.up_proj.weight": Dest("layers.shared_gate_up", True, "up"),
            "mlp.shared_expert.down_proj.weight": Dest("layers.shared_down", True),
            "mlp.shared_expert_gate.weight": Dest("layers.shared_expert_gate", True),  # [1, H] -> [H, 1]
        })
    per_expert = {
        f"{gate}.weight": Dest("layers.experts_gate_up", True, "gate"),
        f"{up}.weight": Dest("layers.experts_gate_up", True, "up"),
        f"{down}.weight": Dest("layers.experts_down", True),
    }
    return ArchNames(LLAMA_NAMES.globals, per_layer, per_expert, expert_prefix=expert_prefix)


MIXTRAL_NAMES = _moe_names("block_sparse_moe.gate", "block_sparse_moe.experts.", "w1", "w3", "w2")
# MiniMax-M2: Mixtral's names, q/k norms over the projection, the router's correction bias
MINIMAX_M2_NAMES = replace(MIXTRAL_NAMES, per_layer={
    **MIXTRAL_NAMES.per_layer,
    "block_sparse_moe.e_score_correction_bias": Dest("layers.router_correction_bias", False),
})
QWEN2_MOE_NAMES = _moe_names("mlp.gate", "mlp.experts.", "gate_proj", "up_proj", "down_proj", shared=True)
QWEN3_MOE_NAMES = _moe_names("mlp.gate", "mlp.experts.", "gate_proj", "up_proj", "down_proj")

# GLM-4.5: Llama's layer (q/k/v biases, optional q/k norms) with a dense MLP in its first layers and
# routed plus shared experts in the others. The MoE layers' tensors fill stacks that start at layer
# first_k_dense_replace: checkpoints_conv.views shows layer i's as layer i - first_k_dense_replace's.
GLM4_MOE_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **LLAMA_NAMES.per_layer,
        "mlp.gate.weight": Dest("layers.router", True),
        "mlp.gate.e_score_correction_bias": Dest("layers.router_correction_bias", False),
        "mlp.shared_experts.gate_proj.weight": Dest("layers.shared_gate_up", True, "gate"),
        "mlp.shared_experts.up_proj.weight": Dest("layers.shared_gate_up", True, "up"),
        "mlp.shared_experts.down_proj.weight": Dest("layers.shared_down", True),
    },
    per_expert=QWEN3_MOE_NAMES.per_expert,
)

# DeepSeek-V2 / V3 / R1, Kimi K2: multi-head latent attention (jaxinfer.models.deepseek: q through a
# low-rank q_a / q_b pair or one q_proj, the latent K/V projection and its norm, each head's K/V
# up-projection) and GLM-4.5's MoE layout (dense first layers; routed and shared experts).
DEEPSEEK_V3_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **{k: v for k, v in GLM4_MOE_NAMES.per_layer.items() if not k.startswith("self_attn.")},
        "self_attn.q_proj.weight": Dest("layers.q_proj", True),
        "self_attn.q_a_proj.weight": Dest("layers.q_a_proj", True),
        "self_attn.q_a_layernorm.weight": Dest("layers.q_a_norm", False),
        "self_attn.q_b_proj.weight": Dest("layers.q_b_proj", True),
        "self_attn.kv_a_proj_with_mqa.weight": Dest("layers.kv_a_proj", True),
        "self_attn.kv_a_layernorm.weight": Dest("layers.kv_a_norm", False),
        "self_attn.kv_b_proj.weight": Dest("layers.kv_b_proj", True),
        "self_attn.o_proj.weight": Dest("layers.o_proj", True),
        # the multi-token-prediction layer's input (read through checkpoints_conv.views.mtp_views)
        "enorm.weight": Dest("layers.mtp_enorm", False),
        "hnorm.weight": Dest("layers.mtp_hnorm", False),
        "eh_proj.weight": Dest("layers.mtp_eh_proj", True),
    },
    per_expert=QWEN3_MOE_NAMES.per_expert,
)

# DeepSeek-V3.2 and GLM-5: DeepSeek-V3's names and the sparse-attention indexer of each layer.
DEEPSEEK_V32_NAMES = ArchNames(
    globals=DEEPSEEK_V3_NAMES.globals,
    per_layer={
        **DEEPSEEK_V3_NAMES.per_layer,
        "self_attn.indexer.wq_b.weight": Dest("layers.index_wq", True),
        "self_attn.indexer.wk.weight": Dest("layers.index_wk", True),
        "self_attn.indexer.k_norm.weight": Dest("layers.index_k_norm", False),
        "self_attn.indexer.k_norm.bias": Dest("layers.index_k_norm_bias", False),
        "self_attn.indexer.weights_proj.weight": Dest("layers.index_weights", True),
    },
    per_expert=QWEN3_MOE_NAMES.per_expert,
)

# Qwen3-Next and Qwen3.5: full attention with a gate on its output (the q projection's second half
# per head, split off by checkpoints_conv.views as self_attn.gate_proj) every few layers, Gated
# DeltaNet layers between (Qwen3-Next's fused in_proj_qkvz / in_proj_ba read as Qwen3.5's four
# projections, and each kind's layers numbered among themselves, by the views); Qwen3-Next's MoE is
# Qwen2-MoE's.
_GATED_DELTANET = {
    "self_attn.gate_proj.weight": Dest("layers.attn_gate", True),
    # (in_proj_qkv [q | k | v] and the convolution's channels, read in parts by the views: each
    # tensor shard holds its own key and value heads' columns, shard-major like qkv_proj)
    **{f"linear_attn.in_proj_{p}.weight": Dest("layers.lin_qkv", True, p) for p in "qkv"},
    **{f"linear_attn.conv1d_{p}.weight": Dest("layers.lin_conv", True, p) for p in "qkv"},
    "linear_attn.in_proj_z.weight": Dest("layers.lin_z", True),
    "linear_attn.in_proj_b.weight": Dest("layers.lin_b", True),
    "linear_attn.in_proj_a.weight": Dest("layers.lin_a", True),
    "linear_attn.dt_bias": Dest("layers.lin_dt_bias", False),
    "linear_attn.A_log": Dest("layers.lin_a_log", False),
    "linear_attn.norm.weight": Dest("layers.lin_norm", False),
    "linear_attn.out_proj.weight": Dest("layers.lin_out", True),
}
QWEN3_5_NAMES = replace(LLAMA_NAMES, per_layer={**LLAMA_NAMES.per_layer, **_GATED_DELTANET})
QWEN3_NEXT_NAMES = replace(QWEN2_MOE_NAMES, per_layer={**QWEN2_MOE_NAMES.per_layer, **_GATED_DELTANET})

# Gemma 2 / 3: a norm before and after each branch (Llama's post_attention_layernorm is the norm
# *after* attention here, and pre_feedforward_layernorm the one before the MLP); Gemma 3's q/k norms.
GEMMA_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **{k: v for k, v in LLAMA_NAMES.per_layer.items() if k != "post_attention_layernorm.weight"},
        "post_attention_layernorm.weight": Dest("layers.post_attn_norm", False),
        "pre_feedforward_layernorm.weight": Dest("layers.mlp_norm", False),
        "post_feedforward_layernorm.weight": Dest("layers.post_mlp_norm", False),
    },
)

# Gemma 3's multimodal folders (Gemma3ForConditionalGeneration): the text decoder under
# model.language_model (older exports' language_model.model.* read so through checkpoints_conv.views);
# the vision tower and its projector are skipped.
GEMMA3_MULTIMODAL_NAMES = ArchNames(
    globals={
        "model.language_model.embed_tokens.weight": Dest("embed", False),
        "model.language_model.norm.weight": Dest("final_norm", False),
        "lm_head.weight": Dest("lm_head", True),
    },
    per_layer=GEMMA_NAMES.per_layer,
    layer_prefix="model.language_model.layers.",
    ignored_prefixes=("model.vision_tower.", "model.multi_modal_projector."),
)

# Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): a Qwen2 text decoder under Llama's names (transformers
# 5 saves it so; model.language_model.* read so through checkpoints_conv.views); the vision tower
# (visual.* or model.visual.*, jaxinfer.models.vision.qwen_vl) is skipped. Qwen3-VL's folders alike.
QWEN2_5_VL_NAMES = replace(LLAMA_NAMES, ignored_prefixes=("visual.", "model.visual."))

# OLMo 2 / 3: norms after each branch only; q/k norms over the whole projection.
OLMO_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **{k: v for k, v in LLAMA_NAMES.per_layer.items() if k not in ("input_layernorm.weight", "post_attention_layernorm.weight")},
        "post_attention_layernorm.weight": Dest("layers.post_attn_norm", False),
        "post_feedforward_layernorm.weight": Dest("layers.post_mlp_norm", False),
    },
)

# GPT-OSS: Llama attention with biases and sinks; a router with a bias; each expert as
# checkpoints_conv.views shows it (per-expert gate / up / down linears with biases).
GPT_OSS_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **_ATTENTION,
        "self_attn.sinks": Dest("layers.sinks", False),
        "mlp.router.weight": Dest("layers.router", True),
        "mlp.router.bias": Dest("layers.router_bias", False),
    },
    per_expert={
        **_linear("gate_proj", "layers.experts_gate_up", "layers.experts_gate_up_bias", part="gate"),
        **_linear("up_proj", "layers.experts_gate_up", "layers.experts_gate_up_bias", part="up"),
        **_linear("down_proj", "layers.experts_down", "layers.experts_down_bias"),
    },
)

# Llama 4 (checkpoints_conv.views shows its tensors so): Llama attention and norms; a dense MLP or a
# router, per-expert SwiGLU weights and a shared expert, under feed_forward (each MLP kind numbered
# on its own); a multimodal folder's vision tower skipped.
LLAMA4_NAMES = ArchNames(
    globals=LLAMA_NAMES.globals,
    per_layer={
        **_ATTENTION,
        "feed_forward.gate_proj.weight": Dest("layers.gate_up_proj", True, "gate"),
        "feed_forward.up_proj.weight": Dest("layers.gate_up_proj", True, "up"),
        "feed_forward.down_proj.weight": Dest("layers.down_proj", True),
        "feed_forward.router.weight": Dest("layers.router", True),
        "feed_forward.shared_expert.gate_proj.weight": Dest("layers.shared_gate_up", True, "gate"),
        "feed_forward.shared_expert.up_proj.weight": Dest("layers.shared_gate_up", True, "up"),
        "feed_forward.shared_expert.down_proj.weight": Dest("layers.shared_down", True),
    },
    per_expert=QWEN3_MOE_NAMES.per_expert,
    expert_prefix="feed_forward.experts.",
    ignored_prefixes=("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector."),
)

# Gemma 4 (checkpoints_conv.views shows its tensors so): Gemma's sandwich norms; the global layers'
# attention (`global_attn`) and the KV-shared layers' double-wide MLP (`wide_mlp`) numbered on their
# own; a MoE block beside the dense MLP (a router with input and per-expert scales, norms around the
# experts); per-layer input embeddings; a learned scalar per layer. A multimodal folder's text
# decoder reads as the text model; its vision and audio towers are skipped.
def _stack_names(module: str, stack_prefix: str, names: Mapping[str, Dest]) -> dict[str, Dest]:
    """`names` (Llama's, under `self_attn.` / `mlp.`) for HF module `module`, filling the stacks
    `layers.{stack_prefix}<name>` (param_layout.stack_of: Gemma 4's stacks of their own)."""
    return {f"{module}.{key.split('.', 1)[1]}": dest._replace(param=dest.param.replace("layers.", f"layers.{stack_prefix}"))
            for key, dest in names.items()}


_LLAMA_ATTENTION_WEIGHTS = {k: v for k, v in _ATTENTION.items() if k.endswith("weight") and "layernorm" not in k}
_LLAMA_MLP_WEIGHTS = {k: v for k, v in LLAMA_NAMES.per_layer.items() if k.startswith("mlp.") and k.endswith("weight")}
GEMMA4_NAMES = ArchNames(
    globals={
        **LLAMA_NAMES.globals,
        "model.embed_tokens_per_layer.weight": Dest("embed_per_layer", False),  # [Vp, L * P]
        "model.per_layer_model_projection.weight": Dest("per_layer_proj", True),  # HF [L * P, H]
        "model.per_layer_projection_norm.weight": Dest("per_layer_proj_norm", False),
    },
    per_layer={
        **_stack_names("self_attn", "", _LLAMA_ATTENTION_WEIGHTS),
        **_stack_names("global_attn", "global_", _LLAMA_ATTENTION_WEIGHTS),
        **_stack_names("mlp", "", _LLAMA_MLP_WEIGHTS),
        **_stack_names("wide_mlp", "wide_", _LLAMA_MLP_WEIGHTS),
        "input_layernorm.weight": Dest("layers.attn_norm", False),
        "post_attention_layernorm.weight": Dest("layers.post_attn_norm", False),
        "pre_feedforward_layernorm.weight": Dest("layers.mlp_norm", False),
        "post_feedforward_layernorm.weight": Dest("layers.post_mlp_norm", False),
        "router.proj.weight": Dest("layers.router", True),
        "router.scale": Dest("layers.router_scale", False),
        "router.per_expert_scale": Dest("layers.expert_scale", False),
        "post_feedforward_layernorm_1.weight": Dest("layers.post_dense_norm", False),
        "pre_feedforward_layernorm_2.weight": Dest("layers.experts_norm", False),
        "post_feedforward_layernorm_2.weight": Dest("layers.post_experts_norm", False),
        "per_layer_input_gate.weight": Dest("layers.ple_gate", True),
        "per_layer_projection.weight": Dest("layers.ple_proj", True),
        "post_per_layer_input_norm.weight": Dest("layers.ple_norm", False),
        "layer_scalar": Dest("layers.layer_scalar", False),
    },
    per_expert=QWEN3_MOE_NAMES.per_expert,
    expert_prefix="experts.",
    ignored_suffixes=("rotary_emb.inv_freq", "embed_scale"),
    ignored_prefixes=("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."),
)

# HF model_type -> its names. Which of the params exist (e.g. biases) is up to the caller's spec.
HF_NAME_MAPS: dict[str, ArchNames] = {
    "llama": LLAMA_NAMES,
    "mistral": LLAMA_NAMES,
    "qwen2": LLAMA_NAMES,
    "qwen3": LLAMA_NAMES,
    "mixtral": MIXTRAL_NAMES,
    "minimax_m2": MINIMAX_M2_NAMES,
    "glm4_moe": GLM4_MOE_NAMES,
    "deepseek_v2": DEEPSEEK_V3_NAMES,  # (the same tensor names)
    "deepseek_v3": DEEPSEEK_V3_NAMES,
    "deepseek_v32": DEEPSEEK_V32_NAMES,
    "qwen3_next": QWEN3_NEXT_NAMES,
    "qwen3_5_text": QWEN3_5_NAMES,
    "qwen3_5": QWEN3_5_NAMES,  # a multimodal folder's text decoder (checkpoints_conv.views)
    "qwen3_5_moe_text": QWEN3_NEXT_NAMES,  # (Qwen3-Next's experts, Qwen3.5's projections: the views read both alike)
    "qwen3_5_moe": QWEN3_NEXT_NAMES,
    "glm_moe_dsa": DEEPSEEK_V32_NAMES,
    "llama4_text": LLAMA4_NAMES,
    "llama4": LLAMA4_NAMES,
    "qwen2_moe": QWEN2_MOE_NAMES,
    "qwen3_moe": QWEN3_MOE_NAMES,
    "smollm3": LLAMA_NAMES,
    "gemma2": GEMMA_NAMES,
    "gemma3_text": GEMMA_NAMES,
    "gemma3": GEMMA3_MULTIMODAL_NAMES,
    "qwen2_5_vl": QWEN2_5_VL_NAMES,
    "qwen3_vl": QWEN2_5_VL_NAMES,  # Qwen3-VL: a Qwen3 decoder (q/k norms) under the same names
    "gemma4_text": GEMMA4_NAMES,
    "gemma4": GEMMA4_NAMES,
    "olmo2": OLMO_NAMES,
    "olmo3": OLMO_NAMES,
    "gpt_oss": GPT_OSS_NAMES,
    "phi3": LLAMA_NAMES,  # its fused qkv_proj / gate_up_proj read as Llama's parts (checkpoints_conv.views)
}


def arch_names(model_type: str) -> ArchNames:
    """The `ArchNames` of HF `model_type`; CheckpointError naming it when unsupported."""
    try:
        return HF_NAME_MAPS[model_type]
    except KeyError:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: no tensor name map (known: {sorted(HF_NAME_MAPS)})"
        ) from None


def map_hf_name(model_type: str, hf_name: str) -> Target | None:
    """HF tensor name -> `Target` (param, layer or None, transpose); None for an unknown name."""
    return arch_names(model_type).target(hf_name)


# ---- GGUF -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GgufArch:
    """One GGUF `general.architecture`: the HF model_type it becomes, its tensor names (GGUF base
    name -> HF module name; the `.weight`/`.bias` suffix carries over), whether llama.cpp's
    converter permuted the rows of attn_q / attn_k (which the reader must undo), and `norm_shift`:
    what the converter added to every tensor whose HF name ends in `norm.weight`.

    Gemma's RMSNorms multiply by (1 + w) and HF stores w; llama.cpp's converter
    (convert_hf_to_gguf.py, GemmaModel / Gemma2Model / Gemma3Model.modify_tensors) writes 1 + w
    instead, so that llama.cpp multiplies by the stored tensor. The reader subtracts the shift
    again (`GgufSource`) rather than telling the model to use offset 0: the config and the params
    then equal those of the HF checkpoint (one `ModelConfig`, one converted folder, whichever file
    the model came from). The +1 rounded away the bits of w below the float32 ulp of 1 + w, which
    no reader gets back; but for a stored y = 1 + w >= 0.5, y - 1 is exact (Sterbenz), so the
    model's 1 + (y - 1) is y again, bit for bit: the very scale llama.cpp and HF multiply by."""

    model_type: str
    globals: Mapping[str, str]
    per_layer: Mapping[str, str]
    permuted_qk: bool = False
    norm_shift: float = 0.0
    # GGUF base names of tensors stacked over the experts on their first axis ([E, out, in], or [E, out]
    # for a bias): their HF module name has no expert index, which GgufSource inserts per expert
    stacked_experts: frozenset = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
    moe_model_type: str | None = None  # the model_type of a file of this architecture with experts (llama -> mixtral)
    # GGUF `base.suffix` (or a bare `base`: llama.cpp's ssm_a) -> HF name after `model.layers.{i}.`, where HF's
    # name is no module + suffix
    exact: Mapping[str, str] = field(default_factory=dict)
    # HF names (their ends) that `norm_shift` leaves alone: Qwen3-Next's gated norm multiplies by w itself
    norm_shift_skip: tuple[str, ...] = ()
    # Gated DeltaNet layers between full-attention ones (Qwen3-Next, Qwen3.5): gguf_io.GgufSource undoes
    # what llama.cpp's converter did to them (ssm_a = -exp(A_log), the squeezed convolution, and with
    # `tiled_value_heads` Qwen3.5's value heads reordered from grouped by key head to tiled)
    gated_deltanet: bool = False
    tiled_value_heads: bool = False
    _layer_re: re.Pattern = field(init=False, repr=False, compare=False, default=re.compile(r"blk\.(\d+)\.(.+)"))

    def hf_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
        base, dot, suffix = gguf_name.rpartition(".")
        m = self._layer_re.fullmatch(base)
        whole = self._layer_re.fullmatch(gguf_name)
        if whole and whole.group(2) in self.exact:
            return f"model.layers.{whole.group(1)}.{self.exact[whole.group(2)]}"
        if not dot or suffix not in ("weight", "bias"):
            return None
        if base in self.globals:
            return f"{self.globals[base]}.{suffix}"
        if m and m.group(2) in self.per_layer:
            return f"model.layers.{m.group(1)}.{self.per_layer[m.group(2)]}.{suffix}"
        return None


_LLAMA_GGUF_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_GGUF_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma 2 / 3 (gguf.constants MODEL_TENSORS[GEMMA2 / GEMMA3]): a norm on both sides of each
# branch. llama.cpp's ffn_norm is the norm before the MLP, which Gemma calls
# pre_feedforward_layernorm (Llama's post_attention_layernorm); Gemma's post_attention_layernorm
# is the norm after attention, post_attention_norm. Gemma 3 adds attn_q_norm / attn_k_norm.
_GEMMA_GGUF_PER_LAYER = {
    **_LLAMA_GGUF_PER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# OLMo 2 (and OLMo 3, which llama.cpp writes as "olmo2"): norms after each branch only.
_OLMO2_GGUF_PER_LAYER = {
    **{k: v for k, v in _LLAMA_GGUF_PER_LAYER.items() if k not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# The mixtures of experts (gguf.constants MODEL_TENSORS): a router (ffn_gate_inp), the experts'
# projections stacked [E, out, in] (ffn_*_exps; GgufSource lists them per expert), Qwen2-MoE's
# shared expert (ffn_*_shexp) and its gate (ffn_gate_inp_shexp). llama.cpp writes Mixtral as "llama".
def _moe_gguf_per_layer(router: str, experts: str, gate: str, up: str, down: str) -> dict[str, str]:
    return {"ffn_gate_inp": router, "ffn_gate_exps": f"{experts}.{gate}", "ffn_up_exps": f"{experts}.{up}",
            "ffn_down_exps": f"{experts}.{down}"}


_QWEN_MOE_GGUF_PER_LAYER = {
    **_LLAMA_GGUF_PER_LAYER,
    **_moe_gguf_per_layer("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# GPT-OSS (llama.cpp's "gpt-oss"): the norm before the MLP is post_attention_norm, the sinks a bare
# tensor (self_attn.sinks in HF), gate and up stored apart (the converter de-interleaves them).
_GPT_OSS_GGUF_PER_LAYER = {
    **{k: v for k, v in _LLAMA_GGUF_PER_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    **_moe_gguf_per_layer("mlp.router", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
# GLM-4.5 ("glm4moe"): the norm before the MLP is post_attention_norm; dense first layers; shared
# experts; a correction bias (exp_probs_b); the multi-token-prediction layer after the last one
# (nextn.*, hidden at load by checkpoints_conv.views like the HF checkpoint's).
_GLM4_MOE_GGUF_PER_LAYER = {
    **{k: v for k, v in _LLAMA_GGUF_PER_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    **_moe_gguf_per_layer("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
    **{f"nextn.{n}": n.replace("shared_head_", "shared_head.") for n in ("eh_proj", "embed_tokens", "enorm", "hnorm",
                                                                         "shared_head_head", "shared_head_norm")},
}
# MiniMax-M2 ("minimax-m2"): Mixtral's names with q/k norms over the projection and a correction bias.
_MINIMAX_M2_GGUF_PER_LAYER = {
    **_LLAMA_GGUF_PER_LAYER,
    **_moe_gguf_per_layer("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
}

# Llama 4 ("llama4"): q/k rows as HF has them (RoPE on adjacent pairs; checkpoints_conv.views
# reorders them), dense and MoE layers under feed_forward (views renumber each kind).
_LLAMA4_GGUF_PER_LAYER = {
    **{k: v for k, v in _LLAMA_GGUF_PER_LAYER.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    **{f"ffn_{p}": f"feed_forward.{p}_proj" for p in ("gate", "up", "down")},
    **_moe_gguf_per_layer("feed_forward.router", "feed_forward.experts", "gate_proj", "up_proj", "down_proj"),
    **{f"ffn_{p}_shexp": f"feed_forward.shared_expert.{p}_proj" for p in ("gate", "up", "down")},
}

# Gemma 4 ("gemma4"): Gemma's sandwich norms (stored as they are: its norms multiply by w), the
# experts stacked as HF stacks them (gate_up [E, 2I, H], down [E, H, I]: checkpoints_conv.views
# splits them as for the HF folder), the router's input scale and per-expert scales as `.scale`
# tensors, per-layer input embeddings, the layer scalar.
_GEMMA4_GGUF_PER_LAYER = {
    **_GEMMA_GGUF_PER_LAYER,
    "ffn_gate_inp": "router.proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GEMMA4_GGUF_EXACT = {"ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                      "layer_output_scale.weight": "layer_scalar", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
                      "ffn_down_exps.weight": "experts.down_proj"}

# Qwen3-Next ("qwen3next"), Qwen3.5 ("qwen35") and Qwen3.5-MoE ("qwen35moe"), as convert_hf_to_gguf.py's
# Qwen3NextModel / Qwen3_5TextModel / Qwen3_5MoeTextModel write them (gguf.constants MODEL_TENSORS): the norm
# before the MLP is post_attention_norm; full attention's q_proj (query and gate per head) as attn_q; a Gated
# DeltaNet layer's q | k | v projection as attn_qkv and its z as attn_gate (Qwen3-Next's fused in_proj_qkvz
# split so by the converter; files older than llama.cpp PR #18683 keep it whole as ssm_in), Qwen3-Next's
# in_proj_ba as ssm_ba, Qwen3.5's in_proj_b / in_proj_a as ssm_beta / ssm_alpha, the convolution as
# ssm_conv1d, dt_bias renamed dt_proj.bias (ssm_dt.bias), -exp(A_log) as a bare ssm_a, the gated norm as
# ssm_norm, out_proj as ssm_out; Qwen2-MoE's experts and gated shared expert.
_GATED_DELTANET_GGUF_PER_LAYER = {
    **{k: v for k, v in _QWEN_MOE_GGUF_PER_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_GATED_DELTANET_GGUF_EXACT = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


def _gated_deltanet_arch(model_type: str, tiled_value_heads: bool) -> GgufArch:
    """Every norm but the Gated DeltaNet's own stored as 1 + w (Qwen3NextModel.modify_tensors)."""
    return GgufArch(model_type, _LLAMA_GGUF_GLOBALS, _GATED_DELTANET_GGUF_PER_LAYER, norm_shift=1.0,
                    norm_shift_skip=(".linear_attn.norm.weight",), gated_deltanet=True,
                    tiled_value_heads=tiled_value_heads, exact=_GATED_DELTANET_GGUF_EXACT)


# GGUF general.architecture -> how to read it. Mistral GGUFs say "llama". llama.cpp permutes the
# q/k rows of llama-style (interleaved-pair RoPE) archs only; gemma2 / gemma3 / olmo2 run NeoX-style
# RoPE (HF's half-split order) and are stored as HF has them. An "olmo2" file with a sliding window
# is an OLMo 3 (gguf_io.read_gguf_config gives it model_type olmo3).
GGUF_ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("llama", _LLAMA_GGUF_GLOBALS, {**_LLAMA_GGUF_PER_LAYER, **_moe_gguf_per_layer(
        "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")}, permuted_qk=True, moe_model_type="mixtral"),
    "qwen2": GgufArch("qwen2", _LLAMA_GGUF_GLOBALS, _LLAMA_GGUF_PER_LAYER),
    "qwen3": GgufArch("qwen3", _LLAMA_GGUF_GLOBALS, _LLAMA_GGUF_PER_LAYER),
    "gemma2": GgufArch("gemma2", _LLAMA_GGUF_GLOBALS, _GEMMA_GGUF_PER_LAYER, norm_shift=1.0),
    "gemma3": GgufArch("gemma3_text", _LLAMA_GGUF_GLOBALS, _GEMMA_GGUF_PER_LAYER, norm_shift=1.0),
    "olmo2": GgufArch("olmo2", _LLAMA_GGUF_GLOBALS, _OLMO2_GGUF_PER_LAYER),
    "qwen2moe": GgufArch("qwen2_moe", _LLAMA_GGUF_GLOBALS, _QWEN_MOE_GGUF_PER_LAYER),
    "qwen3moe": GgufArch("qwen3_moe", _LLAMA_GGUF_GLOBALS, _QWEN_MOE_GGUF_PER_LAYER),
    "gpt-oss": GgufArch("gpt_oss", _LLAMA_GGUF_GLOBALS, _GPT_OSS_GGUF_PER_LAYER, exact={"attn_sinks.weight": "self_attn.sinks"}),
    "glm4moe": GgufArch("glm4_moe", _LLAMA_GGUF_GLOBALS, _GLM4_MOE_GGUF_PER_LAYER,
                        exact={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}),
    "llama4": GgufArch("llama4_text", _LLAMA_GGUF_GLOBALS, _LLAMA4_GGUF_PER_LAYER),
    "gemma4": GgufArch("gemma4_text", {**_LLAMA_GGUF_GLOBALS, "per_layer_token_embd": "model.embed_tokens_per_layer",
                                       "per_layer_model_proj": "model.per_layer_model_projection",
                                       "per_layer_proj_norm": "model.per_layer_projection_norm"},
                       _GEMMA4_GGUF_PER_LAYER, stacked_experts=frozenset(), exact=_GEMMA4_GGUF_EXACT),
    "minimax-m2": GgufArch("minimax_m2", _LLAMA_GGUF_GLOBALS, _MINIMAX_M2_GGUF_PER_LAYER,
                           exact={"exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"}),
    "qwen3next": _gated_deltanet_arch("qwen3_next", tiled_value_heads=False),
    "qwen35": _gated_deltanet_arch("qwen3_5_text", tiled_value_heads=True),
    "qwen35moe": _gated_deltanet_arch("qwen3_5_moe_text", tiled_value_heads=True),
}


def gguf_arch(architecture: str, source: str = "") -> GgufArch:
    """The `GgufArch` of a GGUF `general.architecture`; CheckpointError naming it when unsupported."""
    try:
        return GGUF_ARCHS[architecture]
    except KeyError:
        where = f"{source}: " if source else ""
        raise CheckpointError(
            f"{where}unsupported GGUF general.architecture {architecture!r} (known: {sorted(GGUF_ARCHS)})"
        ) from None


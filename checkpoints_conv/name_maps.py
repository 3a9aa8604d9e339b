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
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from checkpoints_conv.errors import CheckpointError


class Dest(NamedTuple):
    """Where an HF tensor goes, without the layer: `param` (flat name), whether the HF array is
    transposed ([out, in] -> [in, out]) and, for a fused param, the `part` it fills."""

    param: str
    transpose: bool
    part: str | None = None


class Target(NamedTuple):
    """Where one HF tensor goes: `param` (flat name), `layer` (slot on the stacked axis, or None
    for an unstacked param), whether the HF array is transposed ([out, in] -> [in, out]) and, for
    a fused param, the `part` (a range of its last axis) it fills."""

    param: str
    layer: int | None
    transpose: bool
    part: str | None = None


@dataclass(frozen=True)
class ArchNames:
    """How one architecture names its HF tensors.

    `globals` maps a full HF name to its `Dest`; `per_layer` maps the part after
    `{layer_prefix}{i}.` to its `Dest`. Names ending in one of `ignored_suffixes` are
    buffers that are not parameters (e.g. rotary `inv_freq`) and are skipped by the loader.
    """

    globals: Mapping[str, Dest]
    per_layer: Mapping[str, Dest]
    layer_prefix: str = "model.layers."
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    _layer_re: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_layer_re", re.compile(re.escape(self.layer_prefix) + r"(\d+)\.(.+)"))

    def target(self, hf_name: str) -> Target | None:
        """The `Target` of `hf_name`, or None when this architecture has no such tensor."""
        if hf_name in self.globals:
            dest = self.globals[hf_name]
            return Target(dest.param, None, dest.transpose, dest.part)
        m = self._layer_re.fullmatch(hf_name)
        if m and m.group(2) in self.per_layer:
            dest = self.per_layer[m.group(2)]
            return Target(dest.param, int(m.group(1)), dest.transpose, dest.part)
        return None

    def is_ignored(self, hf_name: str) -> bool:
        """True for non-parameter buffers that checkpoints sometimes carry."""
        return hf_name.endswith(self.ignored_suffixes)

    def stacked_params(self) -> set[str]:
        """Params filled per layer, i.e. stacked on a leading layer axis."""
        return {dest.param for dest in self.per_layer.values()}

    def hf_name(self, param: str, layer: int | None, part: str | None = None) -> str:
        """The HF tensor name that fills `param` (at `layer` when stacked; its `part` when fused);
        for error messages."""
        if layer is None:
            for name, dest in self.globals.items():
                if (dest.param, dest.part) == (param, part):
                    return name
        else:
            for suffix, dest in self.per_layer.items():
                if (dest.param, dest.part) == (param, part):
                    return f"{self.layer_prefix}{layer}.{suffix}"
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

# HF model_type -> its names. Which of the params exist (e.g. biases) is up to the caller's spec.
HF_NAME_MAPS: dict[str, ArchNames] = {
    "llama": LLAMA_NAMES,
    "mistral": LLAMA_NAMES,
    "qwen2": LLAMA_NAMES,
    "qwen3": LLAMA_NAMES,
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
    name -> HF module name; the `.weight`/`.bias` suffix carries over), and whether llama.cpp's
    converter permuted the rows of attn_q / attn_k (which the reader must undo)."""

    model_type: str
    globals: Mapping[str, str]
    per_layer: Mapping[str, str]
    permuted_qk: bool = False
    _layer_re: re.Pattern = field(init=False, repr=False, compare=False, default=re.compile(r"blk\.(\d+)\.(\w+)"))

    def hf_name(self, gguf_name: str) -> str | None:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
        base, dot, suffix = gguf_name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            return None
        if base in self.globals:
            return f"{self.globals[base]}.{suffix}"
        m = self._layer_re.fullmatch(base)
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

# GGUF general.architecture -> how to read it. Mistral GGUFs say "llama".
GGUF_ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("llama", _LLAMA_GGUF_GLOBALS, _LLAMA_GGUF_PER_LAYER, permuted_qk=True),
    "qwen2": GgufArch("qwen2", _LLAMA_GGUF_GLOBALS, _LLAMA_GGUF_PER_LAYER),
    "qwen3": GgufArch("qwen3", _LLAMA_GGUF_GLOBALS, _LLAMA_GGUF_PER_LAYER),
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


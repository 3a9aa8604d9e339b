"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector (Flax NNX).

One image becomes `mm_tokens_per_image` soft tokens in the text model's hidden size, exactly what
transformers' `Gemma3ForConditionalGeneration.get_image_features(pixel_values).pooler_output` is:

    pixel_values [N, C, H, W]                     # Gemma3ImageProcessor: H = W = image_size, in [-1, 1]
    x = patches(pixel_values) @ patch_embed        # [N, S, D]: the stride-P conv as a matmul over
        + patch_bias + position_embed              #   flattened [C*P*P] patches, S = (H / P) ** 2
    per layer (pre-LN; every patch attends to every patch, no mask, no RoPE):
        x = x + o_proj(attention(layer_norm1(x)))
        x = x + fc2(gelu_tanh(fc1(layer_norm2(x))))
    x = post_layernorm(x)                          # [N, S, D]: SigLIP's last_hidden_state
    projector:
        x = avg_pool(x)                            # the (H/P) x (H/P) patch grid pooled down to
                                                   #   sqrt(T) x sqrt(T), T = mm_tokens_per_image
        x = rms_norm(x) * (1 + w)                  # Gemma stores w - 1, as its text norms
        soft_tokens = x @ mm_input_projection      # [N, T, E], E = the text model's hidden size

Gemma 3 4B..27B: image 896, patch 14 (a 64 x 64 grid), D 1152, 27 layers of 16 heads, F 4304,
T 256 (pooled 4 x 4).

Weights load from a Hugging Face folder (`load_gemma3_vision`): its `config.json`'s
`vision_config` and `mm_tokens_per_image` (`Gemma3VisionConfig.from_hf_dict`), and the tensors
under `vision_tower.` and `multi_modal_projector.` (see `HF_NAMES`). The released checkpoints and
transformers 4 name the tower `vision_tower.vision_model.*`, transformers 5 saves
`vision_tower.*`; either may sit under `model.`. SigLIP's pooling head (`vision_use_head`) is not
used by Gemma 3 and is not read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints_conv import read_hf_config
from jaxinfer.models.vision import weights

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu": False}  # hidden_act -> jax.nn.gelu(approximate=...)


def _square(value, key: str) -> int:
    """An image or patch size given as an int or as an equal (height, width) pair."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config.{key}={value!r}: only square sizes are supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"vision_config.{key}={value!r}: expected a positive integer")
    return value


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """transformers' SiglipVisionConfig (its defaults: a key config.json leaves out takes them)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision_config.{key}={value!r}: expected a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision_config.hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config.image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act={self.hidden_act!r} is not supported (supported: {sorted(ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @classmethod
    def from_hf_dict(cls, vision_config: dict) -> SiglipVisionConfig:
        if not isinstance(vision_config, dict):
            raise ValueError(f"vision_config: expected an object, found {type(vision_config).__name__}")
        model_type = vision_config.get("model_type", "siglip_vision_model")
        if model_type != "siglip_vision_model":
            raise ValueError(f"vision_config.model_type={model_type!r}: only SigLIP ('siglip_vision_model') is supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vision_config.items() if k in fields}
        for key in ("image_size", "patch_size"):
            if key in values:
                values[key] = _square(values[key], key)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """The tower, how many soft tokens an image becomes, and the text model's hidden size."""

    vision: SiglipVisionConfig = SiglipVisionConfig()
    mm_tokens_per_image: int = 256
    text_hidden_size: int = 2304  # Gemma3TextConfig's default

    def __post_init__(self):
        side = math.isqrt(self.mm_tokens_per_image) if self.mm_tokens_per_image > 0 else 0
        if side * side != self.mm_tokens_per_image or side == 0 or self.vision.grid % side:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose side divides the "
                             f"patch grid's ({self.vision.grid} = image_size {self.vision.image_size} / patch_size "
                             f"{self.vision.patch_size})")

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool(self) -> int:
        """The average pool's kernel and stride, in patches."""
        return self.vision.grid // self.tokens_per_side

    @classmethod
    def from_hf_dict(cls, hf: dict) -> Gemma3VisionConfig:
        """From a Gemma 3 `config.json` (model_type "gemma3": `vision_config`, `mm_tokens_per_image`,
        `text_config.hidden_size`)."""
        if hf.get("model_type", "gemma3") != "gemma3":
            raise ValueError(f"model_type={hf.get('model_type')!r}: the Gemma 3 vision encoder needs a 'gemma3' config")
        if "vision_config" not in hf:
            raise ValueError("config has no vision_config: a text-only Gemma 3 checkpoint has no vision tower")
        text = hf.get("text_config") or {}
        mm_tokens = hf.get("mm_tokens_per_image", 256)
        if not isinstance(mm_tokens, int) or isinstance(mm_tokens, bool):
            raise ValueError(f"mm_tokens_per_image={mm_tokens!r}: expected an integer")
        return cls(vision=SiglipVisionConfig.from_hf_dict(hf["vision_config"]), mm_tokens_per_image=mm_tokens,
                   text_hidden_size=int(text.get("hidden_size", 2304)))


# ----------------------------------------------------------------------------------------------
# Layers (plain functions of arrays)
# ----------------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """[..., D], in float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """[..., D] * rsqrt(mean(x^2) + eps) * (1 + w), in float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def patchify(pixel_values: jax.Array, patch: int) -> jax.Array:
    """[N, C, H, W] -> [N, (H/P) * (W/P), C*P*P]: patches in row-major grid order, each flattened
    (channel, row, column) like the conv weight [D, C, P, P]."""
    N, C, H, W = pixel_values.shape
    x = pixel_values.reshape(N, C, H // patch, patch, W // patch, patch)
    x = x.transpose(0, 2, 4, 1, 3, 5)  # [N, H/P, W/P, C, P, P]
    return x.reshape(N, (H // patch) * (W // patch), C * patch * patch)


def attention(x: jax.Array, w: dict, eps: float) -> jax.Array:
    """Bidirectional multi-head self-attention over the patches of each image: x [N, S, D]."""
    h = layer_norm(x, w["ln1_scale"], w["ln1_bias"], eps)
    q = jnp.einsum("nsd,dhk->nshk", h, w["q_proj"]) + w["q_bias"]  # [N, S, H, Dh]
    k = jnp.einsum("nsd,dhk->nshk", h, w["k_proj"]) + w["k_bias"]
    v = jnp.einsum("nsd,dhk->nshk", h, w["v_proj"]) + w["v_bias"]
    o = jax.nn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5)  # [N, S, H, Dh]
    return jnp.einsum("nshk,hkd->nsd", o, w["o_proj"]) + w["o_bias"]  # [N, S, D]


def mlp(x: jax.Array, w: dict, eps: float, approximate: bool) -> jax.Array:
    h = layer_norm(x, w["ln2_scale"], w["ln2_bias"], eps)
    h = jax.nn.gelu(h @ w["fc1"] + w["fc1_bias"], approximate=approximate)  # [N, S, F]
    return h @ w["fc2"] + w["fc2_bias"]  # [N, S, D]


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _init(name: str, shape: tuple[int, ...], dtype, rngs: nnx.Rngs) -> nnx.Param:
    """Random weights for a model built without a checkpoint (LayerNorm scales 1, biases and the
    projector's (1 + w) norm 0)."""
    if name.endswith("_scale"):
        return nnx.Param(jnp.ones(shape, dtype))
    if name.endswith("_bias") or name == "norm":
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def layer_shapes(cfg: SiglipVisionConfig) -> dict[str, tuple[int, ...]]:
    """The encoder layers' weights, each stacked on a leading [L] axis."""
    L, D, H, Dh, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "ln1_scale": (L, D), "ln1_bias": (L, D),
        "q_proj": (L, D, H, Dh), "q_bias": (L, H, Dh),
        "k_proj": (L, D, H, Dh), "k_bias": (L, H, Dh),
        "v_proj": (L, D, H, Dh), "v_bias": (L, H, Dh),
        "o_proj": (L, H, Dh, D), "o_bias": (L, D),
        "ln2_scale": (L, D), "ln2_bias": (L, D),
        "fc1": (L, D, F), "fc1_bias": (L, F),
        "fc2": (L, F, D), "fc2_bias": (L, D),
    }


class SiglipEncoderLayers(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, param_dtype, rngs: nnx.Rngs):
        for name, shape in layer_shapes(cfg).items():
            setattr(self, name, _init(name, shape, param_dtype, rngs))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class SiglipVisionTower(nnx.Module):
    """pixel_values [N, C, H, W] -> last_hidden_state [N, S, D]."""

    def __init__(self, cfg: SiglipVisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        C, P, D = cfg.num_channels, cfg.patch_size, cfg.hidden_size
        self.patch_embed = _init("patch_embed", (C * P * P, D), param_dtype, rngs)  # [C*P*P, D]
        self.patch_bias = _init("patch_bias", (D,), param_dtype, rngs)
        self.position_embed = _init("position_embed", (cfg.num_patches, D), param_dtype, rngs)  # [S, D]
        self.layers = SiglipEncoderLayers(cfg, param_dtype=param_dtype, rngs=rngs)
        self.post_norm_scale = _init("post_norm_scale", (D,), param_dtype, rngs)
        self.post_norm_bias = _init("post_norm_bias", (D,), param_dtype, rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        cfg = self.cfg
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: expected [N, {', '.join(map(str, expected))}] "
                             f"(the model's image_size; position embeddings are not interpolated)")
        dtype = self.patch_embed[...].dtype
        x = patchify(pixel_values.astype(dtype), cfg.patch_size) @ self.patch_embed[...] + self.patch_bias[...]
        x = x + self.position_embed[...]  # [N, S, D]
        eps, approximate = cfg.layer_norm_eps, ACTIVATIONS[cfg.hidden_act]

        def layer(x, w):
            x = x + attention(x, w, eps)
            x = x + mlp(x, w, eps, approximate)
            return x, None

        x, _ = jax.lax.scan(layer, x, self.layers.stacked())
        return layer_norm(x, self.post_norm_scale[...], self.post_norm_bias[...], eps)  # [N, S, D]


class Gemma3MultiModalProjector(nnx.Module):
    """last_hidden_state [N, S, D] -> soft tokens [N, T, E]."""

    def __init__(self, cfg: Gemma3VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        D = cfg.vision.hidden_size
        self.norm = _init("norm", (D,), param_dtype, rngs)  # applied as (1 + w)
        self.proj = _init("proj", (D, cfg.text_hidden_size), param_dtype, rngs)  # [D, E]

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        N, _, D = x.shape
        g, t, k = cfg.vision.grid, cfg.tokens_per_side, cfg.pool
        pooled = x.astype(jnp.float32).reshape(N, t, k, t, k, D).mean(axis=(2, 4))  # [N, t, t, D]
        pooled = pooled.reshape(N, t * t, D).astype(x.dtype)  # [N, T, D], row-major over the pooled grid
        h = gemma_rms_norm(pooled, self.norm[...], cfg.vision.layer_norm_eps)
        return (h @ self.proj[...]).astype(x.dtype)  # [N, T, E]


class Gemma3VisionEncoder(nnx.Module):
    """pixel_values [N, C, H, W] -> image soft tokens [N, mm_tokens_per_image, text hidden size]."""

    def __init__(self, cfg: Gemma3VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tower = SiglipVisionTower(cfg.vision, param_dtype=param_dtype, rngs=rngs)
        self.projector = Gemma3MultiModalProjector(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        return self.projector(self.tower(pixel_values))


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef: nnx.GraphDef, state: nnx.State, pixel_values: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(pixel_values)


def image_features(model: Gemma3VisionEncoder, pixel_values) -> jax.Array:
    """The jitted encoder (one compile per batch size): [N, C, H, W] -> [N, T, E]."""
    graphdef, state = nnx.split(model)
    return _apply(graphdef, state, jnp.asarray(pixel_values, jnp.float32))


# ----------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------

# Parameter <- HF tensor (under the tower's or the projector's prefix; {i}: the layer), and how the
# HF layout becomes ours (torch Linear weights are [out, in]).
HF_NAMES: dict[str, str] = {
    "tower.patch_embed": "vision_tower.embeddings.patch_embedding.weight",  # [D, C, P, P] -> [C*P*P, D]
    "tower.patch_bias": "vision_tower.embeddings.patch_embedding.bias",
    "tower.position_embed": "vision_tower.embeddings.position_embedding.weight",  # [S, D]
    "tower.layers.ln1_scale": "vision_tower.encoder.layers.{i}.layer_norm1.weight",
    "tower.layers.ln1_bias": "vision_tower.encoder.layers.{i}.layer_norm1.bias",
    "tower.layers.q_proj": "vision_tower.encoder.layers.{i}.self_attn.q_proj.weight",  # [H*Dh, D] -> [D, H, Dh]
    "tower.layers.q_bias": "vision_tower.encoder.layers.{i}.self_attn.q_proj.bias",  # [H*Dh] -> [H, Dh]
    "tower.layers.k_proj": "vision_tower.encoder.layers.{i}.self_attn.k_proj.weight",
    "tower.layers.k_bias": "vision_tower.encoder.layers.{i}.self_attn.k_proj.bias",
    "tower.layers.v_proj": "vision_tower.encoder.layers.{i}.self_attn.v_proj.weight",
    "tower.layers.v_bias": "vision_tower.encoder.layers.{i}.self_attn.v_proj.bias",
    "tower.layers.o_proj": "vision_tower.encoder.layers.{i}.self_attn.out_proj.weight",  # [D, H*Dh] -> [H, Dh, D]
    "tower.layers.o_bias": "vision_tower.encoder.layers.{i}.self_attn.out_proj.bias",
    "tower.layers.ln2_scale": "vision_tower.encoder.layers.{i}.layer_norm2.weight",
    "tower.layers.ln2_bias": "vision_tower.encoder.layers.{i}.layer_norm2.bias",
    "tower.layers.fc1": "vision_tower.encoder.layers.{i}.mlp.fc1.weight",  # [F, D] -> [D, F]
    "tower.layers.fc1_bias": "vision_tower.encoder.layers.{i}.mlp.fc1.bias",
    "tower.layers.fc2": "vision_tower.encoder.layers.{i}.mlp.fc2.weight",  # [D, F] -> [F, D]
    "tower.layers.fc2_bias": "vision_tower.encoder.layers.{i}.mlp.fc2.bias",
    "tower.post_norm_scale": "vision_tower.post_layernorm.weight",
    "tower.post_norm_bias": "vision_tower.post_layernorm.bias",
    "projector.norm": "multi_modal_projector.mm_soft_emb_norm.weight",  # w of (1 + w)
    "projector.proj": "multi_modal_projector.mm_input_projection_weight",  # [D, E], as stored
}
_STORED = re.compile(r"^(?:model\.)?(?:(vision_tower)\.(?:vision_model\.)?|(multi_modal_projector)\.)(.+)$")
UNUSED_PREFIXES = ("vision_tower.head.",)  # SigLIP's attention-pooling head (vision_use_head): Gemma 3 reads the patches


def hf_shape(param: str, cfg: Gemma3VisionConfig) -> tuple[int, ...]:
    """The shape of one HF tensor of `param` (one layer's, for a stacked one)."""
    v = cfg.vision
    D, F, C, P = v.hidden_size, v.intermediate_size, v.num_channels, v.patch_size
    return {
        "tower.patch_embed": (D, C, P, P), "tower.patch_bias": (D,), "tower.position_embed": (v.num_patches, D),
        "tower.layers.q_proj": (D, D), "tower.layers.k_proj": (D, D), "tower.layers.v_proj": (D, D),
        "tower.layers.o_proj": (D, D), "tower.layers.fc1": (F, D), "tower.layers.fc1_bias": (F,),
        "tower.layers.fc2": (D, F), "projector.proj": (D, cfg.text_hidden_size),
    }.get(param, (D,))


def to_param(param: str, array: np.ndarray, cfg: Gemma3VisionConfig) -> np.ndarray:
    """One HF tensor (one layer's) in our layout."""
    v = cfg.vision
    H, Dh = v.num_attention_heads, v.head_dim
    leaf = param.rsplit(".", 1)[-1]
    if leaf == "patch_embed":
        return array.reshape(array.shape[0], -1).T  # [C*P*P, D]
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return array.T.reshape(-1, H, Dh)  # [D, H, Dh]
    if leaf in ("q_bias", "k_bias", "v_bias"):
        return array.reshape(H, Dh)
    if leaf == "o_proj":
        return array.T.reshape(H, Dh, -1)  # [H, Dh, D]
    if leaf in ("fc1", "fc2"):
        return array.T
    return array


def stored_names(names) -> dict[str, str]:
    """Canonical HF name (`vision_tower.*` without `vision_model.`, `multi_modal_projector.*`) ->
    the name a checkpoint stores it under, for the tensors of the tower and the projector."""
    return weights.stored_names(names, _STORED, lambda m: f"{m.group(1) or m.group(2)}.{m.group(3)}")


def read_params(source, cfg: Gemma3VisionConfig, param_dtype=jnp.float32, where: str = "checkpoint") -> dict[str, jax.Array]:
    """Flat parameter name -> array, from a checkpoints_conv tensor source (listing/read by HF name).
    Every missing tensor, unexpected tower tensor and wrong shape is reported at once, by name,
    before any data is read."""
    return weights.read_tower_params(
        source, stored_names(dict(source.listing())), HF_NAMES, stacks={"tower.layers.": cfg.vision.num_hidden_layers},
        shape_of=lambda param: hf_shape(param, cfg), convert=lambda param, a: to_param(param, a, cfg),
        param_dtype=param_dtype, where=where, what="Gemma 3 vision tower", ignored=UNUSED_PREFIXES)


def load_gemma3_vision(model_dir: str | os.PathLike, *, param_dtype=jnp.float32) -> Gemma3VisionEncoder:
    """The vision encoder of a Gemma 3 Hugging Face folder (config.json + safetensors), its
    weights cast to `param_dtype`. CheckpointError names a missing, unexpected or misshapen tensor;
    ValueError a config field the encoder does not support."""
    cfg = Gemma3VisionConfig.from_hf_dict(read_hf_config(model_dir))
    return weights.load_tower(model_dir, lambda: Gemma3VisionEncoder(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)),
                              lambda source: read_params(source, cfg, param_dtype, where=str(model_dir)))

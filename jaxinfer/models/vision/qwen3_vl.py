"""Qwen3-VL's image encoder: the vision transformer, its patch merger and the deepstack mergers (Flax NNX).

The images of a Qwen2VLImageProcessor batch become soft tokens in the text model's hidden size,
and deepstack features the text decoder adds to the image tokens after its first layers, exactly
what transformers' `Qwen3VLForConditionalGeneration.model.visual(pixel_values, grid_thw=...)` gives
as `pooler_output` and `deepstack_features`:

    pixel_values [S_all, C*T*P*P]                  # each image's patches in spatial-merge order
    image_grid_thw [N, 3]                          #   (t, h/m, w/m, m, m), as for Qwen2.5-VL
    per image (grid t x h x w, S = t*h*w patches, U = m*m patches per merged token):
        x = pixels @ patch_embed + bias            # [S, D]: the Conv3d as a matmul
        x = x + pos_embed(bilinear(rows, cols))    # the learned G x G position grid (G^2 =
                                                   #   num_position_embeddings) resampled to h x w
                                                   #   (align_corners), each frame alike
        cos, sin = rope2d(rows, cols)              # [S, Dh]: as Qwen2.5-VL's
        per layer l (pre-LayerNorm):
            x = x + proj(attention(norm1(x)))      # bidirectional over the patch's frame
            x = x + fc2(act(fc1(norm2(x))))        # gelu (tanh) MLP
            if l is deepstack_visual_indexes[j]:   # [S / U, E]: merged as below, but LayerNorm over
                deepstack[j] = merger_j(x)         #   the U neighbours side by side (U * D)
        y = LayerNorm(x).reshape(S / U, U * D)     # the merger
        y = fc2(gelu(fc1(y)))                      # [S / U, E], E = out_hidden_size
    features = concatenate over images             # [n, E] and deepstack [K, n, E]

Qwen3-VL 2B..32B: P 16, T 2, m 2, D 1024 / 1152, 24 / 27 layers, G 48, deepstack after 3 layers
(e.g. 8, 16, 24). Unlike Qwen2.5-VL there are no windows: merged tokens stay in row-major order.

Shared with Qwen2.5-VL (`qwen_vl`): the patch order and 2-D rotary angles, the attention, the
per-image jitted loop, the checkpoint plumbing (`visual.*` or `model.visual.*`) and the
preprocessing (`preprocess_qwen_images`: Qwen3-VL's processor is Qwen2VLImageProcessor).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints_conv import read_hf_config
from jaxinfer.models.vision import qwen_vl, weights
from jaxinfer.models.vision.qwen_vl import ACTIVATIONS, Blocks, merge_order_positions, positive, rope_cos_sin, self_attention

LN_EPS = 1e-6  # transformers fixes the vision LayerNorms' eps


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig:
    """transformers' Qwen3VLVisionConfig (its defaults: a key config.json leaves out takes them)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    def __post_init__(self):
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                    "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
            positive(getattr(self, key), key)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                             "multiple of 4 (the head splits into row and column rotary halves)")
        layers = self.deepstack_visual_indexes
        if not layers or len(set(layers)) != len(layers) or any(
                not isinstance(i, int) or not 0 <= i < self.depth for i in layers):
            raise ValueError(f"vision_config.deepstack_visual_indexes={list(layers)}: expected distinct layers of a "
                             f"depth-{self.depth} tower, at least one")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act={self.hidden_act!r} is not supported (supported: {sorted(ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (U)."""
        return self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """G: the learned position grid is G x G."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> Qwen3VisionConfig:
        """From a Qwen3-VL `config.json` (model_type "qwen3_vl", its `vision_config`) or from the vision_config itself."""
        if "vision_config" in hf or hf.get("model_type") == "qwen3_vl" and "depth" not in hf:
            if hf.get("model_type", "qwen3_vl") != "qwen3_vl":
                raise ValueError(f"model_type={hf.get('model_type')!r}: the Qwen3-VL vision tower needs a 'qwen3_vl' config")
            if "vision_config" not in hf:
                raise ValueError("config has no vision_config: a text-only checkpoint has no vision tower")
            hf = hf["vision_config"]
        if not isinstance(hf, dict):
            raise ValueError(f"vision_config: expected an object, found {type(hf).__name__}")
        model_type = hf.get("model_type", "qwen3_vl_vision")
        if model_type not in ("qwen3_vl_vision", "qwen3_vl"):
            raise ValueError(f"vision_config.model_type={model_type!r}: only Qwen3-VL's vision tower is supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in fields}
        for key in ("patch_size", "temporal_patch_size"):
            if key in values:
                values[key] = positive(values[key], key)
        if "deepstack_visual_indexes" in values:
            values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"vision_config.rope_parameters={rope!r}: only the axial 2-D rope is supported")
        values["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        return cls(**values)


# ----------------------------------------------------------------------------------------------
# Index bookkeeping (numpy, from one image's static grid)
# ----------------------------------------------------------------------------------------------


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps [n, 2] into a `side`-long axis for positions `index` of a `size`-long one
    (align_corners, edges clamped) and their weights, in float32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0).astype(np.float32)
    return np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1), weights


@functools.lru_cache(maxsize=64)
def grid_indices(cfg: Qwen3VisionConfig, t: int, h: int, w: int):
    """For one image of t x h x w patches (spatial-merge order):

        rows, cols [S]        each patch's grid row / column (the rotary positions)
        taps, tap_weights     [S, 4]: the rows of the learned position grid it mixes, and how much
        frame [S]             its frame (the attention blocks)
    """
    rows, cols = merge_order_positions(t, h, w, cfg.spatial_merge_size)
    G = cfg.grid_side
    (rt, rw), (ct, cw) = _axis_taps(rows, h, G), _axis_taps(cols, w, G)
    taps = (rt[:, :, None] * G + ct[:, None, :]).reshape(-1, 4)
    tap_weights = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    frame = np.arange(t * h * w) // (h * w)
    return rows, cols, taps, tap_weights, frame


# ----------------------------------------------------------------------------------------------
# Layers (plain functions of arrays)
# ----------------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float = LN_EPS) -> jax.Array:
    """[..., D] LayerNorm in float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def mlp(x: jax.Array, w: dict, act) -> jax.Array:
    h = layer_norm(x, w["norm2"], w["norm2_bias"])
    return act(h @ w["fc1"] + w["fc1_bias"]) @ w["fc2"] + w["fc2_bias"]  # [S, D]


def merge(x: jax.Array, w: dict, post_shuffle: bool) -> jax.Array:
    """x [S, D] -> [S / U, E]: LayerNorm over each patch (the merger) or over the U patches of a
    merged token side by side (`post_shuffle`: the deepstack mergers), then fc1, gelu, fc2."""
    M = w["fc1"].shape[0]  # U * D
    if post_shuffle:
        y = layer_norm(x.reshape(-1, M), w["norm"], w["norm_bias"])  # [S/U, U*D]
    else:
        y = layer_norm(x, w["norm"], w["norm_bias"]).reshape(-1, M)
    y = jax.nn.gelu(y @ w["fc1"] + w["fc1_bias"], approximate=False)
    return y @ w["fc2"] + w["fc2_bias"]  # [S / U, E]


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


class Params(nnx.Module):
    """Named weights of the given shapes (a stack's with a leading [L] or [K] axis)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, param_dtype, rngs: nnx.Rngs):
        for name, shape in shapes.items():
            setattr(self, name, qwen_vl._init(name, shape, param_dtype, rngs))

    def get(self) -> dict[str, jax.Array]:
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def shapes(cfg: Qwen3VisionConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """The weights of the blocks ([L] stacked), the merger and the deepstack mergers ([K] stacked)."""
    L, D, H, Dh, F = cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    K, M, E = len(cfg.deepstack_visual_indexes), D * cfg.merge_unit, cfg.out_hidden_size
    merger = {"fc1": (M, M), "fc1_bias": (M,), "fc2": (M, E), "fc2_bias": (E,)}
    return {
        "blocks": {"norm1": (L, D), "norm1_bias": (L, D), "qkv": (L, D, 3, H, Dh), "qkv_bias": (L, 3, H, Dh),
                   "proj": (L, H, Dh, D), "proj_bias": (L, D), "norm2": (L, D), "norm2_bias": (L, D),
                   "fc1": (L, D, F), "fc1_bias": (L, F), "fc2": (L, F, D), "fc2_bias": (L, D)},
        "merger": {"norm": (D,), "norm_bias": (D,), **merger},
        "deepstack": {"norm": (K, M), "norm_bias": (K, M), **{k: (K, *v) for k, v in merger.items()}},
    }


class Qwen3VisionTransformer(nnx.Module):
    """One image's patches [t*h*w, C*T*P*P] (grid t, h, w given statically) -> (features
    [t*h*w / U, E], deepstack features [K, t*h*w / U, E])."""

    def __init__(self, cfg: Qwen3VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        D = cfg.hidden_size
        init = functools.partial(qwen_vl._init, dtype=param_dtype, rngs=rngs)
        self.patch_embed = init("patch_embed", (cfg.patch_dim, D))  # [C*T*P*P, D]
        self.patch_embed_bias = init("patch_embed_bias", (D,))
        self.pos_embed = init("pos_embed", (cfg.num_position_embeddings, D))  # [G*G, D]
        for name, group in shapes(cfg).items():
            setattr(self, name, Params(group, param_dtype=param_dtype, rngs=rngs))

    def __call__(self, pixels: jax.Array, grid: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        t, h, w = grid
        if pixels.ndim != 2 or pixels.shape != (t * h * w, cfg.patch_dim):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)}: expected [{t * h * w}, {cfg.patch_dim}] for grid "
                             f"{t} x {h} x {w} (C*T*P*P = {cfg.in_channels}*{cfg.temporal_patch_size}*{cfg.patch_size}**2)")
        rows, cols, taps, tap_weights, frame = grid_indices(cfg, t, h, w)
        dtype = self.patch_embed[...].dtype
        x = pixels.astype(dtype) @ self.patch_embed[...] + self.patch_embed_bias[...]  # [S, D]
        pos = (self.pos_embed[...][jnp.asarray(taps)].astype(jnp.float32) * jnp.asarray(tap_weights)[..., None]).sum(1)
        x = x + pos.astype(dtype)  # [S, D]
        cos, sin = (jnp.asarray(a) for a in rope_cos_sin(cfg, rows, cols))  # [S, Dh]
        frames = Blocks.of(frame)  # [t, h * w]: each frame attends to itself
        act = ACTIVATIONS[cfg.hidden_act]
        blocks, deepstack = self.blocks.get(), self.deepstack.get()

        def layer(x, w):
            x = x + self_attention(layer_norm(x, w["norm1"], w["norm1_bias"]), w, cos, sin, frames)
            return x + mlp(x, w, act), None

        features, start = [], 0
        layers = cfg.deepstack_visual_indexes
        for j in sorted(range(len(layers)), key=layers.__getitem__):  # in layer order, as transformers lists them
            end = layers[j] + 1  # the layers up to deepstack layer j, then its merger
            x, _ = jax.lax.scan(layer, x, jax.tree.map(lambda a: a[start:end], blocks))
            features.append(merge(x, jax.tree.map(lambda a: a[j], deepstack), post_shuffle=True))
            start = end
        if start < cfg.depth:
            x, _ = jax.lax.scan(layer, x, jax.tree.map(lambda a: a[start:], blocks))
        return merge(x, self.merger.get(), post_shuffle=False), jnp.stack(features)  # [S/U, E], [K, S/U, E]


def image_features(model: Qwen3VisionTransformer, pixel_values, image_grid_thw) -> tuple[jax.Array, jax.Array]:
    """pixel_values [sum t*h*w, C*T*P*P], image_grid_thw [N, 3] -> (features [n, E], deepstack
    features [K, n, E]), n = sum t*h*w / U, images in order (each encoded on its own)."""
    out = qwen_vl.per_image(model, pixel_values, image_grid_thw)
    return jnp.concatenate([f for f, _ in out]), jnp.concatenate([d for _, d in out], axis=1)


# ----------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------

_MERGER = {"norm": "norm.weight", "norm_bias": "norm.bias", "fc1": "linear_fc1.weight", "fc1_bias": "linear_fc1.bias",
           "fc2": "linear_fc2.weight", "fc2_bias": "linear_fc2.bias"}
# Parameter <- HF tensor (under `visual.`; {i}: the block or the deepstack merger); the layouts
# convert as Qwen2.5-VL's (`qwen_vl.to_param`: torch Linear weights [out, in] transposed).
HF_NAMES: dict[str, str] = {
    "patch_embed": "visual.patch_embed.proj.weight",  # [D, C, T, P, P] -> [C*T*P*P, D]
    "patch_embed_bias": "visual.patch_embed.proj.bias",
    "pos_embed": "visual.pos_embed.weight",  # [G*G, D]
    **{f"blocks.{name}": f"visual.blocks.{{i}}.{hf}" for name, hf in {
        "norm1": "norm1.weight", "norm1_bias": "norm1.bias", "qkv": "attn.qkv.weight", "qkv_bias": "attn.qkv.bias",
        "proj": "attn.proj.weight", "proj_bias": "attn.proj.bias", "norm2": "norm2.weight", "norm2_bias": "norm2.bias",
        "fc1": "mlp.linear_fc1.weight", "fc1_bias": "mlp.linear_fc1.bias", "fc2": "mlp.linear_fc2.weight",
        "fc2_bias": "mlp.linear_fc2.bias"}.items()},
    **{f"merger.{name}": f"visual.merger.{hf}" for name, hf in _MERGER.items()},
    **{f"deepstack.{name}": f"visual.deepstack_merger_list.{{i}}.{hf}" for name, hf in _MERGER.items()},
}


def hf_shape(param: str, cfg: Qwen3VisionConfig) -> tuple[int, ...]:
    """The shape of one HF tensor of `param` (one block's or merger's, for a stacked one)."""
    D, F, M, E = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
    group, _, leaf = param.rpartition(".")
    if param == "patch_embed":
        return (D, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
    if param == "pos_embed":
        return (cfg.num_position_embeddings, D)
    if group == "blocks":
        return {"qkv": (3 * D, D), "qkv_bias": (3 * D,), "proj": (D, D), "fc1": (F, D), "fc1_bias": (F,),
                "fc2": (D, F)}.get(leaf, (D,))
    if group in ("merger", "deepstack"):
        norm = (D,) if group == "merger" else (M,)
        return {"norm": norm, "norm_bias": norm, "fc1": (M, M), "fc1_bias": (M,), "fc2": (E, M), "fc2_bias": (E,)}[leaf]
    return (D,)  # patch_embed_bias


def read_params(source, cfg: Qwen3VisionConfig, param_dtype=jnp.float32, where: str = "checkpoint") -> dict[str, jax.Array]:
    """Flat parameter name -> array, from a checkpoints_conv tensor source; every missing,
    unexpected or misshapen tensor reported at once, by name, before any data is read."""
    return weights.read_tower_params(
        source, qwen_vl.stored_names(dict(source.listing())), HF_NAMES,
        stacks={"blocks.": cfg.depth, "deepstack.": len(cfg.deepstack_visual_indexes)},
        shape_of=lambda param: hf_shape(param, cfg), convert=lambda param, a: qwen_vl.to_param(param, a, cfg),
        param_dtype=param_dtype, where=where, what="Qwen3-VL vision tower")


def load_qwen3_vl_vision(model_dir: str | os.PathLike, *, param_dtype=jnp.float32) -> Qwen3VisionTransformer:
    """The vision tower of a Qwen3-VL Hugging Face folder (config.json + safetensors), its weights
    cast to `param_dtype`. CheckpointError names a missing, unexpected or misshapen tensor;
    ValueError a config field the tower does not support."""
    cfg = Qwen3VisionConfig.from_hf_dict(read_hf_config(model_dir))
    return weights.load_tower(model_dir, lambda: Qwen3VisionTransformer(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)),
                              lambda source: read_params(source, cfg, param_dtype, where=str(model_dir)))

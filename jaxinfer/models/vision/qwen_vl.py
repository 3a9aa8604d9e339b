"""Qwen2.5-VL's image encoder: the vision transformer and its patch merger (Flax NNX).

The images of a Qwen2VLImageProcessor batch become soft tokens in the text model's hidden size,
exactly what transformers' `Qwen2_5_VLForConditionalGeneration.model.visual(pixel_values,
grid_thw=image_grid_thw).pooler_output` is (`get_image_features` splits it per image):

    pixel_values [S_all, C*T*P*P]                  # Qwen2VLImageProcessor: each image's patches in
    image_grid_thw [N, 3]                          #   spatial-merge order (t, h/m, w/m, m, m), the
                                                   #   image repeated over T = temporal_patch_size
    per image (grid t x h x w, S = t*h*w patches, U = m*m patches per merged token):
        x = pixels @ patch_embed                   # [S, D]: the Conv3d (kernel = stride = T x P x P,
                                                   #   no bias) as a matmul over flattened patches
        x = x[perm]                                # window order: merged tokens grouped by window
                                                   #   (window_size / m / P merged tokens a side)
        cos, sin = rope2d(rows, cols)[perm]        # [S, Dh]: half of each head rotates by the patch's
                                                   #   row, half by its column (theta 10000)
        per layer (pre-RMSNorm):
            x = x + proj(attention(norm1(x)))      # bidirectional; a patch sees its window's patches,
                                                   #   or its frame's in `fullatt_block_indexes` layers
            x = x + down(act(gate(norm2(x))) * up(norm2(x)))
        merger:
            y = rms_norm(x).reshape(S / U, U * D)  # the U neighbours of each merged token side by side
            y = fc2(gelu(fc1(y)))                  # [S / U, E], E = out_hidden_size
            y = y[argsort(window_index)]           # back to merged-token (row-major) order
    features = concatenate over images             # [sum S / U, E]

Qwen2.5-VL 3B..72B: P 14, T 2, m 2, D 1280, 32 layers of 16 heads, F 3420, window 112 pixels
(4 x 4 merged tokens), full attention in layers 7, 15, 23, 31.

Attention is plain jnp within blocks of consecutive patches (`Blocks`, static shapes from the
grid): a window layer gathers the patches (already in window order) into [windows, longest window,
...] (8 x 8 = 64 patches a window; an edge window, cut short, is padded and its padding keys
masked), attends per window and puts the patches back in order; a full-attention layer is the same with one block
per frame (no padding). Window layers thus cost O(S * 64) scores, full layers O(S^2) per head:
fine for the image sizes the processor's default max_pixels allows (S <= 5120). Each image is
encoded on its own, one compile per grid size.

Weights load from a Hugging Face folder (`load_qwen2_5_vl_vision`): its `config.json`'s
`vision_config` (`Qwen2_5_VisionConfig.from_hf_dict`) and the tensors under `visual.` (the released
checkpoints and transformers 5's saves) or `model.visual.` (see `HF_NAMES`).
`preprocess_qwen_images` runs the folder's Qwen2VLImageProcessor (numpy / Pillow, no torch).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import Qwen2VLImageProcessorPil

from checkpoints_conv import read_hf_config
from jaxinfer.models.vision import weights
from jaxinfer.models.vision.preprocess import ImageInput, describe, load_image, load_processor

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}
RMS_EPS = 1e-6  # transformers fixes the vision RMSNorms' eps


def positive(value, key: str) -> int:
    if isinstance(value, (list, tuple)):  # patch sizes may be given as an equal pair
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config.{key}={value!r}: only square sizes are supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"vision_config.{key}={value!r}: expected a positive integer")
    return value


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VisionConfig:
    """transformers' Qwen2_5_VLVisionConfig (its defaults: a key config.json leaves out takes them)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    def __post_init__(self):
        for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                    "temporal_patch_size", "spatial_merge_size", "window_size", "out_hidden_size"):
            positive(getattr(self, key), key)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a "
                             "multiple of 4 (the head splits into row and column rotary halves)")
        if self.window_size // self.spatial_merge_size // self.patch_size <= 0:
            raise ValueError(f"vision_config.window_size={self.window_size} is under one merged token "
                             f"(spatial_merge_size {self.spatial_merge_size} x patch_size {self.patch_size} pixels)")
        bad = [i for i in self.fullatt_block_indexes if not isinstance(i, int) or not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision_config.fullatt_block_indexes={list(self.fullatt_block_indexes)}: {bad} not layers "
                             f"of a depth-{self.depth} tower")
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
    def window_tokens(self) -> int:
        """Merged tokens per window side."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf_dict(cls, hf: dict) -> Qwen2_5_VisionConfig:
        """From a Qwen2.5-VL `config.json` (model_type "qwen2_5_vl", its `vision_config`) or from the
        vision_config itself. The released configs say `in_chans` and leave rope_parameters out."""
        if "vision_config" in hf or hf.get("model_type") == "qwen2_5_vl" and "depth" not in hf:
            if hf.get("model_type", "qwen2_5_vl") != "qwen2_5_vl":
                raise ValueError(f"model_type={hf.get('model_type')!r}: the Qwen2.5-VL vision tower needs a 'qwen2_5_vl' config")
            if "vision_config" not in hf:
                raise ValueError("config has no vision_config: a text-only checkpoint has no vision tower")
            hf = hf["vision_config"]
        if not isinstance(hf, dict):
            raise ValueError(f"vision_config: expected an object, found {type(hf).__name__}")
        model_type = hf.get("model_type", "qwen2_5_vl_vision")
        if model_type not in ("qwen2_5_vl_vision", "qwen2_5_vl"):  # old saves wrote the parent's type
            raise ValueError(f"vision_config.model_type={model_type!r}: only Qwen2.5-VL's vision tower is supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in fields}
        if "in_channels" not in values and "in_chans" in hf:
            values["in_channels"] = hf["in_chans"]
        for key in ("patch_size", "temporal_patch_size"):
            if key in values:
                values[key] = positive(values[key], key)
        if "fullatt_block_indexes" in values:
            values["fullatt_block_indexes"] = tuple(values["fullatt_block_indexes"])
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"vision_config.rope_parameters={rope!r}: only the axial 2-D rope is supported")
        values["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        return cls(**values)


# ----------------------------------------------------------------------------------------------
# Index bookkeeping (numpy, from one image's static grid)
# ----------------------------------------------------------------------------------------------


def merge_order_positions(t: int, h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) [t*h*w]: each patch's grid row / column, patches in spatial-merge order
    (t, h/m, w/m, m, m) as the processor lays them out (each run of m*m patches one merged token)."""
    if h % m or w % m:
        raise ValueError(f"image grid {t} x {h} x {w}: h and w must be multiples of spatial_merge_size {m}")
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    order = lambda a: np.tile(a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1), t)  # noqa: E731
    return order(r), order(c)


@functools.lru_cache(maxsize=64)
def grid_indices(cfg: Qwen2_5_VisionConfig, t: int, h: int, w: int):
    """For one image of t x h x w patches (h, w multiples of m), as transformers'
    get_vision_position_ids / get_vision_window_index compute them:

        perm [S]          patch order -> window order (window_index expanded to its U patches)
        inverse [S/U]     argsort(window_index): merged tokens back to row-major order
        rows, cols [S]    each patch's grid row / column, in window order
        window [S]        the window of each patch (window order): the attention blocks of window layers
        frame [S]         its frame: the blocks of full-attention layers
    """
    m, U, k = cfg.spatial_merge_size, cfg.merge_unit, cfg.window_tokens
    r, c = merge_order_positions(t, h, w, m)  # [S]
    hm, wm = h // m, w // m  # merged tokens per column / row
    # Windows of k x k merged tokens over each frame's (hm x wm) grid, the last row / column of
    # windows cut short; merged tokens taken window by window, row-major inside each.
    ids = np.arange(t * hm * wm).reshape(t, hm, wm)
    wr, wc = np.arange(hm)[:, None] // k, np.arange(wm)[None, :] // k
    n_wc = -(-wm // k)
    win = np.broadcast_to(np.arange(t)[:, None, None] * (-(-hm // k) * n_wc) + wr * n_wc + wc, ids.shape)
    order = np.lexsort((ids.reshape(-1), win.reshape(-1)))  # stable: by window, then by token id
    window_index = ids.reshape(-1)[order]  # [S/U]
    perm = (window_index[:, None] * U + np.arange(U)).reshape(-1)  # [S]
    window = np.repeat(win.reshape(-1)[order], U)
    frame = perm // (h * w)
    return perm, np.argsort(window_index), r[perm], c[perm], window, frame


@dataclasses.dataclass(frozen=True, eq=False)
class Blocks:
    """S patches cut into B attention blocks, each a run of consecutive patches (a window, or a
    frame): a patch attends to its own block's patches only. Attention runs on [B, L, ...] arrays,
    L the longest block's length, a shorter block padded at its end. Static (numpy, from the grid):

        index [B, L]   the patch in each slot (a padding slot repeats its block's first patch)
        valid [B, L]   False at padding slots: keys there are masked, queries there dropped
        slot [S]       each patch's slot in the flattened [B * L]

    Blocks all of one length (the usual image: every window whole, or one frame) need no padding:
    `split` / `join` are then reshapes.
    """

    index: np.ndarray
    valid: np.ndarray
    slot: np.ndarray

    @classmethod
    def of(cls, block: np.ndarray) -> Blocks:
        """From each patch's block id [S] (`grid_indices`' window or frame), equal ids consecutive."""
        block = np.asarray(block)
        starts = np.flatnonzero(np.r_[True, block[1:] != block[:-1]])  # [B]: where each run begins
        if len(starts) != len(np.unique(block)):
            raise ValueError("attention blocks must be runs of consecutive patches")
        lengths = np.diff(np.r_[starts, len(block)])  # [B]
        j = np.arange(lengths.max())  # [L]
        valid = j < lengths[:, None]  # [B, L]
        index = starts[:, None] + np.where(valid, j, 0)
        slot = (np.arange(len(starts))[:, None] * len(j) + j)[valid]  # row-major: block by block, in patch order
        return cls(index, valid, slot)

    @property
    def padded(self) -> bool:
        return not self.valid.all()

    def split(self, x: jax.Array) -> jax.Array:
        """[S, ...] -> [B, L, ...]."""
        if self.padded:
            return x[jnp.asarray(self.index)]
        return x.reshape(*self.index.shape, *x.shape[1:])

    def join(self, y: jax.Array) -> jax.Array:
        """[B, L, ...] -> [S, ...] (padding slots dropped)."""
        y = y.reshape(-1, *y.shape[2:])
        return y[jnp.asarray(self.slot)] if self.padded else y


def rope_cos_sin(cfg: Qwen2_5_VisionConfig, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S, Dh] each: angles (rows * f, cols * f, rows * f, cols * f), f the Dh/4 frequencies."""
    quarter = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))  # [Dh/4]
    inv_freq = inv_freq.astype(np.float32)
    angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], -1).astype(np.float32)  # [S, Dh/2]
    angles = np.concatenate([angles, angles], -1)  # [S, Dh]
    return np.cos(angles), np.sin(angles)


# ----------------------------------------------------------------------------------------------
# Layers (plain functions of arrays)
# ----------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, w: jax.Array, eps: float = RMS_EPS) -> jax.Array:
    """[..., D] * rsqrt(mean(x^2) + eps) * w, in float32, back in x's dtype."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    return w.astype(x.dtype) * y


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def attention(x: jax.Array, w: dict, cos: jax.Array, sin: jax.Array, blocks: Blocks) -> jax.Array:
    """x [S, D]; cos, sin [S, Dh]; attending within `blocks` -> [S, D] (pre-RMSNorm norm1)."""
    return self_attention(rms_norm(x, w["norm1"]), w, cos, sin, blocks)


def self_attention(h: jax.Array, w: dict, cos: jax.Array, sin: jax.Array, blocks: Blocks) -> jax.Array:
    """The attention of normed patches h [S, D] (weights qkv [D, 3, H, Dh], qkv_bias, proj
    [H, Dh, D], proj_bias), each patch over its block's patches, rotary q / k in float32 -> [S, D].
    B blocks of up to L patches (`Blocks`)."""
    qkv = jnp.einsum("sd,dthk->tshk", h, w["qkv"]) + w["qkv_bias"][:, None]  # [3, S, H, Dh]
    q, k, v = qkv[0], qkv[1], qkv[2]
    c, s = cos[:, None, :], sin[:, None, :]  # [S, 1, Dh]
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q = (qf * c + rotate_half(qf) * s).astype(h.dtype)
    k = (kf * c + rotate_half(kf) * s).astype(h.dtype)
    q, k, v = (blocks.split(a) for a in (q, k, v))  # [B, L, H, Dh]
    scores = jnp.einsum("bshk,bthk->bhst", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5  # [B, H, L, L]
    if blocks.padded:  # a padding slot is no key
        scores = jnp.where(jnp.asarray(blocks.valid)[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
    o = blocks.join(jnp.einsum("bhst,bthk->bshk", probs, v))  # [S, H, Dh]
    return jnp.einsum("shk,hkd->sd", o, w["proj"]) + w["proj_bias"]  # [S, D]


def mlp(x: jax.Array, w: dict, act) -> jax.Array:
    h = rms_norm(x, w["norm2"])
    g = act(h @ w["gate"] + w["gate_bias"]) * (h @ w["up"] + w["up_bias"])  # [S, F]
    return g @ w["down"] + w["down_bias"]  # [S, D]


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------


def _init(name: str, shape: tuple[int, ...], dtype, rngs: nnx.Rngs) -> nnx.Param:
    """Random weights for a model built without a checkpoint (norm weights 1, biases 0)."""
    if name.endswith("_bias"):
        return nnx.Param(jnp.zeros(shape, dtype))
    if name.startswith("norm") or name == "ln_q":
        return nnx.Param(jnp.ones(shape, dtype))
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def layer_shapes(cfg: Qwen2_5_VisionConfig) -> dict[str, tuple[int, ...]]:
    """The blocks' weights, each stacked on a leading [L] axis."""
    L, D, H, Dh, F = cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "norm1": (L, D),
        "qkv": (L, D, 3, H, Dh), "qkv_bias": (L, 3, H, Dh),
        "proj": (L, H, Dh, D), "proj_bias": (L, D),
        "norm2": (L, D),
        "gate": (L, D, F), "gate_bias": (L, F),
        "up": (L, D, F), "up_bias": (L, F),
        "down": (L, F, D), "down_bias": (L, D),
    }


class Qwen2_5_VisionBlocks(nnx.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig, *, param_dtype, rngs: nnx.Rngs):
        for name, shape in layer_shapes(cfg).items():
            setattr(self, name, _init(name, shape, param_dtype, rngs))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class Qwen2_5_VisionMerger(nnx.Module):
    """[S, D] (window order) -> [S / U, E] (window order)."""

    def __init__(self, cfg: Qwen2_5_VisionConfig, *, param_dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        D, M, E = cfg.hidden_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
        self.ln_q = _init("ln_q", (D,), param_dtype, rngs)
        self.fc1 = _init("fc1", (M, M), param_dtype, rngs)  # [U*D, U*D]
        self.fc1_bias = _init("fc1_bias", (M,), param_dtype, rngs)
        self.fc2 = _init("fc2", (M, E), param_dtype, rngs)  # [U*D, E]
        self.fc2_bias = _init("fc2_bias", (E,), param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_norm(x, self.ln_q[...]).reshape(-1, self.fc1.shape[0])  # [S/U, U*D]
        y = jax.nn.gelu(y @ self.fc1[...] + self.fc1_bias[...], approximate=False)
        return y @ self.fc2[...] + self.fc2_bias[...]  # [S/U, E]


class Qwen2_5_VisionTransformer(nnx.Module):
    """One image's patches [t*h*w, C*T*P*P] (grid t, h, w given statically) -> [t*h*w / U, E]."""

    def __init__(self, cfg: Qwen2_5_VisionConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.patch_embed = _init("patch_embed", (cfg.patch_dim, cfg.hidden_size), param_dtype, rngs)  # [C*T*P*P, D]
        self.blocks = Qwen2_5_VisionBlocks(cfg, param_dtype=param_dtype, rngs=rngs)
        self.merger = Qwen2_5_VisionMerger(cfg, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, pixels: jax.Array, grid: tuple[int, int, int]) -> jax.Array:
        cfg = self.cfg
        t, h, w = grid
        if pixels.ndim != 2 or pixels.shape != (t * h * w, cfg.patch_dim):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)}: expected [{t * h * w}, {cfg.patch_dim}] for grid "
                             f"{t} x {h} x {w} (C*T*P*P = {cfg.in_channels}*{cfg.temporal_patch_size}*{cfg.patch_size}**2)")
        perm, inverse, rows, cols, window, frame = grid_indices(cfg, t, h, w)
        dtype = self.patch_embed[...].dtype
        x = pixels.astype(dtype)[perm] @ self.patch_embed[...]  # [S, D], window order
        cos, sin = (jnp.asarray(a) for a in rope_cos_sin(cfg, rows, cols))  # [S, Dh]
        windows = Blocks.of(window)  # [windows, up to (window_tokens * m)^2 patches]
        frames = Blocks.of(frame)  # [t, h * w]: full attention
        full = jnp.asarray([i in cfg.fullatt_block_indexes for i in range(cfg.depth)])  # [L]
        act = ACTIVATIONS[cfg.hidden_act]

        def layer(x, xs):
            w, is_full = xs
            x = x + jax.lax.cond(is_full, lambda: attention(x, w, cos, sin, frames),
                                 lambda: attention(x, w, cos, sin, windows))
            x = x + mlp(x, w, act)
            return x, None

        x, _ = jax.lax.scan(layer, x, (self.blocks.stacked(), full))
        return self.merger(x)[jnp.asarray(inverse)]  # [S/U, E], merged tokens row-major


@functools.partial(jax.jit, static_argnums=(0, 3))
def _apply(graphdef: nnx.GraphDef, state: nnx.State, pixels: jax.Array, grid: tuple[int, int, int]) -> jax.Array:
    return nnx.merge(graphdef, state)(pixels, grid)


def per_image(model: nnx.Module, pixel_values, image_grid_thw) -> list:
    """The jitted tower on each image of a processor batch in turn (one compile per grid size):
    pixel_values [sum t*h*w, C*T*P*P], image_grid_thw [N, 3] -> N outputs of `model(pixels, grid)`."""
    grids = np.asarray(image_grid_thw).reshape(-1, 3).astype(np.int64)
    pixel_values = np.asarray(pixel_values)
    total = int(grids.prod(-1).sum())
    if pixel_values.ndim != 2 or pixel_values.shape[0] != total:
        raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: image_grid_thw {grids.tolist()} "
                         f"asks for {total} patches")
    graphdef, state = nnx.split(model)
    out, start = [], 0
    for t, h, w in grids.tolist():
        n = t * h * w
        out.append(_apply(graphdef, state, jnp.asarray(pixel_values[start:start + n], jnp.float32), (t, h, w)))
        start += n
    return out


def image_features(model: Qwen2_5_VisionTransformer, pixel_values, image_grid_thw) -> jax.Array:
    """pixel_values [sum t*h*w, C*T*P*P], image_grid_thw [N, 3] -> [sum t*h*w / U, E], images in order."""
    return jnp.concatenate(per_image(model, pixel_values, image_grid_thw))


# ----------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------

# Parameter <- HF tensor (under `visual.`; {i}: the block), and how the HF layout becomes ours
# (torch Linear weights are [out, in]).
HF_NAMES: dict[str, str] = {
    "patch_embed": "visual.patch_embed.proj.weight",  # [D, C, T, P, P] -> [C*T*P*P, D]
    "blocks.norm1": "visual.blocks.{i}.norm1.weight",
    "blocks.qkv": "visual.blocks.{i}.attn.qkv.weight",  # [3*H*Dh, D] -> [D, 3, H, Dh]
    "blocks.qkv_bias": "visual.blocks.{i}.attn.qkv.bias",  # [3*H*Dh] -> [3, H, Dh]
    "blocks.proj": "visual.blocks.{i}.attn.proj.weight",  # [D, H*Dh] -> [H, Dh, D]
    "blocks.proj_bias": "visual.blocks.{i}.attn.proj.bias",
    "blocks.norm2": "visual.blocks.{i}.norm2.weight",
    "blocks.gate": "visual.blocks.{i}.mlp.gate_proj.weight",  # [F, D] -> [D, F]
    "blocks.gate_bias": "visual.blocks.{i}.mlp.gate_proj.bias",
    "blocks.up": "visual.blocks.{i}.mlp.up_proj.weight",
    "blocks.up_bias": "visual.blocks.{i}.mlp.up_proj.bias",
    "blocks.down": "visual.blocks.{i}.mlp.down_proj.weight",  # [D, F] -> [F, D]
    "blocks.down_bias": "visual.blocks.{i}.mlp.down_proj.bias",
    "merger.ln_q": "visual.merger.ln_q.weight",
    "merger.fc1": "visual.merger.mlp.0.weight",  # [U*D, U*D] -> transposed
    "merger.fc1_bias": "visual.merger.mlp.0.bias",
    "merger.fc2": "visual.merger.mlp.2.weight",  # [E, U*D] -> [U*D, E]
    "merger.fc2_bias": "visual.merger.mlp.2.bias",
}
_STORED = re.compile(r"^(?:model\.)?(visual\..+)$")


def hf_shape(param: str, cfg: Qwen2_5_VisionConfig) -> tuple[int, ...]:
    """The shape of one HF tensor of `param` (one block's, for a stacked one)."""
    D, F, M, E = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size * cfg.merge_unit, cfg.out_hidden_size
    return {
        "patch_embed": (D, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        "blocks.qkv": (3 * D, D), "blocks.qkv_bias": (3 * D,), "blocks.proj": (D, D),
        "blocks.gate": (F, D), "blocks.gate_bias": (F,), "blocks.up": (F, D), "blocks.up_bias": (F,),
        "blocks.down": (D, F), "merger.fc1": (M, M), "merger.fc1_bias": (M,), "merger.fc2": (E, M),
        "merger.fc2_bias": (E,),
    }.get(param, (D,))


def to_param(param: str, array: np.ndarray, cfg: Qwen2_5_VisionConfig) -> np.ndarray:
    """One HF tensor (one block's) in our layout."""
    H, Dh = cfg.num_heads, cfg.head_dim
    leaf = param.rsplit(".", 1)[-1]
    if leaf == "patch_embed":
        return array.reshape(array.shape[0], -1).T  # [C*T*P*P, D]
    if leaf == "qkv":
        return array.T.reshape(-1, 3, H, Dh)  # [D, 3, H, Dh]
    if leaf == "qkv_bias":
        return array.reshape(3, H, Dh)
    if leaf == "proj":
        return array.T.reshape(H, Dh, -1)  # [H, Dh, D]
    if leaf in ("gate", "up", "down", "fc1", "fc2"):
        return array.T
    return array


def stored_names(names) -> dict[str, str]:
    """Canonical HF name (`visual.*`) -> the name a checkpoint stores it under."""
    return weights.stored_names(names, _STORED, lambda m: m.group(1))


def read_params(source, cfg: Qwen2_5_VisionConfig, param_dtype=jnp.float32, where: str = "checkpoint") -> dict[str, jax.Array]:
    """Flat parameter name -> array, from a checkpoints_conv tensor source (listing/read by HF name).
    Every missing tensor, unexpected tower tensor and wrong shape is reported at once, by name,
    before any data is read."""
    return weights.read_tower_params(
        source, stored_names(dict(source.listing())), HF_NAMES, stacks={"blocks.": cfg.depth},
        shape_of=lambda param: hf_shape(param, cfg), convert=lambda param, a: to_param(param, a, cfg),
        param_dtype=param_dtype, where=where, what="Qwen2.5-VL vision tower")


def load_qwen2_5_vl_vision(model_dir: str | os.PathLike, *, param_dtype=jnp.float32) -> Qwen2_5_VisionTransformer:
    """The vision tower of a Qwen2.5-VL Hugging Face folder (config.json + safetensors), its
    weights cast to `param_dtype`. CheckpointError names a missing, unexpected or misshapen tensor;
    ValueError a config field the tower does not support."""
    cfg = Qwen2_5_VisionConfig.from_hf_dict(read_hf_config(model_dir))
    return weights.load_tower(model_dir, lambda: Qwen2_5_VisionTransformer(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(0)),
                              lambda source: read_params(source, cfg, param_dtype, where=str(model_dir)))


# ----------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------


def load_qwen_image_processor(model_dir: str | os.PathLike) -> Qwen2VLImageProcessorPil:
    """The folder's saved image processor (preprocessor_config.json), as transformers' numpy /
    Pillow Qwen2VLImageProcessor. Never downloads: `model_dir` must be a local folder."""
    return load_processor(model_dir, Qwen2VLImageProcessorPil)


def preprocess_qwen_images(images: Sequence[ImageInput], processor: Qwen2VLImageProcessorPil) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values float32 [sum t*h*w, C*T*P*P], image_grid_thw int64 [N, 3]) for N images, equal
    to `processor(images=..., return_tensors="np")`. Images as `preprocess.load_image` takes them."""
    if isinstance(images, (np.ndarray, str, bytes, bytearray, os.PathLike)) or not isinstance(images, Sequence):
        images = [images]
    if len(images) == 0:
        raise ValueError("no images to preprocess")
    pixels, grids = [], []
    for i, image in enumerate(images):
        decoded = load_image(image, i)
        try:  # one at a time, so a failure names its image (the processor treats each alone anyway)
            out = processor(images=[decoded], return_tensors="np")
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"image {i} ({describe(image)}): the image processor refused it ({type(e).__name__}: {e})") from e
        pixels.append(np.asarray(out["pixel_values"], np.float32))
        grids.append(np.asarray(out["image_grid_thw"], np.int64))
    return np.concatenate(pixels), np.concatenate(grids)

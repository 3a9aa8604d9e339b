"""A multimodal model's image encoder compiled for the target, beside the serving step (issue 39).

    spec = vision_spec(hf_config_dict, images=4)        # None: the config has no vision tower we know
    result = compile_vision(spec, mesh, "bfloat16")     # weights, compiled memory, HLO FLOPs per chip

As the step (`step_compile`), with nothing real in it: the encoder's parameters come from
`nnx.eval_shape` (no weight read, nothing allocated), every array is a `jax.ShapeDtypeStruct`
with its NamedSharding on the target's mesh, and the program is the one `image_features` runs:

- Gemma 3 (`model_type` "gemma3"): SigLIP + the multimodal projector over a batch of `images`
  images of the processor's size (vision_config.image_size; the position embeddings are not
  interpolated), pixel_values float32 [N, 3, S, S] -> soft tokens [N, mm_tokens_per_image, E];
- Qwen2.5-VL ("qwen2_5_vl"): the ViT + merger over one image of `image_size` (H x W pixels,
  multiples of patch * merge); `image_features` runs one program per image, so `images` images are
  that many calls of it, one after another: memory is one call's, FLOPs `images` calls'.
- Qwen3-VL ("qwen3_vl"): as Qwen2.5-VL (one program per image), its ViT + merger and the deepstack
  mergers (soft tokens [n, E] and deepstack features [K, n, E]).

The encoder's weights are replicated on every chip (the step's tensor-parallel layout does not
cover them; a SigLIP so400m is 0.8 GB in bf16). XLA's cost analysis counts a loop's body once
(measured: the program's count is under one layer's), so the layer loop's FLOPs are counted as one
layer compiled alone times the depth: HLO FLOPs = program + (depth - 1) x layer. Qwen2.5-VL has
two kinds of layer (attending per window, or over the whole image), chosen per layer by a
conditional that the cost analysis counts as its costlier branch (measured): its program counts
one full-attention layer (one window layer if it has none), and each kind's other layers are added
at that kind's count compiled alone. Qwen3-VL's layers run as one loop per deepstack merger (and
one after the last): the program counts one layer per loop.

`VisionSpec.image_inputs` gives the shapes of the step's image variant (the batch fields that carry
the soft tokens: jaxinfer.aot.plan compiles it for the largest prefill bucket).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.engine.memory import bytes_per_device
from jaxinfer.models.vision import qwen3_vl, qwen_vl, siglip

VISION_MODEL_TYPES = ("gemma3", "qwen2_5_vl", "qwen3_vl")


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """Which encoder to compile and over what: `images` per step, Qwen2.5-VL's `image_size` (H, W)."""

    config: siglip.Gemma3VisionConfig | qwen_vl.Qwen2_5_VisionConfig | qwen3_vl.Qwen3VisionConfig
    images: int = 1
    image_size: tuple[int, int] | None = None

    @property
    def is_gemma(self) -> bool:
        return isinstance(self.config, siglip.Gemma3VisionConfig)

    @property
    def is_qwen3(self) -> bool:
        return isinstance(self.config, qwen3_vl.Qwen3VisionConfig)

    @property
    def deepstack_rows(self) -> int:
        """Deepstack rows per image token the step takes (Qwen3-VL), else 0."""
        return len(self.config.deepstack_visual_indexes) if self.is_qwen3 else 0

    def image_inputs(self, hidden_size: int) -> tuple[int, int, bool]:
        """The step's image variant, as `ModelRunner.image_inputs`: (soft-token width, deepstack
        rows, whether images attend both ways: Gemma 3's `span_end`)."""
        return hidden_size, self.deepstack_rows, self.is_gemma

    @property
    def pixels(self) -> tuple[int, int]:
        """(H, W) of one image as the encoder takes it."""
        if self.is_gemma:
            return (self.config.vision.image_size,) * 2
        return self.image_size

    @property
    def grid(self) -> tuple[int, int, int]:  # Qwen2.5-VL: one frame of (H / P) x (W / P) patches
        p = self.config.patch_size
        return 1, self.pixels[0] // p, self.pixels[1] // p

    @property
    def soft_tokens(self) -> int:
        """Soft tokens one image becomes."""
        if self.is_gemma:
            return self.config.mm_tokens_per_image
        return self.grid[1] * self.grid[2] // self.config.merge_unit

    @property
    def depth(self) -> int:
        return self.config.vision.num_hidden_layers if self.is_gemma else self.config.depth

    def describe(self) -> str:
        if self.is_gemma:
            v = self.config.vision
            return (f"Gemma 3 SigLIP ({v.num_hidden_layers} layers, {v.num_attention_heads} heads of {v.head_dim}, "
                    f"{v.num_patches} patches) + projector to {self.config.text_hidden_size}")
        c = self.config
        if self.is_qwen3:
            return (f"Qwen3-VL ViT ({c.depth} layers, {c.num_heads} heads of {c.head_dim}, {self.grid[1] * self.grid[2]} "
                    f"patches) + merger and {self.deepstack_rows} deepstack mergers to {c.out_hidden_size}")
        return (f"Qwen2.5-VL ViT ({c.depth} layers, {c.num_heads} heads of {c.head_dim}, {self.grid[1] * self.grid[2]} "
                f"patches) + merger to {c.out_hidden_size}")


def vision_spec(hf: dict | None, images: int = 1, image_size: tuple[int, int] | None = None) -> VisionSpec | None:
    """The encoder of a Hugging Face config dict with a `vision_config`, or None (no vision tower,
    `images` 0, or a tower this module does not know: `VISION_MODEL_TYPES`). ValueError for an
    image size the encoder cannot take."""
    if not hf or "vision_config" not in hf or images <= 0 or hf.get("model_type") not in VISION_MODEL_TYPES:
        return None
    if hf["model_type"] == "gemma3":
        config = siglip.Gemma3VisionConfig.from_hf_dict(hf)
        side = config.vision.image_size
        if image_size is not None and tuple(image_size) != (side, side):
            raise ValueError(f"image size {image_size[0]}x{image_size[1]}: Gemma 3's encoder takes {side}x{side} images "
                             f"(its processor's size; the position embeddings are not interpolated)")
        return VisionSpec(config, images)
    qwen3 = hf["model_type"] == "qwen3_vl"
    config = (qwen3_vl.Qwen3VisionConfig if qwen3 else qwen_vl.Qwen2_5_VisionConfig).from_hf_dict(hf)
    image_size = tuple(image_size or (896, 896))
    unit = config.patch_size * config.spatial_merge_size
    if len(image_size) != 2 or any(s <= 0 or s % unit for s in image_size):
        raise ValueError(f"image size {'x'.join(map(str, image_size))}: {'Qwen3-VL' if qwen3 else 'Qwen2.5-VL'} takes heights and widths that are "
                         f"multiples of {unit} pixels (patch {config.patch_size} x merge {config.spatial_merge_size})")
    return VisionSpec(config, images, image_size)


@dataclasses.dataclass
class VisionCompile:
    spec: VisionSpec
    dtype: str
    seconds: float  # compiling the encoder and its layers alone
    weight_bytes: int  # per chip (replicated)
    argument_bytes: int  # per chip: weights and pixels
    temp_bytes: int
    output_bytes: int  # the soft tokens
    flops: float  # per step (`images` images), HLO: program + the layers its loop leaves uncounted

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes

    @property
    def scratch_bytes(self) -> int:
        """Beyond its weights: what running the encoder needs while the step's buffers stay put."""
        return self.peak_bytes - self.weight_bytes


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def _abstract(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _programs(spec: VisionSpec, dtype):
    """(encoder module, its call, its input; [(one layer's function, its inputs, how many more
    times than the program counts it)]), all abstract and unsharded."""
    cfg = spec.config
    if spec.is_gemma:
        v = cfg.vision
        model = nnx.eval_shape(lambda: siglip.Gemma3VisionEncoder(cfg, param_dtype=dtype, rngs=nnx.Rngs(0)))
        pixels = jax.ShapeDtypeStruct((spec.images, v.num_channels, v.image_size, v.image_size), jnp.float32)
        eps, approximate = v.layer_norm_eps, siglip.ACTIVATIONS[v.hidden_act]

        def layer(x, w):  # as SiglipVisionTower's scan body
            x = x + siglip.attention(x, w, eps)
            return x + siglip.mlp(x, w, eps, approximate)

        x = jax.ShapeDtypeStruct((spec.images, v.num_patches, v.hidden_size), dtype)
        w = {k: jax.ShapeDtypeStruct(s[1:], dtype) for k, s in siglip.layer_shapes(v).items()}
        return model, lambda m, px: m(px), pixels, [(layer, (x, w), v.num_hidden_layers - 1)]
    if spec.is_qwen3:
        return _qwen3_programs(spec, dtype)
    model = nnx.eval_shape(lambda: qwen_vl.Qwen2_5_VisionTransformer(cfg, param_dtype=dtype, rngs=nnx.Rngs(0)))
    grid, S = spec.grid, spec.grid[0] * spec.grid[1] * spec.grid[2]
    pixels = jax.ShapeDtypeStruct((S, cfg.patch_dim), jnp.float32)
    act = qwen_vl.ACTIVATIONS[cfg.hidden_act]
    *_, window, frame = qwen_vl.grid_indices(cfg, *grid)

    def layer(blocks: qwen_vl.Blocks):  # as Qwen2_5_VisionTransformer's scan body, for one kind of layer
        def run(x, w, cos, sin):
            x = x + qwen_vl.attention(x, w, cos, sin, blocks)
            return x + qwen_vl.mlp(x, w, act)
        return run

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    w = {k: jax.ShapeDtypeStruct(s[1:], dtype) for k, s in qwen_vl.layer_shapes(cfg).items()}
    inputs = (jax.ShapeDtypeStruct((S, cfg.hidden_size), dtype), w, f32(S, cfg.head_dim), f32(S, cfg.head_dim))
    full = sum(i in cfg.fullatt_block_indexes for i in range(cfg.depth))
    windowed = cfg.depth - full  # the program counts one full layer, or one window layer if there is none
    window_layer, full_layer = layer(qwen_vl.Blocks.of(window)), layer(qwen_vl.Blocks.of(frame))
    return model, lambda m, px: m(px, grid), pixels, [(window_layer, inputs, windowed - (full == 0)),
                                                      (full_layer, inputs, full - (full > 0))]


def _qwen3_programs(spec: VisionSpec, dtype):
    """`_programs` of Qwen3-VL: one loop of layers per deepstack merger and one after the last,
    each counted once by the cost analysis."""
    cfg = spec.config
    model = nnx.eval_shape(lambda: qwen3_vl.Qwen3VisionTransformer(cfg, param_dtype=dtype, rngs=nnx.Rngs(0)))
    grid, S = spec.grid, spec.grid[0] * spec.grid[1] * spec.grid[2]
    pixels = jax.ShapeDtypeStruct((S, cfg.patch_dim), jnp.float32)
    act = qwen_vl.ACTIVATIONS[cfg.hidden_act]
    frames = qwen_vl.Blocks.of(qwen3_vl.grid_indices(cfg, *grid)[-1])

    def layer(x, w, cos, sin):  # as Qwen3VisionTransformer's scan body
        x = x + qwen_vl.self_attention(qwen3_vl.layer_norm(x, w["norm1"], w["norm1_bias"]), w, cos, sin, frames)
        return x + qwen3_vl.mlp(x, w, act)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    w = {k: jax.ShapeDtypeStruct(s[1:], dtype) for k, s in qwen3_vl.shapes(cfg)["blocks"].items()}
    inputs = (jax.ShapeDtypeStruct((S, cfg.hidden_size), dtype), w, f32(S, cfg.head_dim), f32(S, cfg.head_dim))
    loops = len(cfg.deepstack_visual_indexes) + (max(cfg.deepstack_visual_indexes) + 1 < cfg.depth)
    return model, lambda m, px: m(px, grid), pixels, [(layer, inputs, cfg.depth - loops)]


def compile_vision(spec: VisionSpec, mesh: jax.sharding.Mesh, dtype: str = "bfloat16") -> VisionCompile:
    """The encoder compiled for the mesh's chips, weights in `dtype` replicated on every chip."""
    start = time.perf_counter()
    model, call, pixels, layers = _programs(spec, jnp.dtype(dtype))
    graphdef, state = nnx.split(model)
    replicated = NamedSharding(mesh, PartitionSpec())
    params, pixels = _abstract(state, replicated), _abstract(pixels, replicated)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda s, px: call(nnx.merge(graphdef, s), px)).lower(params, pixels).compile()
        flops = _flops(compiled)
        for layer, inputs, more in layers:  # the layers the loop's single count leaves out
            if more:
                flops += more * _flops(jax.jit(layer).lower(*_abstract(inputs, replicated)).compile())
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    calls = 1 if spec.is_gemma else spec.images  # Qwen2.5-VL, Qwen3-VL: one program per image
    flops *= calls
    return VisionCompile(spec, str(jnp.dtype(dtype)), seconds, bytes_per_device(params), m.argument_size_in_bytes,
                         m.temp_size_in_bytes, m.output_size_in_bytes, flops)


def format_vision(v: VisionCompile, gib: float = 2**30) -> str:
    """One line: the encoder, its weights, compiled memory and HLO FLOPs per chip."""
    s = v.spec
    h, w = s.pixels
    per_call = f"{s.images} image{'s' if s.images > 1 else ''} of {h}x{w} per step" + (
        "" if s.is_gemma else f" (one program per image, {s.images} call{'s' if s.images > 1 else ''})")
    return (f"image encoder: {s.describe()}, weights {v.dtype} replicated on every chip; {per_call} -> {s.soft_tokens} "
            f"soft tokens each; weights {v.weight_bytes / gib:.2f} GiB, compiled memory {v.peak_bytes / gib:.2f} GiB per chip "
            f"(arguments {v.argument_bytes / gib:.2f} + temporaries {v.temp_bytes / gib:.2f} + output {v.output_bytes / gib:.2f}), "
            f"{v.flops / 1e12:.2f} TFLOP per step (HLO; {v.flops / 1e12 / s.images:.2f} per image), compile {v.seconds:.1f} s")

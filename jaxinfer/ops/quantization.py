"""Weight quantization: round-to-nearest quantizers and the `QuantizedWeight` pytree.

The storage layout is fixed by `pallas_kernels.quantized_matmul.reference`: w = v * scale (+
offset), per output column or per group of `group_size` rows of K. The round-to-nearest (RTN)
quantizers here make:

    mode   per                             symmetric                        asymmetric (symmetric=False)
    int8   output column, or group of K    absmax / 127, f32 scales         -
           (group_size 16..128)            absmax / 127, f32 scales         (max - min) / 255, f32 scale + offset
    int4   group of `group_size` rows      absmax / 7, bf16 scales          (max - min) / 15, bf16 scale, f32 offset
    fp8    output column, or group of 128  absmax / 448, f32 scales         -

    w8a8   output column (weights), row       absmax / 127, f32 scales         -
           of x (activations, at run time)

w8a8 is int8 per column whose matmul also quantizes its input: each row of x is scaled by its
absmax / 127 and rounded to int8 when the matmul runs ("dynamic per-token" activations, as
vLLM's W8A8 and llama.cpp's Q8 activations), and the product is an int8 x int8 dot with int32
accumulation, times both scales. x's rows are first turned by an orthogonal matrix R and w's
rows by R^T (Hadamard blocks mixed by a fixed orthogonal matrix: (x R)(R^T w) = x w), which
spreads a few large channels over all of them, so a row's absmax no longer sets a coarse grid
for the rest. It changes the arithmetic (the activations lose precision too), not just the
storage; on the CPU it is the fastest mode (XLA:CPU's int8 dots, no float copy of
the weight), and it quantizes a tied embedding too, stored [H, V] as the LM head reads it.
A W8A8 checkpoint (compressed-tensors' "int-quantized" format: int8 weights per channel, int8
activations per token, dynamic; `jaxinfer quantize --method smoothquant` writes one) runs
through the same int8 x int8 matmul without the rotation (`QuantizedWeight.rotated=False`): its
weights are stored as they are, and SmoothQuant's answer to the large channels (dividing them
down, folded into the norms and projections before) is already in its floats.

Asymmetric groups fit [min, max] instead of [-absmax, absmax]: a group whose values are not
centred on 0 loses less. Checkpoints quantized elsewhere (GGUF blocks, AWQ, GPTQ) become
QuantizedWeights without passing through these quantizers (`checkpoints_conv`), keeping their
own scales exactly.

Weights are [K, N] (in, out) as `layers.linear` takes them, or stacked [L, K, N] as the decoder
layers keep them; every function here works on the last two axes, so a stacked weight is
quantized layer by layer and its scales keep the leading L axis.

The scales are written by hand rather than through `qwix` (`qwix.quantize(w, jnp.int8,
channelwise_axes=...)` would compute them in a line): qwix is not a dependency of this project,
its integer scales use absmax / (qmax + 0.5) (127.5, 7.5) rather than the absmax / qmax the
layout above promises, its scales keep the weight's dtype and a keepdims shape, and its int4
comes out unpacked, so the nibble packing would be ours anyway. A few lines of jnp per mode do
not justify the dependency.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.tree import nested_to_flat
from pallas_kernels.quantized_matmul import reference as qmm
from pallas_kernels.quantized_matmul.reference import GROUP_SIZES, INT4_GROUP_SIZES, check_mode
from pallas_kernels.quantized_matmul.reference import MODES as KERNEL_MODES

__all__ = [
    "ACTIVATION_MODES",
    "GROUP_SIZES",
    "INT4_GROUP_SIZES",
    "MATMUL_WEIGHT_NAMES",
    "MODES",
    "QUANTIZATION_GROUP_SIZES",
    "QUANTIZATION_MODES",
    "QuantizedWeight",
    "cast_scales",
    "pack_int4",
    "param_bytes",
    "quantize",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantize_params",
    "replace_weights",
]

INT8_MAX = 127
# The modes `quantize` makes: the kernels' stored modes but mxfp4 (a checkpoint's format, read as it
# is stored, not made here). What `quantization=` may name: those, and w8a8 (int8 per column, int8
# activations).
MODES = tuple(m for m in KERNEL_MODES if m != "mxfp4")
QUANTIZATION_MODES = (*MODES, "w8a8")
QUANTIZATION_GROUP_SIZES = {**{m: GROUP_SIZES[m] for m in MODES}, "w8a8": (None,)}
ACTIVATION_MODES = (None, "int8")  # QuantizedWeight.activations
INT4_MAX = 7
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _safe(scale: jax.Array) -> jax.Array:
    """Divisor for w / scale: an all-zero column or group has scale 0 and quantizes to 0."""
    return jnp.where(scale > 0, scale, 1.0)


def _groups(w: jax.Array, group_size: int) -> jax.Array:
    """w [..., K, N] -> f32 [..., G, g, N], K padded with zero rows to whole groups."""
    *lead, K, N = w.shape
    Kp = -(-K // group_size) * group_size
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, Kp - K), (0, 0)])
    return wf.reshape(*lead, Kp // group_size, group_size, N)


def _symmetric_grid(wg: jax.Array, vmax: int, scale_dtype):
    """Round-to-nearest of grouped weights wg [..., G, g, N] onto v in [-vmax - 1, vmax] with
    scale absmax / vmax: (v [..., G, g, N] f32, scales [..., G, N]). The scale is rounded to its
    stored dtype first, so v is the nearest level under the number actually kept."""
    scales = (jnp.max(jnp.abs(wg), axis=-2) / vmax).astype(scale_dtype)
    v = jnp.round(wg / _safe(scales.astype(jnp.float32))[..., None, :])
    return jnp.clip(v, -vmax - 1, vmax), scales


def _asymmetric_grid(wg: jax.Array, vmin: int, vmax: int, scale_dtype):
    """The same onto v in [vmin, vmax] with scale (max - min) / (vmax - vmin) (rounded to
    scale_dtype first) and an offset that is a whole number of scales, -z * scale with z the
    level nearest the group's zero (GPTQ's and AWQ's zero point): (v, scales, offsets float32).
    Zero is then a level: most weights are near zero, and with the group's min as the offset
    (llama.cpp's Q4_1) they round to levels a fraction of a step off zero, all the same way, a
    bias the whole group shares. Measured on SmolLM2 int4 g128, fake-quantized: min offsets +87 %
    perplexity (f32 scales) / +94 % (bf16), zero points +23 %. (At g32 the min grid gives 0 %:
    that checkpoint's floats are a Q4_1 grid, which its GGUF runs as it is.)"""
    # The range holds 0, so that the zero point is a level (a group of one sign would clip its far end).
    lo, hi = jnp.minimum(jnp.min(wg, axis=-2), 0.0), jnp.maximum(jnp.max(wg, axis=-2), 0.0)   # [..., G, N]
    scales = ((hi - lo) / (vmax - vmin)).astype(scale_dtype)
    s = _safe(scales.astype(jnp.float32))
    zero = jnp.clip(jnp.round(vmin - lo / s), vmin, vmax)                 # the level standing for 0
    offsets = -zero * scales.astype(jnp.float32)                           # exact in float32 (0 for an all-zero group)
    v = jnp.round(wg / s[..., None, :]) + zero[..., None, :]
    return jnp.clip(v, vmin, vmax), scales, offsets


# ----------------------------------------------------------------------------- int8
@functools.partial(jax.jit, static_argnames=("group_size", "symmetric"))
def quantize_int8(w: jax.Array, group_size: int | None = None, symmetric: bool = True):
    """w [..., K, N] -> (int8 [..., Kp, N], f32 scales [..., N] or [..., Kp // g, N], f32 offsets or None).

    Per output column (group_size None, symmetric only) or per group of `group_size` rows of K
    (K padded to whole groups). |w - dequantized| <= scale / 2."""
    if group_size is None:
        if not symmetric:
            raise ValueError("asymmetric int8 needs a group_size (offsets are per group)")
        wf = w.astype(jnp.float32)
        scales = jnp.max(jnp.abs(wf), axis=-2) / INT8_MAX                  # [..., N]
        q = jnp.round(wf / _safe(scales)[..., None, :])
        return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scales, None
    wg = _groups(w, group_size)
    if symmetric:
        (v, scales), offsets = _symmetric_grid(wg, INT8_MAX, jnp.float32), None
        v = jnp.maximum(v, -INT8_MAX)
    else:
        v, scales, offsets = _asymmetric_grid(wg, -128, INT8_MAX, jnp.float32)
    *lead, G, g, N = v.shape
    return v.reshape(*lead, G * g, N).astype(jnp.int8), scales, offsets


# ----------------------------------------------------------------------------- int4, per group of K
def pack_int4(v: jax.Array, signed: bool = True) -> jax.Array:
    """int [..., K, N] in [-8, 7] (signed: stored as v + 8) or [0, 15] -> uint8 [..., K // 2, N]:
    k = 2i in the low nibble of row i, 2i + 1 in the high."""
    u = (v.astype(jnp.int32) + (8 if signed else 0)).astype(jnp.uint8)    # unsigned nibbles 0..15
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric"))
def quantize_int4(w: jax.Array, group_size: int, symmetric: bool = True):
    """w [..., K, N] -> (uint8 [..., Kp // 2, N], bf16 scales [..., Kp // g, N], f32 offsets or None).

    Kp is K rounded up to a multiple of group_size (the weight is padded with zero rows). Each
    run of `group_size` rows of a column shares a scale (and offset); |w - dequantized| <= scale / 2
    (within the group's range; the zero point's rounding may clip its ends by up to half a step).
    """
    check_mode("int4", group_size)
    wg = _groups(w, group_size)
    if symmetric:
        (v, scales), offsets = _symmetric_grid(wg, INT4_MAX, jnp.bfloat16), None
    else:
        v, scales, offsets = _asymmetric_grid(wg, 0, 15, jnp.bfloat16)
    *lead, G, g, N = v.shape
    return pack_int4(v.reshape(*lead, G * g, N), signed=symmetric), scales, offsets


# ----------------------------------------------------------------------------- fp8, per column or group
@functools.partial(jax.jit, static_argnames=("group_size",))
def quantize_fp8(w: jax.Array, group_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (float8_e4m3fn [..., Kp, N], f32 scales [..., N] or [..., Kp // g, N]): each
    column's (or each group of `group_size` rows') absmax maps to 448."""
    if group_size is None:
        wf = w.astype(jnp.float32)
        scales = jnp.max(jnp.abs(wf), axis=-2) / FP8_MAX                   # [..., N]
        q = jnp.clip(wf / _safe(scales)[..., None, :], -FP8_MAX, FP8_MAX)  # the cast rounds to nearest
        return q.astype(jnp.float8_e4m3fn), scales
    wg = _groups(w, group_size)                                            # [..., G, g, N]
    scales = jnp.max(jnp.abs(wg), axis=-2) / FP8_MAX                       # [..., G, N]
    q = jnp.clip(wg / _safe(scales)[..., None, :], -FP8_MAX, FP8_MAX)
    *lead, G, g, N = q.shape
    return q.reshape(*lead, G * g, N).astype(jnp.float8_e4m3fn), scales


# ----------------------------------------------------------------------------- the pytree
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [K, N] (or stacked [L, K, N]) matmul weight.

    qweight, scales and offsets (None for a symmetric weight) are the pytree's leaves, laid out
    as in `pallas_kernels.quantized_matmul.reference`; mode, group_size and in_features (K, which
    a grouped weight may store padded) are static, so `jax.tree.map(lambda a: a[i], qw)` takes
    layer i of a stacked weight and jit sees the mode as part of the program. A checkpoint
    quantized with act-order stores its rows sorted by group: `input_order` says which input
    each row is, and the matmul reads x's columns in that order (x[..., input_order] @ rows).
    `activations="int8"` (static; int8 per column only): the matmul quantizes x's rows to int8
    as it runs and multiplies integers (the w8a8 mode, `quantize_rows_int8`). `rotated` (static,
    with int8 activations): the weight stores R^T w and the matmul turns x by R first (what
    `quantize(w, "w8a8")` makes); a W8A8 checkpoint (compressed-tensors "int-quantized", e.g.
    SmoothQuant's: the smoothing is folded into its floats) stores w itself, rotated=False.
    """

    qweight: jax.Array
    scales: jax.Array
    offsets: jax.Array | None = None
    input_order: jax.Array | None = None  # int32 [..., K]: x's columns in the order of the rows (GPTQ act-order)
    mode: str = "int8"
    group_size: int | None = None
    in_features: int | None = None  # K; None: all of qweight's rows (2 per byte row for int4)
    activations: str | None = None  # None: x as it comes; "int8": x quantized per row at run time
    rotated: bool = False  # (int8 activations) qweight holds R^T w and x is turned by R (rotate_rows)

    def __post_init__(self):
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"QuantizedWeight(activations={self.activations!r}): expected one of {ACTIVATION_MODES}")
        if self.activations == "int8" and (self.mode != "int8" or self.group_size is not None
                                           or self.offsets is not None or self.input_order is not None):
            raise ValueError("int8 activations need an int8 weight with one symmetric scale per output column")
        if self.rotated and self.activations != "int8":
            raise ValueError("rotated=True is the w8a8 mode's (int8 activations)")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight this stands for ([..., K, N])."""
        *lead, _, N = self.qweight.shape
        return (*lead, self.in_features or qmm.stored_rows(self.qweight, self.mode), N)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.qweight, self.scales, self.offsets, self.input_order) if a is not None)

    def dequantize(self) -> jax.Array:
        """The float32 weight [..., K, N] (rows in input order)."""
        w = qmm.dequantize(self.qweight, self.scales, self.offsets, mode=self.mode, group_size=self.group_size)
        w = w[..., : self.shape[-2], :]
        if self.input_order is None:
            return w
        inverse = jnp.argsort(self.input_order, axis=-1)  # input k sits at row inverse[k]
        return jnp.take_along_axis(w, inverse[..., :, None], axis=-2)


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["qweight", "scales", "offsets", "input_order"],
    meta_fields=["mode", "group_size", "in_features", "activations", "rotated"]
)


# SmolLM2 w8a8 perplexity: Hadamard blocks of 64 +1.3 %, of up to 512 (down_proj's 1536 inputs) +0.3 %,
# and with the blocks mixed (block_mixing) +0.01 %
ROTATION_BLOCK = 512


def rotation_block(K: int) -> int:
    """The size of the Hadamard blocks a w8a8 matmul turns its K inputs by: the largest power of
    two up to ROTATION_BLOCK that divides K."""
    b = 1
    while b < ROTATION_BLOCK and K % (2 * b) == 0:
        b *= 2
    return b


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """The normalized [n, n] Hadamard matrix in Sylvester's order (n a power of two): symmetric
    and orthogonal."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    """A fixed [n, n] orthogonal matrix drawn from `seed` (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


@functools.cache
def block_mixing(n: int) -> np.ndarray:
    """A fixed [n, n] orthogonal matrix that mixes the n Hadamard blocks of a row."""
    return np.ones((1, 1), np.float32) if n == 1 else random_orthogonal(n, seed=n)


def rotate_rows(x: jax.Array, axis: int, inverse: bool = False) -> jax.Array:
    """x (float32) with its `axis` (of size K) multiplied by R, or by R^T with inverse=True.

    R = Q (x) H (Kronecker product): H the normalized Hadamard matrix of rotation_block(K) turns
    each block of entries, Q (block_mixing) mixes the K / block blocks, so a large entry is spread
    over the whole row; R is orthogonal, so (x R)(R^T w) = x w, and `rotate_rows(w, axis=-2)` is
    R^T w for a [K, N] weight."""
    x = jnp.moveaxis(x, axis, -1).astype(jnp.float32)
    *lead, K = x.shape
    b = rotation_block(K)
    H, Q = hadamard(b), block_mixing(K // b)  # H is symmetric
    if inverse:
        Q = Q.T
    y = jnp.einsum("...gi,ij->...gj", x.reshape(*lead, K // b, b), H, precision=jax.lax.Precision.HIGHEST)  # each block by H
    y = jnp.einsum("...gj,gh->...hj", y, Q, precision=jax.lax.Precision.HIGHEST)  # the blocks mixed by Q
    return jnp.moveaxis(y.reshape(*lead, K), -1, axis)


def quantize_rows_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (int8 [M, K], f32 scales [M, 1]): each row by its absmax / 127, rounded to
    nearest (a row of zeros gets scale 0 and zeros)."""
    xf = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / INT8_MAX
    q = jnp.clip(jnp.round(xf / _safe(scales)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scales


def int8_activation_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] @ w (int8 per column, activations="int8") -> float32 [M, N]: x's rows (turned by R
    first when w is rotated) quantized to int8, an int8 x int8 dot accumulated in int32, times the
    row and column scales."""
    xq, x_scales = quantize_rows_int8(rotate_rows(x, axis=-1) if w.rotated else x)
    acc = jnp.dot(xq, w.qweight, preferred_element_type=jnp.int32)          # [M, N] exact
    return acc.astype(jnp.float32) * x_scales * w.scales.astype(jnp.float32)


def default_group_size(mode: str) -> int | None:
    """int4: 128; int8, w8a8 and fp8: None (one scale per output column)."""
    return 128 if mode == "int4" else None


def quantize(w: jax.Array, mode: str, group_size: int | None = None, symmetric: bool = True) -> QuantizedWeight:
    """One [..., K, N] weight -> QuantizedWeight, round to nearest (see the module docstring).
    group_size None: the mode's default (int4: 128; int8: per output column)."""
    group_size = default_group_size(mode) if group_size is None else group_size
    if mode == "w8a8":
        if group_size is not None or not symmetric:
            raise ValueError("w8a8 is symmetric int8 with one scale per output column: no group_size, symmetric only")
        return QuantizedWeight(*quantize_int8(rotate_rows(w, axis=-2)), mode="int8", activations="int8", rotated=True)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (or w8a8), got {mode!r}")
    check_mode(mode, group_size)
    if not symmetric and group_size is None:
        raise ValueError(f"asymmetric {mode} needs groups (offsets are per group); give a group_size")
    K = w.shape[-2]
    if mode == "int8":
        return QuantizedWeight(*quantize_int8(w, group_size, symmetric), mode="int8", group_size=group_size,
                               in_features=K if group_size else None)
    if mode == "int4":
        return QuantizedWeight(*quantize_int4(w, group_size, symmetric), mode="int4", group_size=group_size, in_features=K)
    return QuantizedWeight(*quantize_fp8(w, group_size), mode="fp8", group_size=group_size, in_features=K if group_size else None)


# ----------------------------------------------------------------------------- whole parameter dicts
# The matmul weights of `jaxinfer.models.llama.param_shapes`, matched on the last dot-separated
# part of the name: the attention and MLP projections ("layers.qkv_proj", stacked [L, K, N]) and
# the untied LM head ([H, V]). Everything else (embed, *_norm, *_bias) stays as it is: the
# embedding is a row gather, not a matmul, and norms and biases are tiny.
MATMUL_WEIGHT_NAMES = frozenset(
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head",
     "global_qkv_proj", "global_o_proj", "wide_gate_up_proj", "wide_down_proj",  # (Gemma 4's stacks of their own)
     "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj"}  # (MLA's; kv_b_proj is read per head, absorbed: floats)
)


def quantize_params(
    params: Mapping[str, jax.Array | QuantizedWeight],
    mode: str,
    group_size: int | None = None,
    skip: Iterable[str] = (),
    symmetric: bool = True,
) -> dict[str, jax.Array | QuantizedWeight]:
    """A flat name -> array dict with its matmul weights (MATMUL_WEIGHT_NAMES, 2-D or stacked 3-D)
    replaced by QuantizedWeight; `skip` names parameters (full name, e.g. "lm_head") to leave
    unquantized. Weights already quantized stay as they are. The input dict is not modified.
    w8a8 also quantizes a tied embedding ("embed" [V, H] without "lm_head"), stored [H, V]."""
    group_size = default_group_size(mode) if group_size is None else group_size
    if mode != "w8a8":
        check_mode(mode, group_size)
    skip = frozenset(skip)
    out: dict[str, jax.Array | QuantizedWeight] = {}
    for name, w in params.items():
        if (mode == "w8a8" and name == "embed" and "lm_head" not in params and name not in skip
                and not isinstance(w, QuantizedWeight)):
            out[name] = quantize(w.T, mode)  # the tied LM head: [H, V], a scale per token
            continue
        if (name in skip or isinstance(w, QuantizedWeight) or name.rsplit(".", 1)[-1] not in MATMUL_WEIGHT_NAMES
                or w.ndim not in (2, 3)):
            out[name] = w
            continue
        out[name] = quantize(w, mode, group_size, symmetric)
    return out


def quantize_model(graphdef, state, mode: str, group_size: int | None = None, skip: Iterable[str] = (), symmetric: bool = True):
    """(graphdef, state) of a loaded nnx model -> the same with its matmul weights quantized
    (round to nearest); weights already quantized (a checkpoint's own grid) stay as they are.

    Each quantized parameter becomes an nnx.Param holding a QuantizedWeight, so the model's
    forward sees it where it used to see the array (`models.layers.matmul` takes either). The
    unquantized arrays are not kept.
    """
    from flax import nnx  # the model container; the rest of this module is plain JAX

    flat = nested_to_flat(nnx.to_pure_dict(state))
    quantized = {k: v for k, v in quantize_params(flat, mode, group_size, skip, symmetric).items()
                 if isinstance(v, QuantizedWeight) and not isinstance(flat[k], QuantizedWeight)}
    del flat
    return replace_weights(graphdef, state, quantized)


def replace_weights(graphdef, state, weights: Mapping[str, QuantizedWeight]):
    """(graphdef, state) with each named parameter (flat name) holding its QuantizedWeight."""
    from flax import nnx  # the model container; the rest of this module is plain JAX

    model = nnx.merge(graphdef, state)
    for name, qw in weights.items():
        *path, leaf = name.split(".")
        owner = functools.reduce(getattr, path, model)
        setattr(owner, leaf, nnx.Param(qw))
    return nnx.split(model)


def cast_scales(params, scale_dtype):
    """`params` (any pytree) with the scales and offsets of every QuantizedWeight in
    scale_dtype(their dtype) (the kernel table's `scale_dtype`)."""
    def cast(w):
        if not isinstance(w, QuantizedWeight):
            return w
        to = lambda a: None if a is None else a.astype(scale_dtype(a.dtype))  # noqa: E731
        return dataclasses.replace(w, scales=to(w.scales), offsets=to(w.offsets))

    return jax.tree.map(cast, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def param_bytes(params) -> int:
    """Bytes held by every array in a pytree of parameters (a QuantizedWeight counts its qweight, scales and offsets)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))

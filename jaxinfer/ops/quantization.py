"""Weight-only quantization: round-to-nearest quantizers and the `QuantizedWeight` pytree.

Three modes, all symmetric (no zero point), the storage layout fixed by
`pallas_kernels.quantized_matmul.reference`:

    mode   per                          scale                 values
    int8   output column                absmax / 127          int8 in [-127, 127]
    int4   group of `group_size` rows   absmax / 7 (bf16)     [-8, 7] packed two per byte (uint8)
    fp8    output column                absmax / 448          float8_e4m3fn

Weights are [K, N] (in, out) as `layers.linear` takes them, or stacked [L, K, N] as the decoder
layers keep them; every function here works on the last two axes, so a stacked weight is
quantized layer by layer and its scales keep the leading L axis.

The scales are written by hand rather than through `qwix` (`qwix.quantize(w, jnp.int8,
channelwise_axes=...)` would compute them in a line): qwix is not a dependency of this project,
its integer scales use absmax / (qmax + 0.5) (127.5, 7.5) rather than the absmax / qmax the
layout above promises, its scales keep the weight's dtype and a keepdims shape, and its int4
comes out unpacked, so the nibble packing would be ours anyway. Three lines of jnp per mode do
not justify the dependency.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from jaxinfer.tree import nested_to_flat
from pallas_kernels.quantized_matmul import reference as qmm
from pallas_kernels.quantized_matmul.reference import INT4_GROUP_SIZES, MODES, check_mode

__all__ = [
    "INT4_GROUP_SIZES",
    "MATMUL_WEIGHT_NAMES",
    "MODES",
    "QuantizedWeight",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int8",
    "pack_int4",
    "param_bytes",
    "quantize",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantize_params",
]

INT8_MAX = 127
INT4_MAX = 7
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _safe(scale: jax.Array) -> jax.Array:
    """Divisor for w / scale: an all-zero column or group has scale 0 and quantizes to 0."""
    return jnp.where(scale > 0, scale, 1.0)


# ----------------------------------------------------------------------------- int8, per column
@jax.jit
def quantize_int8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (int8 [..., K, N], f32 scales [..., N]); |w - q * scale| <= scale / 2."""
    wf = w.astype(jnp.float32)
    scales = jnp.max(jnp.abs(wf), axis=-2) / INT8_MAX                     # [..., N]
    q = jnp.round(wf / _safe(scales)[..., None, :])
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scales


def dequantize_int8(qweight: jax.Array, scales: jax.Array) -> jax.Array:
    """(int8 [..., K, N], [..., N]) -> f32 [..., K, N]."""
    return qmm.dequantize(qweight, scales, mode="int8")


# ----------------------------------------------------------------------------- int4, per group of K
def pack_int4(q: jax.Array) -> jax.Array:
    """int [..., K, N] in [-8, 7] -> uint8 [..., K // 2, N]: k = 2i in the low nibble of row i, 2i + 1 in the high."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)                        # unsigned nibbles 0..15
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


@functools.partial(jax.jit, static_argnames="group_size")
def quantize_int4(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (uint8 [..., Kp // 2, N], bf16 scales [..., Kp // group_size, N]).

    Kp is K rounded up to a multiple of group_size (the weight is padded with zero rows). Each
    run of `group_size` rows of a column shares a scale; |w - q * scale| <= scale / 2.
    """
    check_mode("int4", group_size)
    *lead, K, N = w.shape
    Kp = -(-K // group_size) * group_size
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, Kp - K), (0, 0)])
    wg = wf.reshape(*lead, Kp // group_size, group_size, N)                   # [..., G, g, N]
    # Rounded to the stored bf16 first, so q is the nearest level under the scale actually kept.
    scales = (jnp.max(jnp.abs(wg), axis=-2) / INT4_MAX).astype(jnp.bfloat16)  # [..., G, N]
    q = jnp.clip(jnp.round(wg / _safe(scales.astype(jnp.float32))[..., None, :]), -8, INT4_MAX)
    return pack_int4(q.reshape(*lead, Kp, N)), scales


def dequantize_int4(packed: jax.Array, scales: jax.Array, group_size: int) -> jax.Array:
    """(uint8 [..., Kp // 2, N], [..., Kp // group_size, N]) -> f32 [..., Kp, N] (padding rows included)."""
    return qmm.dequantize(packed, scales, mode="int4", group_size=group_size)


# ----------------------------------------------------------------------------- fp8, per column
@jax.jit
def quantize_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (float8_e4m3fn [..., K, N], f32 scales [..., N]); each column's absmax maps to 448."""
    wf = w.astype(jnp.float32)
    scales = jnp.max(jnp.abs(wf), axis=-2) / FP8_MAX                       # [..., N]
    q = jnp.clip(wf / _safe(scales)[..., None, :], -FP8_MAX, FP8_MAX)      # the cast rounds to nearest
    return q.astype(jnp.float8_e4m3fn), scales


def dequantize_fp8(qweight: jax.Array, scales: jax.Array) -> jax.Array:
    """(float8_e4m3fn [..., K, N], [..., N]) -> f32 [..., K, N]."""
    return qmm.dequantize(qweight, scales, mode="fp8")


# ----------------------------------------------------------------------------- the pytree
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [K, N] (or stacked [L, K, N]) matmul weight.

    qweight and scales are the pytree's leaves (laid out as in the module docstring); mode,
    group_size and in_features (K, which int4 may store padded) are static, so `jax.tree.map(lambda a: a[i], qw)` takes layer i of a stacked
    weight and jit sees the mode as part of the program.
    """

    qweight: jax.Array
    scales: jax.Array
    mode: str
    group_size: int | None = None
    in_features: int | None = None  # K; None: all of qweight's rows (2 per byte row for int4)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight this stands for ([..., K, N])."""
        *lead, rows, N = self.qweight.shape
        stored = 2 * rows if self.mode == "int4" else rows
        return (*lead, self.in_features or stored, N)

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes

    def dequantize(self) -> jax.Array:
        """The float32 weight [..., K, N]."""
        w = qmm.dequantize(self.qweight, self.scales, mode=self.mode, group_size=self.group_size)
        return w[..., : self.shape[-2], :]


jax.tree_util.register_dataclass(
    QuantizedWeight, data_fields=["qweight", "scales"], meta_fields=["mode", "group_size", "in_features"]
)


def quantize(w: jax.Array, mode: str, group_size: int | None = None) -> QuantizedWeight:
    """One [..., K, N] weight -> QuantizedWeight (group_size is used by int4 only)."""
    check_mode(mode, group_size if mode == "int4" else None)
    if mode == "int8":
        return QuantizedWeight(*quantize_int8(w), mode="int8")
    if mode == "int4":
        return QuantizedWeight(*quantize_int4(w, group_size), mode="int4", group_size=group_size, in_features=w.shape[-2])
    return QuantizedWeight(*quantize_fp8(w), mode="fp8")


# ----------------------------------------------------------------------------- whole parameter dicts
# The matmul weights of `jaxinfer.models.llama.param_shapes`, matched on the last dot-separated
# part of the name: the attention and MLP projections ("layers.qkv_proj", stacked [L, K, N]) and
# the untied LM head ([H, V]). Everything else (embed, *_norm, *_bias) stays as it is: the
# embedding is a row gather, not a matmul, and norms and biases are tiny.
MATMUL_WEIGHT_NAMES = frozenset(
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
)


def quantize_params(
    params: Mapping[str, jax.Array],
    mode: str,
    group_size: int = 128,
    skip: Iterable[str] = (),
) -> dict[str, jax.Array | QuantizedWeight]:
    """A flat name -> array dict with its matmul weights (MATMUL_WEIGHT_NAMES, 2-D or stacked 3-D)
    replaced by QuantizedWeight; `skip` names parameters (full name, e.g. "lm_head") to leave
    unquantized. `group_size` is used by int4 only. The input dict is not modified."""
    check_mode(mode, group_size if mode == "int4" else None)
    skip = frozenset(skip)
    out: dict[str, jax.Array | QuantizedWeight] = {}
    for name, w in params.items():
        if name in skip or name.rsplit(".", 1)[-1] not in MATMUL_WEIGHT_NAMES or w.ndim not in (2, 3):
            out[name] = w
            continue
        out[name] = quantize(w, mode, group_size)
    return out


def quantize_model(graphdef, state, mode: str, group_size: int = 128, skip: Iterable[str] = ()):
    """(graphdef, state) of a loaded nnx model -> the same with its matmul weights quantized.

    Each quantized parameter becomes an nnx.Param holding a QuantizedWeight, so the model's
    forward sees it where it used to see the array (`models.layers.matmul` takes either). The
    unquantized arrays are not kept.
    """
    from flax import nnx  # the model container; the rest of this module is plain JAX

    flat = nested_to_flat(nnx.to_pure_dict(state))
    quantized = {k: v for k, v in quantize_params(flat, mode, group_size, skip).items() if isinstance(v, QuantizedWeight)}
    model = nnx.merge(graphdef, state)
    del flat, state
    for name, qw in quantized.items():
        *path, leaf = name.split(".")
        owner = functools.reduce(getattr, path, model)
        setattr(owner, leaf, nnx.Param(qw))
    return nnx.split(model)


def param_bytes(params) -> int:
    """Bytes held by every array in a pytree of parameters (a QuantizedWeight counts its qweight and scales)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))

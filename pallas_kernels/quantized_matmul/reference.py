"""Quantized matmul in plain jnp: the truth every fused kernel is held to.

    y [M, N] = x [M, K] @ dequantize(qweight, scales) [K, N]

with the dequantization done here, in float32, and the product accumulated in float32; the
result comes back in x's dtype. This file also fixes the storage layout of each mode:

    mode    qweight                 scales                     w[k, n] =
    int8    int8 [K, N]             f32 [N]                    qweight[k, n] * scales[n]
    int4    uint8 [K // 2, N]       bf16 [K // group_size, N]  q(k, n) * scales[k // group_size, n]
    fp8     float8_e4m3fn [K, N]    f32 [N]                    qweight[k, n] * scales[n]

int4 packs two values of K per byte: byte row i holds k = 2i in its low nibble and k = 2i + 1 in
its high nibble, each stored as the unsigned nibble q + 8 (so q is in [-8, 7]). group_size is one
of 32, 64, 128. When it does not divide K (SmolLM2's hidden size 576 with groups of 128), the
weight is stored padded with zero rows up to Kp = the next multiple of group_size: qweight is
[Kp // 2, N], scales [Kp // group_size, N], and x [M, K] is read as if padded with zero columns.
int4 keeps its scales in bfloat16 (as GPTQ/AWQ kernels keep theirs in 16 bits): one per 128
weights, f32 scales would cost 0.25 bits per weight, bf16 0.125. Kernels widen them to f32. All three are symmetric (no zero point); how the scales are chosen
is the quantizer's business (`jaxinfer.ops.quantization`), not this file's.

`dequantize` also accepts leading axes ([..., K, N] weights with [..., N] or [..., G, N] scales),
so stacked per-layer weights can be expanded in one call; `quantized_matmul` takes one 2-D weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MODES = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)

_QWEIGHT_DTYPE = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn}
SCALES_DTYPE = {"int8": jnp.float32, "int4": jnp.bfloat16, "fp8": jnp.float32}


def check_mode(mode: str, group_size: int | None) -> None:
    """ValueError naming the argument unless (mode, group_size) is a supported pair.

    int4 needs a group size in INT4_GROUP_SIZES; int8 and fp8 are per output channel and take none.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "int4":
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for mode='int4', got {group_size!r}")
    elif group_size is not None:
        raise ValueError(f"group_size applies to mode='int4' only (mode={mode!r} is per output channel), got {group_size!r}")


def check_layout(qweight: jax.Array, scales: jax.Array, mode: str, group_size: int | None) -> None:
    check_mode(mode, group_size)
    want = jnp.dtype(_QWEIGHT_DTYPE[mode])
    if qweight.dtype != want:
        raise ValueError(f"qweight must be {want} for mode={mode!r}, got {qweight.dtype}")
    if qweight.ndim < 2:
        raise ValueError(f"qweight must be [..., K, N], got shape {qweight.shape}")
    *lead, rows, N = qweight.shape
    if mode == "int4":
        K = 2 * rows
        if K % group_size:
            raise ValueError(f"int4 qweight holds K = {K} rows, not a multiple of group_size = {group_size} (pad K)")
        want_scales = (*lead, K // group_size, N)
    else:
        want_scales = (*lead, N)
    if scales.dtype != jnp.dtype(SCALES_DTYPE[mode]):
        raise ValueError(f"scales must be {jnp.dtype(SCALES_DTYPE[mode])} for mode={mode!r}, got {scales.dtype}")
    if tuple(scales.shape) != want_scales:
        raise ValueError(f"scales must have shape {want_scales} for qweight {qweight.shape} (mode={mode!r}), got {scales.shape}")


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[..., K // 2, N] uint8 -> [..., K, N] int8 in [-8, 7]; row 2i from the low nibble, 2i + 1 from the high."""
    low = (packed & 0x0F).astype(jnp.int8) - 8   # k = 2i
    high = (packed >> 4).astype(jnp.int8) - 8    # k = 2i + 1
    *lead, rows, N = packed.shape
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * rows, N)  # [..., K//2, 2, N] -> [..., K, N]


def dequantize(qweight: jax.Array, scales: jax.Array, *, mode: str, group_size: int | None = None) -> jax.Array:
    """The float32 weight [..., K, N] that (qweight, scales) stand for (int4: padded K, Kp rows)."""
    check_layout(qweight, scales, mode, group_size)
    if mode == "int4":
        q = unpack_int4(qweight).astype(jnp.float32)                        # [..., K, N]
        *lead, K, N = q.shape
        q = q.reshape(*lead, K // group_size, group_size, N)                # [..., G, g, N]
        return (q * scales.astype(jnp.float32)[..., :, None, :]).reshape(*lead, K, N)
    # int8 and fp8: one scale per output column.
    return qweight.astype(jnp.float32) * scales.astype(jnp.float32)[..., None, :]


def check_matmul_inputs(x: jax.Array, qweight: jax.Array, scales: jax.Array, mode: str, group_size: int | None) -> int:
    """ValueError naming the argument at fault unless x [M, K] and the weight fit; returns the
    weight's stored K (int4: the padded Kp, which x's K may fall short of by less than a group)."""
    check_mode(mode, group_size)
    if x.ndim != 2 or qweight.ndim != 2:
        raise ValueError(f"x must be [M, K] and qweight 2-D, got {x.shape} and {qweight.shape}")
    check_layout(qweight, scales, mode, group_size)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    K = x.shape[1]
    Kw = 2 * qweight.shape[0] if mode == "int4" else qweight.shape[0]
    padded = mode == "int4" and Kw - group_size < K < Kw
    if K != Kw and not padded:
        raise ValueError(f"x has K = {K} but the weight has K = {Kw}")
    return Kw


@functools.partial(jax.jit, static_argnames=("mode", "group_size"))
def quantized_matmul(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    *,
    mode: str,
    group_size: int | None = None,
) -> jax.Array:
    """x [M, K] (float32 or bfloat16) @ dequantize(qweight, scales) [K, N] -> [M, N] in x's dtype.

    Both operands are taken to float32 (exact for bf16 x) and multiplied at full float32 precision,
    so this is the product of the numbers the quantized weight represents; a kernel feeding bf16
    to the matrix unit is compared against it with a tolerance.
    """
    check_matmul_inputs(x, qweight, scales, mode, group_size)
    w = dequantize(qweight, scales, mode=mode, group_size=group_size)  # [K, N] f32 ([Kp, N] for int4)
    w = w[: x.shape[1]]  # the zero rows of a padded int4 weight meet x's (absent) zero columns
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)

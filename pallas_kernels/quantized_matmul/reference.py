"""Quantized matmul in plain jnp: the truth every fused kernel is held to.

    y [M, N] = x [M, K] @ dequantize(qweight, scales, offsets) [K, N]

with the dequantization done here, in float32, and the product accumulated in float32; the
result comes back in x's dtype. This file also fixes the storage layout of each mode:

    mode    qweight                 scales, offsets                  w[k, n] =
    int8    int8 [K, N]             [N], or [K // g, N] per group    v * scale (+ offset)
    int4    uint8 [K // 2, N]       [K // g, N]                      v * scale (+ offset)
    fp8     float8_e4m3fn [K, N]    [N], or [K // 128, N]            v * scale
    mxfp4   uint8 [K // 2, N]       uint8 [K // 32, N]               e2m1(v) * 2 ** (scale - 127)

with the scale (and offset) of k's group (k // g), or of column n. v is the stored value: the
int8 or fp8 entry; for int4 the nibble minus 8 (v in [-8, 7]) when the weight is symmetric (no
offsets), the nibble itself (v in [0, 15]) when it has offsets: the two forms llama.cpp's Q4_0
("d (q - 8)") and Q4_1 ("d q + m") take, so both load with their float16 numbers as they are.
int4 packs two values of K per byte: byte row i holds k = 2i in its low nibble and k = 2i + 1 in
its high nibble. A group is `group_size` consecutive rows of K sharing a scale: int4 always has
groups (32, 64 or 128), int8 either one scale per output column (group_size None) or groups of
16, 32, 64 or 128 (GGUF's Q8_0 is int8 with groups of 32, its Q6_K int8 with groups of 16).
When the group size does not divide K (SmolLM2's hidden size 576 with groups of 128), the weight
is stored padded with zero rows up to Kp = the next multiple of group_size: qweight is
[Kp // 2, N] (int4) or [Kp, N] (int8), scales [Kp // group_size, N], and x [M, K] is read as if
padded with zero columns.

mxfp4 is the OCP microscaling format GPT-OSS ships its experts in: int4's packing of two 4-bit
values per byte, each an E2M1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2,
3, 4, 6 and their negatives), and per group of 32 rows an 8-bit power-of-two exponent (E8M0,
bias 127) as its scale. Every product is exact in float32 and bfloat16; an exponent byte of 0
(2 ** -127, below float32's normal numbers) counts as 0 here and in the kernels.

fp8 with groups of 128 rows is how DeepSeek-V3 and the "FP8" releases of Qwen3 and others ship
their weights: e4m3 values with a float32 scale per block of 128 x 128, which is a scale per group
of 128 rows of K for each column here (the block's scale repeated over its 128 columns).

Symmetric weights have no offsets. Asymmetric ones (GGUF's Q4_1 / Q4_K / Q5_K, AWQ, GPTQ) carry
`offsets` of the scales' shape, added after scaling: "(q - z) * s" is v = q with offset -z * s.
Offsets exist only with groups (not per column, not fp8).

Scales and offsets are float32, bfloat16 or float16, whichever holds the checkpoint's numbers
exactly (GGUF's Q4_0 / Q4_1 / Q8_0 are float16; a Q4_K scale, a 6-bit integer times a float16,
needs float32; the round-to-nearest quantizer keeps int4 scales in bfloat16: one per 128 weights,
f32 would cost 0.25 bits per weight, bf16 0.125). Kernels widen them to f32. How the scales are
chosen is the quantizer's business (`jaxinfer.ops.quantization`), not this file's.

`dequantize` also accepts leading axes ([..., K, N] weights with [..., N] or [..., G, N] scales),
so stacked per-layer weights can be expanded in one call; `quantized_matmul` takes one 2-D weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MODES = ("int8", "int4", "fp8", "mxfp4")
GROUP_SIZES = {"int8": (None, 16, 32, 64, 128), "int4": (32, 64, 128), "fp8": (None, 128), "mxfp4": (32,)}
PACKED_MODES = ("int4", "mxfp4")  # two values of K per byte
INT4_GROUP_SIZES = GROUP_SIZES["int4"]
SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

_QWEIGHT_DTYPE = {"int8": jnp.int8, "int4": jnp.uint8, "fp8": jnp.float8_e4m3fn, "mxfp4": jnp.uint8}


def check_mode(mode: str, group_size: int | None) -> None:
    """ValueError naming the argument unless (mode, group_size) is a supported pair (GROUP_SIZES)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if group_size not in GROUP_SIZES[mode]:
        allowed = ", ".join("None (per output column)" if g is None else str(g) for g in GROUP_SIZES[mode])
        raise ValueError(f"group_size must be one of {allowed} for mode={mode!r}, got {group_size!r}")


def stored_rows(qweight: jax.Array, mode: str) -> int:
    """K as stored (int4: two rows per byte row; padded to whole groups)."""
    return 2 * qweight.shape[-2] if mode in PACKED_MODES else qweight.shape[-2]


def check_layout(qweight: jax.Array, scales: jax.Array, mode: str, group_size: int | None, offsets: jax.Array | None = None) -> None:
    check_mode(mode, group_size)
    want = jnp.dtype(_QWEIGHT_DTYPE[mode])
    if qweight.dtype != want:
        raise ValueError(f"qweight must be {want} for mode={mode!r}, got {qweight.dtype}")
    if qweight.ndim < 2:
        raise ValueError(f"qweight must be [..., K, N], got shape {qweight.shape}")
    *lead, _, N = qweight.shape
    K = stored_rows(qweight, mode)
    if group_size is not None:
        if K % group_size:
            raise ValueError(f"qweight holds K = {K} rows, not a multiple of group_size = {group_size} (pad K)")
        want_scales = (*lead, K // group_size, N)
    else:
        want_scales = (*lead, N)
    if mode == "mxfp4" and (scales.dtype != jnp.uint8 or offsets is not None):
        raise ValueError(f"mxfp4 takes uint8 exponent scales and no offsets, got {scales.dtype} scales")
    for name, array in (("scales", scales), ("offsets", offsets)):
        if array is None:
            continue
        if mode != "mxfp4" and array.dtype not in [jnp.dtype(d) for d in SCALE_DTYPES]:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {array.dtype}")
        if tuple(array.shape) != want_scales:
            raise ValueError(f"{name} must have shape {want_scales} for qweight {qweight.shape} (mode={mode!r}), got {array.shape}")
    if offsets is not None and group_size is None:
        raise ValueError(f"offsets need groups (mode={mode!r} per output column has none)")


def unpack_int4(packed: jax.Array, signed: bool = True) -> jax.Array:
    """[..., K // 2, N] uint8 -> [..., K, N] int8: the nibbles minus 8 (signed, in [-8, 7]) or as
    they are (in [0, 15]); row 2i from the low nibble, 2i + 1 from the high."""
    bias = 8 if signed else 0
    low = (packed & 0x0F).astype(jnp.int8) - bias   # k = 2i
    high = (packed >> 4).astype(jnp.int8) - bias    # k = 2i + 1
    *lead, rows, N = packed.shape
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * rows, N)  # [..., K//2, 2, N] -> [..., K, N]


def e2m1(nibbles: jax.Array) -> jax.Array:
    """E2M1 nibbles (int, 0..15) -> their float32 values, by arithmetic (as the kernels decode them)."""
    magnitude = nibbles & 7
    exponent, mantissa = magnitude >> 1, (magnitude & 1).astype(jnp.float32)
    power = jnp.where(exponent == 3, 4.0, jnp.where(exponent == 2, 2.0, 1.0))
    value = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    return jnp.where(nibbles >= 8, -value, value)


def e8m0(exponents: jax.Array) -> jax.Array:
    """E8M0 bytes -> the powers of two 2 ** (e - 127) as float32, exactly (the byte as the float's
    exponent field); 0 for a byte of 0 (see the module docstring)."""
    return jax.lax.bitcast_convert_type(exponents.astype(jnp.int32) << 23, jnp.float32)


def dequantize(qweight: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *, mode: str,
               group_size: int | None = None) -> jax.Array:
    """The float32 weight [..., K, N] that (qweight, scales, offsets) stand for (padded K, Kp rows)."""
    check_layout(qweight, scales, mode, group_size, offsets)
    if mode == "mxfp4":
        v, scales = e2m1(unpack_int4(qweight, signed=False).astype(jnp.int32)), e8m0(scales)
    else:
        v = unpack_int4(qweight, signed=offsets is None) if mode == "int4" else qweight
    v = v.astype(jnp.float32)                                               # [..., K, N]
    if group_size is None:  # one scale per output column
        return v * scales.astype(jnp.float32)[..., None, :]
    *lead, K, N = v.shape
    v = v.reshape(*lead, K // group_size, group_size, N)                    # [..., G, g, N]
    w = v * scales.astype(jnp.float32)[..., :, None, :]
    if offsets is not None:
        w = w + offsets.astype(jnp.float32)[..., :, None, :]
    return w.reshape(*lead, K, N)


def check_matmul_inputs(x: jax.Array, qweight: jax.Array, scales: jax.Array, mode: str, group_size: int | None,
                        offsets: jax.Array | None = None) -> int:
    """ValueError naming the argument at fault unless x [M, K] and the weight fit; returns the
    weight's stored K (padded to whole groups, which x's K may fall short of by less than a group)."""
    check_mode(mode, group_size)
    if x.ndim != 2 or qweight.ndim != 2:
        raise ValueError(f"x must be [M, K] and qweight 2-D, got {x.shape} and {qweight.shape}")
    check_layout(qweight, scales, mode, group_size, offsets)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    K = x.shape[1]
    Kw = stored_rows(qweight, mode)
    padded = group_size is not None and Kw - group_size < K < Kw
    if K != Kw and not padded:
        raise ValueError(f"x has K = {K} but the weight has K = {Kw}")
    return Kw


@functools.partial(jax.jit, static_argnames=("mode", "group_size"))
def quantized_matmul(
    x: jax.Array,
    qweight: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None = None,
    *,
    mode: str,
    group_size: int | None = None,
) -> jax.Array:
    """x [M, K] (float32 or bfloat16) @ dequantize(qweight, scales, offsets) [K, N] -> [M, N] in x's dtype.

    Both operands are taken to float32 (exact for bf16 x) and multiplied at full float32 precision,
    so this is the product of the numbers the quantized weight represents; a kernel feeding bf16
    to the matrix unit is compared against it with a tolerance.
    """
    check_matmul_inputs(x, qweight, scales, mode, group_size, offsets)
    w = dequantize(qweight, scales, offsets, mode=mode, group_size=group_size)  # [Kp, N] f32
    w = w[: x.shape[1]]  # the zero rows of a padded weight meet x's (absent) zero columns
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)

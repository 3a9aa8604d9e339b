"""Quantized matmul as a Pallas TPU (Mosaic) kernel: the weight is dequantized tile by tile in VMEM.

Same positional arguments, `mode` / `group_size` and result as `reference.quantized_matmul`:

    y [M, N] = x [M, K] @ dequantize(qweight, scales, offsets) [K, N]        (in x's dtype)

Only the quantized bytes are read from HBM; each [block_k, block_n] weight tile is turned into
numbers in VMEM, fed to the MXU and dropped, so the float weight never exists in HBM.

Grid and memory
---------------
grid = (Mp // bm, cdiv(N, bn), Kw // bk), K innermost ("arbitrary": it is the reduction). Every
input block is copied HBM -> VMEM by the Pallas pipeline (double-buffered); a float32 [bm, bn] VMEM
scratch accumulates over the K steps: zeroed at the first K step (`pl.when`), written to the
output block at the last.

* M (the token count, 1..8 rows in decode) is padded in the wrapper to a multiple of bm, which is
  rounded up to the sublane tile (8 rows for f32, 16 for bf16). Padding x costs M x K, nothing.
* N is never padded (that would copy the weight): bn is either all of N or a multiple of 128, and
  a last partial block is left to Pallas, whose out-of-range output columns are discarded.
* K is the reduction, so a partial block would add garbage: bk is the largest multiple of the
  lane width (int4: see below) dividing Kw that is <= block_k, else all of Kw.

Modes
-----
* int8 / fp8 per output column: the [bk, bn] tile is cast to x's dtype (exact: int8 and e4m3
  values are all bfloat16 numbers), multiplied on the MXU with f32 accumulation, and the column
  scales [1, bn] multiply the accumulator once, at the last K step.
* grouped (int4, int8 with groups, and fp8 in groups of 128 rows): the group scales (and offsets) must be applied before
  groups are summed, so each weight tile is dequantized in VMEM: viewed as [groups, g, bn] (a
  sublane-aligned split), multiplied by its groups' scales, offsets added, cast to x's dtype for
  one full-depth MXU dot. One dot per group would keep the integers exact but contract only
  16..128 deep on a 128/256-deep MXU; rounding q * s (+ o) to bf16 costs at most 2^-9 relative
  per weight, the precision of the bf16 activations themselves. The scales are passed reshaped
  to [Kp/bk, bk/g, N] so that each block's last two dims are whole array dims (a [bk/g, bn]
  block of 4 rows would not be a legal f32 tile). Scales and offsets are read as stored (f32 or
  bf16) and widened in VMEM. Mosaic refuses float16 vector loads ("Invalid vector type for
  load", libtpu, v5e / v6e / v5p), so float16 scales (GGUF's) are widened to f32 before the call:
  an extra pass over them every call, which placing them as f32 once avoids
  (`jaxinfer.ops.kernels`: the TPU table's `scale_dtype`).
* int4: byte row i of the packed weight holds k = 2i (low nibble) and k = 2i + 1 (high nibble).
  Interleaving the two nibble planes back into rows would be a sublane shuffle of every weight
  tile; instead the wrapper splits x's columns into even and odd ([M, Kp/2] each, a cheap
  permutation of the small operand), and the kernel computes
      x_even @ dequant(low nibbles) + x_odd @ dequant(high nibbles),
  each plane holding half of every group's rows. bk is a multiple of 256 (so each x half's
  block is a whole number of 128-lane tiles) and of group_size, or all of Kp.
* mxfp4: int4's packing and planes; each nibble is decoded as an E2M1 float (`reference.e2m1`'s
  arithmetic) and its group's E8M0 exponent byte made its power of two in the wrapper (exactly,
  as bfloat16: one pass over K / 32 x N bytes); value x scale is exact in bfloat16.
* x with K < Kp (K = 576 with groups of 128) is padded with zero columns.

Verified on the CPU with `interpret=True` only (no TPU here); pass `interpret=True` or a
`pltpu.InterpretParams()` to run it there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.tpu_chip import compiler_params, mxu_columns
from pallas_kernels.quantized_matmul.reference import PACKED_MODES, check_matmul_inputs, e2m1, e8m0

LANES = 128  # TPU vreg lane width: the minor dim of a block is a multiple of this, or the whole dim


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _reduction_block(size: int, limit: int, multiple: int) -> int:
    """Largest multiple of `multiple` that divides `size` and is <= limit; `size` itself if none."""
    for b in range(limit - limit % multiple, 0, -multiple):
        if size % b == 0:
            return b
    return size


def _vector_dtype(a: jax.Array) -> jax.Array:
    """Scales or offsets in a dtype Mosaic loads: float16 widened to float32 (see Modes)."""
    return a.astype(jnp.float32) if a.dtype == jnp.float16 else a


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at full f32 precision."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- kernels
def _k_steps(k_steps):
    """(this K step, the last K step): `k_steps` when given (read outside a `pl.when`: the
    interpreter has no program ids inside one), else grid axis 2."""
    return k_steps if k_steps is not None else (pl.program_id(2), pl.num_programs(2) - 1)


def _per_column_kernel(x_ref, w_ref, scale_ref, out_ref, acc_ref, *, k_steps=None):
    """int8 / fp8. x_ref [bm, bk], w_ref [bk, bn], scale_ref [1, bn] f32, out_ref [bm, bn], acc_ref [bm, bn] f32."""
    k_step, last_step = _k_steps(k_steps)

    @pl.when(k_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]                                   # [bm, bk]
    acc_ref[...] += _dot(x, w_ref[...].astype(x.dtype))  # [bm, bn]; the cast is exact

    @pl.when(k_step == last_step)
    def _finalize():
        out_ref[...] = (acc_ref[...] * scale_ref[...]).astype(out_ref.dtype)


def _grouped_kernel(*refs, planes: int, has_offsets: bool, fp4: bool = False, fp8: bool = False, k_steps=None):
    """int4 (planes = 2) or grouped int8 (planes = 1). refs: x_ref per plane [bm, bk / planes] (int4:
    x's columns k = 2i, then 2i + 1), w_ref [bk / planes, bn] (int8 | packed uint8), scale_ref
    [bk/g, bn], offset_ref [bk/g, bn] if has_offsets, out_ref [bm, bn], acc_ref [bm, bn] f32."""
    x_refs, (w_ref, scale_ref, *rest) = refs[:planes], refs[planes:]
    offset_ref = rest.pop(0) if has_offsets else None
    out_ref, acc_ref = rest
    k_step, last_step = _k_steps(k_steps)

    @pl.when(k_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    stored = w_ref[...].astype(jnp.float32 if fp8 else jnp.int32)  # [bk / planes, bn] (fp8: the e4m3 values)
    scales = e8m0(scale_ref[...]) if fp4 else scale_ref[...].astype(jnp.float32)  # [groups, bn] (mxfp4: exponent bytes)
    offsets = offset_ref[...].astype(jnp.float32) if has_offsets else None
    groups = scales.shape[0]
    rows, bn = stored.shape                          # a group covers rows // groups rows of each plane
    x_dtype = x_refs[0].dtype

    def dequantize(v):                               # [rows, bn] int32 -> [rows, bn] in x's dtype
        w = v.astype(jnp.float32).reshape(groups, rows // groups, bn) * scales[:, None, :]
        if offsets is not None:
            w = w + offsets[:, None, :]
        return w.reshape(rows, bn).astype(x_dtype)

    if fp4:                                          # mxfp4: E2M1 floats, rows k = 2i (low nibble), 2i + 1 (high)
        values = (e2m1(stored & 0x0F), e2m1(stored >> 4))
    elif planes == 2:                                # weight rows k = 2i (low nibble), 2i + 1 (high)
        bias = 0 if has_offsets else 8               # with offsets the nibble is v as it is
        values = ((stored & 0x0F) - bias, (stored >> 4) - bias)
    else:
        values = (stored,)
    acc_ref[...] += sum(_dot(x_ref[...], dequantize(v)) for x_ref, v in zip(x_refs, values))

    @pl.when(k_step == last_step)
    def _finalize():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


# ----------------------------------------------------------------------------- wrapper
@functools.partial(
    jax.jit, static_argnames=("mode", "group_size", "block_m", "block_n", "block_k", "interpret")
)
def quantized_matmul(
    x: jax.Array,        # [M, K] f32 or bf16
    qweight: jax.Array,  # int8 [K, N] | uint8 [Kp/2, N] | float8_e4m3fn [K, N]
    scales: jax.Array,   # [N] per column | [Kp/group_size, N] per group
    offsets: jax.Array | None = None,  # None | [Kp/group_size, N]
    *,
    mode: str,
    group_size: int | None = None,
    block_m: int = 128,
    block_n: int | None = None,  # default: twice the chip's MXU width (256 on v5e / v5p, 512 on v6e)
    block_k: int = 512,
    interpret=False,     # False on TPU; True or pltpu.InterpretParams() elsewhere
) -> jax.Array:          # [M, N] in x's dtype
    Kw = check_matmul_inputs(x, qweight, scales, mode, group_size, offsets)  # the weight's K (padded Kp)
    block_n = block_n or 2 * mxu_columns()
    if block_m < 1 or block_n < 1 or block_n % LANES or block_k < 1:
        raise ValueError(f"block sizes must be positive and block_n a multiple of {LANES}, got {block_m, block_n, block_k}")
    M, K = x.shape
    N = qweight.shape[1]
    if interpret:
        patch_interpret_mode()

    sublanes = 8 * 4 // x.dtype.itemsize                 # rows per vreg: 8 for f32, 16 for bf16
    bm = _round_up(min(block_m, M), sublanes)
    Mp = _round_up(M, bm)
    bn = N if N <= block_n else block_n
    planes = 2 if mode in PACKED_MODES else 1            # int4, mxfp4: each x half's block is bk/2 lanes wide
    bk = _reduction_block(Kw, block_k, planes * LANES)
    grid = (Mp // bm, pl.cdiv(N, bn), Kw // bk)

    x = jnp.pad(x, ((0, Mp - M), (0, Kw - K)))           # [Mp, Kw]; zero rows and zero columns up to Kp
    out_block = pl.BlockSpec((bm, bn), lambda i, j, k: (i, j))
    if group_size is not None:
        xs = [x] if planes == 1 else [x[:, 0::2], x[:, 1::2]]  # int4: x's columns k = 2i, then 2i + 1
        group_block = pl.BlockSpec((None, bk // group_size, bn), lambda i, j, k: (k, 0, j))
        per_group = [_vector_dtype(a).reshape(Kw // bk, bk // group_size, N) for a in (scales, offsets) if a is not None]
        operands = (*xs, qweight, *per_group)
        in_specs = [pl.BlockSpec((bm, bk // planes), lambda i, j, k: (i, k)) for _ in xs] + [
            pl.BlockSpec((bk // planes, bn), lambda i, j, k: (k, j)),                  # int8 | packed rows
        ] + [group_block] * len(per_group)
        kernel = functools.partial(_grouped_kernel, planes=planes, has_offsets=offsets is not None, fp4=mode == "mxfp4",
                                   fp8=mode == "fp8")
    else:
        operands = (x, qweight, scales.astype(jnp.float32).reshape(1, N))
        in_specs = [
            pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
            pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
            pl.BlockSpec((1, bn), lambda i, j, k: (0, j)),
        ]
        kernel = _per_column_kernel

    weight_bytes = sum(a.size * a.dtype.itemsize for a in (qweight, scales, offsets) if a is not None)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_block,
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        cost_estimate=cost.matmul(M, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize,
                                  weight_bytes=weight_bytes),
        name="quantized_matmul",
    )(*operands)
    return out[:M]

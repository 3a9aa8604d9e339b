"""Quantized matmul as a Pallas TPU (Mosaic) kernel: the weight is dequantized tile by tile in VMEM.

Same positional arguments, `mode` / `group_size` and result as `reference.quantized_matmul`:

    y [M, N] = x [M, K] @ dequantize(qweight, scales) [K, N]        (in x's dtype)

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
* int8 / fp8 (per output column): the [bk, bn] tile is cast to x's dtype (exact: int8 and e4m3
  values are all bfloat16 numbers), multiplied on the MXU with f32 accumulation, and the column
  scales [1, bn] multiply the accumulator once, at the last K step.
* int4 (per group of `group_size` rows of K): byte row i of the packed weight holds k = 2i (low
  nibble) and k = 2i + 1 (high nibble). Interleaving the two nibble planes back into rows would be
  a sublane shuffle of every weight tile; instead the wrapper splits x's columns into even and odd
  ([M, Kp/2] each, a cheap permutation of the small operand), and the kernel computes
      x_even @ dequant(low nibbles) + x_odd @ dequant(high nibbles).
  The group scales must be applied before groups are summed, so each unpacked tile is multiplied
  by its group's scales ([bk/2, bn] viewed as [groups, group_size/2, bn], a sublane-aligned split)
  and then cast to x's dtype for one full-depth MXU dot per nibble plane. One dot per group would
  keep the integers exact but contract only 16..64 deep on a 128/256-deep MXU; rounding q * s to
  bf16 costs at most 2^-9 relative per weight, the precision of the bf16 activations themselves.
  bk is a multiple of 256 (so each x half's block is a whole number of 128-lane tiles) and of
  group_size, or all of Kp. x with K < Kp (K = 576 with groups of 128) is padded with zero columns.
  The scales [Kp/g, N] are passed reshaped to [Kp/bk, bk/g, N] so that each block's last two dims
  are whole array dims (a [bk/g, bn] block of 4 rows would not be a legal f32 tile).

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
from pallas_kernels.quantized_matmul.reference import check_matmul_inputs

LANES = 128  # TPU vreg lane width: the minor dim of a block is a multiple of this, or the whole dim


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _reduction_block(size: int, limit: int, multiple: int) -> int:
    """Largest multiple of `multiple` that divides `size` and is <= limit; `size` itself if none."""
    for b in range(limit - limit % multiple, 0, -multiple):
        if size % b == 0:
            return b
    return size


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at full f32 precision."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- kernels
def _per_column_kernel(x_ref, w_ref, scale_ref, out_ref, acc_ref):
    """int8 / fp8. x_ref [bm, bk], w_ref [bk, bn], scale_ref [1, bn] f32, out_ref [bm, bn], acc_ref [bm, bn] f32."""
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]                                   # [bm, bk]
    acc_ref[...] += _dot(x, w_ref[...].astype(x.dtype))  # [bm, bn]; the cast is exact

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _finalize():
        out_ref[...] = (acc_ref[...] * scale_ref[...]).astype(out_ref.dtype)


def _int4_kernel(x_even_ref, x_odd_ref, packed_ref, scale_ref, out_ref, acc_ref):
    """x_even_ref / x_odd_ref [bm, bk/2] (x's columns k = 2i / 2i+1 of this K block), packed_ref
    [bk/2, bn] uint8, scale_ref [bk/g, bn] f32 (one row per group), out_ref [bm, bn], acc_ref [bm, bn] f32."""
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    packed = packed_ref[...].astype(jnp.int32)       # [bk/2, bn]
    scales = scale_ref[...]                          # [groups, bn]
    groups = scales.shape[0]
    rows, bn = packed.shape                          # rows = bk/2; a group covers rows // groups byte rows
    x_dtype = x_even_ref.dtype

    def dequantize(nibbles):                         # [bk/2, bn] int32 in [0, 15]
        q = (nibbles - 8).astype(jnp.float32).reshape(groups, rows // groups, bn)
        return (q * scales[:, None, :]).reshape(rows, bn).astype(x_dtype)

    low = dequantize(packed & 0x0F)                  # weight rows k = 2i
    high = dequantize(packed >> 4)                   # weight rows k = 2i + 1
    acc_ref[...] += _dot(x_even_ref[...], low) + _dot(x_odd_ref[...], high)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _finalize():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


# ----------------------------------------------------------------------------- wrapper
@functools.partial(
    jax.jit, static_argnames=("mode", "group_size", "block_m", "block_n", "block_k", "interpret")
)
def quantized_matmul(
    x: jax.Array,        # [M, K] f32 or bf16
    qweight: jax.Array,  # int8 [K, N] | uint8 [Kp/2, N] | float8_e4m3fn [K, N]
    scales: jax.Array,   # f32 [N] | f32 [Kp/group_size, N] | f32 [N]
    *,
    mode: str,
    group_size: int | None = None,
    block_m: int = 128,
    block_n: int | None = None,  # default: twice the chip's MXU width (256 on v5e / v5p, 512 on v6e)
    block_k: int = 512,
    interpret=False,     # False on TPU; True or pltpu.InterpretParams() elsewhere
) -> jax.Array:          # [M, N] in x's dtype
    Kw = check_matmul_inputs(x, qweight, scales, mode, group_size)  # the weight's K (int4: padded Kp)
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
    k_multiple = 2 * LANES if mode == "int4" else LANES  # int4: each x half's block is bk/2 lanes wide
    bk = _reduction_block(Kw, block_k, k_multiple)
    grid = (Mp // bm, pl.cdiv(N, bn), Kw // bk)

    x = jnp.pad(x, ((0, Mp - M), (0, Kw - K)))           # [Mp, Kw]; zero rows and (int4) zero columns
    out_block = pl.BlockSpec((bm, bn), lambda i, j, k: (i, j))
    if mode == "int4":
        x_pairs = x.reshape(Mp, Kw // 2, 2)              # [Mp, Kp/2, (even, odd)]
        operands = (x_pairs[..., 0], x_pairs[..., 1], qweight, scales.reshape(Kw // bk, bk // group_size, N))
        in_specs = [
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),                      # x_even
            pl.BlockSpec((bm, bk // 2), lambda i, j, k: (i, k)),                      # x_odd
            pl.BlockSpec((bk // 2, bn), lambda i, j, k: (k, j)),                      # packed
            pl.BlockSpec((None, bk // group_size, bn), lambda i, j, k: (k, 0, j)),    # scales
        ]
        kernel = _int4_kernel
    else:
        operands = (x, qweight, scales.reshape(1, N))
        in_specs = [
            pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
            pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),
            pl.BlockSpec((1, bn), lambda i, j, k: (0, j)),
        ]
        kernel = _per_column_kernel

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
                                  weight_bytes=qweight.size * qweight.dtype.itemsize + scales.size * scales.dtype.itemsize),
        name="quantized_matmul",
    )(*operands)
    return out[:M]


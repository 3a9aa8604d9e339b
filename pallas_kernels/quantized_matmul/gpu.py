"""Quantized matmul as a Pallas GPU kernel (Triton lowering): dequantized tile by tile in registers.

Same positional arguments, `mode` / `group_size` and result as `reference.quantized_matmul`:

    y [M, N] = x [M, K] @ dequantize(qweight, scales) [K, N]        (in x's dtype)

Why Triton and not Mosaic GPU: Pallas' Mosaic GPU backend has no interpret mode in this JAX
(0.10.2) and there is no GPU on the machines this was written on, so a Mosaic GPU kernel could not
have been run at all. The Triton lowering runs under `interpret=True` on the CPU, which is how this
file is tested; it has not been run on a GPU.

Grid and memory
---------------
grid = (cdiv(M, bm), cdiv(N, bn)); each program owns one [bm, bn] output tile and walks all of K
in a `fori_loop`, its float32 accumulator a loop carry (registers). There is no K grid axis:
Triton programs run concurrently and have no scratch that outlives one program, so a reduction
split over programs would need atomics or a second pass. The arrays are passed whole (no
BlockSpec) and every tile is a masked load (`other=0`), so no dimension needs to divide its block
and nothing is padded except what the int4 split below needs. Triton wants power-of-two tiles of
at least 16 per dot dimension, so bm, bn, bk are powers of two >= 16.

Decode (M = 1..8) is memory-bound: the point of int4 is to read a quarter of the bytes. The
small-M path takes bm = 16 (the smallest dot tile) with the rows past M masked off, and a
narrower bn (64) so a short N still spreads over more programs.

Modes
-----
* int8 / fp8 (per output column): each [bk, bn] tile is cast to x's dtype (exact: int8 and e4m3
  values are all bfloat16 numbers) for a tensor-core dot with f32 accumulation; the column scales
  multiply the accumulator once, after the loop.
* int4 (per group of `group_size` rows of K): byte row i holds k = 2i (low nibble) and k = 2i + 1
  (high nibble). Rather than interleave the nibble planes back into rows, the wrapper splits x's
  columns into even and odd halves ([M, Kp/2] each; x is the small operand) and each group adds
      scale[g] * (x_even[g] @ low[g] + x_odd[g] @ high[g])
  to the accumulator: the integer tiles (-8..7) are exact in bf16, the group's scale is applied to
  the [bm, bn] partial before groups are summed (bm is small in decode, so this is fewer
  multiplies than scaling the [g/2, bn] weight tile), and a dot of depth g/2 = 16..64 is a native
  tensor-core shape. bk is a multiple of group_size: one loop step does bk / group_size groups.
  x with K < Kp (K = 576 with groups of 128) is padded with zero columns up to Kp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.quantized_matmul.reference import check_matmul_inputs

SMALL_M = 16  # the smallest tile a tensor-core dot takes; decode batches are padded (masked) up to it


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at HIGHEST precision (IEEE f32: the
    Triton lowering turns the default precision into tf32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _tile(ref, rows: jax.Array, cols: jax.Array, row_start, col_start, n_rows: int, n_cols: int):
    """Masked [n_rows, n_cols] tile of a 2-D ref starting at (row_start, col_start); 0 outside the array."""
    row_ids = row_start + jnp.arange(n_rows)
    col_ids = col_start + jnp.arange(n_cols)
    mask = (row_ids < rows)[:, None] & (col_ids < cols)[None, :]
    return plt.load(ref.at[pl.ds(row_start, n_rows), pl.ds(col_start, n_cols)], mask=mask, other=jnp.zeros((), ref.dtype))


# ----------------------------------------------------------------------------- kernels
def _per_column_kernel(x_ref, w_ref, scale_ref, out_ref, *, bm: int, bn: int, bk: int):
    """int8 / fp8. x_ref [M, K], w_ref [K, N], scale_ref [N] f32, out_ref [M, N] (whole arrays)."""
    M, K = x_ref.shape
    N = w_ref.shape[1]
    m0 = pl.program_id(0) * bm
    n0 = pl.program_id(1) * bn

    def k_step(step, acc):                                   # acc [bm, bn] f32
        k0 = step * bk
        x = _tile(x_ref, M, K, m0, k0, bm, bk)               # [bm, bk]
        w = _tile(w_ref, K, N, k0, n0, bk, bn)               # [bk, bn] int8 | fp8
        return acc + _dot(x, w.astype(x.dtype))              # the cast is exact

    acc = jax.lax.fori_loop(0, pl.cdiv(K, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    cols = n0 + jnp.arange(bn)
    scale = plt.load(scale_ref.at[pl.ds(n0, bn)], mask=cols < N, other=0.0)   # [bn]
    rows = m0 + jnp.arange(bm)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    plt.store(out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], (acc * scale[None, :]).astype(out_ref.dtype), mask=out_mask)


def _int4_kernel(x_even_ref, x_odd_ref, packed_ref, scale_ref, out_ref, *, bm: int, bn: int, bk: int, group_size: int):
    """x_even_ref / x_odd_ref [M, Kp/2] (x's columns k = 2i / 2i+1), packed_ref [Kp/2, N] uint8,
    scale_ref [Kp/g, N] f32, out_ref [M, N] (whole arrays)."""
    M, half_k = x_even_ref.shape                             # half_k = Kp / 2 byte rows
    N = packed_ref.shape[1]
    n_groups = scale_ref.shape[0]
    half_g = group_size // 2                                 # byte rows per group
    m0 = pl.program_id(0) * bm
    n0 = pl.program_id(1) * bn
    cols = n0 + jnp.arange(bn)
    x_dtype = x_even_ref.dtype

    def k_step(step, acc):                                   # acc [bm, bn] f32
        for g_in_step in range(bk // group_size):            # static: bk / group_size groups per step
            group = step * (bk // group_size) + g_in_step
            r0 = group * half_g                              # first byte row of this group
            x_even = _tile(x_even_ref, M, half_k, m0, r0, bm, half_g)      # [bm, g/2]
            x_odd = _tile(x_odd_ref, M, half_k, m0, r0, bm, half_g)        # [bm, g/2]
            packed = _tile(packed_ref, half_k, N, r0, n0, half_g, bn).astype(jnp.int32)  # [g/2, bn]
            low = ((packed & 0x0F) - 8).astype(x_dtype)      # weight rows k = 2i, exact
            high = ((packed >> 4) - 8).astype(x_dtype)       # weight rows k = 2i + 1
            scale = plt.load(scale_ref.at[group, pl.ds(n0, bn)], mask=(cols < N) & (group < n_groups), other=0.0)
            acc = acc + (_dot(x_even, low) + _dot(x_odd, high)) * scale[None, :]
        return acc

    acc = jax.lax.fori_loop(0, pl.cdiv(n_groups * group_size, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    rows = m0 + jnp.arange(bm)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    plt.store(out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=out_mask)


# ----------------------------------------------------------------------------- wrapper
@functools.partial(
    jax.jit,
    static_argnames=("mode", "group_size", "block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"),
)
def quantized_matmul(
    x: jax.Array,        # [M, K] f32 or bf16
    qweight: jax.Array,  # int8 [K, N] | uint8 [Kp/2, N] | float8_e4m3fn [K, N]
    scales: jax.Array,   # f32 [N] | f32 [Kp/group_size, N] | f32 [N]
    *,
    mode: str,
    group_size: int | None = None,
    block_m: int | None = None,  # None: 16 for M <= 16 (decode), else 64
    block_n: int | None = None,  # None: 64 for M <= 16, else 128
    block_k: int | None = None,  # None: 128 (int4: at least group_size)
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:          # [M, N] in x's dtype
    Kw = check_matmul_inputs(x, qweight, scales, mode, group_size)  # the weight's K (int4: padded Kp)
    M, K = x.shape
    N = qweight.shape[1]

    small_m = M <= SMALL_M
    bm = block_m or (SMALL_M if small_m else 64)
    bn = block_n or (64 if small_m else 128)
    bk = block_k or (max(128, group_size) if mode == "int4" else 128)
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    if mode == "int4" and bk % group_size:
        raise ValueError(f"block_k must be a multiple of group_size = {group_size}, got {bk}")
    if interpret:
        patch_interpret_mode()

    if mode == "int4":
        x_pairs = jnp.pad(x, ((0, 0), (0, Kw - K))).reshape(M, Kw // 2, 2)   # [M, Kp/2, (even, odd)]
        operands = (x_pairs[..., 0], x_pairs[..., 1], qweight, scales)
        kernel = functools.partial(_int4_kernel, bm=bm, bn=bn, bk=bk, group_size=group_size)
    else:
        operands = (x, qweight, scales)
        kernel = functools.partial(_per_column_kernel, bm=bm, bn=bn, bk=bk)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.matmul(M, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize,
                                  weight_bytes=qweight.size * qweight.dtype.itemsize + scales.size * scales.dtype.itemsize),
        name="quantized_matmul",
    )(*operands)

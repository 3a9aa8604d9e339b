"""Quantized matmul as a Pallas GPU kernel (Triton lowering): dequantized tile by tile in registers.

Same positional arguments, `mode` / `group_size` and result as `reference.quantized_matmul`:

    y [M, N] = x [M, K] @ dequantize(qweight, scales, offsets) [K, N]        (in x's dtype)

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
and nothing is padded except what the grouped path below needs. Triton wants power-of-two tiles of
at least 16 per dot dimension, so bm, bn, bk are powers of two >= 16.

Decode (M = 1..8) is memory-bound: the point of int4 is to read a quarter of the bytes. The
small-M path takes bm = 16 (the smallest dot tile) with the rows past M masked off, and a
narrower bn (64) so a short N still spreads over more programs.

Modes
-----
* int8 / fp8 per output column: each [bk, bn] tile is cast to x's dtype (exact: int8 and e4m3
  values are all bfloat16 numbers) for a tensor-core dot with f32 accumulation; the column scales
  multiply the accumulator once, after the loop.
* grouped (int4, int8 with groups of 16..128, fp8 with groups of 128): the integer tiles are exact in bf16, so each
  group is one dot of depth g (int8) or two of depth g/2 (int4's nibble planes, below), and the
  group's scale multiplies the [bm, bn] partial before groups are summed (bm is small in decode,
  so this is fewer multiplies than scaling the weight tile); an offset o adds o * (the sum of x
  over the group's columns), an outer product of [bm] and [bn]:
      acc += (x_g @ v_g) * scale[g] + rowsum(x_g) * offset[g]
  Scales and offsets are loaded in their stored dtype (f32, bf16 or f16) and widened.
* int4: byte row i holds k = 2i (low nibble) and k = 2i + 1 (high nibble). Rather than
  interleave the nibble planes back into rows, the wrapper splits x's columns into even and odd
  halves ([M, Kp/2] each; x is the small operand) and each group's product is
  x_even[g] @ low[g] + x_odd[g] @ high[g]. bk is a multiple of group_size: one loop step does
  bk / group_size groups.
* mxfp4: int4's packing and planes, each nibble decoded as an E2M1 float (exact in bf16, so the
  group's dot stays exact) and the group's E8M0 exponent byte made its power of two as it is
  loaded (shifted into a float32's exponent field).
* x with K < Kp (K = 576 with groups of 128) is padded with zero columns up to Kp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.quantized_matmul.reference import PACKED_MODES, check_matmul_inputs, e2m1, e8m0
from pallas_kernels.triton_tiles import masked_tile

SMALL_M = 16  # the smallest tile a tensor-core dot takes; decode batches are padded (masked) up to it


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at HIGHEST precision (IEEE f32: the
    Triton lowering turns the default precision into tf32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- kernels
def _at(ref, expert, *index):
    """ref.at[index], or ref.at[expert, *index] for one matrix of a stack (`expert` not None)."""
    return ref.at[index if expert is None else (expert, *index)]


def _tile_origin(program, bm: int, bn: int):
    """(first row, first column) of this program's output tile; `program`: its (i, j) when read
    outside a `pl.when` (the interpreter has no program ids inside one), else pl.program_id."""
    i, j = program if program is not None else (pl.program_id(0), pl.program_id(1))
    return i * bm, j * bn


def _per_column_kernel(x_ref, w_ref, scale_ref, out_ref, *, bm: int, bn: int, bk: int, expert=None, program=None):
    """int8 / fp8. x_ref [M, K], w_ref [K, N], scale_ref [N] f32, out_ref [M, N] (whole arrays);
    with `expert` (a traced index), w_ref [G, K, N] and scale_ref [G, N] stacks, matrix `expert` read;
    `program`: see _tile_origin."""
    M, K = x_ref.shape
    N = w_ref.shape[-1]
    m0, n0 = _tile_origin(program, bm, bn)

    def k_step(step, acc):                                   # acc [bm, bn] f32
        k0 = step * bk
        x = masked_tile(x_ref, M, K, m0, k0, bm, bk)         # [bm, bk]
        w = masked_tile(w_ref, K, N, k0, n0, bk, bn, lead=expert)  # [bk, bn] int8 | fp8
        return acc + _dot(x, w.astype(x.dtype))              # the cast is exact

    acc = jax.lax.fori_loop(0, pl.cdiv(K, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    cols = n0 + jnp.arange(bn)
    scale = plt.load(_at(scale_ref, expert, pl.ds(n0, bn)), mask=cols < N, other=0.0)   # [bn]
    rows = m0 + jnp.arange(bm)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    plt.store(out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], (acc * scale[None, :]).astype(out_ref.dtype), mask=out_mask)


def _grouped_kernel(*refs, planes: int, has_offsets: bool, bm: int, bn: int, bk: int, group_size: int, fp4: bool = False,
                    fp8: bool = False, expert=None, program=None):
    """int4 / mxfp4 (planes = 2) or grouped int8 (planes = 1). refs: x_ref per plane [M, Kp / planes]
    (int4: x's columns k = 2i, then 2i + 1), w_ref [Kp / planes, N] (int8 | packed uint8),
    scale_ref [Kp/g, N] (mxfp4: exponent bytes), offset_ref [Kp/g, N] if has_offsets, out_ref [M, N]
    (whole arrays); with `expert`, w_ref, scale_ref and offset_ref are stacks [G, ...] and matrix
    `expert` is read."""
    x_refs, (w_ref, scale_ref, *rest) = refs[:planes], refs[planes:]
    offset_ref = rest.pop(0) if has_offsets else None
    [out_ref] = rest
    M, plane_k = x_refs[0].shape                             # plane_k = Kp / planes rows of each plane
    N = w_ref.shape[-1]
    n_groups = scale_ref.shape[-2]
    plane_g = group_size // planes                           # rows of each plane per group
    m0, n0 = _tile_origin(program, bm, bn)
    cols = n0 + jnp.arange(bn)
    x_dtype = x_refs[0].dtype

    def per_group(ref, group):                               # [bn] f32: one group's scales or offsets
        numbers = plt.load(_at(ref, expert, group, pl.ds(n0, bn)), mask=(cols < N) & (group < n_groups),
                           other=jnp.zeros((), ref.dtype))
        return e8m0(numbers) if fp4 and ref is scale_ref else numbers.astype(jnp.float32)

    def k_step(step, acc):                                   # acc [bm, bn] f32
        for g_in_step in range(bk // group_size):            # static: bk / group_size groups per step
            group = step * (bk // group_size) + g_in_step
            r0 = group * plane_g                             # first row of this group in each plane
            xs = [masked_tile(x_ref, M, plane_k, m0, r0, bm, plane_g) for x_ref in x_refs]    # [bm, g / planes] each
            stored = masked_tile(w_ref, plane_k, N, r0, n0, plane_g, bn, lead=expert)  # [g / planes, bn]
            stored = stored.astype(jnp.float32 if fp8 else jnp.int32)  # (fp8: the e4m3 values, exact in bf16)
            bias = 0 if offset_ref is not None else 8        # int4 with offsets: the nibble is v as it is
            if fp4:                                          # mxfp4: E2M1 floats
                values = (e2m1(stored & 0x0F), e2m1(stored >> 4))
            elif planes == 2:
                values = ((stored & 0x0F) - bias, (stored >> 4) - bias)
            else:
                values = (stored,)
            partial = sum(_dot(x, v.astype(x_dtype)) for x, v in zip(xs, values))      # exact integers
            acc = acc + partial * per_group(scale_ref, group)[None, :]
            if offset_ref is not None:
                x_sum = sum(jnp.sum(x.astype(jnp.float32), axis=1) for x in xs)        # [bm]
                acc = acc + x_sum[:, None] * per_group(offset_ref, group)[None, :]
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
    scales: jax.Array,   # [N] per column | [Kp/group_size, N] per group
    offsets: jax.Array | None = None,  # None | [Kp/group_size, N]
    *,
    mode: str,
    group_size: int | None = None,
    block_m: int | None = None,  # None: 16 for M <= 16 (decode), else 64
    block_n: int | None = None,  # None: 64 for M <= 16, else 128
    block_k: int | None = None,  # None: 128 (grouped: at least group_size)
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:          # [M, N] in x's dtype
    Kw = check_matmul_inputs(x, qweight, scales, mode, group_size, offsets)  # the weight's K (padded Kp)
    M, K = x.shape
    N = qweight.shape[1]

    small_m = M <= SMALL_M
    bm = block_m or (SMALL_M if small_m else 64)
    bn = block_n or (64 if small_m else 128)
    bk = block_k or (max(128, group_size or 0))
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    if group_size is not None and bk % group_size:
        raise ValueError(f"block_k must be a multiple of group_size = {group_size}, got {bk}")
    if interpret:
        patch_interpret_mode()

    if group_size is not None:
        planes = 2 if mode in PACKED_MODES else 1
        x = jnp.pad(x, ((0, 0), (0, Kw - K)))                                 # zero columns up to Kp
        xs = [x] if planes == 1 else [x[:, 0::2], x[:, 1::2]]                 # int4: x's columns k = 2i, then 2i + 1
        operands = (*xs, qweight, *(a for a in (scales, offsets) if a is not None))
        kernel = functools.partial(_grouped_kernel, planes=planes, has_offsets=offsets is not None, bm=bm, bn=bn, bk=bk,
                                   group_size=group_size, fp4=mode == "mxfp4", fp8=mode == "fp8")
    else:
        operands = (x, qweight, scales.astype(jnp.float32))
        kernel = functools.partial(_per_column_kernel, bm=bm, bn=bn, bk=bk)

    weight_bytes = sum(a.size * a.dtype.itemsize for a in (qweight, scales, offsets) if a is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.matmul(M, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize,
                                  weight_bytes=weight_bytes),
        name="quantized_matmul",
    )(*operands)

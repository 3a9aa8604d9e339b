"""2:4 sparse matmul as a Pallas TPU (Mosaic) kernel: the compressed weight is expanded tile by tile in VMEM.

Same arguments and result as `reference.sparse24_matmul`:

    y [M, N] = x [M, K] @ densify(values [4, K/8, N], mask uint8 [K/8, N]) [K, N]   (in x's dtype)

Only the compressed bytes cross HBM: per [8 rows, column] block of W, four kept values and one
mask byte (bfloat16: 9 bytes for 16 dense ones). Each tile is expanded in VMEM by selects, fed to
the MXU and dropped.

Grid and memory
---------------
grid = (Mp // bm, cdiv(N, bn), (K/8) // bk8), the K axis innermost ("arbitrary": the reduction).
Per step the pipeline copies HBM -> VMEM (double-buffered):

    x planes    [8, bm, bk8]    x's columns j, j + 8, ... of this K step (the wrapper's split,
                                reference.x_planes: x is the small operand, one pass over it)
    values      [4, bk8, bn]    the four kept-value planes of 8 * bk8 rows of W
    mask        [bk8, bn]       uint8

and a float32 [bm, bn] VMEM scratch accumulates over the K steps (zeroed at the first, written at
the last). In VMEM each of the two groups of a mask byte (e = 0, 1) gives four [bk8, bn] tiles
W_p (the reference's selects: a row's mask bit, and whether it is its group's first kept row),
each multiplied with x plane 4e + p: eight MXU dots of depth bk8, a dense tile's work, no
shuffle of rows (sublanes).

* M (1..8 rows in decode) is padded to bm, a multiple of the sublane tile (8 f32 / 16 bf16).
* N is never padded (that would copy the weight): bn is all of N or a multiple of 128; Pallas
  drops a last partial block's out-of-range columns.
* K is the reduction, so bk8 divides K/8: the largest multiple of 128 (x's lanes; also whole
  (32, 128) uint8 tiles of the mask) that divides K/8 and is <= block_k / 8, else all of K/8
  (SmolLM2's 576 inputs: 72 mask rows in one step).

Values are cast to x's dtype before the dot (the model passes x in the weight's dtype). Verified
on the CPU with `interpret=True`; compiled by libtpu for v5e / v6e (tests, jaxinfer.aot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import cost
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.sparse24_matmul.reference import check_matmul_inputs, x_planes
from pallas_kernels.tpu_chip import compiler_params, mxu_columns

LANES = 128


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _reduction_block(size: int, limit: int, multiple: int) -> int:
    """Largest multiple of `multiple` that divides `size` and is <= limit; `size` itself if none."""
    for b in range(limit - limit % multiple, 0, -multiple):
        if size % b == 0:
            return b
    return size


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def expanded_planes(mask: jax.Array, values, dtype):
    """The eight [rows, cols] tiles W_{4e+p} of a block (the reference's selects): mask int32
    [rows, cols], values four [rows, cols] planes (indexable), in `dtype`. Shared with gpu.py."""
    zero = jnp.zeros((), dtype)
    tiles = []
    for e in range(2):
        v_a, v_b = values[2 * e].astype(dtype), values[2 * e + 1].astype(dtype)  # the group's first and second kept
        b0, b1, b2, b3 = ((mask & (1 << (4 * e + p))) != 0 for p in range(4))  # two VPU ops per bit
        tiles += [jnp.where(b0, v_a, zero),
                  jnp.where(b1, jnp.where(b0, v_b, v_a), zero),
                  jnp.where(b2, jnp.where(b3, v_a, v_b), zero),
                  jnp.where(b3, v_b, zero)]
    return tiles


def _kernel(x_ref, values_ref, mask_ref, out_ref, acc_ref, *, k_steps=None):
    """x_ref [8, bm, bk8], values_ref [4, bk8, bn], mask_ref [bk8, bn] uint8, out_ref [bm, bn], acc_ref [bm, bn] f32."""
    k_step, last_step = k_steps if k_steps is not None else (pl.program_id(2), pl.num_programs(2) - 1)

    @pl.when(k_step == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dtype = x_ref.dtype
    mask = mask_ref[...].astype(jnp.int32)                       # [bk8, bn]
    tiles = expanded_planes(mask, [values_ref[q] for q in range(4)], dtype)
    acc_ref[...] += sum(_dot(x_ref[j], tiles[j]) for j in range(8))

    @pl.when(k_step == last_step)
    def _finalize():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def sparse24_matmul(
    x: jax.Array,       # [M, K] f32 or bf16
    values: jax.Array,  # [4, K/8, N]
    mask: jax.Array,    # uint8 [K/8, N]
    *,
    block_m: int = 128,
    block_n: int | None = None,  # default: twice the chip's MXU width (256 on v5e / v5p, 512 on v6e)
    block_k: int = 2048,         # rows of W per K step (8 per mask row)
    interpret=False,
) -> jax.Array:                  # [M, N] in x's dtype
    K = check_matmul_inputs(x, values, mask)
    block_n = block_n or 2 * mxu_columns()
    if block_m < 1 or block_n < 1 or block_n % LANES or block_k < 8:
        raise ValueError(f"block sizes must be positive, block_n a multiple of {LANES} and block_k >= 8, got "
                         f"{block_m, block_n, block_k}")
    M = x.shape[0]
    K8, N = mask.shape
    if interpret:
        patch_interpret_mode()

    sublanes = 8 * 4 // x.dtype.itemsize
    bm = _round_up(min(block_m, M), sublanes)
    Mp = _round_up(M, bm)
    bn = N if N <= block_n else block_n
    bk8 = _reduction_block(K8, max(block_k // 8, LANES), LANES)
    grid = (Mp // bm, pl.cdiv(N, bn), K8 // bk8)

    xs = x_planes(jnp.pad(x, ((0, Mp - M), (0, 0))))            # [8, Mp, K/8]
    weight_bytes = values.size * values.dtype.itemsize + mask.size
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=[
                pl.BlockSpec((8, bm, bk8), lambda i, j, k: (0, i, k)),
                pl.BlockSpec((4, bk8, bn), lambda i, j, k: (0, k, j)),
                pl.BlockSpec((bk8, bn), lambda i, j, k: (k, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        cost_estimate=cost.matmul(M, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize,
                                  weight_bytes=weight_bytes),
        name="sparse24_matmul",
    )(xs, values, mask)
    return out[:M]

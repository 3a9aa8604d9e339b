"""Grouped quantized matmul as a Pallas TPU (Mosaic) kernel: each block of rows reads one matrix of
the stack, quantized bytes only, dequantized tile by tile in VMEM.

Same arguments and result as `reference.grouped_quantized_matmul`:

    y [M, N] float32,  y[r] = x[r] @ dequantize(stack[group_of_row[r]])   (0 for group_of_row[r] = G)

Layout
------
`pallas_kernels.row_groups.group_by_slot` lays the rows out in blocks of `tm` rows of one group
each (slot = group + 1; empty rows, slot 0, get no row), gathered in XLA (M x K values). The
blocks' groups (`block_slot`) and how many blocks hold rows (`used`) go to the kernel as scalar
prefetch (SMEM), so each BlockSpec's index map picks its block's matrix.

Grid (cdiv(N, bn), blocks, Kw // bk), K innermost ("arbitrary": the reduction), blocks inside
the column blocks so consecutive blocks of one group reuse the weight tile already in VMEM when
K fits one step. The blocks past `used` repeat the last used block's indices (its matrix, its
last K step, its output block): the pipeline fetches nothing new for them, the body is skipped,
and the output block, unchanged since it was written, is written back again as it was.

The body is `quantized_matmul.tpu`'s, for every mode (int8 / fp8 per column; int4, grouped int8
and mxfp4 per group of K, the mxfp4 exponent bytes decoded in VMEM): the stack's leading axis is
squeezed out by the BlockSpecs.

Blocks: tm is a sublane tile (8 rows for float32 x, 16 for bfloat16) times the smallest power of
two that covers M / G rows, up to block_m (128): a decode step spreads a few rows over many
experts, so each block is mostly one expert's few rows (a group wastes at most tm - 1 rows); a
long prefill gives each expert many rows and takes larger blocks, so a weight tile is read
M / (G tm) times, not once per 8 rows. bk and bn are chosen as in `quantized_matmul.tpu`. Not
tuned on a chip (none here).

Verified on the CPU in interpret mode, and compiled by the real TPU compiler (`tests/test_aot.py`,
`python -m jaxinfer.aot.kernel_check --kernel grouped_matmul`); not run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import cost, row_groups
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.grouped_matmul.reference import check_grouped_inputs, rows_by_matrix
from pallas_kernels.quantized_matmul.reference import PACKED_MODES
from pallas_kernels.quantized_matmul.tpu import LANES, _grouped_kernel, _per_column_kernel, _reduction_block, _vector_dtype
from pallas_kernels.tpu_chip import compiler_params, mxu_columns


def block_rows(M: int, G: int, sublanes: int, limit: int) -> int:
    """Rows per block: `sublanes` times the smallest power of two covering M / G rows, at most `limit`."""
    tm = sublanes
    while tm < limit and tm * G < M:
        tm *= 2
    return tm


def _live_body(block_slot_ref, used_ref, *refs, body):
    """The matmul body on the blocks that hold rows; nothing on those past them."""
    del block_slot_ref
    k_steps = (pl.program_id(2), pl.num_programs(2) - 1)

    @pl.when(pl.program_id(1) < used_ref[0])
    def _compute():
        body(*refs, k_steps=k_steps)


@functools.partial(jax.jit, static_argnames=("mode", "group_size", "block_m", "block_n", "block_k", "interpret"))
def grouped_quantized_matmul(
    x: jax.Array,             # [M, K] f32 or bf16, rows in any order
    group_of_row: jax.Array,  # [M] int: each row's matrix, G for none
    qweight: jax.Array,       # [G, K', N] in `mode`'s layout
    scales: jax.Array,        # [G, N] | [G, Kp / group_size, N]
    offsets: jax.Array | None = None,
    *,
    mode: str,
    group_size: int | None = None,
    block_m: int = 128,
    block_n: int | None = None,  # default: twice the chip's MXU width
    block_k: int = 512,
    interpret=False,
) -> jax.Array:               # [M, N] float32
    Kw = check_grouped_inputs(x, group_of_row, qweight, scales, mode, group_size, offsets)
    block_n = block_n or 2 * mxu_columns()
    if block_n % LANES:
        raise ValueError(f"block_n must be a multiple of {LANES}, got {block_n}")
    if interpret:
        patch_interpret_mode()
    M, K = x.shape
    G, _, N = qweight.shape
    sublanes = 8 * 4 // x.dtype.itemsize
    tm = block_rows(M, G, sublanes, block_m)
    slot, grouping, used, xg = rows_by_matrix(x, group_of_row, G, tm, Kw)  # xg [blocks * tm, Kw]

    planes = 2 if mode in PACKED_MODES else 1
    bn = N if N <= block_n else block_n
    bk = _reduction_block(Kw, block_k, planes * LANES)
    nk = Kw // bk
    grid = (pl.cdiv(N, bn), grouping.num_blocks, nk)

    def live(i, k, used):  # past the used blocks: the last used block's last step again (nothing to fetch)
        on = i < used[0]
        return jnp.where(on, i, jnp.maximum(used[0] - 1, 0)), jnp.where(on, k, nk - 1)

    def matrix(i, slots, used):
        return jnp.maximum(slots[live(i, 0, used)[0]] - 1, 0)

    if group_size is not None:
        xs = [xg] if planes == 1 else [xg[:, 0::2], xg[:, 1::2]]     # int4 / mxfp4: x's columns k = 2i, then 2i + 1
        per_group = [_vector_dtype(a).reshape(G, nk, bk // group_size, N) for a in (scales, offsets) if a is not None]
        operands = (*xs, qweight, *per_group)
        in_specs = [pl.BlockSpec((tm, bk // planes), lambda j, i, k, s, u: live(i, k, u)) for _ in xs] + [
            pl.BlockSpec((None, bk // planes, bn), lambda j, i, k, s, u: (matrix(i, s, u), live(i, k, u)[1], j)),
        ] + [pl.BlockSpec((None, None, bk // group_size, bn), lambda j, i, k, s, u: (matrix(i, s, u), live(i, k, u)[1], 0, j))
             ] * len(per_group)
        body = functools.partial(_grouped_kernel, planes=planes, has_offsets=offsets is not None, fp4=mode == "mxfp4",
                                 fp8=mode == "fp8")
    else:
        operands = (xg, qweight, scales.astype(jnp.float32).reshape(G, 1, N))
        in_specs = [
            pl.BlockSpec((tm, bk), lambda j, i, k, s, u: live(i, k, u)),
            pl.BlockSpec((None, bk, bn), lambda j, i, k, s, u: (matrix(i, s, u), live(i, k, u)[1], j)),
            pl.BlockSpec((None, 1, bn), lambda j, i, k, s, u: (matrix(i, s, u), 0, j)),
        ]
        body = _per_column_kernel

    rows = grouping.num_blocks * tm
    weight_bytes = sum(a.size * a.dtype.itemsize for a in (qweight, scales, offsets) if a is not None)  # every matrix once
    y = pl.pallas_call(
        functools.partial(_live_body, body=body),
        out_shape=jax.ShapeDtypeStruct((rows, N), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, bn), lambda j, i, k, s, u: (live(i, k, u)[0], j)),
            scratch_shapes=[pltpu.VMEM((tm, bn), jnp.float32)],
        ),
        compiler_params=compiler_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        cost_estimate=cost.matmul(rows, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=4, weight_bytes=weight_bytes),
        name="grouped_quantized_matmul",
    )(grouping.block_slot, used, *operands)
    return row_groups.scatter_back(y, slot, grouping)

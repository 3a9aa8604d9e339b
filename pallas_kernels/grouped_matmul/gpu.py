"""Grouped quantized matmul as a Pallas GPU kernel (Triton lowering): each block of rows reads one
matrix of the stack, dequantized tile by tile in registers.

Same arguments and result as `reference.grouped_quantized_matmul`:

    y [M, N] float32,  y[r] = x[r] @ dequantize(stack[group_of_row[r]])   (0 for group_of_row[r] = G)

The rows are laid out in blocks of 16 rows of one group (`pallas_kernels.row_groups`, slot =
group + 1), gathered in XLA. Grid (blocks, cdiv(N, bn)); program (i, j) reads its block's group
from `block_slot` (a plain int32 input) and, if the block holds rows (i < used), runs
`quantized_matmul.gpu`'s body on matrix `group` of the stacks (masked tile loads with the stack
index in front; every mode, the mxfp4 exponent bytes decoded as they are loaded). Blocks past the
used ones return at once; their rows are never read back.

16 rows is the smallest tile a tensor-core dot takes: a decode step's few rows per expert waste
little. A long prefill reads each weight tile once per 16 rows; larger blocks for many rows per
expert are the first thing to measure on a GPU (none here).

Verified on the CPU in interpret mode and compiled for an H100 by the CUDA plugin
(`tests/test_aot.py`); not run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import cost, row_groups
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.grouped_matmul.reference import check_grouped_inputs, rows_by_matrix
from pallas_kernels.quantized_matmul.gpu import _grouped_kernel, _is_power_of_two, _per_column_kernel
from pallas_kernels.quantized_matmul.reference import PACKED_MODES

BLOCK = 16  # rows per block: the smallest tensor-core dot tile


def _live_body(block_slot_ref, used_ref, *refs, body):
    """The body on matrix block_slot[i] - 1 for the blocks that hold rows."""
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < used_ref[0])
    def _compute():
        body(*refs, expert=block_slot_ref[i] - 1, program=(i, j))


@functools.partial(jax.jit, static_argnames=("mode", "group_size", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def grouped_quantized_matmul(
    x: jax.Array,             # [M, K] f32 or bf16, rows in any order
    group_of_row: jax.Array,  # [M] int: each row's matrix, G for none
    qweight: jax.Array,       # [G, K', N] in `mode`'s layout
    scales: jax.Array,        # [G, N] | [G, Kp / group_size, N]
    offsets: jax.Array | None = None,
    *,
    mode: str,
    group_size: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,  # None: 128 (grouped: at least group_size)
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:               # [M, N] float32
    Kw = check_grouped_inputs(x, group_of_row, qweight, scales, mode, group_size, offsets)
    bk = block_k or max(128, group_size or 0)
    for name, b in (("block_n", block_n), ("block_k", bk)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    if group_size is not None and bk % group_size:
        raise ValueError(f"block_k must be a multiple of group_size = {group_size}, got {bk}")
    if interpret:
        patch_interpret_mode()
    M, K = x.shape
    G, _, N = qweight.shape
    slot, grouping, used, xg = rows_by_matrix(x, group_of_row, G, BLOCK, Kw)  # xg [blocks * BLOCK, Kw]

    if group_size is not None:
        planes = 2 if mode in PACKED_MODES else 1
        xs = [xg] if planes == 1 else [xg[:, 0::2], xg[:, 1::2]]     # int4 / mxfp4: x's columns k = 2i, then 2i + 1
        operands = (*xs, qweight, *(a for a in (scales, offsets) if a is not None))
        body = functools.partial(_grouped_kernel, planes=planes, has_offsets=offsets is not None, bm=BLOCK, bn=block_n,
                                 bk=bk, group_size=group_size, fp4=mode == "mxfp4",
                                 fp8=mode == "fp8")
    else:
        operands = (xg, qweight, scales.astype(jnp.float32))
        body = functools.partial(_per_column_kernel, bm=BLOCK, bn=block_n, bk=bk)

    rows = grouping.num_blocks * BLOCK
    weight_bytes = sum(a.size * a.dtype.itemsize for a in (qweight, scales, offsets) if a is not None)
    y = pl.pallas_call(
        functools.partial(_live_body, body=body),
        out_shape=jax.ShapeDtypeStruct((rows, N), jnp.float32),
        grid=(grouping.num_blocks, pl.cdiv(N, block_n)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.matmul(rows, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=4, weight_bytes=weight_bytes),
        name="grouped_quantized_matmul",
    )(grouping.block_slot, used, *operands)
    return row_groups.scatter_back(y, slot, grouping)

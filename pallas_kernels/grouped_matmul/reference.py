"""Grouped matmul against a stack of quantized matrices, in plain jnp: the truth the kernels are held to.

    y [M, N] (float32) :  y[r] = x[r] @ dequantize(qweight[g], scales[g], offsets[g])   g = group_of_row[r]
                          y[r] = 0                                                       g = G ("no group")

qweight [G, K', N] stacks G matrices in one of `pallas_kernels.quantized_matmul`'s layouts (int8,
int4, fp8, mxfp4; per column or per group of K), scales [G, N] or [G, K / g, N]. This is a mixture
of experts' layer: row r is a (token, expert) pair, group_of_row[r] its expert, the stack all the
experts' gate/up or down matrices (GPT-OSS ships them in mxfp4). The rows come in any order; the
value G marks an empty row (the padding of an expert-parallel buffer), whose output is 0.

Here the rows are sorted by group, the stack dequantized to float32 and multiplied with
`jax.lax.ragged_dot` at float32 precision, and the result put back in row order. The product is
float32 (the caller activates or sums it in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import row_groups
from pallas_kernels.quantized_matmul.reference import check_layout, check_mode, dequantize, stored_rows


def check_grouped_inputs(x: jax.Array, group_of_row: jax.Array, qweight: jax.Array, scales: jax.Array, mode: str,
                         group_size: int | None, offsets: jax.Array | None = None) -> int:
    """ValueError naming the argument at fault unless x [M, K], group_of_row [M] and the stack
    [G, K', N] fit; returns the stack's stored K (padded to whole groups)."""
    check_mode(mode, group_size)
    if x.ndim != 2 or qweight.ndim != 3:
        raise ValueError(f"x must be [M, K] and qweight a stack [G, K', N], got {x.shape} and {qweight.shape}")
    if group_of_row.shape != x.shape[:1] or not jnp.issubdtype(group_of_row.dtype, jnp.integer):
        raise ValueError(f"group_of_row must be integers [M] = [{x.shape[0]}], got {group_of_row.dtype} {group_of_row.shape}")
    check_layout(qweight, scales, mode, group_size, offsets)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    K, Kw = x.shape[1], stored_rows(qweight, mode)
    if K != Kw and not (group_size is not None and Kw - group_size < K < Kw):
        raise ValueError(f"x has K = {K} but the stacked matrices have K = {Kw}")
    return Kw


def rows_by_matrix(x: jax.Array, group_of_row: jax.Array, num_matrices: int, block: int, Kw: int):
    """The kernels' layout: x's rows in blocks of `block` rows of one matrix each
    (`pallas_kernels.row_groups`, slot = group + 1; a row of no group gets no row), K padded with
    zero columns to Kw. -> (slot [M], grouping, used blocks [1], grouped x [blocks * block, Kw])."""
    slot = jnp.where((group_of_row >= 0) & (group_of_row < num_matrices), group_of_row + 1, 0).astype(jnp.int32)
    grouping = row_groups.group_by_slot(slot, num_matrices + 1, block)
    xg = row_groups.gather_rows(jnp.pad(x, ((0, 0), (0, Kw - x.shape[1]))), grouping)
    return slot, grouping, row_groups.used_blocks(grouping), xg


@functools.partial(jax.jit, static_argnames=("mode", "group_size"))
def grouped_quantized_matmul(x: jax.Array, group_of_row: jax.Array, qweight: jax.Array, scales: jax.Array,
                             offsets: jax.Array | None = None, *, mode: str, group_size: int | None = None) -> jax.Array:
    """See the module docstring. -> float32 [M, N]."""
    check_grouped_inputs(x, group_of_row, qweight, scales, mode, group_size, offsets)
    G = qweight.shape[0]
    w = dequantize(qweight, scales, offsets, mode=mode, group_size=group_size)[:, : x.shape[1]]  # [G, K, N] f32
    group_of_row = group_of_row.astype(jnp.int32)
    order = jnp.argsort(group_of_row, stable=True)                            # rows by group; empty rows last
    sizes = jnp.sum(jax.nn.one_hot(group_of_row, G, dtype=jnp.int32), axis=0)  # [G]; empty rows count nowhere
    y = jax.lax.ragged_dot(x[order].astype(jnp.float32), w, sizes, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)                 # [M, N]; rows past the groups 0
    return jnp.zeros_like(y).at[order].set(y)

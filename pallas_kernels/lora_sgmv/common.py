"""What the TPU and GPU SGMV kernels share (and `xla.grouped_blocks`, their algorithm in jnp): the
tokens laid out in blocks of one adapter slot each (`pallas_kernels.row_groups`), the dot they
accumulate with, and their cost estimate.

A step's tokens come in sequence order, each with its sequence's slot (0: no adapter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import cost
from pallas_kernels.row_groups import Grouping, gather_rows, group_by_slot, num_blocks, scatter_back  # noqa: F401


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at full f32 precision (HIGHEST)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def cost_estimate(rows: int, K: int, N: int, *, matrices_read: int, itemsize: int, out_itemsize: int) -> pl.CostEstimate:
    """[rows, K] grouped rows times one [K, N] matrix per block, read `matrices_read` times in all
    (an upper bound where the number of blocks in use is only known at run time)."""
    return cost.matmul(rows, K, N, x_itemsize=itemsize, weight_bytes=matrices_read * K * N * itemsize,
                       out_itemsize=out_itemsize)

"""What the TPU and GPU SwiGLU matmul kernels share: the dot they accumulate gate and up with, and
their cost estimate.

Each backend keeps its own tiling: the TPU kernel's K grid axis with VMEM accumulators and
BlockSpec windows on the one weight array, the GPU kernel's K loop over masked tiles in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import cost


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] with f32 accumulation; f32 inputs at full f32 precision (HIGHEST: not one
    bf16 pass on the MXU, not TF32 on tensor cores)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def cost_estimate(M: int, K: int, N: int, *, w_dtype, out_dtype) -> pl.CostEstimate:
    """`cost.swiglu_matmul` of x [M, K] (cast to the weight's dtype) against w_gate_up [K, 2N]."""
    w_itemsize = jnp.dtype(w_dtype).itemsize
    return cost.swiglu_matmul(M, K, N, x_itemsize=w_itemsize, w_itemsize=w_itemsize,
                              out_itemsize=jnp.dtype(out_dtype).itemsize)

"""What the TPU and GPU residual add + RMSNorm kernels share: the norm of a block of rows, and the
`pallas_call` around the two kernel bodies (with and without a residual), its outputs and cost.

Each backend keeps what differs: how a block is loaded and stored (plain refs on the TPU, masked
power-of-two tiles on the GPU), its block shapes, grid and compiler parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import cost


def normalize(s, weight, *, hidden: int, eps: float):
    """s [B, H'] in x's dtype, the real rows' sums, zero past column `hidden` when H' > hidden;
    weight [H'] or [1, H'] -> normed [B, H'] in s's dtype. The math of `layers.rms_norm`: float32 from the
    rounded sum, mean of squares over the `hidden` real columns, weight multiplied in float32."""
    sf = s.astype(jnp.float32)
    mean_square = jnp.sum(sf * sf, axis=-1, keepdims=True) / hidden  # [B, 1]; padding adds 0
    sf = sf * jax.lax.rsqrt(mean_square + eps)  # [B, H'] unit RMS
    return (weight.astype(jnp.float32) * sf).astype(s.dtype)


def call(
    x: jax.Array,  # [T, H]
    residual: jax.Array | None,  # [T, H], x's dtype
    weight: jax.Array,  # the weight as the kernels take it ([H] or [1, H])
    *,
    norm_kernel: Callable,  # (x_ref, weight_ref, normed_ref)
    add_norm_kernel: Callable,  # (x_ref, residual_ref, weight_ref, normed_ref, new_residual_ref)
    rows: pl.BlockSpec,  # x, residual and both outputs
    whole_weight: pl.BlockSpec,
    pallas_call: Callable,  # pl.pallas_call with the backend's grid, compiler_params and interpret bound
) -> tuple[jax.Array, jax.Array]:  # normed [T, H], new_residual [T, H], both x's dtype
    """Run `add_norm_kernel`, or `norm_kernel` without a residual (x is then the new residual: no copy
    is written)."""
    T, H = x.shape
    out_struct = jax.ShapeDtypeStruct((T, H), x.dtype)  # each output: [T, H] in x's dtype
    if residual is None:
        normed = pallas_call(
            norm_kernel,
            out_shape=out_struct,
            in_specs=[rows, whole_weight],
            out_specs=rows,
            cost_estimate=cost.rms_norm(T, H, itemsize=x.dtype.itemsize, with_residual=False),
            name="rms_norm",
        )(x, weight)
        return normed, x
    normed, new_residual = pallas_call(
        add_norm_kernel,
        out_shape=(out_struct, out_struct),
        in_specs=[rows, rows, whole_weight],
        out_specs=(rows, rows),
        cost_estimate=cost.rms_norm(T, H, itemsize=x.dtype.itemsize, with_residual=True),
        name="add_rms_norm",
    )(x, residual, weight)
    return normed, new_residual

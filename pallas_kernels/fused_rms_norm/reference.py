"""Residual add + RMSNorm in plain jnp: the truth the kernels match.

    add_rms_norm(x [T, H], residual [T, H] or None, weight [H], *, eps) -> (normed [T, H], new_residual [T, H])

    new_residual = x + residual          in x's dtype (just x when residual is None)
    normed       = rms_norm(new_residual)

This is the step a pre-norm decoder runs between sublayers (vLLM calls it fused_add_rms_norm):
add the sublayer output to the residual stream, then normalise the sum for the next sublayer.
The norm follows Hugging Face's order of operations, exactly as `jaxinfer.models.layers.rms_norm`:
cast the (already rounded) sum to float32, multiply by rsqrt(mean(s^2) + eps), multiply by the
weight in float32, and only then cast to x's dtype. Both outputs have x's dtype.

A fused kernel reads x and residual once and writes both outputs in one pass over HBM, instead of
writing the sum and reading it back for the norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def check_inputs(x, residual, weight) -> None:
    """ValueError for shapes or dtypes the operation does not define."""
    if x.ndim != 2:
        raise ValueError(f"expected x [T, H]; got shape {x.shape}")
    if weight.shape != x.shape[1:]:
        raise ValueError(f"weight must be [H] = {x.shape[1:]}; got {weight.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x: x {x.shape} {x.dtype}, residual {residual.shape} {residual.dtype}"
        )


@functools.partial(jax.jit, static_argnames=("eps",))
def add_rms_norm(
    x: jax.Array,  # [T, H]
    residual: jax.Array | None,  # [T, H], x's dtype
    weight: jax.Array,  # [H]
    *,
    eps: float,
) -> tuple[jax.Array, jax.Array]:  # normed [T, H], new_residual [T, H], both x's dtype
    check_inputs(x, residual, weight)
    new_residual = x if residual is None else x + residual  # [T, H], rounded to x's dtype
    s = new_residual.astype(jnp.float32)
    s = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)  # [T, H] unit RMS
    normed = (weight.astype(jnp.float32) * s).astype(x.dtype)
    return normed, new_residual

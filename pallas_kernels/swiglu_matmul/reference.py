"""SwiGLU matmul in plain jnp: the truth the kernels match.

    swiglu_matmul(x [M, K], w_gate_up [K, 2N]) -> [M, N] in x's dtype

    g   = x @ w_gate_up[:, :N]          (gate: columns 0 .. N-1)
    u   = x @ w_gate_up[:, N:]          (up:   columns N .. 2N-1)
    out = silu(g) * u

This is the first half of a gated MLP (Llama, SmolLM2, Qwen): one matmul against the
concatenated [gate | up] weight followed by the SwiGLU activation. The matmul follows
`jaxinfer.models.layers.matmul`: x is cast to the weight's dtype and the product accumulated in
float32. silu and the product are computed in float32 on the accumulators, and only the result is
cast to x's dtype. (The unfused model path, `swiglu(linear(...))`, first rounds g and u to x's
dtype; for bf16 the two differ by about one bf16 rounding of g and u.)

A fused kernel keeps g and u in its accumulators and writes only [M, N], so the [M, 2N]
projection never reaches memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(x: jax.Array, w_gate_up: jax.Array) -> int:
    """ValueError naming the argument at fault unless x [M, K] and w_gate_up [K, 2N] fit; returns N."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K]; got shape {x.shape}")
    if w_gate_up.ndim != 2:
        raise ValueError(f"w_gate_up must be [K, 2N]; got shape {w_gate_up.shape}")
    if x.shape[1] != w_gate_up.shape[0]:
        raise ValueError(f"x has K = {x.shape[1]} but w_gate_up has K = {w_gate_up.shape[0]}")
    if w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must have an even number of columns ([gate | up]); got {w_gate_up.shape[1]}")
    return w_gate_up.shape[1] // 2


@jax.jit
def swiglu_matmul(
    x: jax.Array,  # [M, K]
    w_gate_up: jax.Array,  # [K, 2N] = [gate | up]
) -> jax.Array:  # [M, N] in x's dtype
    N = check_inputs(x, w_gate_up)
    # HIGHEST: full f32 products for f32 weights on every backend (the CPU default already is).
    y = jnp.dot(
        x.astype(w_gate_up.dtype), w_gate_up, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )  # [M, 2N] f32
    gate, up = y[:, :N], y[:, N:]  # [M, N] each
    return (jax.nn.silu(gate) * up).astype(x.dtype)

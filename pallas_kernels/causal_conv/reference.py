"""The causal depthwise convolution of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over one
sequence's chunk, in plain jnp: the truth the kernels are checked against, and the kernel table's
XLA path.

Each channel c has its own K taps (K = 4 in Qwen's layers); a token's output reads its own input
and the K - 1 before it, reaching into `before` (the sequence's inputs saved by its last step, or
zeros for a fresh sequence) for the chunk's first K - 1 tokens:

    x_ext    = concat(before, x)                                  [K - 1 + T, C]
    out[t]   = sum_j weight[j] * x_ext[t + j]     (float32, then x's dtype; before the activation)
    last     = x_ext[valid_len : valid_len + K - 1]                [K - 1, C]

`last` is the K - 1 inputs ending at the chunk's length (rows from valid_len on are padding: the
ragged step gathers each chunk into the step's T rows), what the sequence's next step reads as its
`before`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def causal_conv(x: jax.Array, before: jax.Array, weight: jax.Array, valid_len=None):
    """x [T, C] (one chunk's inputs), before [K - 1, C], weight [K, C], valid_len (an int or a
    traced int32 scalar; None: T) -> (out [T, C] in x's dtype, last [K - 1, C] in x's dtype)."""
    T = x.shape[0]
    K = weight.shape[0]
    ext = jnp.concatenate([before.astype(x.dtype), x])  # [K - 1 + T, C]
    out = sum(ext[j : j + T].astype(jnp.float32) * weight[j].astype(jnp.float32) for j in range(K))
    end = T if valid_len is None else jnp.clip(jnp.asarray(valid_len, jnp.int32), 0, T)
    last = jax.lax.dynamic_slice_in_dim(ext, end, K - 1)  # the K - 1 inputs before position valid_len
    return out.astype(x.dtype), last


def cost(T: int, C: int, K: int, itemsize: int) -> pl.CostEstimate:
    """What either kernel does for one chunk: K multiply-adds per output, x read and out written
    once, the taps, `before` and `last` once."""
    return pl.CostEstimate(flops=2 * K * T * C, transcendentals=0,
                           bytes_accessed=itemsize * (2 * T * C + 2 * (K - 1) * C) + 4 * K * C)

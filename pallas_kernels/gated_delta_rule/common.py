"""What the TPU and GPU kernels share: one chunk of the gated delta rule for one value head, in
float32 matmuls (`chunk_step`), its cost, and the gates' layout the wrappers prepare.

The math is `reference.chunked`'s for one chunk c of C tokens and one head (G_i: the sum of g over
the chunk's positions up to i, so G_last is the whole chunk's log decay):

    decay  = exp(G_i - G_j) for j <= i, else 0                                [C, C]
    A      = (beta_i k_i . k_j) decay_ij for j < i, else 0                    [C, C]
    (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(C/2))  (A is nilpotent: matmuls, no solve)
    u      = (I + A)^-1 (beta v)            w = (I + A)^-1 (beta exp(G) k)   [C, Dv], [C, Dk]
    new_v  = u - w S                                                          [C, Dv]
    out    = (exp(G) q) S + ((q . k) decay) new_v                             [C, Dv]
    S      = exp(G_last) S + (exp(G_last - G) k)^T new_v                       [Dk, Dv]

Only the last three lines read the state: the chunk's own matrices are recomputed by each program
(a head's chunks run in order, the heads in parallel), nothing but q, k, v, the gates and the
outputs goes through HBM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

HIGHEST = jax.lax.Precision.HIGHEST  # float32 products on both chips (Mosaic's fp32, Triton's "ieee": not TF32)


def dot(a, b):
    """a [M, K] @ b [K, N] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """a [M, K] @ b[N, K]^T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a[K, M]^T @ b [K, N]."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def unit_lower_inverse(a, eye):
    """(I + a)^-1 for strictly lower-triangular a [C, C] (C a power of two), as
    `reference.unit_lower_inverse`: 2 log2(C) - 2 matmuls (10 at C = 64)."""
    factors = max(0, a.shape[-1].bit_length() - 2)  # (I + a^2), (I + a^4), ..., (I + a^(C/2))
    inverse, power = eye - a, dot(a, a)
    for i in range(factors):
        inverse = dot(inverse, eye + power)
        if i + 1 < factors:
            power = dot(power, power)
    return inverse


def chunk_step(q, k, v, G_col, G_row, G_last, beta_col, state):
    """One chunk of one head (the module docstring): q, k [C, Dk], v [C, Dv], G_col [C, 1] and
    G_row [1, C] (the chunk's cumulative log decay, as a column and a row), G_last [1, 1],
    beta_col [C, 1], state [Dk, Dv], all float32 -> (out [C, Dv], the state after the chunk)."""
    C = q.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    causal = row >= col
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, G_col - G_row, 0.0)), 0.0)  # [C, C]; 0 above the diagonal
    k_beta = k * beta_col  # [C, Dk]
    system = jnp.where(row > col, dot_nt(k_beta, k) * decay, 0.0)  # A [C, C]
    inverse = unit_lower_inverse(system, jnp.where(row == col, 1.0, 0.0).astype(jnp.float32))
    u = dot(inverse, v * beta_col)  # [C, Dv]
    w = dot(inverse, k_beta * jnp.exp(G_col))  # [C, Dk]
    new_v = u - dot(w, state)  # [C, Dv]
    out = dot(q * jnp.exp(G_col), state) + dot(dot_nt(q, k) * decay, new_v)  # [C, Dv]
    state = state * jnp.exp(G_last) + dot_tn(k * jnp.exp(G_last - G_col), new_v)  # [Dk, Dv]
    return out, state


def chunk_gates(g, beta, chunk_size: int):
    """g, beta [T, H] (T a multiple of chunk_size) -> (G [T, H]: g summed within each chunk up to
    each position, beta [T, H]), float32: the gates as both kernels read them."""
    T, H = g.shape
    G = jnp.cumsum(g.astype(jnp.float32).reshape(T // chunk_size, chunk_size, H), axis=1).reshape(T, H)
    return G, beta.astype(jnp.float32)


def pad_tokens(chunk_size: int, *arrays):
    """Each array [T, ...] padded with zero rows to a multiple of chunk_size: tokens that change
    nothing (g = 0: no decay, beta = 0: no write, k = 0)."""
    pad = -arrays[0].shape[0] % chunk_size
    return tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a for a in arrays)


def cost(T: int, H: int, Dk: int, Dv: int, chunk_size: int, programs_per_head: int = 1) -> pl.CostEstimate:
    """The kernel's work for T tokens (a multiple of the chunk) and H heads: per chunk and head the
    matrices of `chunk_step` (recomputed by each of a head's `programs_per_head` programs), float32
    q, k, v, gates and outputs read / written once, the state read and written once per head."""
    C, n = chunk_size, T // chunk_size
    factors = max(0, C.bit_length() - 2)
    own = 2 * C * C * Dk * 2 + 2 * C**3 * (2 * factors) + 2 * C * C * Dk  # k k^T, q k^T, the inverse, w
    per_value = 2 * C * C * Dv * 2 + 2 * C * Dk * Dv * 3  # u, intra new_v; w S, q S, the state update
    return pl.CostEstimate(
        flops=n * H * (own * programs_per_head + per_value), transcendentals=n * H * (C * C + 3 * C),
        bytes_accessed=4 * (T * H * (2 * Dk + 2 * Dv + 2) + 2 * H * Dk * Dv),
    )

"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) in plain jnp: the sequential truth,
the chunked form for prefill and the one-token step for decode.

One sequence's linear attention, per value head h, with a state S [Dk, Dv] carried across tokens:

    S     = exp(g_t) * S                       # decay (g_t <= 0, log space)
    S     = S + k_t (beta_t (v_t - S^T k_t))^T   # the delta rule: write what S mispredicts, at rate beta
    out_t = S^T q_t

q and k are L2-normalised per head and q scaled by Dk ** -0.5 (`prepare_qk`, as transformers
does inside its kernels); with fewer key heads than value heads each key head serves
Hv / Hk consecutive value heads. Everything is float32.

Shapes: q, k [T, Hv, Dk] (already repeated to the value heads), v [T, Hv, Dv], g and beta [T, Hv],
state [Hv, Dk, Dv].

- `recurrent`: a `lax.scan` over the tokens (the truth, and what decode runs one token at a time:
  `step`, vectorised over sequences);
- `chunked`: the same in chunks of C tokens: within a chunk the updates are folded into matmuls
  with the UT transform (a unit lower-triangular solve), then one state update per chunk; T / C
  sequential steps instead of T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (transformers' and FLA's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: jax.Array, k: jax.Array, num_value_heads: int) -> tuple[jax.Array, jax.Array]:
    """q, k [..., Hk, Dk] -> L2-normalised, q scaled by Dk ** -0.5, each head repeated for its
    Hv / Hk value heads: [..., Hv, Dk] float32 each."""
    repeat = num_value_heads // q.shape[-2]
    q, k = (jnp.repeat(l2_normalize(x), repeat, axis=-2) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def update(k, v, g, beta, state):
    """The state after one token: k [..., Hv, Dk], v [..., Hv, Dv], g and beta [..., Hv], state
    [..., Hv, Dk, Dv] (g = beta = 0: unchanged), float32."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("...hkv,...hk->...hv", state, k)
    delta = (v - predicted) * beta[..., None]
    return state + k[..., :, None] * delta[..., None, :]


def step(q, k, v, g, beta, state):
    """One token per sequence: q, k [N, Hv, Dk], v [N, Hv, Dv], g and beta [N, Hv], state
    [N, Hv, Dk, Dv] -> (out [N, Hv, Dv], the new state), float32."""
    state = update(k, v, g, beta, state)
    return jnp.einsum("nhkv,nhk->nhv", state, q), state


def recurrent(q, k, v, g, beta, state):
    """One sequence, token by token: (out [T, Hv, Dv], the final state [Hv, Dk, Dv])."""
    def one(state, x):
        out, state = step(*(a[None] for a in x), state[None])
        return state[0], out[0]

    args = tuple(a.astype(jnp.float32) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(one, state.astype(jnp.float32), args)
    return out, state


def chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """One sequence in chunks of chunk_size tokens (T padded to a multiple with tokens that change
    nothing: g = 0, beta = 0): (out [T, Hv, Dv], the final state [Hv, Dk, Dv]).

    Within chunk c (positions i, j; G_i = sum of g up to i in the chunk):
        A      = strictly_lower(beta_i k_i . k_j exp(G_i - G_j))            UT system
        U      = (I + A)^-1 (beta v)          W = (I + A)^-1 (beta k exp(G))   (the inverse by matmuls:
                                                                              `unit_lower_inverse`)
        new_v  = U - W S                      the values the chunk writes, less what S predicts
        out    = (q exp(G)) S + tril(q_i . k_j exp(G_i - G_j)) new_v
        S      = exp(G_last) S + (k exp(G_last - G))^T new_v
    """
    T, H, Dk = k.shape
    pad = -T % chunk_size
    f32 = lambda a: jnp.pad(a.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    q, k, v, g, beta = (f32(a) for a in (q, k, v, g, beta))
    n = (T + pad) // chunk_size
    # [chunks, H, C, ...]: heads before positions, as the matmuls want them
    heads_first = lambda a: a.reshape(n, chunk_size, H, *a.shape[2:]).swapaxes(1, 2)  # noqa: E731
    q, k, v, g, beta = (heads_first(a) for a in (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)  # [n, H, C]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    decay = jnp.exp(jnp.where(causal, G[..., :, None] - G[..., None, :], -jnp.inf))  # [n, H, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = jnp.where(causal & ~jnp.eye(chunk_size, dtype=bool), k_beta @ k.swapaxes(-1, -2) * decay, 0.0)
    inverse = unit_lower_inverse(system)  # (I + A)^-1
    u, w = inverse @ v_beta, inverse @ (k_beta * jnp.exp(G)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay  # [n, H, C, C]
    q_decayed = q * jnp.exp(G)[..., None]
    k_to_end = k * jnp.exp(G[..., -1:] - G)[..., None]
    chunk_decay = jnp.exp(G[..., -1])[..., None, None]  # [n, H, 1, 1]

    def one_chunk(state, x):
        u, w, intra, q_decayed, k_to_end, chunk_decay = x
        new_v = u - w @ state  # [H, C, Dv]
        out = q_decayed @ state + intra @ new_v
        return state * chunk_decay + k_to_end.swapaxes(-1, -2) @ new_v, out

    state, out = jax.lax.scan(one_chunk, state.astype(jnp.float32), (u, w, intra, q_decayed, k_to_end, chunk_decay))
    out = out.swapaxes(1, 2).reshape(n * chunk_size, H, -1)[:T]
    return out, state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C a power of two), by matmuls only:
    a is nilpotent (a^C = 0), so (I + a)^-1 = sum_j (-a)^j = (I - a)(I + a^2)(I + a^4)...(I + a^(C/2))."""
    C = a.shape[-1]
    eye = jnp.eye(C, dtype=a.dtype)
    inverse, power = eye - a, a @ a
    for _ in range(max(0, C.bit_length() - 2)):  # the factors (I + a^2), (I + a^4), ..., (I + a^(C/2))
        inverse = inverse @ (eye + power)
        power = power @ power
    return inverse


def decay_and_rate(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-token, per-value-head gates from their projections a, b [..., Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0) and beta = sigmoid(b), float32."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))

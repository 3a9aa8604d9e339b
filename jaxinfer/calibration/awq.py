"""AWQ (Lin et al., 2023): protect the input channels that carry large activations by scaling them
up in the weight before rounding, and dividing them back out of the operation that feeds it.

For y = x @ W, scaling input channel k by s_k in W (rows multiplied) and by 1 / s_k in x leaves y
unchanged in exact arithmetic, but the rounding error of the scaled rows shrinks relative to
their values. The scales are searched per layer input: s = mean|x|^a / mean(|W| / group max)^(1-a)
for a on a grid in [0, 1), normalized to a geometric mean of one, keeping the a whose
round-to-nearest weight gives the smallest output error on the calibration inputs. Then
1 / s folds into the feeder: the RMSNorm weight in front of qkv_proj and gate_up_proj, the up
projection's output columns in front of down_proj, and (with as many KV heads as query heads) the
v projection's output columns in front of o_proj. Each group's range is then searched too
(`clip`): shrinking it to a fraction of max |w| may lower the output error, as in AWQ's auto-clip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.grid import ZeroPointGrid, group_params, pad_rows, quantize_rows

GRID = 20  # exponents a = 0, 1/20, ..., 19/20
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
MAX_TOKENS = 512  # calibration rows the error searches read (a sample of them beyond that)


def _fake_quantize(w, *, bits: int, group_size: int, symmetric: bool, clip=None):
    """w [K, N] rounded to its grid and back (float32); clip [G, N]: the fraction of each group's range kept."""
    K, N = w.shape
    wg = pad_rows(w, group_size).reshape(-1, group_size, N)
    if clip is not None:
        hi = jnp.max(jnp.abs(wg), axis=1, keepdims=True) * clip[:, None, :]
        wg = jnp.clip(wg, -hi, hi)
    scale, zero = group_params(wg, bits, symmetric)
    q = quantize_rows(wg, scale[:, None, :], zero[:, None, :], bits)
    return ((q - zero[:, None, :]) * scale[:, None, :]).reshape(-1, N)[:K]


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def search_scales(w: jax.Array, x: jax.Array, *, bits: int, group_size: int, symmetric: bool) -> jax.Array:
    """The input-channel scales s [K] for y = x [T, K] @ w [K, N] (see the module docstring)."""
    K, N = w.shape
    x_mean = jnp.mean(jnp.abs(x), axis=0)                                              # [K]
    wg = pad_rows(jnp.abs(w), group_size).reshape(-1, group_size, N)
    w_mean = jnp.mean((wg / (jnp.max(wg, axis=1, keepdims=True) + 1e-6)).reshape(-1, N)[:K], axis=1)  # [K]
    y = x @ w

    def loss(a):
        s = jnp.clip(x_mean ** a / (w_mean ** (1 - a) + 1e-4), 1e-4, None)
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        wq = _fake_quantize(w * s[:, None], bits=bits, group_size=group_size, symmetric=symmetric) / s[:, None]
        return jnp.mean((x @ wq - y) ** 2), s

    losses, scales = jax.lax.map(loss, jnp.arange(GRID, dtype=jnp.float32) / GRID)
    return scales[jnp.argmin(losses)]


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def search_clip(w: jax.Array, x: jax.Array, *, bits: int, group_size: int, symmetric: bool) -> jax.Array:
    """Per group and output column, the fraction of max |w| [G, N] to keep that gives the smallest
    error of that group's share of the output, x_g @ w_g, on the calibration inputs."""
    K, N = w.shape
    G = -(-K // group_size)
    xg = jnp.pad(x, ((0, 0), (0, G * group_size - K))).reshape(x.shape[0], G, group_size)  # [T, G, g]
    wg = pad_rows(w, group_size).reshape(G, group_size, N)
    y = jnp.einsum("tgk,gkn->tgn", xg, wg)

    def err(ratio):
        wq = _fake_quantize(w, bits=bits, group_size=group_size, symmetric=symmetric, clip=jnp.full((G, N), ratio))
        wq = pad_rows(wq, group_size).reshape(G, group_size, N)
        return jnp.mean((jnp.einsum("tgk,gkn->tgn", xg, wq) - y) ** 2, axis=0)           # [G, N]

    errors = jax.lax.map(err, jnp.asarray(CLIP_GRID, jnp.float32))                     # [R, G, N]
    return jnp.asarray(CLIP_GRID, jnp.float32)[jnp.argmin(errors, axis=0)]


def sample_rows(inputs: list[jax.Array], limit: int = MAX_TOKENS, seed: int = 0) -> jax.Array:
    """The calibration rows [T, K] the searches read: all of them, or `limit` of them drawn evenly."""
    x = jnp.concatenate(inputs, axis=0).astype(jnp.float32)
    if x.shape[0] <= limit:
        return x
    return x[np.sort(np.random.default_rng(seed).choice(x.shape[0], limit, replace=False))]


def quantize_clipped(w: np.ndarray, clip: jax.Array, *, bits: int, group_size: int, symmetric: bool) -> ZeroPointGrid:
    """w [K, N] onto its grid with each group's range cut to clip [G, N] of its max |w|."""
    K, N = w.shape
    wg = pad_rows(jnp.asarray(w, jnp.float32), group_size).reshape(-1, group_size, N)
    hi = jnp.max(jnp.abs(wg), axis=1, keepdims=True) * clip[:, None, :]
    wg = jnp.clip(wg, -hi, hi)
    scale, zero = group_params(wg, bits, symmetric)
    q = quantize_rows(wg, scale[:, None, :], zero[:, None, :], bits)
    return ZeroPointGrid(np.asarray(q, np.int64).reshape(-1, N)[:K], np.asarray(zero, np.int64), np.asarray(scale, np.float16),
                         np.arange(K) // group_size, bits, group_size)

"""Integer grids with zero points, the form GPTQ and AWQ quantize into and their checkpoints store.

A weight w [K, N] (jaxinfer's orientation: input rows, output columns) with groups of
`group_size` input rows per column is stored as unsigned integers q [K, N] in [0, 2^bits), and
per group a scale and a zero point: w ~ (q - zero) * scale. Symmetric grids fix the zero point
at 2^(bits-1) (GPTQ's convention), asymmetric ones put the group's min on q = 0 and its max on
q = 2^bits - 1. Scales are rounded to float16 first (the checkpoints store them so), and q is the
nearest level under the scale actually kept. A K that groups do not divide ends in a partial
group: the quantizers pad w with copies of its last row to whole groups (which leaves the last
group's range as it is) and drop the padding from q.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class ZeroPointGrid:
    """q [K, N] unsigned, zeros and scales [G, N] (float16), g_idx [K] (the group of each input
    row: k // group_size, or a permutation's groups under act-order)."""

    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray
    bits: int
    group_size: int

    def dequantize(self) -> np.ndarray:
        """float32 [K, N]. (In float32: q - zero is a small integer, exact, and its product with
        the scale rounds once, as it did in float64 and back; half the memory traffic.)"""
        levels = self.q.astype(np.float32) - self.zeros.astype(np.float32)[self.g_idx]
        return levels * self.scales.astype(np.float32)[self.g_idx]


def group_params(w: jax.Array, bits: int, symmetric: bool) -> tuple[jax.Array, jax.Array]:
    """(scale, zero) [..., N] of the rows w [..., g, N] of one group (scale float16-rounded, in float32)."""
    top = (1 << bits) - 1
    # The range holds 0, so that the zero point is a level (as GPTQ's quantizer does): a group of
    # one sign would otherwise clip its far end.
    lo, hi = jnp.minimum(jnp.min(w, axis=-2), 0.0), jnp.maximum(jnp.max(w, axis=-2), 0.0)
    if symmetric:
        hi = jnp.maximum(-lo, hi)
        lo = -hi
    scale = (hi - lo) / top
    scale = jnp.where(scale > 0, scale, 1.0).astype(jnp.float16).astype(jnp.float32)
    zero = jnp.full_like(scale, 1 << (bits - 1)) if symmetric else jnp.clip(jnp.round(-lo / scale), 0, top)
    return scale, zero


def quantize_rows(w: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """The levels q of rows w [..., N] under (scale, zero) [N]."""
    return jnp.clip(jnp.round(w / scale) + zero, 0, (1 << bits) - 1)


def pad_rows(w: jax.Array, group_size: int) -> jax.Array:
    """w [K, ...] with copies of its last row appended up to whole groups."""
    K = w.shape[0]
    return jnp.pad(w, [(0, -K % group_size)] + [(0, 0)] * (w.ndim - 1), mode="edge")


def round_to_nearest(w: np.ndarray, bits: int, group_size: int, symmetric: bool) -> ZeroPointGrid:
    """w [K, N] onto its grid, each group on its own min and max."""
    K, N = w.shape
    wp = pad_rows(jnp.asarray(w, jnp.float32), group_size)
    wg = wp.reshape(-1, group_size, N)
    scale, zero = group_params(wg, bits, symmetric)                           # [G, N]
    q = quantize_rows(wg, scale[:, None, :], zero[:, None, :], bits)
    return ZeroPointGrid(np.asarray(q, np.int64).reshape(-1, N)[:K], np.asarray(zero, np.int64), np.asarray(scale, np.float16),
                         np.arange(K) // group_size, bits, group_size)

"""The combined KV page layout the TPU kernels read and write: K and V of every head in one row.

    kv_pages  [P, page_size, Hkv * 2 * Ds]     one token's row: K_0 V_0 K_1 V_1 ... (Ds lanes each)

Why (measured with libtpu, `tests/test_kv_layout.py`): a TPU tiles the last two dimensions of an
array ((8, 128) 32-bit words; bf16 packs 2 rows per word, 8-bit data 4). Separate pools
[P, page_size, Hkv, D] pay for those tiles: head_dim 64 fills half of every 128-lane row (2x the
bytes), and one or two KV heads per chip leave the sublanes of a tile half empty unless the
compiler moves the page axis into the tile, which the kernels cannot read. A combined row is
2 * Hkv * Ds lanes, a whole number of 128-lane rows for every head_dim that is 64 or a multiple
of 128 and any head count, and `page_size` tokens are its sublanes: the pool is stored with no
padding at all, and the bytes per token are exactly the model's K/V bytes (per chip: each
tensor-parallel shard holds a contiguous run of whole heads of the row).

Ds (`combined_head_dim`) is head_dim itself for 64 and multiples of 128; other head dims are
stored in 64 (below 64) or a multiple of 128 lanes, the extra lanes zero.

Reading a head: K_h is lanes [2 Ds h, 2 Ds h + Ds), V_h the next Ds. With Ds = 64 a head's K and V
share one 128-lane row; the kernel then multiplies the whole row (`lane_width`: 128 lanes) with q
padded by zeros (the V lanes add 0 to every score) and keeps the V half of p @ row: no slice ever
cuts a 128-lane row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128


def combined_head_dim(head_dim: int) -> int:
    """Lanes each of K_h and V_h takes in a combined row: 64 or a multiple of 128."""
    if head_dim <= 64:
        return 64
    return -(-head_dim // LANES) * LANES


def lane_width(stored_head_dim: int) -> int:
    """Lanes the kernel multiplies per head for K (and for V): Ds, or the whole 128-lane row
    holding both when Ds = 64."""
    return max(stored_head_dim, LANES)


def row_width(num_kv_heads: int, head_dim: int) -> int:
    return num_kv_heads * 2 * combined_head_dim(head_dim)


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v [..., Hkv, D] -> rows [..., Hkv * 2 * Ds] (zero lanes from D to Ds)."""
    D = k.shape[-1]
    Ds = combined_head_dim(D)
    pad = [(0, 0)] * (k.ndim - 1) + [(0, Ds - D)]
    pair = jnp.stack([jnp.pad(k, pad), jnp.pad(v.astype(k.dtype), pad)], axis=-2)  # [..., Hkv, 2, Ds]
    return pair.reshape(k.shape[:-2] + (k.shape[-2] * 2 * Ds,))


def split_kv(rows: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """rows [..., Hkv * 2 * Ds] -> k, v [..., Hkv, head_dim]: the inverse of combine_kv."""
    Ds = combined_head_dim(head_dim)
    pair = rows.reshape(rows.shape[:-1] + (rows.shape[-1] // (2 * Ds), 2, Ds))
    return pair[..., 0, :head_dim], pair[..., 1, :head_dim]


def num_heads(rows: jax.Array, head_dim: int) -> int:
    """KV heads a combined pool (or row block) holds."""
    return rows.shape[-1] // (2 * combined_head_dim(head_dim))


def combine_scales(k_scale: jax.Array, v_scale: jax.Array) -> jax.Array:
    """A quantized pool's scales k_scale, v_scale [P, page_size, Hkv] -> one scale pool
    [P, Hkv * 2 * page_size] in (head, K|V, token) order: a page's scales of one head and of K or V
    are page_size consecutive entries, and a tensor-parallel shard of the last axis holds its heads'."""
    pair = jnp.stack([k_scale, v_scale], axis=-1)  # [P, page_size, Hkv, 2]
    P, page_size, Hkv, _ = pair.shape
    return pair.transpose(0, 2, 3, 1).reshape(P, Hkv * 2 * page_size)


def split_scales(kv_scale: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """The inverse of combine_scales: [..., Hkv * 2 * page_size] -> k_scale, v_scale [..., page_size, Hkv]."""
    lead = kv_scale.shape[:-1]
    pair = kv_scale.reshape(lead + (kv_scale.shape[-1] // (2 * page_size), 2, page_size))
    pair = jnp.moveaxis(pair, -1, -3)  # [..., page_size, Hkv, 2]
    return pair[..., 0], pair[..., 1]

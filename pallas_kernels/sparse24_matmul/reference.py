"""2:4 sparse matmul in plain jnp: the truth the kernels are held to, and the storage layout.

    y [M, N] = x [M, K] @ W [K, N]        W 2:4 sparse: at most two nonzeros in every group of
                                          four consecutive rows k = 4g .. 4g + 3 of a column

(jaxinfer's orientation: y = x @ W, W [in, out]; a torch Linear's weight is W^T.) W is stored in
its compressed form, the kept values and where they sit, never as [K, N] floats:

    values  [4, K / 8, N]   the weight's dtype (bfloat16 / float32 / ...)
    mask    [K / 8, N]      uint8

with K a multiple of 8. Rows of W come in blocks of eight, r = k // 8 (two groups of four):

* `mask[r, n]`, bit j (least significant first), is set when W[8r + j, n] is kept. Exactly two
  bits of each nibble are set (a group keeps two entries, zeros included when it has fewer
  nonzeros). This is compressed-tensors' "sparse-24-bitmask" bitmask as it is (numpy.packbits
  of the [N, K] keep-mask along K, bitorder "little"), transposed to [K / 8, N].
* `values[q, r, n]` is the q-th kept entry of rows 8r .. 8r + 7 of column n, in row order:
  q = 0, 1 the two of group 2r (the low nibble), q = 2, 3 the two of group 2r + 1 (the high).
  compressed-tensors' "compressed" tensor [N, K / 2] holds the same values in row order, kept
  entry i = 4r + q; `from_compressed_tensors` transposes and reshapes it to this layout
  ([K / 2, N] -> [K / 8, 4, N] -> [4, K / 8, N]).

Bytes per column, bfloat16: dense 2K; values K (half) + mask K / 8, 56 % of dense. float32: 53 %.

Why the values are four planes, not [K / 2, N] in row order: each plane is aligned row for row
with the mask bytes, so a kernel expands a tile with element-wise selects, no shuffle of rows
(sublanes on a TPU); and the planes' K axis (K / 8) splits over tensor-parallel shards like the
mask's (a row-parallel weight: shard t holds rows [t K / tp, (t + 1) K / tp) of both).

The kernels split x's columns the same way: x_j [M, K / 8] = x[:, j::8] (j = 4e + p, p the row
within group e of a block), and with b_p = bit 4e + p of the mask, v_a = values[2e], v_b =
values[2e + 1] (the group's first and second kept entries):

    W_p = b_p ? (the first kept row of the group ? v_a : v_b) : 0
      p = 0: b_0 ? v_a : 0        p = 1: b_1 ? (b_0 ? v_b : v_a) : 0
      p = 2: b_2 ? (b_3 ? v_a : v_b) : 0                    p = 3: b_3 ? v_b : 0
    y = sum over e, p of x_{4e+p} @ W_{e,p}      (eight dots of depth K / 8: a dense matmul's work)

Leading axes ([..., 4, K / 8, N] values with [..., K / 8, N] masks: stacked layers) are accepted
by `densify`, `from_dense_24` and the checks; `sparse24_matmul` takes one matrix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ROWS_PER_BYTE = 8  # rows of W per mask byte: two groups of four
VALUE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_layout(values: jax.Array, mask: jax.Array) -> int:
    """ValueError naming the argument unless (values, mask) is a 2:4 weight in this file's layout;
    returns K."""
    if mask.dtype != jnp.uint8:
        raise ValueError(f"mask must be uint8 (8 rows of W per byte), got {mask.dtype}")
    if mask.ndim < 2:
        raise ValueError(f"mask must be [..., K / 8, N], got shape {mask.shape}")
    if values.dtype not in [jnp.dtype(d) for d in VALUE_DTYPES]:
        raise ValueError(f"values must be float32, bfloat16 or float16, got {values.dtype}")
    want = (*mask.shape[:-2], 4, *mask.shape[-2:])
    if tuple(values.shape) != want:
        raise ValueError(f"values must have shape {want} ([..., 4, K / 8, N]) for mask {tuple(mask.shape)}, got {tuple(values.shape)}")
    return ROWS_PER_BYTE * mask.shape[-2]


def check_matmul_inputs(x: jax.Array, values: jax.Array, mask: jax.Array) -> int:
    """ValueError naming the argument at fault unless x [M, K] and the weight fit; returns K."""
    if x.ndim != 2 or mask.ndim != 2:
        raise ValueError(f"x must be [M, K] and mask [K / 8, N] (one matrix), got {x.shape} and {mask.shape}")
    K = check_layout(values, mask)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.shape[1] != K:
        raise ValueError(f"x has K = {x.shape[1]} but the 2:4 weight has K = {K} (8 x {mask.shape[0]} mask rows)")
    return K


def kept_bits(mask: jax.Array) -> jax.Array:
    """uint8 [..., K / 8, N] -> bool [..., K, N]: whether each entry of W is kept."""
    bits = (mask[..., :, None, :].astype(jnp.int32) >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1  # [..., K/8, 8, N]
    *lead, R, _, N = bits.shape
    return bits.reshape(*lead, 8 * R, N).astype(bool)


def densify(values: jax.Array, mask: jax.Array, dtype=None) -> jax.Array:
    """The dense W [..., K, N] (in `dtype`, default the values' dtype) that (values, mask) stand for."""
    check_layout(values, mask)
    dtype = values.dtype if dtype is None else dtype
    kept = kept_bits(mask)                                                   # [..., K, N]
    *lead, K, N = kept.shape
    kept = kept.reshape(*lead, K // 4, 4, N)                                 # [..., G, 4, N]
    rank = jnp.cumsum(kept.astype(jnp.int32), axis=-2) - 1                   # 0: the group's first kept row, 1: its second
    planes = jnp.moveaxis(values, -3, -2)                                    # [..., K/8, 4, N]
    pairs = planes.reshape(*lead, K // 4, 2, N).astype(dtype)                # [..., G, 2, N]: (first, second) kept value
    w = jnp.where(rank == 0, pairs[..., 0:1, :], pairs[..., 1:2, :])         # [..., G, 4, N]
    w = jnp.where(kept, w, jnp.zeros((), dtype))
    return w.reshape(*lead, K, N)


def _keep_two(scores: jax.Array) -> jax.Array:
    """scores [..., G, 4, N] -> bool: the two largest of each group of four, ties to the lower row."""
    p = jnp.arange(4)
    s_p, s_q = scores[..., :, None, :], scores[..., None, :, :]             # [..., G, 4 (p), 4 (q), N]
    ahead = (s_q > s_p) | ((s_q == s_p) & (p[None, :, None] < p[:, None, None]))  # q ranks before p
    return jnp.sum(ahead, axis=-2) < 2


@jax.jit
def _violations(w: jax.Array) -> jax.Array:
    *lead, K, N = w.shape
    return jnp.sum(jnp.sum(w.reshape(*lead, K // 4, 4, N) != 0, axis=-2) > 2)


def violating_groups(w) -> int:
    """How many groups of four consecutive rows (of a column) of w [..., K, N] hold more than two
    nonzeros (counted where w lives: a sharded weight is not gathered)."""
    return int(_violations(w))


@functools.partial(jax.jit, static_argnames=("prune",))
def _compress(w: jax.Array, prune: bool) -> tuple[jax.Array, jax.Array]:
    *lead, K, N = w.shape
    wg = w.reshape(*lead, K // 4, 4, N)
    scores = jnp.abs(wg.astype(jnp.float32)) if prune else (wg != 0).astype(jnp.float32)
    kept = _keep_two(scores)                                                 # [..., G, 4, N], two per group
    rank = jnp.cumsum(kept.astype(jnp.int32), axis=-2) - 1
    zero = jnp.zeros((), w.dtype)
    first = jnp.sum(jnp.where(kept & (rank == 0), wg, zero), axis=-2, dtype=w.dtype)   # [..., G, N]: one term each
    second = jnp.sum(jnp.where(kept & (rank == 1), wg, zero), axis=-2, dtype=w.dtype)
    kept_values = jnp.stack([first, second], axis=-2).reshape(*lead, K // 8, 4, N)      # kept entry 4r + q
    values = jnp.moveaxis(kept_values, -2, -3)                               # [..., 4, K/8, N]
    bits = kept.reshape(*lead, K // 8, 8, N).astype(jnp.int32) << jnp.arange(8, dtype=jnp.int32)[:, None]
    mask = jnp.sum(bits, axis=-2).astype(jnp.uint8)                          # [..., K/8, N]
    return values, mask


def from_dense_24(w: jax.Array, *, prune: bool = False) -> tuple[jax.Array, jax.Array]:
    """A dense 2:4 sparse W [..., K, N] -> (values [..., 4, K / 8, N] in w's dtype, mask uint8 [..., K / 8, N]).

    W must have at most two nonzeros in every group of four rows of a column (ValueError with the
    count otherwise, when w is concrete); groups with fewer keep zeros at their lowest free rows.
    `prune=True` instead keeps the two largest magnitudes of each group (ties to the lower row,
    as compressed-tensors' `get_24_bytemasks` up to ties): magnitude 2:4 pruning, no check."""
    if w.ndim < 2 or w.shape[-2] % ROWS_PER_BYTE:
        raise ValueError(f"a 2:4 weight must be [..., K, N] with K a multiple of 8, got shape {w.shape}")
    if not prune and not isinstance(w, jax.core.Tracer):
        bad = violating_groups(w)
        if bad:
            raise ValueError(f"w [{', '.join(map(str, w.shape))}] is not 2:4 sparse: {bad} groups of four rows hold more "
                             f"than two nonzeros (prune=True keeps the two largest of each)")
    return _compress(jnp.asarray(w), prune)


def from_compressed_tensors(compressed, bitmask, shape) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' "sparse-24-bitmask" tensors of one torch weight [N, K] (`shape`):
    compressed [N, K / 2] (the kept values in row order) and bitmask uint8 [N, K / 8] -> this
    file's (values [4, K / 8, N], mask [K / 8, N]), as numpy (a transpose and a reshape: no
    value changes). ValueError unless every group of four holds exactly two bits."""
    N, K = (int(s) for s in np.asarray(shape).reshape(-1)[:2])
    compressed, bitmask = np.asarray(compressed), np.asarray(bitmask, dtype=np.uint8)
    if K % ROWS_PER_BYTE or compressed.shape != (N, K // 2) or bitmask.shape != (N, K // 8):
        raise ValueError(f"sparse-24-bitmask tensors of a [{N}, {K}] weight must be compressed [{N}, {K // 2}] and bitmask "
                         f"[{N}, {K // 8}] (K a multiple of 8), got {compressed.shape} and {bitmask.shape}")
    counts = np.unpackbits(bitmask, axis=-1, bitorder="little").reshape(N, K // 4, 4).sum(axis=-1)
    if not np.all(counts == 2):
        raise ValueError(f"bitmask: {int(np.sum(counts != 2))} groups of four keep other than two entries (2:4 keeps exactly two)")
    values = compressed.T.reshape(K // 8, 4, N).transpose(1, 0, 2)
    return np.ascontiguousarray(values), np.ascontiguousarray(bitmask.T)


def to_compressed_tensors(values, mask) -> dict[str, np.ndarray]:
    """The inverse of `from_compressed_tensors`: {"compressed" [N, K / 2], "bitmask" [N, K / 8],
    "shape" [[N], [K]]} as compressed-tensors saves one torch weight (a [K, N] W is a torch [N, K])."""
    values, mask = np.asarray(values), np.asarray(mask, dtype=np.uint8)
    _, R, N = values.shape
    compressed = values.transpose(1, 0, 2).reshape(4 * R, N).T
    return {"compressed": np.ascontiguousarray(compressed), "bitmask": np.ascontiguousarray(mask.T),
            "shape": np.array([[N], [8 * R]], dtype=np.int64)}


def x_planes(x: jax.Array) -> jax.Array:
    """x [M, K] -> [8, M, K / 8]: plane j holds x's columns j, j + 8, j + 16, ... (the rows of W
    that mask bit j covers), the split both kernels read x in."""
    M, K = x.shape
    return jnp.transpose(x.reshape(M, K // 8, 8), (2, 0, 1))


@jax.jit
def sparse24_matmul(x: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """x [M, K] (float32 or bfloat16) @ densify(values, mask) [K, N] -> [M, N] in x's dtype.

    Both operands are taken to float32 and multiplied at full float32 precision: the product of
    the numbers the compressed weight stands for; kernels feeding bf16 to the matrix unit are
    compared against it with a tolerance."""
    check_matmul_inputs(x, values, mask)
    w = densify(values, mask, jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)

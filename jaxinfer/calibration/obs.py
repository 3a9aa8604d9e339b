"""Optimal Brain Surgeon, blocked and lazy: what GPTQ (quantization) and SparseGPT (pruning) share.

For y = x @ W (W [K, N], jaxinfer's orientation: input rows, output columns) and calibration
inputs X [n, K], the output error of a change dW is tr(dWᵀ H dW) with H = 2 Xᵀ X / n. Both methods
fix the rows of W one at a time, in order: row k becomes its target t_k (its rounded grid values
for GPTQ; itself with the pruned entries zeroed for SparseGPT; both when pruning and quantizing at
once), and the rows after it absorb the change optimally,

    W[k+1:] -= U[k, k+1:]ᵀ (w_k - t_k) / U[k, k]        with U the upper Cholesky factor of H⁻¹

(the papers' numerically stable form: H⁻¹ = Uᵀ U). Rows go in blocks of 128: inside a block every
row updates the block's later rows; the rows after the block take the block's errors at once, in
one matmul (the lazy batch update). Output columns never mix, so each column's work is its own.

The pieces, each used by both methods:

- `hessian`: H from the calibration inputs, shrunk toward its diagonal when the samples are few
  (gptq.py's docstring: with n near K the rounding error is steered by noise);
- `prepare`: inputs the calibration never saw (zero diagonal) get their weights zeroed, damping
  (H += 1% of its mean diagonal), rows padded to whole blocks, U;
- `sweep`: the blocked lazy loop. A row's target comes from a keep mask (which entries stay) and,
  when `bits` is set, the group's grid (its scale and zero point fixed from the group's kept rows
  as they are when its first row is reached; a pruned entry takes the zero point's level, so it
  dequantizes to exactly 0). The mask is given (Wanda, magnitude, or none), or chosen as the
  sweep goes, SparseGPT's adaptive mask selection: at the start of each block, per fused part
  (q / k / v, gate / up: each HF matrix on its own), the fraction `sparsity` of the block's
  entries with the smallest w² / U_kk² (the OBS cost of removing them, with the row's inverse-
  Hessian pivot as it stands then); with `pattern` "2:4", at every fourth row, the two of that
  row and the next three with the smallest cost, per output column (the paper's semi-structured
  variant).

The sweep compiles with XLA's full optimization on the CPU whatever the process default (a test
session compiles for speed of compiling, which makes this loop of small updates 10-20x slower),
unless its matrices are small enough for the compile to outweigh the run (`fast_jit`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.grid import group_params, quantize_rows

DAMP = 0.01  # GPTQ's percdamp: H += 0.01 * mean(diag H) * I
BLOCK = 128  # rows per lazy batch update
CPU_OPTIONS = {"xla_backend_optimization_level": "3"}
FAST_MIN_SIZE = 1 << 18  # (SmolLM2's smallest sweep holds 1.1M entries; a test model's, 65k)


def fast_jit(fn, **kwargs):
    """jax.jit(fn), compiled with XLA's full optimization on the CPU when its arrays hold
    FAST_MIN_SIZE entries or more, where the run outweighs the compile (module docstring)."""
    plain, cpu = jax.jit(fn, **kwargs), jax.jit(fn, compiler_options=CPU_OPTIONS, **kwargs)

    @functools.wraps(fn)
    def call(*args, **kw):
        if jax.default_backend() != "cpu":
            return plain(*args, **kw)
        size = sum(np.size(a) for a in jax.tree.leaves((args, kw)) if hasattr(a, "shape"))
        return (cpu if size >= FAST_MIN_SIZE else plain)(*args, **kw)
    return call


@fast_jit
def hessian(inputs: list[jax.Array]) -> jax.Array:
    """H = 2 Xᵀ X / n [K, K] (float32) over the rows of every input [T, K], shrunk toward its
    diagonal by K / (K + n) (gptq.py's docstring)."""
    n = sum(x.shape[0] for x in inputs)
    K = inputs[0].shape[1]
    H = sum(2.0 / n * jnp.einsum("tk,tj->kj", x, x, precision=jax.lax.Precision.HIGHEST) for x in inputs)
    shrink = K / (K + n)
    return (1 - shrink) * H + shrink * jnp.diag(jnp.diag(H))


@dataclasses.dataclass
class Prepared:
    """W and U ready for `sweep`: rows in sweep order, padded to whole blocks (the padding outside
    H: the identity there, so no error reaches it from a real row, none leaves it)."""

    w: jax.Array  # [Kb, N]
    U: jax.Array  # [Kb, Kb] upper: H⁻¹ = Uᵀ U
    K: int  # real rows
    block: int  # rows per block (whole groups)
    order: np.ndarray  # [K]: sweep row i is input row order[i]


def prepare(w, H: jax.Array, *, group_size: int = 1, order: np.ndarray | None = None) -> Prepared:
    """W [K, N] and its input Hessian H [K, K] made ready for `sweep` (module docstring); `order`:
    the rows' sweep order (GPTQ's act-order), default their own. A partial last group is padded
    with copies of the last row (grid.pad_rows: it keeps its range)."""
    K, N = w.shape
    order = np.arange(K) if order is None else np.asarray(order)
    block = group_size * -(-BLOCK // group_size)  # whole groups in a block
    Kb = -(-K // block) * block
    H = jnp.asarray(H, jnp.float32)
    dead = np.asarray(jnp.diag(H) == 0)  # inputs the calibration never saw: no information, weight set to 0
    w = np.where(dead[:, None], 0.0, np.asarray(w, np.float32))[order]
    w = np.concatenate([np.pad(w, ((0, -K % group_size), (0, 0)), mode="edge"),  # (grid.pad_rows)
                        np.broadcast_to(w[-1:], (Kb - K - (-K % group_size), N))])
    return Prepared(jnp.asarray(w), _factor(H, jnp.asarray(order, jnp.int32), Kb=Kb), K, block, order)


@functools.partial(fast_jit, static_argnames=("Kb",))
def _factor(H, order, *, Kb: int):
    """U [Kb, Kb] of `prepare` (unseen inputs' diagonal set to 1, damping, padding outside H)."""
    K = H.shape[0]
    H = H + jnp.diag((jnp.diag(H) == 0).astype(H.dtype))
    H = H[order][:, order]
    H = H + DAMP * jnp.mean(jnp.diag(H)) * jnp.eye(K, dtype=H.dtype)
    H = jnp.pad(H, (0, Kb - K)) + jnp.diag((jnp.arange(Kb) >= K).astype(H.dtype))
    return jnp.linalg.cholesky(jnp.linalg.inv(H)).T


@dataclasses.dataclass
class Swept:
    """What `sweep` chose, rows in input order (the padding dropped): values [K, N] float32 (the
    new weight: pruned entries 0, grids dequantized), keep [K, N] bool; with `bits`, the levels
    q [K, N] and per group (in sweep order) scales and zeros [G, N]."""

    values: np.ndarray
    keep: np.ndarray
    q: np.ndarray | None = None
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None


def sweep(prep: Prepared, *, keep: np.ndarray | None = None, bits: int | None = None, group_size: int = 1,
          symmetric: bool = False, select: str | None = None, sparsity: float = 0.0,
          parts: tuple[tuple[int, int], ...] | None = None) -> Swept:
    """The blocked lazy OBS loop over `prep` (module docstring). `keep` [K, N] (input order): the
    entries kept, default all (a given mask); `select`: None, "unstructured" (SparseGPT's mask per
    block, `sparsity` of each block of each part pruned) or "2:4"; `bits`: quantize the kept
    entries on grids of `group_size` rows; `parts`: (first column, width) of each fused part."""
    Kb, N = prep.w.shape
    keep_p = np.ones((Kb, N), bool)
    if keep is not None:
        keep_p[: prep.K] = np.asarray(keep, bool)[prep.order]
    parts = parts or ((0, N),)
    values, kept, q, scales, zeros = _sweep(prep.w, prep.U, jnp.asarray(keep_p), jnp.int32(prep.K), block=prep.block,
                                        group_size=group_size, bits=bits, symmetric=symmetric, select=select,
                                        sparsity=float(sparsity), parts=tuple(parts))
    inverse = np.argsort(prep.order)  # input row k is sweep row inverse[k]
    out = Swept(np.asarray(values)[inverse], np.asarray(kept)[inverse])
    if bits is not None:
        out.q, out.scales, out.zeros = np.asarray(q)[inverse], np.asarray(scales), np.asarray(zeros)
    return out


def prune_smallest(score: jax.Array, count) -> jax.Array:
    """bool [R, C]: in each column of score [R, C] (scores >= 0, inf never chosen while count
    allows), the `count` smallest entries (ties: the lower rows first). By bisection on the
    scores' bits (a non-negative float's int32 bits order as the float does): 32 counting passes
    instead of a sort, which XLA:CPU runs slowly."""
    bits = jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.int32)

    def halve(_, bounds):  # count(bits <= lo) < count <= count(bits <= hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(bits <= mid[None, :], axis=0) >= count
        return jnp.where(enough, lo, mid), jnp.where(enough, mid, hi)

    C = score.shape[1]
    lo, hi = jnp.full((C,), -1, jnp.int32), jnp.full((C,), 0x7F800000, jnp.int32)
    _, kth = jax.lax.fori_loop(0, 32, halve, (lo, hi))                  # the count-th smallest, per column
    below, ties = bits < kth[None, :], bits == kth[None, :]
    need = count - jnp.sum(below, axis=0)
    return (below | (ties & (jnp.cumsum(ties, axis=0) <= need[None, :]))) & (count > 0)


def keep_fraction(score: jax.Array, valid: jax.Array, sparsity: float, parts) -> jax.Array:
    """The entries of score [B, N] kept when, per part (its columns), the `sparsity` of its entries
    in valid rows (valid [B] bool) with the smallest scores are pruned: round(sparsity * valid
    rows * width) of them."""
    B, N = score.shape
    rows = jnp.sum(valid)
    keep = jnp.ones((B, N), bool)
    for start, width in parts:
        s = jnp.where(valid[:, None], score[:, start:start + width], jnp.inf).reshape(-1, 1)
        count = jnp.floor(sparsity * rows * width + 0.5).astype(jnp.int32)
        keep = keep.at[:, start:start + width].set(~prune_smallest(s, count).reshape(B, width))
    return keep


def keep_two_of_four(score: jax.Array) -> jax.Array:
    """score [4 g, N] -> keep [4 g, N]: in each group of four consecutive rows and each column,
    the two largest (ties: the later rows kept)."""
    R, N = score.shape
    s = score.reshape(R // 4, 4, N)
    i = jnp.arange(4)
    lower = (s[:, :, None, :] < s[:, None, :, :]) | ((s[:, :, None, :] == s[:, None, :, :]) & (i[:, None] < i[None, :])[None, :, :, None])
    rank = jnp.sum(lower, axis=1)  # rank[g, j, n]: the entries of the group that order before j
    return (rank >= 2).reshape(R, N)


def _sweep_impl(w, U, keep, K, *, block: int, group_size: int, bits: int | None, symmetric: bool, select: str | None,
                sparsity: float, parts):
    """Rows of w [Kb, N] in order, each set to its target and its error spread over the rows
    after it (module docstring): (values [Kb, N], keep [Kb, N], levels [Kb, N], scales [G, N],
    zeros [G, N]; the last three zeros without `bits`)."""
    Kb, N = w.shape
    G = Kb // group_size if bits is not None else 1
    block_rows = jnp.arange(block)

    def one_block(b, carry):
        w, values, keep, levels, scales, zeros = carry
        b0 = b * block
        wb = jax.lax.dynamic_slice_in_dim(w, b0, block)                              # [B, N]
        ub = jax.lax.dynamic_slice(U, (b0, b0), (block, block))                    # [B, B]
        kb = jax.lax.dynamic_slice_in_dim(keep, b0, block)
        pivot = jnp.diag(ub)
        if select == "unstructured":  # SparseGPT's adaptive mask: this block's cheapest entries
            kb = keep_fraction(wb ** 2 / pivot[:, None] ** 2, b0 + block_rows < K, sparsity, parts)

        def row(i, carry):
            wb, vb, kb, qb, errors, scales, zeros = carry
            if select == "2:4":  # at the first row of each group of four: its two cheapest entries per column
                def choose(kb):
                    w4 = jax.lax.dynamic_slice_in_dim(wb, i, 4)
                    d4 = jax.lax.dynamic_slice_in_dim(pivot, i, 4)
                    return jax.lax.dynamic_update_slice_in_dim(kb, keep_two_of_four(w4 ** 2 / d4[:, None] ** 2), i, 0)
                kb = jax.lax.cond(i % 4 == 0, choose, lambda kb: kb, kb)
            kept = kb[i]
            if bits is None:
                target, level = jnp.where(kept, wb[i], 0.0), jnp.zeros((N,))
            else:
                g = (b0 + i) // group_size

                def new_group(_):  # the group's grid from its kept rows as they are now (a group lies in one block)
                    rows = jax.lax.dynamic_slice_in_dim(jnp.where(kb, wb, 0.0), i, group_size)
                    s, z = group_params(rows, bits, symmetric)
                    return scales.at[g].set(s), zeros.at[g].set(z)

                scales, zeros = jax.lax.cond(i % group_size == 0, new_group, lambda _: (scales, zeros), None)
                s, z = scales[g], zeros[g]
                level = jnp.where(kept, quantize_rows(wb[i], s, z, bits), z)          # [N]
                target = (level - z) * s
            err = (wb[i] - target) / ub[i, i]
            wb = wb - jnp.where(block_rows[:, None] > i, ub[i][:, None] * err[None, :], 0.0)
            return wb, vb.at[i].set(target), kb, qb.at[i].set(level), errors.at[i].set(err), scales, zeros

        init = (wb, jnp.zeros((block, N)), kb, jnp.zeros((block, N)), jnp.zeros((block, N)), scales, zeros)
        _, vb, kb, qb, errors, scales, zeros = jax.lax.fori_loop(0, block, row, init)
        later = jax.lax.dynamic_slice_in_dim(U, b0, block).T @ errors               # [Kb, N]
        w = w - jnp.where(jnp.arange(Kb)[:, None] >= b0 + block, later, 0.0)
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=b0, axis=0)
        return w, put(values, vb), put(keep, kb), put(levels, qb), scales, zeros

    init = (w, jnp.zeros((Kb, N)), keep, jnp.zeros((Kb, N)), jnp.ones((G, N)), jnp.zeros((G, N)))
    _, values, keep, levels, scales, zeros = jax.lax.fori_loop(0, Kb // block, one_block, init)
    return values, keep, levels, scales, zeros


_sweep = fast_jit(_sweep_impl, static_argnames=("block", "group_size", "bits", "symmetric", "select", "sparsity", "parts"))

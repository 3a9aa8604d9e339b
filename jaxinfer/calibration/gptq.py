"""GPTQ (Frantar et al., 2022): quantize a weight one input row at a time, pushing each row's
rounding error onto the rows not yet quantized, weighted by the inverse Hessian of the layer's
inputs, so that the layer's output on the calibration inputs moves as little as it can.

For y = x @ W (W [K, N], jaxinfer's orientation) and calibration inputs X [n, K], the output error
of a change dW is tr(dWᵀ H dW) with H = 2 Xᵀ X / n. Quantizing row k to q_k costs
(w_k - q_k)² / [H⁻¹]_kk, and the rows after k absorb the error optimally by
W[k+1:] -= [H⁻¹]_{k, k+1:}ᵀ (w_k - q_k) / [H⁻¹]_kk. With U the upper Cholesky factor of H⁻¹,
row k uses U[k, k] and U[k, k+1:] (the paper's numerically stable form). A group's scale and zero
point are fixed from its rows as they are when its first row is reached.

`act_order` quantizes rows in order of decreasing H diagonal (the inputs that matter most first,
while the most rows remain to absorb error); groups then follow that order, so the checkpoint
stores g_idx (GPTQ's desc_act).

Few calibration tokens: with n samples and K inputs, H has rank at most n, and with n near or
below K (a few hundred tokens of text, K = 1536 for SmolLM2's down projection) GPTQ fits the
calibration inputs and does worse than round-to-nearest on other text (measured: down_proj's
held-out output error 1.2-1.5x RTN's). So H is shrunk toward its diagonal, H' = (1 - a) H +
a diag(H) with a = K / (K + n): the less the samples say about the input correlations, the less
the rounding error is steered by them (measured on SmolLM2 with 512 tokens: every matmul's
held-out error below RTN's, 1.3-20x).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.grid import ZeroPointGrid, group_params, pad_rows, quantize_rows

DAMP = 0.01  # GPTQ's percdamp: H += 0.01 * mean(diag H) * I
BLOCK = 128  # rows per lazy batch update


def hessian(inputs: list[jax.Array]) -> jax.Array:
    """H = 2 Xᵀ X / n [K, K] (float32) over the rows of every input [T, K], shrunk toward its
    diagonal by K / (K + n) (module docstring)."""
    n = sum(x.shape[0] for x in inputs)
    K = inputs[0].shape[1]
    H = sum(2.0 / n * jnp.einsum("tk,tj->kj", x, x, precision=jax.lax.Precision.HIGHEST) for x in inputs)
    shrink = K / (K + n)
    return (1 - shrink) * H + shrink * jnp.diag(jnp.diag(H))


def gptq(w: np.ndarray, H: jax.Array, *, bits: int, group_size: int, symmetric: bool, act_order: bool = False) -> ZeroPointGrid:
    """w [K, N] onto its grid by GPTQ with the input Hessian H [K, K]."""
    K, N = w.shape
    w = jnp.asarray(w, jnp.float32)
    dead = jnp.diag(H) == 0  # inputs the calibration never saw: no information, weight set to 0
    H = H + jnp.diag(dead.astype(H.dtype))
    w = jnp.where(dead[:, None], 0.0, w)
    order = np.asarray(jnp.argsort(-jnp.diag(H))) if act_order else np.arange(K)
    w, H = w[order], H[order][:, order]
    H = H + DAMP * jnp.mean(jnp.diag(H)) * jnp.eye(K, dtype=H.dtype)
    # Rows padded to whole blocks with copies of the last (grid.pad_rows: a partial last group keeps
    # its range), outside H (the identity there: no error reaches them from a real row, none leaves).
    block = max(BLOCK, group_size)
    Kb = -(-K // block) * block
    w = jnp.concatenate([pad_rows(w, group_size), jnp.broadcast_to(w[-1:], (Kb - K - (-K % group_size), N))])
    H = jnp.pad(H, (0, Kb - K)) + jnp.diag((jnp.arange(Kb) >= K).astype(H.dtype))
    U = jnp.linalg.cholesky(jnp.linalg.inv(H)).T  # upper: H⁻¹ = Uᵀ U
    q, scales, zeros = _quantize(w, U, bits=bits, group_size=group_size, symmetric=symmetric, block=block)
    G = -(-K // group_size)
    inverse = np.argsort(order)  # input row k is quantized row inverse[k]
    return ZeroPointGrid(np.asarray(q, np.int64)[inverse], np.asarray(zeros, np.int64)[:G], np.asarray(scales, np.float16)[:G],
                         inverse // group_size, bits, group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric", "block"))
def _quantize(w, U, *, bits: int, group_size: int, symmetric: bool, block: int):
    """Rows of w [Kb, N] in order, each rounded on its group's grid and its error spread over the
    rows after it: (q [Kb, N], scales [G, N], zeros [G, N]). Blocked as in the paper: inside a
    block of rows every row updates the block's later rows; the rows after the block take the
    block's errors at once, in one matmul (the lazy batch update)."""
    Kb, N = w.shape
    G = Kb // group_size
    block_rows = jnp.arange(block)

    def one_block(b, carry):
        w, q, scales, zeros = carry
        b0 = b * block
        wb = jax.lax.dynamic_slice_in_dim(w, b0, block)                              # [B, N]
        ub = jax.lax.dynamic_slice(U, (b0, b0), (block, block))                    # [B, B]

        def row(i, carry):
            wb, qb, errors, scales, zeros = carry
            g = (b0 + i) // group_size

            def new_group(_):  # the group's grid from its rows as they are now (a group lies in one block)
                s, z = group_params(jax.lax.dynamic_slice_in_dim(wb, i, group_size), bits, symmetric)
                return scales.at[g].set(s), zeros.at[g].set(z)

            scales, zeros = jax.lax.cond(i % group_size == 0, new_group, lambda _: (scales, zeros), None)
            s, z = scales[g], zeros[g]
            level = quantize_rows(wb[i], s, z, bits)                               # [N]
            err = (wb[i] - (level - z) * s) / ub[i, i]
            wb = wb - jnp.where(block_rows[:, None] > i, ub[i][:, None] * err[None, :], 0.0)
            return wb, qb.at[i].set(level), errors.at[i].set(err), scales, zeros

        init = (wb, jnp.zeros((block, N)), jnp.zeros((block, N)), scales, zeros)
        _, qb, errors, scales, zeros = jax.lax.fori_loop(0, block, row, init)
        later = jax.lax.dynamic_slice_in_dim(U, b0, block).T @ errors               # [Kb, N]
        w = w - jnp.where(jnp.arange(Kb)[:, None] >= b0 + block, later, 0.0)
        return w, jax.lax.dynamic_update_slice_in_dim(q, qb, b0, axis=0), scales, zeros

    init = (w, jnp.zeros((Kb, N)), jnp.ones((G, N)), jnp.zeros((G, N)))
    _, q, scales, zeros = jax.lax.fori_loop(0, Kb // block, one_block, init)
    return q, scales, zeros

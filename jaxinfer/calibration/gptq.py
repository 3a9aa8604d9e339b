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

The Hessian, the damping, the Cholesky factor and the blocked lazy loop are `obs`'s, shared with
SparseGPT (`pruning`); GPTQ is that loop with every row's target its rounded grid values.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.calibration.grid import ZeroPointGrid
from jaxinfer.calibration.obs import BLOCK, DAMP, hessian, prepare, sweep  # noqa: F401  (hessian, DAMP, BLOCK: GPTQ's too)


def gptq(w: np.ndarray, H, *, bits: int, group_size: int, symmetric: bool, act_order: bool = False,
         keep: np.ndarray | None = None) -> ZeroPointGrid:
    """w [K, N] onto its grid by GPTQ with the input Hessian H [K, K] (the blocked lazy OBS loop
    of `obs`). `keep` [K, N]: a pruning mask (Wanda's, magnitude's): the entries it drops take
    their group's zero point, so they stay exactly 0, and their error is pushed on like any other."""
    K, N = w.shape
    diag = np.diag(np.asarray(H))
    order = np.argsort(-np.where(diag == 0, 1, diag), kind="stable") if act_order else None  # (unseen inputs: 1, as prepare sets them)
    prep = prepare(w, H, group_size=group_size, order=order)
    out = sweep(prep, keep=keep, bits=bits, group_size=group_size, symmetric=symmetric)
    G = -(-K // group_size)
    inverse = np.argsort(prep.order)  # input row k is quantized row inverse[k]
    return ZeroPointGrid(out.q.astype(np.int64), out.zeros.astype(np.int64)[:G], out.scales.astype(np.float16)[:G],
                         inverse // group_size, bits, group_size)

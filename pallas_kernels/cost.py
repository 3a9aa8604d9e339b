"""What each kernel costs, declared to XLA as a `pl.CostEstimate` on its `pallas_call`.

XLA's cost analysis (`compiled.cost_analysis()`, and its scheduler) cannot see inside a custom
kernel: without an estimate a kernel counts as free. The TPU and GPU version of a kernel do the
same work, so both declare the same numbers from here. Attention over a paged cache cannot know
its sequences' lengths at trace time: the estimate is an upper bound (every query block reads its
sequence's whole row of the page table).
"""

from __future__ import annotations

from jax.experimental import pallas as pl


def matmul(M: int, K: int, N: int, *, x_itemsize: int, weight_bytes: int, out_itemsize: int) -> pl.CostEstimate:
    """[M, K] @ [K, N] with `weight_bytes` of weights (quantized weights and scales included)."""
    return pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                           bytes_accessed=M * K * x_itemsize + weight_bytes + M * N * out_itemsize)


def swiglu_matmul(M: int, K: int, N: int, *, x_itemsize: int, w_itemsize: int, out_itemsize: int) -> pl.CostEstimate:
    """silu(x @ gate) * (x @ up), gate and up [K, N] each."""
    return pl.CostEstimate(flops=4 * M * K * N + 4 * M * N, transcendentals=M * N,
                           bytes_accessed=M * K * x_itemsize + 2 * K * N * w_itemsize + M * N * out_itemsize)


def rms_norm(T: int, H: int, *, itemsize: int, with_residual: bool) -> pl.CostEstimate:
    arrays_read, arrays_written = (2, 2) if with_residual else (1, 1)
    return pl.CostEstimate(flops=5 * T * H, transcendentals=T,
                           bytes_accessed=(arrays_read + arrays_written) * T * H * itemsize + H * itemsize)


def flash_attention(T: int, Hq: int, Hkv: int, D: int, *, itemsize: int, causal: bool) -> pl.CostEstimate:
    """Attention of T queries over the step's own T keys (half of them visible when causal)."""
    pairs = T * T // 2 if causal else T * T
    return pl.CostEstimate(flops=4 * pairs * Hq * D, transcendentals=pairs * Hq,
                           bytes_accessed=(2 * T * Hq * D + 2 * T * Hkv * D) * itemsize)


def ragged_paged_attention(*, query_rows: int, query_blocks: int, Hq: int, Hkv_stored: int, D: int, kv_tokens_per_block: int,
                           q_itemsize: int, kv_itemsize: int) -> pl.CostEstimate:
    """Upper bound: each of `query_blocks` blocks reads kv_tokens_per_block tokens of K and V."""
    pairs = query_rows * kv_tokens_per_block
    return pl.CostEstimate(
        flops=4 * pairs * Hq * D, transcendentals=pairs * Hq,
        bytes_accessed=2 * query_rows * Hq * D * q_itemsize + 2 * query_blocks * kv_tokens_per_block * Hkv_stored * D * kv_itemsize,
    )


def rope_kv_write(T: int, Hq: int, Hkv: int, D: int, *, itemsize: int, pool_itemsize: int) -> pl.CostEstimate:
    """Read q, k, v, cos, sin; write rotated q and k, and each token's K and V row into its page."""
    return pl.CostEstimate(
        flops=6 * T * (Hq + Hkv) * D, transcendentals=0,
        bytes_accessed=itemsize * T * (2 * Hq + 3 * Hkv) * D + 2 * 4 * T * D + 2 * T * Hkv * D * pool_itemsize,
    )

"""The LoRA delta as the XLA path computes it (the CPU's): every adapter slot at once, each token
masked to its own; with fewer tokens than adapter slots, each token's own matrices gathered.

    lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T]) -> float32 [T, sum O_p]

(semantics: `reference.lora_delta`). Two plain matmuls per module instead of a gather of per-token
matrices: [T, K] x [K, (N-1) P R] over slots 1..N-1, masked to each token's slot, then per module
[T, (N-1) R] x [(N-1) R, O_p]. The work follows the table's size (every slot is computed for
every token), not the adapters the batch uses; on the CPU it is still the fastest form measured
from a few tokens up (`scripts/bench_lora.py`: 30x faster than the per-token gather at 512
tokens, 4x faster than `jax.lax.ragged_dot`, even with the kernels' grouped layout done in XLA).
Below N - 1 tokens (a batch-1 decode step has 2) the gather reads less than the N - 1 slots do
and wins: 2-4x per call at 1-2 tokens, a batch-1 decode step with an adapter 1.39x -> 1.13x the
base model's time with 4 slots (1.58x -> 1.14x with 8). T is static, so the choice is made once
per compiled bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lora_sgmv import reference
from pallas_kernels.lora_sgmv.reference import check_inputs


def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> jax.Array:
    P, R = check_inputs(x, a, bs, slot)
    N, K, _ = a.shape
    if x.shape[0] < N - 1:  # fewer tokens than adapter slots: gather each token's matrices
        return reference.lora_delta(x, a, bs, slot)
    dtype = a.dtype
    xa = jnp.dot(x.astype(dtype), a[1:].transpose(1, 0, 2).reshape(K, (N - 1) * P * R), preferred_element_type=jnp.float32)
    xa = xa.reshape(-1, N - 1, P, R)  # [T, slots 1..N-1, P, R]
    xa = jnp.where((slot[:, None] == jnp.arange(1, N))[:, :, None, None], xa, 0.0).astype(dtype)
    return jnp.concatenate([
        jnp.dot(xa[:, :, p].reshape(-1, (N - 1) * R), b[1:].reshape((N - 1) * R, -1), preferred_element_type=jnp.float32)
        for p, b in enumerate(bs)
    ], axis=-1)

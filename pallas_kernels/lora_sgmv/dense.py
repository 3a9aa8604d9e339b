"""The LoRA delta as the XLA path computes it (the CPU's, and the fallback anywhere): every adapter
slot at once, each token masked to its own.

    lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T]) -> float32 [T, sum O_p]

(semantics: `reference.lora_delta`). Two plain matmuls per module instead of a gather of per-token
matrices: [T, K] x [K, (N-1) P R] over slots 1..N-1, masked to each token's slot, then per module
[T, (N-1) R] x [(N-1) R, O_p]. The work follows the table's size (every slot is computed for
every token), not the adapters the batch uses; on the CPU it is still the fastest form measured
(`scripts/bench_lora.py`: 18x faster than the per-token gather at 512 tokens, 2.5x faster than
`jax.lax.ragged_dot`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lora_sgmv.reference import check_inputs


def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> jax.Array:
    P, R = check_inputs(x, a, bs, slot)
    N, K, _ = a.shape
    dtype = a.dtype
    xa = jnp.dot(x.astype(dtype), a[1:].transpose(1, 0, 2).reshape(K, (N - 1) * P * R), preferred_element_type=jnp.float32)
    xa = xa.reshape(-1, N - 1, P, R)  # [T, slots 1..N-1, P, R]
    xa = jnp.where((slot[:, None] == jnp.arange(1, N))[:, :, None, None], xa, 0.0).astype(dtype)
    return jnp.concatenate([
        jnp.dot(xa[:, :, p].reshape(-1, (N - 1) * R), b[1:].reshape((N - 1) * R, -1), preferred_element_type=jnp.float32)
        for p, b in enumerate(bs)
    ], axis=-1)

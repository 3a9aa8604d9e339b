"""The LoRA delta as the XLA path computes it (the CPU's), in the form that is fastest on XLA:CPU
for the step's shape.

    lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T]) -> float32 [T, sum O_p]

(semantics: `reference.lora_delta`). Two forms, chosen by the static token count T against the
table's N slots (measured with `scripts/bench_lora.py` on the 2-core CPU the project is
measured on, SmolLM2's projections, 4 and 8 adapter slots):

- T < N - 1 (a batch-1 decode step has 2 tokens): each token's own matrices gathered
  (`reference.lora_delta`). It reads less than the N - 1 slots do: 2-4x faster per call at 1-2
  tokens; a batch-1 decode step with an adapter went from 1.39x to 1.08-1.16x the base step's time.
- otherwise `dense_over_slots`: every slot at once, each token masked to its own, a few plain
  matmuls. Its work follows the table's size, not the adapters in use.

Measured and not used by `lora_delta`: `grouped_blocks` (below), the SGMV kernels' algorithm in jnp (tokens sorted into blocks of one
slot, one batched dot per block against its slot's A, then its B), whose work follows the
adapters in use. Alone, over a layer's four projections at 512 tokens with 4 adapters in use, it
took 0.88x the dense form's time with 4 slots, 0.80x with 8, 0.62x with 16 (and 1.09-1.38x at 32
tokens); inside the model a prefill step of 512 tokens with it was no faster beyond the VM's
noise (4 slots: 1.28-1.30x the base step against dense's 1.25-1.27x; 8 slots: 1.34-1.42x against
1.40-1.44x). It stays here, tested, for `scripts/bench_lora.py`'s table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lora_sgmv import common, reference
from pallas_kernels.lora_sgmv.reference import check_inputs

GROUP_BLOCK = 32  # rows per block of the grouped form


def dense_over_slots(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> jax.Array:
    """[T, K] x [K, (N-1) P R] over slots 1..N-1, masked to each token's slot, then per module
    [T, (N-1) R] x [(N-1) R, O_p]."""
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


def grouped_blocks(x: jax.Array, a: jax.Array, bs, slot: jax.Array, *, block: int = GROUP_BLOCK) -> jax.Array:
    """Tokens in blocks of one slot: [nb, block, K] x A[block_slot] [nb, K, P R], then per module
    [nb, block, R] x B[block_slot] [nb, R, O_p], back in token order (slot 0: zeros)."""
    _, R = check_inputs(x, a, bs, slot)
    N, K, _ = a.shape
    g = common.group_by_slot(slot.astype(jnp.int32), N, block)
    xg = common.gather_rows(x, g).reshape(g.num_blocks, block, K).astype(a.dtype)
    xa = jnp.einsum("bmk,bkr->bmr", xg, a[g.block_slot], preferred_element_type=jnp.float32).astype(a.dtype)
    y = jnp.concatenate([
        jnp.einsum("bmr,bro->bmo", xa[:, :, p * R : (p + 1) * R], b[g.block_slot], preferred_element_type=jnp.float32)
        for p, b in enumerate(bs)
    ], axis=-1)
    return common.scatter_back(y.reshape(g.num_blocks * block, -1), slot, g)


def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> jax.Array:
    """The form for this shape (module docstring)."""
    if x.shape[0] < a.shape[0] - 1:  # fewer tokens than adapter slots
        return reference.lora_delta(x, a, bs, slot)
    return dense_over_slots(x, a, bs, slot)

"""The one attention entry point of the model: write this step's K/V into the pages, then attend.

The model calls `write_kv_and_attend` once per layer. Today it always uses the plain-jnp
reference from `pallas_kernels.ragged_paged_attention`; the Pallas kernels plug in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.batch import RaggedBatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def kv_slots(batch: RaggedBatch, page_size: int, scratch_page: int) -> jax.Array:
    """Slot of each token in one layer's page pool (page * page_size + offset) [T].

    Padding tokens (past the last real sequence) get slots in the scratch page.
    """
    T = batch.token_ids.shape[0]
    S = batch.kv_lens.shape[0]
    t = jnp.arange(T)
    num_real_tokens = batch.cu_q_lens[batch.num_seqs[0]]
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), S - 1)  # [T]
    page = batch.page_table[seq, batch.positions // page_size]
    slot = page * page_size + batch.positions % page_size
    return jnp.where(t < num_real_tokens, slot, scratch_page * page_size + t % page_size)


def write_kv_and_attend(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [L, P, page_size, Hkv, D], all layers
    v_cache: jax.Array,
    layer: jax.Array,  # scalar int
    slots: jax.Array,  # [T] from kv_slots
    batch: RaggedBatch,
    *,
    sm_scale: float,
    sliding_window: int | None,
    query_block: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (attention output [T, Hq, D], k_cache, v_cache)."""
    L, P, page_size, Hkv, D = k_cache.shape
    # Fold the layer axis into the page axis: layer l's page p is page l * P + p of one pool.
    flat_slots = layer * (P * page_size) + slots
    k_cache = k_cache.reshape(L * P * page_size, Hkv, D).at[flat_slots].set(k.astype(k_cache.dtype))
    v_cache = v_cache.reshape(L * P * page_size, Hkv, D).at[flat_slots].set(v.astype(v_cache.dtype))
    k_cache = k_cache.reshape(L * P, page_size, Hkv, D)
    v_cache = v_cache.reshape(L * P, page_size, Hkv, D)
    out = ragged_paged_attention(
        q,
        k_cache,
        v_cache,
        batch.kv_lens,
        batch.page_table + layer * P,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        num_queries_per_block=query_block,
    )
    shape = (L, P, page_size, Hkv, D)
    return out, k_cache.reshape(shape), v_cache.reshape(shape)

"""The one attention entry point of the model: write this step's K/V into the pages, then attend.

The model calls `write_kv_and_attend` once per layer. Today it always uses the plain-jnp
reference from `pallas_kernels.ragged_paged_attention`; the Pallas kernels plug in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.batch import RaggedBatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def kv_write_locations(batch: RaggedBatch, page_size: int, scratch_page: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) [T] each: where each token's K/V goes in one layer's page pool.

    Padding tokens (past the last real sequence) go to the scratch page.
    """
    T = batch.token_ids.shape[0]
    S = batch.kv_lens.shape[0]
    t = jnp.arange(T)
    is_real = t < batch.cu_q_lens[batch.num_seqs[0]]
    seq = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], t, side="right"), S - 1)  # [T]
    page = jnp.where(is_real, batch.page_table[seq, batch.positions // page_size], scratch_page)
    offset = jnp.where(is_real, batch.positions % page_size, t % page_size)
    return page, offset


def write_kv_and_attend(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_pages: jax.Array,  # [L * P, page_size, Hkv, D]: every layer's pages in one pool
    v_pages: jax.Array,
    layer_page_offset: jax.Array,  # scalar: layer * P, where this layer's pages start
    write_page: jax.Array,  # [T] from kv_write_locations
    write_offset: jax.Array,  # [T]
    batch: RaggedBatch,
    *,
    sm_scale: float,
    sliding_window: int | None,
    query_block: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (attention output [T, Hq, D], k_pages, v_pages).

    The caches keep one shape from the write to the read (and through the layer loop), so XLA
    updates them in place; mixing shapes of one buffer makes it copy the whole pool.
    """
    pages = layer_page_offset + write_page
    k_pages = k_pages.at[pages, write_offset].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[pages, write_offset].set(v.astype(v_pages.dtype))
    out = ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        batch.kv_lens,
        batch.page_table + layer_page_offset,
        batch.cu_q_lens,
        batch.num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        num_queries_per_block=query_block,
    )
    return out, k_pages, v_pages

"""Ragged paged MLA attention in plain jnp (the package docstring has the layout): the latent rows
are the keys and, their first value_dim entries, the values of one KV head that every query head
shares; `ragged_paged_attention`'s reference does the rest."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.ragged_paged_attention import reference


@functools.partial(jax.jit, static_argnames=("value_dim", "sm_scale", "num_queries_per_block", "num_kv_pages_per_block"))
def mla_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, value_dim: int, sm_scale: float = 1.0,
                  num_queries_per_block: int = 8, num_kv_pages_per_block: int | None = None) -> jax.Array:
    """[T, Hq, value_dim]: attention of q [T, Hq, D] over the rows latent_pages [P, page_size, W >= D]."""
    rows = as_kv_head(latent_pages, q.shape[-1])
    out = reference.ragged_paged_attention(q, rows, rows, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                           num_queries_per_block=num_queries_per_block,
                                           num_kv_pages_per_block=num_kv_pages_per_block)
    return out[..., :value_dim]


def as_kv_head(latent_pages: jax.Array, head_dim: int) -> jax.Array:
    """[P, page_size, W] -> [P, page_size, 1, D]: the rows as one KV head (free when W == D, the
    pools of the CPU and GPU; a TPU's padded rows are sliced, a copy)."""
    rows = latent_pages[..., :head_dim] if latent_pages.shape[-1] != head_dim else latent_pages
    return rows[:, :, None, :]

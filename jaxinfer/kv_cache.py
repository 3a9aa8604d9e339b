"""The paged KV state: one pytree of page arrays, threaded through the jitted step and donated.

Layout (chosen once; kernels read it as is):

    k, v   [num_layers, num_pages, page_size, num_kv_heads, head_dim]

A sequence owns a list of pages (its row of the page table); token at position p of that
sequence lives in page `page_table[p // page_size]`, slot `p % page_size`. Page 0 is never
handed to a sequence: padded token slots write their (garbage) K/V there, so padding can never
touch a live page.

Inside the step the layer axis is folded into the page axis (`[L * P, page_size, Hkv, D]`,
a free reshape) and layer `l` addresses its pages as `l * P + page`: one page pool, one
attention signature, no per-layer copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, Hkv, D]
    v: jax.Array  # [L, P, page_size, Hkv, D]

    @staticmethod
    def create(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, *, tp: int = 1,
               sharding=None) -> "KVCache":
        """Zeroed pages. With tensor parallelism the cache holds the KV heads the tp layout stores
        (param_layout.num_kv_heads_stored: replicated when there are fewer than tp). `sharding`
        (a jax Sharding for k and v) places each device's part directly, nothing whole anywhere."""
        from jaxinfer.models.param_layout import num_kv_heads_stored

        shape = (config.num_layers, num_pages, page_size, num_kv_heads_stored(config, tp), config.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(k=zeros(), v=zeros())

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

"""The paged KV state: one pytree of page arrays, threaded through the jitted step and donated.

Layout (chosen once; kernels read it as is):

    k, v   [num_layers, num_pages, page_size, num_kv_heads, head_dim]

Token-major pages: one token's row of every KV head is contiguous, so a write of a token and a
fetch of a page each cut only the two leading (untiled) dimensions on a TPU. With the TPU
kernels a pool may hold more KV heads than the model has (`pool_kv_heads`: whole 32-bit words
and tiles for the kernel's strided head loads, e.g. SmolLM2's 3 -> 4 in bf16) and head_dim in
whole 128-lane rows (`pool_head_dim`); the extra heads and lanes hold zeros and are never read.
Every other back end stores exactly the model's heads.

A sequence owns a list of pages (its row of the page table); token at position p of that
sequence lives in page `page_table[p // page_size]`, slot `p % page_size`. Page 0 is never
handed to a sequence: padded token slots write their (garbage) K/V there, so padding can never
touch a live page.

Inside the step the layer axis is folded into the page axis (`[L * P, page_size, Hkv, D]`,
a free reshape) and layer `l` addresses its pages as `l * P + page`: one page pool, one
attention signature, no per-layer copy.

Quantized pools (`kv_cache_dtype` int8 or float8_e4m3fn) hold each token's K and V per head as
int8 / e4m3 entries and a float32 scale, `entry * scale` being the value:

    k_scale, v_scale   [num_layers, num_pages, page_size, num_kv_heads]   float32

Each (token, head) row is turned by a fixed orthogonal matrix (`attention.kv_rotation`: a
Hadamard matrix, which spreads a key's few large channels over all of them) and quantized on
write with its own absmax (/ 127 for int8, / 448 for e4m3); attention turns q the same way and
its output back. A row is never written twice: no page is rescaled when a later token is larger (which
a scale per page and head would need, re-rounding the page's earlier entries each time), and the
result does not depend on how a sequence's tokens were cut into steps (prefill chunks, decodes,
verified drafts). The price is 4 bytes per (token, head): with head_dim 64 an int8 row is 68
bytes against 128 (bfloat16) or 256 (float32), 1.88x / 3.8x the sequences in the same memory;
with head_dim 128, 1.94x / 3.9x (`pallas_kernels.ragged_paged_attention.reference.quantize_kv`
quantizes, its attention reads them). e4m3 entries are stored as their bytes (uint8,
`reference.storage_dtype`): XLA:CPU scatters into a float8 array by converting all of it. Every page operation (copy-on-write, swap, sharding) moves the
scales with their pages: they share the page axis, so `jax.tree.map` over the cache does it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from pallas_kernels.ragged_paged_attention.reference import QUANTIZED_KV_DTYPES, storage_dtype
from sharding.mesh import kv_heads_per_shard


def pool_kv_heads(config: ModelConfig, dtype, *, tp: int = 1, kernels: Kernels = Kernels()) -> int:
    """KV heads the cache holds (all shards together): each tensor-parallel shard holds its
    model heads (`sharding.mesh.kv_heads_per_shard`: split, or replicated when there are fewer
    than tp), padded with zero heads to what the TPU kernel tiles when the TPU kernels run
    (`pallas_kernels.ragged_paged_attention.tpu.stored_kv_heads`)."""
    return kernels.stored_kv_heads(kv_heads_per_shard(config.num_kv_heads, tp), dtype) * tp


def pool_head_dim(config: ModelConfig, kernels: Kernels = Kernels()) -> int:
    """head_dim of the pool: the model's, rounded up to whole 128-lane rows with the TPU kernels.

    Measured (jaxinfer.aot): a TPU's default layout for a [.., heads, 64] bf16 array puts the
    page axis in the lanes (major_to_minor (0, 2, 3, 4, 1)), which the kernels cannot take, so
    every step copied the whole pool to the row-major layout and back (4 pool-sized copies). A
    128-lane pool keeps the row-major layout; it costs head_dim 64 models (SmolLM2, Llama-3.2-1B)
    twice the KV memory on a TPU.
    """
    return kernels.stored_head_dim(config.head_dim)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_KV_DTYPES


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, P, page_size, Hkv, D]
    v: jax.Array  # [L, P, page_size, Hkv, D]
    k_scale: jax.Array | None = None  # [L, P, page_size, Hkv] float32: quantized pools only
    v_scale: jax.Array | None = None

    @staticmethod
    def create(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, *, tp: int = 1,
               sharding=None, scale_sharding=None, kernels: Kernels = Kernels()) -> "KVCache":
        """Zeroed pages of `pool_kv_heads` heads (and their scales when `dtype` is int8 / e4m3).
        `sharding` (a jax Sharding for k and v; `scale_sharding` for the scales) places each
        device's part directly, nothing whole anywhere."""
        shape = KVCache.shape(config, num_pages, page_size, dtype, tp=tp, kernels=kernels)
        zeros = jax.jit(lambda: jnp.zeros(shape, storage_dtype(dtype)), out_shardings=sharding)
        if not is_quantized(dtype):
            return KVCache(k=zeros(), v=zeros())
        scales = jax.jit(lambda: jnp.zeros(shape[:-1], jnp.float32), out_shardings=scale_sharding)
        return KVCache(k=zeros(), v=zeros(), k_scale=scales(), v_scale=scales())

    @staticmethod
    def page_bytes(config: ModelConfig, page_size: int, dtype, *, tp: int = 1, kernels: Kernels = Kernels()) -> int:
        """Bytes of one page of every layer, K and V (with their scales)."""
        shape = KVCache.shape(config, 1, page_size, dtype, tp=tp, kernels=kernels)
        entry = math.prod(shape) * jnp.dtype(dtype).itemsize
        return 2 * (entry + (math.prod(shape[:-1]) * 4 if is_quantized(dtype) else 0))

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def fold_layers(self) -> "KVCache":
        """Every array with its layer axis folded into the page axis: [L * P, ...] (a free reshape)."""
        return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), self)

    def unfold_layers(self, num_layers: int) -> "KVCache":
        return jax.tree.map(lambda a: a.reshape((num_layers, a.shape[0] // num_layers) + a.shape[1:]), self)

    @staticmethod
    def shape(config: ModelConfig, num_pages: int, page_size: int, dtype, *, tp: int = 1,
              kernels: Kernels = Kernels()) -> tuple[int, ...]:
        """Shape of k (and v): [L, num_pages, page_size, pool_kv_heads, head_dim]."""
        return (config.num_layers, num_pages, page_size, pool_kv_heads(config, dtype, tp=tp, kernels=kernels),
                pool_head_dim(config, kernels))

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))


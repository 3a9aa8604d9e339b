"""The paged KV state: one pytree of page arrays, threaded through the jitted step and donated.

Two layouts (chosen once from the kernel table, `Kernels.combines_kv`; kernels read them as they are):

    separate   k, v  [num_slots, num_pages, page_size, num_kv_heads, head_dim]     CPU, GPU, XLA paths
    combined   kv    [num_slots, num_pages, page_size, num_kv_heads * 2 * Ds]      TPU kernels

num_slots is the number of layers in each KV layer group (`jaxinfer.kv_groups`): one per layer
when every layer attends alike (Llama), fewer when sliding and full layers share the pool
(Gemma 3: a page owned by one of its six groups holds that group's layers, one per slot).

A third, for multi-head latent attention (DeepSeek: `ModelConfig.is_mla`), on every platform:

    latent     kv    [num_slots, num_pages, page_size, tp * W]                  one row per token

holding each token's latent row [c | k_rope] once (kv_lora_rank + qk_rope_head_dim values: the
keys of every head and, its first kv_lora_rank, their values; jaxinfer.models.deepseek), W = that
width, rounded up to whole 128-lane rows on a TPU (576 -> 640: `pallas_kernels.mla_attention`).
Every tensor-parallel shard holds the whole row (each attends for its own heads). It is stored
like a combined pool (`combined` is true: one row per token, split over "tensor" in runs of W)
and read by the MLA attention (`Kernels.mla_attention`). Its bytes per token and layer are the
row's, exactly: (kv_lora_rank + qk_rope_head_dim) x dtype, 1/2 of the row kept as K and V alike.
Quantized (int8 / e4m3), each row is turned by `attention.kv_rotation` and stored with one float32
scale, `kv_scale [slots, P, tp * page_size]`: D + 4 bytes per token and layer (580 at DeepSeek-V3
against 1,152 in bf16), read by the XLA attention.

Token-major pages either way: one token's row of every KV head is contiguous. The combined row
(`pallas_kernels.ragged_paged_attention.combined`) holds K_0 V_0 K_1 V_1 ... in Ds lanes each
(Ds = head_dim for 64 and multiples of 128): a whole number of 128-lane rows, which a TPU stores
with no padding at all, where separate pools padded head_dim 64 to 128 lanes and one KV head per
chip to two (measured with libtpu in tests/test_kv_layout.py: bytes per token per chip are exactly
the model's K/V bytes for head_dim 64 / 128 / 256, 1 / 2 / 8 KV heads per chip, bf16 / int8 /
fp8). With tensor parallelism each shard of the row is a contiguous run of whole heads.

A sequence owns a list of pages per layer group (its rows of the page table); token at position
p of that sequence lives, for a layer of group g, in page `page_table[g][p // page_size]`, offset
`p % page_size`, of the layer's slot. Page 0 is never
handed to a sequence: padded token slots write their (garbage) K/V there, so padding can never
touch a live page.

Inside the step the slot axis is folded into the page axis (`[num_slots * P, page_size, ...]`, a
free reshape) and a layer in slot `s` addresses its pages as `s * P + page`: one page pool, one
attention signature, no per-layer copy.

Quantized pools (`kv_cache_dtype` int8 or float8_e4m3fn) hold each token's K and V per head as
int8 / e4m3 entries and a float32 scale, `entry * scale` being the value:

    k_scale, v_scale   [num_slots, num_pages, page_size, num_kv_heads]   float32   (separate)
    kv_scale           [num_slots, num_pages, num_kv_heads * 2 * page_size]  float32   (combined)

A combined pool's scales run head-major within a page, (head, K|V, token), so a tensor-parallel
shard of the last axis holds its own heads' scales; a TPU stores this array with the page axis
in the lanes, exactly (measured: tests/test_kv_layout.py). Quantized pools are read by the XLA
attention on every platform (jaxinfer.ops.kernels).

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

Outlier tokens (`kv_cache_outliers=R`, separate quantized pools only): each page also keeps R
residual slots, tokens of the page whose rows quantize badly keeping their quantization error in
bfloat16 (residual = turned row - dequantized entries), which the attention adds back:

    k_outlier, v_outlier       [num_slots, num_pages, R, num_kv_heads, head_dim]   bfloat16 (its bytes: uint16)
    outlier_token              [num_slots, num_pages, R]          int32: the page offset a slot holds, -1 none
    outlier_error              [num_slots, num_pages, page_size]  float32: each token's error

A token's error is its K and V rows' squared quantization error summed over its heads
(`attention.outlier_errors`). It is chosen as its row is written, from the tokens before it alone
(`attention.select_outliers`): a token takes a free slot of its page when its error is among the R
largest of the page_size tokens of its sequence ending at it (its page's earlier tokens and the
previous page's later ones; without a previous page to read, in a sequence's first page and in layers
with a sliding window or chunks, among its page's earlier tokens from offset R on), when it is the first token of a sequence (position 0: the attention
sink), or when the page's slots left are as many as its tokens left (so they are all used). A slot
is never given up to a later token: a row reads the same from its write on, whatever follows, and
the pool does not depend on how a sequence's tokens were cut into steps, as above (a write at
offset o drops the slots at offsets >= o: a page handed to a new sequence, a speculative rollback).
(Keeping each page's R worst tokens would need later tokens to take slots from earlier ones: what
a row reads, and so every later layer's K and V of the tokens before it in a step, would change
with the tokens written after it in the same step.)

Storage: R x (2 x Hkv x D x 2 + 4) + page_size x 4 bytes per page and layer; SmolLM2 (3 KV heads
of 64, pages of 16): R x 772 + 64 against 6,528 for the int8 page (+12.8 % at R = 1, +24.6 % at 2).

KV eviction "h2o" (`ModelConfig.kv_eviction`, jaxinfer.ops.kv_eviction) keeps beside the pages
each token's accumulated attention per KV head and the position a slot holds (heavy-hitter slots
take the rows of other tokens):

    evict_score   [num_slots, num_pages, page_size, num_kv_heads]   float32
    evict_pos     [num_slots, num_pages, page_size, num_kv_heads]   int32
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.kv_groups import KVGroups, kv_groups
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.linear_state import LinearState
from pallas_kernels.mla_attention.tpu import padded_row
from pallas_kernels.ragged_paged_attention.combined import row_width
from pallas_kernels.ragged_paged_attention.reference import QUANTIZED_KV_DTYPES, storage_dtype
from sharding.mesh import kv_heads_per_shard


def pool_kv_heads(config: ModelConfig, *, tp: int = 1) -> int:
    """KV heads the cache holds (all shards together): each tensor-parallel shard holds its
    model heads (`sharding.mesh.kv_heads_per_shard`: split, or replicated when there are fewer
    than tp). With layer groups of several shapes (Gemma 4), those of the widest K/V row."""
    return kv_heads_per_shard(pool_kv_shape(config, tp=tp)[0], tp) * tp


def token_row(kv_heads: int, head_dim: int, *, tp: int = 1, combined: bool = False) -> int:
    """Entries of one token's K/V row on one device: K and V of its KV heads (this module's layouts)."""
    local = kv_heads_per_shard(kv_heads, tp)
    return row_width(local, head_dim) if combined else 2 * local * head_dim


def page_factors(groups: KVGroups, *, tp: int = 1, combined: bool = False) -> tuple[int, ...]:
    """Per KV layer group: how many times page_size tokens its pages hold (jaxinfer.kv_groups): the
    widest K/V row per token on one device over the group's own; 1 everywhere when the shapes agree.

    How a group reads them differs by layout. A separate pool (CPU, GPU: row-major) is reshaped to
    page_size * f tokens per page (`KVCache.group_view`). A TPU tiles a combined page [page_size, W]
    in 16 tokens x 128 lanes, so that reshape would put the bytes in another order and XLA would
    copy the pool for every such layer; there a group page is f pages of page_size tokens side by
    side in the lanes, lane block j holding its tokens j * page_size.. (the attention kernel's and
    `write_rows`' `lane_blocks`), and the step gives the layer a page table of those pages."""
    rows = [token_row(heads, dim, tp=tp, combined=combined) for heads, dim in groups.shapes]
    widest = max(rows)
    if any(widest % r for r in rows):
        raise ConfigError(f"KV layer groups with K/V rows of {rows} entries per token: the widest is not a multiple of "
                          "each, so their pages cannot hold the same bytes")
    return tuple(widest // r for r in rows)


def pool_kv_shape(config: ModelConfig, *, tp: int = 1, combined: bool = False) -> tuple[int, int]:
    """(KV heads, head dim) of the pool's pages: the model's, or with layer groups of several shapes
    (Gemma 4) the group with the widest K/V row per token, page factor 1 (jaxinfer.kv_groups); the
    other groups see the same bytes as more tokens per page (`group_view`)."""
    groups = kv_groups(config)
    if len(set(groups.shapes)) <= 1:
        return config.num_kv_heads, config.head_dim
    factors = page_factors(groups, tp=tp, combined=combined)
    return groups.shapes[factors.index(1)]


def combined_pool(config: ModelConfig, kernels: Kernels) -> bool:
    """Whether the pool is one array of rows (`kv`): the TPU kernels' combined K|V rows, or any
    platform's latent rows of an MLA model (module docstring)."""
    return kernels.combines_kv or config.is_mla


def latent_row_width(head_dim: int, kernels: Kernels) -> int:
    """Entries of one token's latent row of head_dim values on one device: padded to whole 128-lane
    rows for the TPU kernels (`pallas_kernels.mla_attention.tpu.padded_row`), as it is elsewhere."""
    return padded_row(head_dim) if kernels.platform == "tpu" else head_dim


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_KV_DTYPES


# outlier tokens' residuals (module docstring): bfloat16 values stored as their bytes (uint16), since
# XLA:CPU scatters into a bfloat16 array by converting all of it (measured: 300 ms a write into a
# 100 000-page pool, against 0.01 ms as bytes), as e4m3 pages are (`reference.storage_dtype`)
OUTLIER_DTYPE = jnp.uint16


def check_outliers(outliers: int, page_size: int, dtype, *, kernels: Kernels | None = None,
                   config: ModelConfig | None = None) -> None:
    """ValueError, naming the setting, unless R = `outliers` residual slots per page can be kept:
    0 < R <= page_size, an int8 / e4m3 pool of separate K and V pages (the XLA attention reads
    them: not the TPU kernels' combined rows, not a latent MLA pool). `kernels` / `config`: None
    leaves those checks for later (before the backend and the model are known)."""
    what = f"kv_cache_outliers={outliers!r}"
    if isinstance(outliers, bool) or not isinstance(outliers, int) or not 0 < outliers <= page_size:
        raise ValueError(f"{what}: expected residual slots per page, an integer in [1, page_size={page_size}] (0: off)")
    if not is_quantized(dtype):
        raise ValueError(f"{what} keeps the worst-quantized tokens' residuals of an int8 / fp8 KV cache; "
                         f"kv_cache_dtype is {jnp.dtype(dtype).name}: set kv_cache_dtype='int8' or 'fp8'")
    if config is not None and getattr(config, "kv_eviction", None) is not None:
        raise ValueError(f"{what} with KV eviction ({config.kv_eviction.method!r}) is not supported: eviction moves "
                         f"rows within pages, which the outlier slots point at; use one or the other")
    if config is not None and config.is_mla:
        raise ValueError(f"{what} with {config.model_type}'s latent (MLA) KV rows is not supported: leave it at 0")
    if kernels is not None and kernels.combines_kv:
        raise ValueError(f"{what} is read by the XLA attention over separate K and V pools; the TPU attention kernel "
                         f"(kernel_impl 'pallas' / 'pallas-tpu') reads combined K|V rows and cannot add the residuals: "
                         f"use kernel_impl='reference' (or xla_kernels=('ragged_attention',)), or leave it at 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array | None = None  # [slots, P, page_size, Hkv, D]: separate layout
    v: jax.Array | None = None  # [slots, P, page_size, Hkv, D]
    k_scale: jax.Array | None = None  # [slots, P, page_size, Hkv] float32: quantized pools only
    v_scale: jax.Array | None = None
    kv: jax.Array | None = None  # [slots, P, page_size, Hkv * 2 * Ds]: combined layout (TPU kernels)
    kv_scale: jax.Array | None = None  # [slots, P, Hkv * 2 * page_size] float32: a quantized combined pool's
    # outlier tokens' residuals (kv_cache_outliers R > 0, separate quantized pools; module docstring)
    k_outlier: jax.Array | None = None  # [slots, P, R, Hkv, D] bfloat16, as its bytes (uint16: OUTLIER_DTYPE)
    v_outlier: jax.Array | None = None
    outlier_token: jax.Array | None = None  # [slots, P, R] int32: page offset, -1 for an empty slot
    outlier_error: jax.Array | None = None  # [slots, P, page_size] float32: each token's error
    # KV eviction "h2o" (jaxinfer.ops.kv_eviction): each slot's accumulated attention per KV head, and
    # the text position it holds (heavy-hitter slots take other tokens' rows)
    evict_score: jax.Array | None = None  # [slots, P, page_size, Hkv] float32
    evict_pos: jax.Array | None = None  # [slots, P, page_size, Hkv] int32
    # a hybrid model's per-sequence recurrent states (Gated DeltaNet layers: jaxinfer.ops.linear_state),
    # beside the pages; page operations never touch them
    state: LinearState | None = None
    # context parallelism (sequence_parallel_attention="context"): the pages are also split over the mesh
    # axis "sequence" (jaxinfer.runtime.placement.kv_partition_spec); static, so the step's specs follow it
    sequence_sharded: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def create(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, *, tp: int = 1,
               sharding=None, scale_sharding=None, kernels: Kernels = Kernels(), state_slots: int = 0,
               state_dtype=None, state_sharding=None, spec_block: int = 0, outliers: int = 0,
               outlier_sharding=None, outlier_token_sharding=None, eviction_sharding=None) -> "KVCache":
        """Zeroed pages in the kernels' layout (and scales when `dtype` is int8 / e4m3).
        `sharding` (a jax Sharding for the page arrays; `scale_sharding` for the scales) places
        each device's part directly, nothing whole anywhere. A hybrid model's cache also holds
        `state_slots` recurrent states (its convolutions' in `state_dtype`, default `dtype`),
        placed with `state_sharding` (jaxinfer.ops.linear_state; with `spec_block` > 0 also the
        inputs of verification chunks of that many tokens). `outliers` R > 0: R outlier-token
        residual slots per page (module docstring), placed with `outlier_sharding` (the residuals)
        and `outlier_token_sharding` (tokens and errors). A model with KV eviction "h2o" also gets
        its scores and positions (`eviction_shape`, placed with `eviction_sharding`)."""
        pool = KVCache._create_pages(config, num_pages, page_size, dtype, tp=tp, sharding=sharding,
                                     scale_sharding=scale_sharding, kernels=kernels)
        if outliers:
            check_outliers(outliers, page_size, dtype, kernels=kernels, config=config)
            shapes = KVCache.outlier_shapes(config, num_pages, page_size, outliers, tp=tp)
            residuals = jax.jit(lambda: jnp.zeros(shapes[0], OUTLIER_DTYPE), out_shardings=outlier_sharding)
            tokens = jax.jit(lambda: jnp.full(shapes[1], -1, jnp.int32), out_shardings=outlier_token_sharding)
            errors = jax.jit(lambda: jnp.zeros(shapes[2], jnp.float32), out_shardings=outlier_token_sharding)
            pool = dataclasses.replace(pool, k_outlier=residuals(), v_outlier=residuals(), outlier_token=tokens(),
                                       outlier_error=errors())
        if config.kv_eviction is not None and config.kv_eviction.method == "h2o":
            shape = KVCache.eviction_shape(config, num_pages, page_size, tp=tp)
            scores = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=eviction_sharding)
            positions = jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=eviction_sharding)
            pool = dataclasses.replace(pool, evict_score=scores(), evict_pos=positions())
        if not config.has_linear_layers:
            return pool
        if state_slots < 2:
            raise ValueError(f"a {config.model_type} cache needs recurrent-state slots (state_slots={state_slots})")
        state = LinearState.create(config, state_slots, state_dtype or dtype, sharding=state_sharding, spec_block=spec_block)
        return dataclasses.replace(pool, state=state)

    @staticmethod
    def _create_pages(config: ModelConfig, num_pages: int, page_size: int, dtype, *, tp: int, sharding, scale_sharding,
                      kernels: Kernels) -> "KVCache":
        shape = KVCache.shape(config, num_pages, page_size, dtype, tp=tp, kernels=kernels)
        zeros = jax.jit(lambda: jnp.zeros(shape, storage_dtype(dtype)), out_shardings=sharding)
        combined = combined_pool(config, kernels)
        if is_quantized(dtype) and len(set(kv_groups(config).shapes)) > 1:
            raise ValueError(f"kv_cache_dtype={jnp.dtype(dtype).name}: a quantized KV cache holds one K/V shape, and this "
                             f"{config.model_type} model's layer groups have several; use the model's dtype")
        if is_quantized(dtype):
            scale_shape = KVCache.scale_shape(config, num_pages, page_size, tp=tp, combined=combined)
            scales = jax.jit(lambda: jnp.zeros(scale_shape, jnp.float32), out_shardings=scale_sharding)
            if combined:
                return KVCache(kv=zeros(), kv_scale=scales())
            return KVCache(k=zeros(), v=zeros(), k_scale=scales(), v_scale=scales())
        return KVCache(kv=zeros()) if combined else KVCache(k=zeros(), v=zeros())

    @staticmethod
    def page_bytes(config: ModelConfig, page_size: int, dtype, *, tp: int = 1, kernels: Kernels = Kernels(),
                   outliers: int = 0) -> int:
        """Bytes of one page id: every slot, K and V (with their scales, and `outliers` residual slots)."""
        combined = combined_pool(config, kernels)
        entries = math.prod(KVCache.shape(config, 1, page_size, dtype, tp=tp, kernels=kernels)) * jnp.dtype(dtype).itemsize
        scales = math.prod(KVCache.scale_shape(config, 1, page_size, tp=tp, combined=combined)) * 4 if is_quantized(dtype) else 0
        extra = 0
        if outliers:  # K and V residuals in bfloat16 and a token (int32) per slot, an error (float32) per token
            residual, token, error = KVCache.outlier_shapes(config, 1, page_size, outliers, tp=tp)
            extra = 2 * math.prod(residual) * jnp.dtype(OUTLIER_DTYPE).itemsize + (math.prod(token) + math.prod(error)) * 4
        if config.kv_eviction is not None and config.kv_eviction.method == "h2o":  # a score and a position per head
            extra += math.prod(KVCache.eviction_shape(config, 1, page_size, tp=tp)) * 8
        return (entries + scales if combined else 2 * (entries + scales)) + extra

    @staticmethod
    def eviction_shape(config: ModelConfig, num_pages: int, page_size: int, *, tp: int = 1) -> tuple[int, ...]:
        """Shape of KV eviction "h2o"'s evict_score / evict_pos: [slots, P, page_size, Hkv]."""
        return (kv_groups(config).num_slots, num_pages, page_size, pool_kv_heads(config, tp=tp))

    @staticmethod
    def outlier_shapes(config: ModelConfig, num_pages: int, page_size: int, outliers: int, *,
                       tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Shapes of k_outlier / v_outlier [slots, P, R, Hkv, D], outlier_token [slots, P, R] and
        outlier_error [slots, P, page_size] (module docstring)."""
        heads, head_dim = pool_kv_shape(config, tp=tp)
        slots = kv_groups(config).num_slots
        return ((slots, num_pages, outliers, kv_heads_per_shard(heads, tp) * tp, head_dim), (slots, num_pages, outliers),
                (slots, num_pages, page_size))

    @staticmethod
    def scale_shape(config: ModelConfig, num_pages: int, page_size: int, *, tp: int = 1, combined: bool) -> tuple[int, ...]:
        """Shape of a quantized pool's scales: kv_scale [slots, P, Hkv * 2 * page_size] (combined;
        an MLA pool's [slots, P, tp * page_size], one per row), or k_scale and v_scale
        [slots, P, page_size, Hkv] each."""
        heads = pool_kv_heads(config, tp=tp)
        slots = kv_groups(config).num_slots
        if config.is_mla:  # one scale per latent row, on every shard
            return (slots, num_pages, tp * page_size)
        if combined:
            return (slots, num_pages, heads * 2 * page_size)
        return (slots, num_pages, page_size, heads)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None or self.kv_scale is not None

    @property
    def combined(self) -> bool:
        return self.kv is not None

    @property
    def outliers(self) -> int:
        """Outlier-token residual slots per page (0: none)."""
        return 0 if self.outlier_token is None else self.outlier_token.shape[-1]

    @property
    def pages(self) -> jax.Array:
        """The (first) page array: kv, or k."""
        return self.kv if self.combined else self.k

    @property
    def scales(self) -> jax.Array | None:
        """The (first) scale array of a quantized pool: kv_scale, or k_scale."""
        return self.kv_scale if self.combined else self.k_scale

    def page_arrays(self) -> "KVCache":
        """The cache without its recurrent states: what page operations (copy, swap, fold) act on."""
        return dataclasses.replace(self, state=None)

    def map_pages(self, fn, *others: "KVCache") -> "KVCache":
        """fn over every page array (and the matching arrays of `others`), the states kept."""
        pages = jax.tree.map(fn, self.page_arrays(), *(dataclasses.replace(other.page_arrays(), sequence_sharded=self.sequence_sharded)
                                                       for other in others))  # (the flag is static: one tree structure)
        return dataclasses.replace(pages, state=self.state)

    def fold_slots(self) -> "KVCache":
        """Every page array with its slot axis folded into the page axis: [slots * P, ...] (a free reshape)."""
        return self.map_pages(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]))

    def group_view(self, factor: int, kv_heads: int, head_dim: int) -> "KVCache":
        """A folded separate pool as a layer group of another shape sees it (jaxinfer.kv_groups):
        each page's bytes as page_size * factor tokens of kv_heads x head_dim (this device's
        heads), a free reshape of a row-major array. The pool itself when nothing differs. (A
        combined pool, tiled on a TPU, is read as lane blocks instead: `page_factors`.)"""
        if self.combined:
            if factor != 1:
                raise ValueError("a combined pool's groups of other rows are read as lane blocks, not reshaped")
            return self
        shape = (self.k.shape[0], self.k.shape[1] * factor, kv_heads, head_dim)
        if shape == self.k.shape:
            return self
        return dataclasses.replace(self, k=self.k.reshape(shape), v=self.v.reshape(shape))  # (never quantized: KVCache.create)

    def like(self, pool: "KVCache") -> "KVCache":
        """This (group) view back in `pool`'s shapes."""
        return self.map_pages(lambda a, b: a.reshape(b.shape), pool)

    def unfold_slots(self, num_slots: int) -> "KVCache":
        return self.map_pages(lambda a: a.reshape((num_slots, a.shape[0] // num_slots) + a.shape[1:]))

    @staticmethod
    def shape(config: ModelConfig, num_pages: int, page_size: int, dtype, *, tp: int = 1,
              kernels: Kernels = Kernels()) -> tuple[int, ...]:
        """Shape of each page array: kv [slots, P, page_size, tp * row] (row = combined.row_width of
        a shard's heads, or an MLA model's latent row), or k and v [slots, P, page_size, pool_kv_heads, head_dim]."""
        slots = kv_groups(config).num_slots
        if config.is_mla:
            return (slots, num_pages, page_size, tp * latent_row_width(config.head_dim, kernels))
        heads, head_dim = pool_kv_shape(config, tp=tp, combined=kernels.combines_kv)
        if kernels.combines_kv:
            row = row_width(kv_heads_per_shard(heads, tp), head_dim)
            return (slots, num_pages, page_size, tp * row)
        return (slots, num_pages, page_size, kv_heads_per_shard(heads, tp) * tp, head_dim)

    @property
    def num_slots(self) -> int:
        return self.pages.shape[0]

    @property
    def num_pages(self) -> int:
        return self.pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]

    def nbytes(self) -> int:
        """The pages' bytes (and their scales'), not the recurrent states'."""
        return sum(a.nbytes for a in jax.tree.leaves(self.page_arrays()))

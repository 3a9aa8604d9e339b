"""How many KV pages the pool gets: given, from a byte budget, or from the device's memory.

    pages = kv_pool_pages(capacity_bytes=32 << 30, utilization=0.9, weight_bytes=15 << 30,
                          scratch_bytes=1 << 30, page_bytes=2 << 20)      # 6553

Precedence (EngineConfig.resolved, jaxinfer.aot's ServingShape): `num_gpu_blocks_override`
(= `num_pages`) > `kv_cache_memory_bytes` > `gpu_memory_utilization`. On the CPU the pool is a
fixed `CPU_KV_CACHE_MEMORY_BYTES` unless given (host memory is shared with everything else).

On a TPU or GPU, every number is per device: the pool takes what is left of
`utilization * capacity` after the weights and the step's scratch, where

- capacity is what the device's allocator may hold (`memory_stats()['bytes_limit']`; on a GPU JAX
  preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of the memory, 0.75 unless set, and that is the
  limit) or, for `jaxinfer aot`, the described chip's HBM;
- scratch is what the compiled step of the largest bucket needs beyond its weights and pool
  (XLA's `memory_analysis()`: temporaries, inputs, outputs not aliased to the donated pool). It
  does not grow with the pool, which is updated in place, so it is measured by compiling over a
  pool of one sequence (`measure_step_scratch`), before the real pool exists.

The same function sizes the engine's pool (engine/build.py, on its devices) and the pool
`jaxinfer aot` plans (aot/plan.py, for a chip that is not here). Variants of the largest bucket
with more logits rows (prompt logprobs) or penalties need a little more scratch than the one
measured; what `utilization` leaves free covers them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.kv_groups import describe, window_pages
from jaxinfer.engine.model_runner import empty_inputs, every_processor_sampling
from jaxinfer.ops.batch import BucketKey, Buckets
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import OUTLIER_DTYPE, KVCache, combined_pool, is_quantized
from jaxinfer.ops.linear_state import DraftInputs, LinearState
from jaxinfer.runtime.placement import kv_partition_spec, linear_state_spec
from jaxinfer.runtime.step import StepFunction
from pallas_kernels.ragged_paged_attention.reference import storage_dtype
from sharding import rules

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, on TPUs too
CPU_KV_CACHE_MEMORY_BYTES = 1 << 30  # the CPU's pool per replica unless given


def kv_pool_pages(*, capacity_bytes: int, utilization: float, weight_bytes: int, scratch_bytes: int,
                  page_bytes: int, sequence_shards: int = 1) -> int:
    """Whole KV pages (per replica, page 0 included) that fit on each device beside the weights
    and the step's scratch, within `utilization` of its capacity; 0 when none does. Every size
    is per device. `sequence_shards` sp (context parallelism): each device holds 1/sp of its
    replica's pages, so the replica gets sp times what one device fits."""
    budget = int(capacity_bytes * utilization) - weight_bytes - scratch_bytes
    return max(0, budget // page_bytes) * sequence_shards


def pages_for_bytes(kv_bytes: int, page_bytes: int, max_pages: int, shards: int = 1) -> int:
    """A pool of `kv_bytes` (per replica, all its devices together) in pages of `page_bytes`
    (likewise), at most `max_pages` (every sequence at max_model_len) and at least 2. `shards`
    (context parallelism: the pool split over the sequence axis, a scratch page in each shard): a
    multiple of it, at least 2 pages a shard."""
    if shards == 1:
        return max(2, min(kv_bytes // page_bytes, max_pages))
    return max(2, min(kv_bytes // page_bytes, max_pages + shards - 1) // shards) * shards


def device_capacity_bytes(mesh) -> int | None:
    """The least memory a device of `mesh` (those of this process) lets its allocator hold
    (`memory_stats()['bytes_limit']`); None where the platform does not say (the CPU)."""
    limits = []
    for device in np.asarray(mesh.devices).flat:
        if getattr(device, "process_index", 0) != jax.process_index():
            continue
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def least_over_processes(value: int) -> int:
    """The smallest of every process's `value` (each process calls it): hosts whose devices
    report different limits still size one pool, as the processes of one mesh must."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def bytes_per_device(tree) -> int:
    """Bytes one device holds of the arrays of `tree` (placed arrays or ShapeDtypeStructs with a
    sharding: each leaf's shard; replicated leaves whole), an array held twice counted once (a
    draft model that is the target itself)."""
    total = 0
    for leaf in {id(leaf): leaf for leaf in jax.tree.leaves(tree)}.values():
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def abstract_pool(config: ModelConfig, num_pages: int, page_size: int, dtype, *, tp: int, kernels: Kernels,
                  mesh, state_slots: int = 0, state_dtype=None, spec_block: int = 0, outliers: int = 0,
                  sequence: bool = False) -> KVCache:
    """The KV pool `KVCache.create` would place (`num_pages` over every replica; a hybrid model's
    `state_slots` recurrent states too, and with `spec_block` > 0 its verification chunks'
    inputs; `outliers` residual slots per page), as ShapeDtypeStructs with their shardings on `mesh`:
    nothing allocated. `sequence` (context parallelism): the pages split over the sequence axis too."""
    pool = _abstract_pages(config, num_pages, page_size, dtype, tp=tp, kernels=kernels, mesh=mesh, sequence=sequence)
    if outliers:
        specs = kv_partition_spec(True, outliers=True)
        residual, token, error = KVCache.outlier_shapes(config, num_pages, page_size, outliers, tp=tp)
        at = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
        pool = dataclasses.replace(pool, k_outlier=at(residual, OUTLIER_DTYPE, specs.k_outlier),
                                   v_outlier=at(residual, OUTLIER_DTYPE, specs.v_outlier),
                                   outlier_token=at(token, jnp.int32, specs.outlier_token),
                                   outlier_error=at(error, jnp.float32, specs.outlier_error))
    if config.kv_eviction is not None and config.kv_eviction.method == "h2o":  # its scores beside the pages
        spec = kv_partition_spec(eviction=True).evict_score
        shape = KVCache.eviction_shape(config, num_pages, page_size, tp=tp)
        pool = dataclasses.replace(pool, evict_score=jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)),
                                   evict_pos=jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, spec)))
    if not config.has_linear_layers:
        return pool
    conv, recurrent = LinearState.shapes(config, state_slots)
    spec = linear_state_spec(drafts=spec_block > 0)
    struct = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    drafts = None
    if spec_block:  # verification chunks' inputs (jaxinfer.ops.linear_state.DraftInputs)
        shapes = LinearState.draft_shapes(config, state_slots, spec_block)
        drafts = DraftInputs(**{f: struct(getattr(shapes, f), (state_dtype or dtype) if f == "conv" else jnp.float32,
                                          getattr(spec.drafts, f)) for f in ("conv", "k", "v", "g", "beta")})
    return dataclasses.replace(pool, state=LinearState(
        conv=struct(conv, state_dtype or dtype, spec.conv), recurrent=struct(recurrent, jnp.float32, spec.recurrent), drafts=drafts))


def _abstract_pages(config: ModelConfig, num_pages: int, page_size: int, dtype, *, tp: int, kernels: Kernels,
                    mesh, sequence: bool = False) -> KVCache:
    shape = KVCache.shape(config, num_pages, page_size, dtype, tp=tp, kernels=kernels)
    combined = combined_pool(config, kernels)
    specs = kv_partition_spec(is_quantized(dtype), combined, sequence=sequence)
    struct = lambda shp, dt, spec: jax.ShapeDtypeStruct(shp, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    stored = storage_dtype(dtype)  # e4m3 pools hold bytes
    scale_shape = KVCache.scale_shape(config, num_pages, page_size, tp=tp, combined=combined)
    scales = lambda spec: struct(scale_shape, jnp.float32, spec) if is_quantized(dtype) else None  # noqa: E731  (a float32 scale per token and head)
    if combined:
        return KVCache(kv=struct(shape, stored, specs.kv), kv_scale=scales(specs.kv_scale), sequence_sharded=sequence)
    return KVCache(k=struct(shape, stored, specs.k), v=struct(shape, stored, specs.v), k_scale=scales(specs.k_scale),
                   v_scale=scales(specs.v_scale), sequence_sharded=sequence)


def abstract_inputs(step: StepFunction, key: BucketKey, buckets: Buckets, with_lora: bool, *,
                    with_rope_positions: bool = False, image_inputs: tuple[int, int, bool] | None = None):
    """(batch, prev_tokens) of bucket `key` (one of `buckets`), abstract and sharded as the model
    program takes them; `with_rope_positions` (an M-RoPE model's every batch) and `image_inputs`
    (the image variant) as `empty_inputs`."""
    batch = _abstract(step, empty_inputs(key, buckets.pages_per_seq, step.num_replicas, with_lora=with_lora,
                                         num_groups=buckets.num_groups, with_rope_positions=with_rope_positions,
                                         image_inputs=image_inputs))
    prev_tokens = jax.ShapeDtypeStruct((step.num_replicas, step.max_rows), np.int32,
                                       sharding=NamedSharding(step.mesh, rules.per_replica(2)))
    return batch, prev_tokens


def _abstract(step: StepFunction, host):
    """A per-replica host tree as ShapeDtypeStructs placed as the step places it."""
    return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        host, step.input_shardings(host))


def largest_bucket(keys) -> BucketKey:
    """The bucket whose step needs the most scratch: the most tokens, then sequences."""
    return max(keys, key=lambda k: (k.num_tokens, k.num_seqs, k.num_logits, k.query_block))


def step_scratch_bytes(memory, weight_bytes: int, pool_bytes: int) -> int:
    """What a compiled step (`memory` = its `memory_analysis()`) needs on a device beyond its
    weights and KV pool: temporaries, the batch's inputs, outputs that do not reuse the donated
    pool's buffer."""
    peak = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes)
    return max(0, peak - weight_bytes - pool_bytes)


def measure_step_scratch(step: StepFunction, params, pool: KVCache, buckets: Buckets, *, with_lora: bool,
                         with_rope_positions: bool = False) -> int:
    """`step_scratch_bytes` of the largest bucket's step, compiled for `params` over `pool` (an
    abstract pool: `abstract_pool`, one sequence's pages are enough): the larger of its model
    program's and of its sampling programs' with every logits processor on (they run one after
    the other; the model's logits are the latter's arguments)."""
    key = largest_bucket(buckets.all_keys())
    lowered = step.lower(params, pool, *abstract_inputs(step, key, buckets, with_lora,
                                                        with_rope_positions=with_rope_positions), key)
    model = step_scratch_bytes(lowered.compile().memory_analysis(), bytes_per_device(params), bytes_per_device(pool))
    logits, _, *hidden = lowered.out_info
    sampling = lower_sampling(step, key.num_logits, logits.shape[-1], buckets.pages_per_seq * pool.page_size,
                              hidden[0].shape[-1] if hidden else None)
    return max(model, *(step_scratch_bytes(program.compile().memory_analysis(), 0, 0) for program in sampling))


def lower_sampling(step: StepFunction, num_rows: int, vocab: int, max_history: int, hidden_size: int | None = None) -> list:
    """The sampling programs of a step of `num_rows` logits rows with every logits processor on
    (StepFunction.lower_sampling), over abstract logits [replicas, num_rows, vocab] (and hidden
    states [replicas, num_rows, hidden_size] with return_hidden)."""
    sampling = _abstract(step, every_processor_sampling(num_rows, vocab, max_history, step.num_replicas))
    rows = step.logits_layout(num_rows, vocab)
    hidden = None if hidden_size is None else jax.ShapeDtypeStruct(rows.shape[:2] + (hidden_size,), jnp.float32,
                                                                   sharding=rows.sharding)
    return step.lower_sampling(rows, sampling, hidden)


@dataclasses.dataclass(frozen=True)
class PoolSummary:
    """The pool as vLLM reports it at start-up, and its layer groups (jaxinfer.kv_groups)."""

    num_pages: int  # per replica, the scratch page 0 included
    page_size: int
    max_model_len: int
    num_replicas: int
    sized_by: str  # "num_gpu_blocks_override", "kv_cache_memory_bytes=...", "gpu_memory_utilization=0.9 of ..."
    windows: tuple = (None,)  # each KV layer group's sliding window (None: full attention)
    page_factors: tuple = ()  # each group's pages hold page_size times this many tokens (() : 1 each)
    state_bytes_per_sequence: int = 0  # a hybrid model's recurrent states, one slot (jaxinfer.ops.linear_state)
    num_prefix_states: int = 0  # a hybrid model's saved states for its prefix cache, per replica

    @property
    def group_page_sizes(self) -> tuple[int, ...]:
        """Each group's tokens per page."""
        return tuple(self.page_size * f for f in self.page_factors or (1,) * len(self.windows))

    def pages_per_sequence(self) -> int:
        """Pages (all groups) one sequence of max_model_len holds as it decodes its last token."""
        return sum(window_pages(w, self.max_model_len, ps) for w, ps in zip(self.windows, self.group_page_sizes))

    def __str__(self) -> str:
        pages = self.num_pages - 1  # page 0 takes padding's writes
        sequences = pages // self.pages_per_sequence()
        per_replica = f" per replica ({self.num_replicas} replicas)" if self.num_replicas > 1 else ""
        if self.windows == (None,):
            size = f"{pages} pages x {self.page_size} tokens = {pages * self.page_size} tokens{per_replica}"
        else:
            kinds = ", ".join(f"{self.windows.count(w)} {describe(w)}" for w in dict.fromkeys(self.windows))
            size = (f"{pages} pages x {self.page_size} tokens{per_replica} shared by {len(self.windows)} layer groups "
                    f"({kinds}); a sequence of max_model_len holds {self.pages_per_sequence()} pages, "
                    f"{sum(-(-self.max_model_len // ps) for ps in self.group_page_sizes)} if every layer kept it whole")
        b = self.state_bytes_per_sequence
        amount = f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"
        states = f"; recurrent states {amount} per sequence (a slot each, max_num_seqs of them)" if b else ""
        if b and self.num_prefix_states:
            states += f" and per saved prefix state ({self.num_prefix_states} of them)"
        return (f"KV cache: {size}; max concurrency at max_model_len {self.max_model_len}: {sequences} sequences "
                f"({self.sized_by}){states}")

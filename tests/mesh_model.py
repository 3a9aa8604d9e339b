"""A model on a device mesh, driven step by step: the harness of the sharding tests.

`MeshModel(model_dir, ParallelConfig(...))` loads a checkpoint onto a mesh (every process's
devices) with one page allocator per replica; `run_scenario` runs the same steps on any mesh (a
ragged prefill of four prompts, three decode steps, a prompt prefilled in two chunks beside
them), dealing sequence i to replica i % replicas, and returns the logits of every requested
row. No torch here: multi-process workers import it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kv_groups import kv_groups
from jaxinfer.ops.batch import BucketKey, Buckets, SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache, combined_pool, page_factors
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.runtime.placement import kv_partition_spec, linear_state_spec, param_partition_specs
from jaxinfer.runtime.step import StepFunction
from sharding.mesh import ParallelConfig, make_mesh

PAGE_SIZE = 4
PAGES_PER_REPLICA = 48
KEY = BucketKey(num_tokens=32, num_seqs=8, num_logits=32, query_block=8)  # every step uses this one bucket
BUCKETS = Buckets((32,), max_num_seqs=8, pages_per_seq=12)
REL_TOL = 1e-5

SHAPES = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96)


class MeshModel:
    """A model loaded onto a mesh, with one page allocator per replica."""

    def __init__(self, model_dir, parallel: ParallelConfig, kernels: Kernels = Kernels()):
        source = resolve_model(model_dir)
        self.config = config = read_config(source)
        self.mesh = make_mesh(parallel)
        graphdef, self.params = load_params(source, config, jnp.float32, jnp.float32, kernels=kernels, parallel=parallel,
                                            mesh=self.mesh, progress=False)
        self.step = StepFunction(graphdef, 0, mesh=self.mesh, param_specs=param_partition_specs(self.params, config))
        self.replicas = parallel.num_replicas
        sharding = jax.sharding.NamedSharding(self.mesh, kv_partition_spec(combined=combined_pool(self.config, kernels)).pages)
        state_sharding = jax.tree.map(lambda spec: jax.sharding.NamedSharding(self.mesh, spec), linear_state_spec(),
                                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        self.kv = KVCache.create(config, PAGES_PER_REPLICA * self.replicas, PAGE_SIZE, tp=parallel.tp, sharding=sharding,
                                 kernels=kernels, state_slots=8 * self.replicas, state_sharding=state_sharding)  # (hybrids')
        self.next_page = [1] * self.replicas  # page 0 of every replica is its scratch page
        groups = kv_groups(config)
        self.num_groups = groups.num_groups
        self.buckets = dataclasses.replace(BUCKETS, num_groups=self.num_groups)
        # each group's tokens per page (jaxinfer.kv_groups: groups of another shape hold more)
        self.page_sizes = [PAGE_SIZE * f for f in page_factors(groups, tp=parallel.tp, combined=kernels.combines_kv)]

    def allocate(self, replica: int, num_tokens: int) -> list[list[int]]:
        """Fresh pages for num_tokens in every KV layer group (a page-table row each)."""
        rows = []
        for page_size in self.page_sizes:
            n = -(-num_tokens // page_size)
            first = self.next_page[replica]
            self.next_page[replica] += n
            rows.append(list(range(first, first + n)))
        assert self.next_page[replica] <= PAGES_PER_REPLICA
        return rows

    def run(self, chunks: list[tuple[int, SequenceChunk]]) -> list[np.ndarray]:
        """One step of (replica, chunk) pairs; the logits [rows, V] of each chunk's requested rows."""
        per_replica = [[c for r, c in chunks if r == replica] for replica in range(self.replicas)]
        packed = [pack_batch(cs, self.buckets, self.page_sizes, KEY) for cs in per_replica]
        batch = self.step.place_inputs(stack_replicas([b for _, b, _ in packed]))
        logits, self.kv = self.step.forward(self.params, self.kv, batch, query_block=KEY.query_block)
        logits = np.asarray(logits, np.float64)  # [replicas, R, V]
        rows = {replica: iter(rows) for replica, (_, _, rows) in enumerate(packed)}
        return [logits[r][next(rows[r])] for r, _ in chunks]


def run_scenario(model: MeshModel) -> list[np.ndarray]:
    """Prefill, decodes, and a chunked prefill riding along with decodes; sequence i on replica i % replicas."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [list(map(int, rng.integers(3, vocab, n))) for n in (5, 9, 3, 12)]
    extra = [list(map(int, rng.integers(3, vocab, 4))) for _ in prompts]  # decoded one by one
    late = list(map(int, rng.integers(3, vocab, 11)))  # prefilled in chunks of 6 and 5
    replica = lambda i: i % model.replicas  # noqa: E731
    pages = [model.allocate(replica(i), len(p) + len(e)) for i, (p, e) in enumerate(zip(prompts, extra))]
    late_pages = model.allocate(replica(4), len(late))
    # (a hybrid model's sequence i keeps its recurrent states in slot i + 1 of its replica)
    out = model.run([(replica(i), SequenceChunk(p, 0, pages[i], list(range(len(p))), state_slot=i + 1))
                     for i, p in enumerate(prompts)])
    for t in range(3):
        decodes = [(replica(i), SequenceChunk([extra[i][t]], len(p) + t, pages[i], [0], state_slot=i + 1))
                   for i, p in enumerate(prompts)]
        if t == 1:
            decodes.append((replica(4), SequenceChunk(late[:6], 0, late_pages, list(range(6)), state_slot=5)))
        if t == 2:
            decodes.append((replica(4), SequenceChunk(late[6:], 6, late_pages, list(range(5)), state_slot=5)))
        out += model.run(decodes)
    return out


def mesh_id(p: ParallelConfig) -> str:
    """"dp2-tp4", "sp4-ring": the sizes above 1, for test ids."""
    sizes = [f"{name}{size}" for name, size in (("pp", p.pp), ("dp", p.dp), ("sp", p.sp), ("ep", p.ep), ("tp", p.tp)) if size > 1]
    return "-".join(sizes + ([p.sp_attention] if p.sp > 1 else []))


def assert_same_logits(got, want, rel_tol: float = REL_TOL):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.abs(g - w).max() / np.abs(w).max() < rel_tol, np.abs(g - w).max() / np.abs(w).max()



"""Logical axis names -> mesh axes -> PartitionSpecs.

Every parameter and cache dimension carries a logical name (what it is: "heads", "mlp",
"experts", "pages", ...; see `jaxinfer.models.param_layout`). One table, `RULES`, says which
mesh axis shards each name; every name it does not list is replicated. The step, the loader and
checkpoint restore all take their shardings from here, so a parameter is laid out the same way
everywhere.

Tensor parallelism (Megatron) shards the columns of the column-parallel projections (fused QKV,
gate/up) and the rows of the row-parallel ones (o, down) over "tensor", so each layer needs one
all-reduce after o and one after down; KV heads follow the query heads. The embedding table and
the LM head are split on the hidden dimension ("embed_tp"): the lookup is all-gathered and the
logits all-reduced, so no vocabulary padding is needed; with lm_head_parallel="vocab" they are split
on the vocabulary instead ("vocab_tp"), and the logits stay split on it for the sampler (`VOCAB_LOGITS`).
Expert weights split over "expert".

Pipeline parallelism splits the leading layer axis of every stacked weight, and of the KV cache's
layer slots, over "pipeline": stage i holds layers i * L / pp .. (i + 1) * L / pp - 1 and their pages.

Replicas: the "data" and "expert" axes together index the attention replicas. Each replica has
its own batch and its own pages of the KV cache (split on the page axis); outside the MoE layers
the expert axis is simply more data parallelism (a dense model has ep = 1).
"""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The mesh axes that index attention replicas (each with its own batch and KV pages).
REPLICA_AXES = ("data", "expert")

RULES: dict[str, str | tuple[str, ...]] = {
    "layers": "pipeline",  # the leading [num_layers] axis of stacked weights and KV slots: a stage's layers
    "embed_tp": "tensor",  # hidden dim of the embedding table and LM head
    "vocab_tp": "tensor",  # their vocabulary instead, with lm_head_parallel="vocab" (param_layout.VOCAB_SPLIT_AXES)
    "qkv": "tensor",  # fused q/k/v columns (shard-major: param_layout)
    "heads": "tensor",  # o_proj rows (query heads x head_dim)
    "q_heads": "tensor",  # one entry per query head (attention sinks)
    "mlp": "tensor",  # gate/up columns, down rows (dense, expert and shared MLPs)
    "kv_heads": "tensor",
    "experts": "expert",
    "pages": REPLICA_AXES,  # KV pages: each replica owns a contiguous block
    "replicas": REPLICA_AXES,  # the leading axis of per-replica batch arrays
}

# KV cache pages [L, P, page_size, Hkv, D].
KV_CACHE_AXES = ("layers", "pages", None, "kv_heads", "head_dim")


def logical_to_spec(axes: tuple[str | None, ...], rules: dict = RULES) -> PartitionSpec:
    """(logical name per dim) -> PartitionSpec; names absent from `rules` are replicated."""
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def named_sharding(mesh: Mesh, axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes))


def param_specs(param_axes: dict[str, tuple[str | None, ...]]) -> dict[str, PartitionSpec]:
    """Flat parameter name -> PartitionSpec."""
    return {name: logical_to_spec(axes) for name, axes in param_axes.items()}


def replicated(ndim: int = 0) -> PartitionSpec:
    return PartitionSpec(*([None] * ndim))


# logits rows [replicas, R, V] of a vocabulary-split LM head: split on the vocabulary too
VOCAB_LOGITS = PartitionSpec(REPLICA_AXES, None, "tensor")


def per_replica(ndim: int) -> PartitionSpec:
    """Spec of an array whose leading axis is the replica index ([replicas, ...])."""
    return PartitionSpec(REPLICA_AXES, *([None] * (ndim - 1)))


def num_replicas(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["expert"]

"""Where every array lives on the mesh: parameters, the KV cache and per-replica step inputs.

One rule for parameters, used by the loader (flat names, before the model exists), the step
(the model's nnx State, quantized weights included) and checkpoint restore: a parameter's
logical axes (`jaxinfer.models.param_layout.param_axes`) mapped to mesh axes by
`sharding.rules`. A dimension that the mesh axis does not divide (a tp = 1 layout restored onto
a larger mesh, before its relayout) stays whole.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.models.lora import LORA_AXES
from jaxinfer.config import ModelConfig
from jaxinfer.models.param_layout import param_axes, param_shapes, quantized_axes
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.ops.linear_state import DraftInputs, LinearState
from sharding import rules


def param_spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh | None = None, *, field: str | None = None) -> PartitionSpec:
    """PartitionSpec of one parameter with logical `axes` and `shape`, or of one `field` of a
    quantized one: per-column scales ([..., N]) drop the input dim's axis, an input order
    ([..., K]) the output dim's; a 2:4 weight's values ([..., 4, K / 8, N]) keep their planes whole. With a mesh, an axis whose size does not divide the dimension is
    dropped (the dimension stays whole)."""
    if field in ("scales", "offsets") and len(shape) == len(axes) - 1:
        axes = axes[:-2] + axes[-1:]
    if field == "input_order":
        axes = axes[:-1]
    if field == "values":  # a Sparse24Weight's kept values [..., 4, K / 8, N]: the planes' axis whole
        axes = axes[:-2] + (None,) + axes[-2:]
    spec = rules.logical_to_spec(axes)
    if mesh is None:
        return spec
    return PartitionSpec(*(a if a is None or shape[i] % _axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)))


QUANTIZED_FIELDS = ("qweight", "scales", "offsets", "input_order", "values", "mask")  # (values, mask: a Sparse24Weight's)


def param_partition_specs(params, config: ModelConfig, lm_head_parallel: str = "hidden") -> object:
    """A tree like `params` (an nnx State, maybe holding QuantizedWeights) of PartitionSpecs
    (`lm_head_parallel`: the embedding / LM head split, param_layout.LM_HEAD_PARALLEL)."""
    axes = {**param_axes(config, lm_head_parallel), **LORA_AXES}  # the LoRA slot table, when the model has one
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = []
    for path, leaf in leaves:
        name = ".".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))
        field = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else None
        field = field if field in QUANTIZED_FIELDS else None  # an array of a QuantizedWeight (not a Variable's .value)
        specs.append(param_spec(quantized_axes(name, lm_head_parallel) if field else axes[name], leaf.shape, field=field))
    return jax.tree_util.tree_unflatten(treedef, specs)


def param_shardings(config: ModelConfig, mesh: Mesh, tp: int | None = None, spec: dict | None = None) -> dict[str, NamedSharding]:
    """Flat param name -> NamedSharding on `mesh`, for the layout of tensor-parallel degree `tp`
    (default: the mesh's). With a loader `spec` (param_layout.quantized_loader_spec): one per
    entry of it, a quantized param's stored arrays `<name>:<field>` included."""
    tp = mesh.shape["tensor"] if tp is None else tp
    if spec is None:
        shapes = param_shapes(config, tp)
        return {name: NamedSharding(mesh, param_spec(axes, shapes[name], mesh)) for name, axes in param_axes(config).items()}
    out = {}
    for entry, (shape, *_) in spec.items():
        name, quantized, _ = entry.partition(":")
        out[entry] = NamedSharding(mesh, param_spec(quantized_axes(name) if quantized else param_axes(config)[name], shape, mesh))
    return out


def kv_partition_spec(quantized: bool = False, combined: bool = False, linear: bool = False, drafts: bool = False,
                      outliers: bool = False, eviction: bool = False, sequence: bool = False) -> KVCache:
    """`kv_partition_spec_replicated`'s spec; `sequence` (context parallelism): every page array's
    page axis also split over "sequence", after the replica axes, so each device of the axis holds a
    contiguous block of its replica's pages (ops.attention.attend_context_parallel), and the spec
    is marked `sequence_sharded` as the cache is."""
    spec = kv_partition_spec_replicated(quantized, combined, linear, drafts, outliers, eviction)
    if not sequence:
        return spec
    if outliers or eviction or linear:
        raise ValueError("a KV pool split over the sequence axis (sequence_parallel_attention='context') holds pages only: "
                         "no outlier slots, KV eviction scores or recurrent states")
    pages = rules.logical_to_spec(("pages",))[0]
    split = lambda p: PartitionSpec(p[0], (*pages, "sequence"), *p[2:]) if p is not None else None  # noqa: E731
    return dataclasses.replace(jax.tree.map(split, spec, is_leaf=lambda x: isinstance(x, PartitionSpec)),
                               sequence_sharded=True)


def kv_partition_spec_replicated(quantized: bool = False, combined: bool = False, linear: bool = False, drafts: bool = False,
                                 outliers: bool = False, eviction: bool = False) -> KVCache:
    """The KV cache's spec: pages split over the replica axes, KV heads over "tensor" (a
    quantized pool's scales, [L, P, page_size, Hkv], likewise; a combined pool's rows
    [L, P, page_size, Hkv * 2 * Ds] split into runs of whole heads); `linear`: with a hybrid
    model's recurrent states, their slots split over the replica axes like pages, their channels and
    value heads over "tensor" like the projections that make them (`drafts`: with the inputs of
    verification chunks, likewise); `outliers`: with a quantized pool's outlier slots, their
    residuals [L, P, R, Hkv, D] split like the pages, their tokens [L, P, R] and errors
    [L, P, page_size] over the replica axes only (every tensor shard picks the same tokens:
    ops.attention.outlier_errors);
    `eviction`: with KV eviction "h2o"'s scores and positions [L, P, page_size, Hkv], split like
    a quantized pool's scales (ops.kv_eviction)."""
    if eviction:
        if combined or quantized:
            raise ValueError("KV eviction scores live beside separate float K and V pools")
        spec = rules.logical_to_spec(rules.KV_CACHE_AXES)
        per_head = rules.logical_to_spec(rules.KV_CACHE_AXES[:-1])
        return KVCache(k=spec, v=spec, evict_score=per_head, evict_pos=per_head,
                       state=linear_state_spec(drafts) if linear else None)
    state = linear_state_spec(drafts) if linear else None
    spec = rules.logical_to_spec(rules.KV_CACHE_AXES)
    if combined:  # rows [L, P, page_size, Hkv * 2 * Ds] and scales [L, P, Hkv * 2 * page_size], head-major
        rows = rules.logical_to_spec(rules.KV_CACHE_AXES[:-1])
        return KVCache(kv=rows, kv_scale=rules.logical_to_spec(("layers", "pages", "kv_heads")) if quantized else None,
                       state=state)
    if not quantized:
        return KVCache(k=spec, v=spec, state=state)
    scale_spec = rules.logical_to_spec(rules.KV_CACHE_AXES[:-1])
    if outliers:
        token_spec = rules.logical_to_spec(rules.KV_CACHE_AXES[:3])
        return KVCache(k=spec, v=spec, k_scale=scale_spec, v_scale=scale_spec, k_outlier=spec, v_outlier=spec,
                       outlier_token=token_spec, outlier_error=token_spec, state=state)
    return KVCache(k=spec, v=spec, k_scale=scale_spec, v_scale=scale_spec, state=state)


def linear_state_spec(drafts: bool = False) -> LinearState:
    """Recurrent states (jaxinfer.ops.linear_state): [L_lin, slots, ...] split on slots over the
    replica axes (and `drafts`, the verification chunks' inputs, as the states they advance)."""
    inputs = None
    if drafts:
        per_head = rules.logical_to_spec(("layers", "pages", None, "heads", None))
        gates = rules.logical_to_spec(("layers", "pages", None, "heads"))
        inputs = DraftInputs(conv=rules.logical_to_spec(("layers", "pages", None, "qkv")), k=per_head, v=per_head,
                             g=gates, beta=gates)
    return LinearState(conv=rules.logical_to_spec(("layers", "pages", None, "qkv")),
                       recurrent=rules.logical_to_spec(("layers", "pages", "heads", None, None)), drafts=inputs)


def cache_spec(kv: KVCache) -> KVCache:
    """The spec of this cache (`kv_partition_spec` of its kind)."""
    return kv_partition_spec(kv.quantized, kv.combined, kv.state is not None, kv.state is not None and kv.state.drafts is not None,
                             kv.outliers > 0, kv.evict_score is not None, kv.sequence_sharded)


def kv_shardings(mesh: Mesh, quantized: bool = False, combined: bool = False, linear: bool = False,
                 drafts: bool = False, outliers: bool = False, eviction: bool = False, sequence: bool = False) -> KVCache:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        kv_partition_spec(quantized, combined, linear, drafts, outliers, eviction, sequence),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def per_replica_specs(tree):
    """PartitionSpec of every array of a per-replica input tree (leading axis = replica)."""
    return jax.tree.map(lambda a: rules.per_replica(np.ndim(a)), tree)


def put_global(tree, specs, mesh: Mesh):
    """Arrays -> jax Arrays placed with NamedSharding(mesh, spec). Host (numpy) arrays: every
    process passes the same global values (the engine runs in lockstep on every host) and places
    its own shards; jax Arrays are resharded on the devices."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(a, sharding):
        if isinstance(a, jax.Array):
            return jax.device_put(a, sharding)
        return jax.make_array_from_callback(np.shape(a), sharding, lambda index: np.asarray(a)[index])

    return jax.tree.map(put, tree, shardings)


def _axis_size(mesh: Mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[n] for n in names]))

"""Map a checkpoint's HF-named tensors onto jaxinfer's flat, stacked parameters, reading only
what each device needs.

The caller gives the target spec: flat param name -> (shape, dtype), or (shape, dtype, columns)
for a fused param. A param is *stacked* when its HF tensors are per layer (`layers.*`: shape
[L, ...], layer i's tensor fills slot i) or per layer and expert (MoE weights: [L, E, ...]); the
name map says which. A fused param holds several HF tensors side by side on its last axis;
`columns` lists what lies there, in order, as either

    (part, width)              the whole of that part's HF tensor, e.g. ("q", 576), or
    (part, src_start, width)   rows src_start : src_start + width of it (a *segment*),

so `(("q", 576), ("k", 192), ("v", 192))` is `[q | k | v]`, and a tensor-parallel layout
interleaves segments, `[q0 | k0 | v0 | q1 | k1 | v1]`, each shard's columns contiguous. A part's
segments may repeat rows (KV heads replicated over more shards than there are heads), but
together they must cover its HF tensor.

Loading runs in two stages:

1. `plan_params(listing, spec, ...)` checks the checkpoint's tensor directory (names and shapes,
   no data) against the spec: every unknown, misplaced, misshapen, duplicate or missing tensor
   raises CheckpointError naming it, before a byte of weight data is read.
2. `read_blocks(plan, indices, read)` builds rectangular blocks of a param (the shards devices
   hold), reading from each HF tensor only the rows and columns that fall inside a block.

`load_params` ties them together. Without shardings it returns whole numpy arrays; with a
sharding per param it builds each jax array from its devices' blocks, so each process reads
only its slices. A stacked param bigger than `max_host_bytes` is placed a few layers at a time
and assembled on the device, so the host never holds much more than that of it at once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Iterable, Mapping

import numpy as np
from tqdm.auto import tqdm

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.name_maps import arch_names
from checkpoints_conv.tensor_source import ArraySource, TensorSource

Columns = tuple[tuple, ...]  # (part, width) or (part, src_start, width) entries, in order
Spec = Mapping[str, tuple[tuple[int, ...], np.dtype] | tuple[tuple[int, ...], np.dtype, Columns]]
Index = tuple[slice, ...]
ReadFn = Callable[[str, Index], np.ndarray]  # (hf_name, index into the HF tensor) -> array

_MAX_LISTED = 10
DEFAULT_MAX_HOST_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Segment:
    """Columns of a fused param filled by rows src_start : src_start + width of one part's HF tensor."""

    part: str
    src_start: int
    width: int


@dataclasses.dataclass
class ParamPlan:
    """How one param is built: which HF tensor fills each (slot, part), checked against the spec."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    num_slot_axes: int  # leading stacked axes: 0 (global), 1 (layers) or 2 (layers, experts)
    segments: tuple[Segment, ...]  # a fused param's last axis, in order; () for a plain param
    part_rows: dict[str, int]  # a fused param's parts: rows of each HF tensor
    fills: dict[tuple[tuple[int, ...], str | None], tuple[str, bool]]  # (slot, part) -> (hf_name, transpose)

    @property
    def slot_counts(self) -> tuple[int, ...]:
        return self.shape[: self.num_slot_axes]


def _segments(param: str, shape: tuple[int, ...], columns: Columns) -> tuple[tuple[Segment, ...], dict[str, int]]:
    """Normalise a spec's columns into segments, and check they tile the last axis and cover each part."""
    segments = tuple(Segment(c[0], 0, c[1]) if len(c) == 2 else Segment(*c) for c in columns)
    if sum(s.width for s in segments) != shape[-1]:
        raise ValueError(f"spec of {param!r}: parts {tuple(columns)} do not add up to its last dim {shape[-1]}")
    part_rows: dict[str, int] = {}
    for part in dict.fromkeys(s.part for s in segments):
        ranges = sorted((s.src_start, s.src_start + s.width) for s in segments if s.part == part)
        covered = 0
        for start, end in ranges:
            if start > covered:
                break
            covered = max(covered, end)
        if covered != ranges[-1][1]:
            raise ValueError(f"spec of {param!r}: the segments of part {part!r} leave rows {covered}:{ranges[-1][1]} uncovered")
        part_rows[part] = covered
    return segments, part_rows


def plan_params(
    listing: Iterable[tuple[str, tuple[int, ...]]], spec: Spec, *, model_type: str, source: str
) -> dict[str, ParamPlan]:
    """Check a checkpoint's tensor directory, (hf_name, shape) pairs, against `spec`.

    Each tensor is mapped by the `model_type` name map and checked against its slot: HF layout
    ([out, in] for linear weights, transposed into jaxinfer's [in, out]), the spec's per-slot
    shape (a fused part's rows from its columns). Raises CheckpointError, naming the tensor and
    the param, for: an unknown tensor, a tensor for a param the spec lacks (except `lm_head.weight`
    when the spec has no `lm_head`: tied embeddings; it is dropped), a wrong shape (both shapes
    given), a layer or expert index out of range, a slot filled twice, and every tensor that never
    came. ValueError for a spec whose columns do not tile its last axis.
    """
    names = arch_names(model_type)
    plans: dict[str, ParamPlan] = {}
    for param, (shape, dtype, *columns) in spec.items():
        shape = tuple(shape)
        segments, part_rows = _segments(param, shape, tuple(columns[0])) if columns and columns[0] else ((), {})
        num_slot_axes = names.num_slot_axes(param.partition(":")[0])  # a quantized "<param>:<field>" stacks as its param
        plans[param] = ParamPlan(param, shape, np.dtype(dtype), num_slot_axes, segments, part_rows, {})

    for hf_name, hf_shape in listing:
        target = _target(names, hf_name)
        if target is None:
            if names.is_ignored(hf_name):
                continue
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r} (shape {tuple(hf_shape)}): not a {model_type} parameter")
        plan = plans.get(target.param)
        if plan is None:
            if target.param.partition(":")[0] == "lm_head":
                continue  # tied embeddings: the model reuses `embed`
            raise CheckpointError(
                f"{source}: unexpected tensor {hf_name!r}: it maps to param {target.param!r}, "
                f"which this model's spec does not have"
            )
        _check_fill(plan, target, hf_name, tuple(hf_shape), source)
        plan.fills[target.slot, target.part] = (hf_name, target.transpose)

    _check_complete(plans, names, source)
    return plans


def _target(names, hf_name: str):
    """The Target of an HF tensor name; a quantized matrix's stored array `<name>:<field>`
    (checkpoints_conv.quantized) fills `<param>:<field>`, always transposed: its arrays are
    [rows = output features, ...] and the param's [..., K, N]."""
    base, sep, field = hf_name.rpartition(":")
    if not sep:
        return names.target(hf_name)
    target = names.target(base)
    return None if target is None else target._replace(param=f"{target.param}:{field}", transpose=True)


def _where(slot: tuple[int, ...], part: str | None) -> str:
    axes = ("layer", "expert")
    return "".join(f" {axis} {i}" for axis, i in zip(axes, slot)) + ("" if part is None else f" part {part!r}")


def _check_fill(plan: ParamPlan, target, hf_name: str, hf_shape: tuple[int, ...], source: str) -> None:
    param, slot, part = plan.name, target.slot, target.part
    if (part is None) != (not plan.segments) or (part is not None and part not in plan.part_rows):
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} maps to param {param!r}{'' if part is None else f' part {part!r}'}, "
            f"but the spec gives that param {'parts ' + str(list(plan.part_rows)) if plan.segments else 'no parts'}"
        )
    if len(slot) != plan.num_slot_axes:  # cannot happen with one consistent name map
        raise CheckpointError(f"{source}: tensor {hf_name!r} maps to param {param!r} at {slot}, which has {plan.num_slot_axes} stacked axes")
    for axis, (i, n) in enumerate(zip(slot, plan.slot_counts)):
        if not 0 <= i < n:
            what = ("layer", "expert")[axis]
            raise CheckpointError(f"{source}: tensor {hf_name!r} is for {what} {i}, but param {param!r} has {n} {what}s")
    slot_shape = plan.shape[plan.num_slot_axes :]
    if part is not None:
        slot_shape = slot_shape[:-1] + (plan.part_rows[part],)
    expected = slot_shape[::-1] if target.transpose else slot_shape
    if hf_shape != expected:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {hf_shape}, expected {expected} "
            f"(param {param!r}{_where(slot, part)}{', stored transposed' if target.transpose else ''})"
        )
    if (slot, part) in plan.fills:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} fills param {param!r}{_where(slot, part)}, "
            f"which {plan.fills[slot, part][0]!r} already filled"
        )


def _check_complete(plans: dict[str, ParamPlan], names, source: str) -> None:
    """CheckpointError listing every expected tensor that never came (HF name, param, slot)."""
    missing = []
    for plan in plans.values():
        parts = list(plan.part_rows) or [None]
        for slot in itertools.product(*(range(n) for n in plan.slot_counts)):
            for part in parts:
                if (slot, part) not in plan.fills:
                    param, sep, field = plan.name.partition(":")
                    hf = names.hf_name(param, slot, part) + sep + field
                    missing.append(f"{hf!r} (param {plan.name!r}{_where(slot, part)})")
    if missing:
        shown = "; ".join(missing[:_MAX_LISTED])
        more = f"; and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise CheckpointError(f"{source}: {len(missing)} tensor(s) missing: {shown}{more}")


# ----------------------------------------------------------------------------- reading blocks
def _full_index(shape: tuple[int, ...]) -> Index:
    return tuple(slice(0, n) for n in shape)


def _normalise(index: Index, shape: tuple[int, ...]) -> Index:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def read_blocks(plan: ParamPlan, indices: list[Index], read: ReadFn) -> list[np.ndarray]:
    """The blocks `plan.shape[index]` of the param, for each index (tuples of slices, step 1).

    Slots (layers, experts) are visited in order across all blocks, so a source that must read a
    whole tensor to slice it (GGUF) reads each at most once for all the blocks it serves.
    """
    indices = [_normalise(index, plan.shape) for index in indices]
    k = plan.num_slot_axes
    blocks = [np.empty(tuple(s.stop - s.start for s in index), plan.dtype) for index in indices]
    slots = sorted({slot for index in indices for slot in itertools.product(*(range(s.start, s.stop) for s in index[:k]))})
    for slot in slots:
        for index, block in zip(indices, blocks):
            if not all(s.start <= i < s.stop for i, s in zip(slot, index[:k])):
                continue
            dst = block[tuple(i - s.start for i, s in zip(slot, index[:k]))]  # this slot's part of the block
            _fill_slot(plan, slot, index[k:], dst, read)
    return blocks


def _fill_slot(plan: ParamPlan, slot: tuple[int, ...], inner: Index, dst: np.ndarray, read: ReadFn) -> None:
    """Write rows/columns `inner` of one slot's (HF-tensor-shaped, transposed) data into dst."""

    def copy(hf_name: str, transpose: bool, index: Index, out: np.ndarray) -> None:
        array = read(hf_name, index[::-1] if transpose else index)
        out[...] = array.T if transpose else array  # numpy casts to the param dtype here

    if not plan.segments:
        copy(*plan.fills[slot, None], inner, dst)
        return
    lo, hi = inner[-1].start, inner[-1].stop
    col = 0
    for seg in plan.segments:
        a, b = max(lo, col), min(hi, col + seg.width)  # this segment's columns inside the block
        if a < b:
            rows = slice(seg.src_start + a - col, seg.src_start + b - col)
            copy(*plan.fills[slot, seg.part], inner[:-1] + (rows,), dst[..., a - lo : b - lo])
        col += seg.width


# ----------------------------------------------------------------------------- the whole load
def load_params(
    tensors: TensorSource | Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    spec: Spec,
    *,
    model_type: str,
    source: str,
    shardings: Mapping[str, object] | None = None,
    progress: bool = True,
    max_host_bytes: int = DEFAULT_MAX_HOST_BYTES,
) -> dict:
    """Build every param of `spec` from a checkpoint.

    `tensors` is a TensorSource (random access: `checkpoints_conv.open_checkpoint`), or for small
    in-memory checkpoints a dict / an iterable of (hf_name, array) pairs. `source` (a path) is
    only used in messages. Without `shardings`, returns flat param name -> numpy array of exactly
    the spec's shape and dtype. With `shardings` (param name -> jax.sharding.Sharding), returns
    jax arrays placed with them, each process reading only the blocks its devices hold.
    Errors: see `plan_params`.
    """
    reader = tensors if isinstance(tensors, TensorSource) else ArraySource(tensors)
    plans = plan_params(reader.listing(), spec, model_type=model_type, source=source)
    out = {}
    try:
        for name, plan in tqdm(plans.items(), desc=f"loading {source}", unit="param", disable=not progress):
            if shardings is None:
                [out[name]] = read_blocks(plan, [_full_index(plan.shape)], reader.read)
            else:
                out[name] = _place(plan, shardings[name], reader.read, max_host_bytes)
    finally:
        reader.close()
    return out


def _place(plan: ParamPlan, sharding, read: ReadFn, max_host_bytes: int):
    """The param as a jax array with `sharding`, built from its addressable devices' blocks; a
    big stacked param a few layers at a time, updated in place on the device."""
    num_layers = plan.shape[0] if plan.num_slot_axes else 1
    layer_bytes = math.prod(plan.shape[1:]) * plan.dtype.itemsize if plan.num_slot_axes else 0
    per_chunk = num_layers if layer_bytes * num_layers <= max_host_bytes else max(1, max_host_bytes // layer_bytes)
    if per_chunk >= num_layers:
        return _place_layers(plan, sharding, read, 0, plan.shape[0])
    import jax.numpy as jnp

    array = _zeros(plan.shape, jnp.dtype(plan.dtype), sharding)
    for start in range(0, num_layers, per_chunk):
        stop = min(num_layers, start + per_chunk)
        array = _set_layers(array, _place_layers(plan, sharding, read, start, stop), start)
    return array


def _place_layers(plan: ParamPlan, sharding, read: ReadFn, start: int, stop: int):
    """Layers start:stop of the param (the whole param when it has no layer axis) as a jax array
    with `sharding` (whose first axis must then be unsharded)."""
    import jax

    shape = (stop - start,) + plan.shape[1:] if plan.num_slot_axes else plan.shape
    local = sharding.addressable_devices_indices_map(shape)
    keys = {}  # distinct blocks: replicas of a block are read once
    for index in local.values():
        keys.setdefault(_key(_normalise(index, shape)), _normalise(index, shape))
    offset = start if plan.num_slot_axes else 0
    global_indices = [(slice(i[0].start + offset, i[0].stop + offset),) + i[1:] for i in keys.values()]
    blocks = dict(zip(keys, read_blocks(plan, global_indices, read)))
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[_key(_normalise(index, shape))])


def _key(index: Index) -> tuple:
    return tuple((s.start, s.stop) for s in index)


@functools.cache
def _jitted_zeros(shape, dtype, sharding):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding):
    return _jitted_zeros(shape, dtype, sharding)()


@functools.cache
def _jitted_set_layers(sharding):
    import jax

    def set_layers(array, rows, start):
        return jax.lax.dynamic_update_slice_in_dim(array, rows.astype(array.dtype), start, axis=0)

    return jax.jit(set_layers, donate_argnums=0, out_shardings=sharding)


def _set_layers(array, rows, start: int):
    return _jitted_set_layers(array.sharding)(array, rows, start)

"""Map a stream of HF-named tensors onto jaxinfer's flat, layer-stacked parameter arrays.

The caller gives the target spec: flat param name -> (shape, dtype), or (shape, dtype, parts)
for a fused param. A param is *stacked* when its HF tensors are per layer (`layers.*`): its shape
is [L, *per_layer_shape] and layer i's tensor fills slot i; L comes from the spec. A fused param
holds several HF tensors side by side on its last axis; `parts` lists them in order as
(part name, width), e.g. `(("q", 576), ("k", 192), ("v", 192))` for `layers.qkv_proj`, and the
name map says which part each HF tensor is. Each target array is allocated once and filled in
place, so at most one source tensor (plus its cast copy) is held besides the result.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from tqdm.auto import tqdm

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.name_maps import ArchNames, Target, arch_names

Parts = tuple[tuple[str, int], ...]  # (part name, width on the last axis), in order
Spec = dict[str, tuple[tuple[int, ...], np.dtype] | tuple[tuple[int, ...], np.dtype, Parts]]

_MAX_LISTED = 10


class _Slots:
    """Which (layer, part) slots of one target array are filled, and by which tensor."""

    def __init__(self, n_layers: int | None, parts: Parts) -> None:
        self.filled_by: dict[tuple[int | None, str | None], str] = {}
        self.n_layers = n_layers
        self.parts = dict(parts)  # part -> width
        self.offsets, start = {}, 0  # part -> first index on the last axis
        for name, width in parts:
            self.offsets[name] = start
            start += width

    def missing(self) -> list[tuple[int | None, str | None]]:
        layers = [None] if self.n_layers is None else range(self.n_layers)
        parts = list(self.parts) or [None]
        return [(layer, part) for layer in layers for part in parts if (layer, part) not in self.filled_by]


def load_params(
    tensors: Iterable[tuple[str, np.ndarray]],
    spec: Spec,
    *,
    model_type: str,
    source: str,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Build every param of `spec` from `tensors`, the (hf_name, array) stream of a checkpoint.

    Each tensor is mapped by the `model_type` name map, transposed where HF's [out, in] differs
    from jaxinfer's [in, out], checked against the spec's per-layer shape, cast to the spec dtype
    (e.g. ml_dtypes.bfloat16) and written into its layer slot. `source` (a path) is only used in
    messages. Raises CheckpointError, naming the tensor and the param, for: an unknown tensor, a
    tensor for a param the spec lacks (except `lm_head.weight` when the spec has no `lm_head`:
    tied embeddings; it is dropped), a wrong shape (both shapes given), a layer index out of
    range, a slot filled twice, and (after the stream ends) every tensor that never came.

    Returns flat param name -> numpy array of exactly the spec's shape and dtype.
    """
    names = arch_names(model_type)
    out, slots = {}, {}
    stacked = names.stacked_params()
    for param, (shape, dtype, *parts) in spec.items():
        parts = tuple(parts[0]) if parts else ()
        if parts and sum(width for _, width in parts) != shape[-1]:
            raise ValueError(f"spec of {param!r}: parts {parts} do not add up to its last dim {shape[-1]}")
        out[param] = np.empty(tuple(shape), dtype=np.dtype(dtype))
        slots[param] = _Slots(shape[0] if param in stacked else None, parts)
    total = len(tensors) if hasattr(tensors, "__len__") else sum((s.n_layers or 1) * max(1, len(s.parts)) for s in slots.values())

    for hf_name, array in tqdm(tensors, total=total, desc=f"loading {source}", unit="tensor", disable=not progress):
        target = names.target(hf_name)
        if target is None:
            if names.is_ignored(hf_name):
                continue
            raise CheckpointError(f"{source}: unexpected tensor {hf_name!r} (shape {array.shape}): not a {model_type} parameter")
        if target.param not in spec:
            if target.param == "lm_head":
                continue  # tied embeddings: the model reuses `embed`
            raise CheckpointError(
                f"{source}: unexpected tensor {hf_name!r}: it maps to param {target.param!r}, "
                f"which this model's spec does not have"
            )
        _place(out[target.param], slots[target.param], target, hf_name, array, source)

    _check_complete(slots, names, source)
    return out


def _place(dest: np.ndarray, slots: _Slots, target: Target, hf_name: str, array: np.ndarray, source: str) -> None:
    """Check `array` (HF layout) against `dest`'s slot, then write it there transposed and cast."""
    param, layer, part = target.param, target.layer, target.part
    where = f"{'' if layer is None else f' layer {layer}'}{'' if part is None else f' part {part!r}'}"
    if (part is None) != (not slots.parts) or (part is not None and part not in slots.parts):
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} maps to param {param!r}{'' if part is None else f' part {part!r}'}, "
            f"but the spec gives that param {'parts ' + str(list(slots.parts)) if slots.parts else 'no parts'}"
        )
    if (layer is None) != (slots.n_layers is None):
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} maps to param {param!r} "
            f"{'per layer' if layer is not None else 'once'}, but the spec shape {dest.shape} says otherwise"
        )
    if layer is not None and not 0 <= layer < slots.n_layers:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} is for layer {layer}, but param {param!r} has {slots.n_layers} layers"
        )
    dest_slot = dest if layer is None else dest[layer]
    if part is not None:  # a range of the last axis
        start = slots.offsets[part]
        dest_slot = dest_slot[..., start : start + slots.parts[part]]
    expected_hf = dest_slot.shape[::-1] if target.transpose else dest_slot.shape
    if tuple(array.shape) != tuple(expected_hf):
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} has shape {tuple(array.shape)}, expected {tuple(expected_hf)} "
            f"(param {param!r}{where}{', stored transposed' if target.transpose else ''})"
        )
    if (layer, part) in slots.filled_by:
        raise CheckpointError(
            f"{source}: tensor {hf_name!r} fills param {param!r}{where}, "
            f"which {slots.filled_by[layer, part]!r} already filled"
        )
    dest_slot[...] = array.T if target.transpose else array  # numpy casts to dest.dtype here
    slots.filled_by[layer, part] = hf_name


def _check_complete(slots: dict[str, _Slots], names: ArchNames, source: str) -> None:
    """CheckpointError listing every expected tensor that never came (HF name, param, layer)."""
    missing = [
        f"{names.hf_name(param, layer, part)!r} (param {param!r}{'' if layer is None else f' layer {layer}'}"
        f"{'' if part is None else f' part {part!r}'})"
        for param, s in slots.items()
        for layer, part in s.missing()
    ]
    if missing:
        shown = "; ".join(missing[:_MAX_LISTED])
        more = f"; and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise CheckpointError(f"{source}: {len(missing)} tensor(s) missing: {shown}{more}")

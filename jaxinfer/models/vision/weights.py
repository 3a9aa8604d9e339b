"""What the vision towers' checkpoint loaders share: their tensors found under the names a
checkpoint stores them by, every missing, unexpected or misshapen one named at once, the
per-layer ones stacked, and the module built around them."""

from __future__ import annotations

import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints_conv import CheckpointError, SafetensorsSource
from jaxinfer.tree import flat_to_nested


def stored_names(names, stored: re.Pattern, canonical: Callable[[re.Match], str]) -> dict[str, str]:
    """Canonical HF name -> the name a checkpoint stores it under, for the names `stored` matches
    (`canonical` makes the canonical name of a match); CheckpointError for two of one name."""
    found: dict[str, str] = {}
    for name in names:
        m = stored.match(name)
        if m is None:
            continue
        key = canonical(m)
        if key in found:
            raise CheckpointError(f"tensors {found[key]!r} and {name!r} are both {key!r}")
        found[key] = name
    return found


def read_tower_params(source, stored: dict[str, str], hf_names: dict[str, str], *, stacks: dict[str, int],
                      shape_of: Callable[[str], tuple[int, ...]], convert: Callable[[str, np.ndarray], np.ndarray],
                      param_dtype, where: str, what: str, ignored: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Flat parameter name -> array. `stored`: canonical HF name -> stored name (`stored_names`);
    `hf_names`: parameter -> its canonical HF name ("{i}" in a stacked one: a parameter starting
    with a `stacks` prefix stacks that many tensors, i = 0 ..); `shape_of` its stored shape,
    `convert` it to the parameter's layout; stored names starting with `ignored` are not the
    tower's. Every problem is reported at once, by name, before any data is read."""
    listing = dict(source.listing())

    def count(param: str) -> int:
        return next(n for prefix, n in stacks.items() if param.startswith(prefix))

    wanted = {param: [hf.format(i=i) for i in range(count(param))] if "{i}" in hf else [hf] for param, hf in hf_names.items()}
    expected = {name for names in wanted.values() for name in names}
    problems = []
    missing = sorted(n for n in expected if n not in stored)
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {missing[:12]}{' ...' if len(missing) > 12 else ''}")
    unexpected = sorted(stored[n] for n in stored if n not in expected and not n.startswith(ignored))
    if unexpected:
        problems.append(f"tensors the {what} does not know ({len(unexpected)}): {unexpected[:12]}")
    for param, names in wanted.items():
        shape = shape_of(param)
        for name in names:
            if name in stored and tuple(listing[stored[name]]) != shape:
                problems.append(f"tensor {stored[name]!r} has shape {list(listing[stored[name]])}, expected {list(shape)}")
    if problems:
        raise CheckpointError(f"{where}: {what}: " + "; ".join(problems))
    flat = {}
    for param, names in wanted.items():
        arrays = [convert(param, np.asarray(source.read(stored[name]))) for name in names]
        array = np.stack(arrays) if param.startswith(tuple(stacks)) else arrays[0]
        flat[param] = jnp.asarray(array.astype(np.float32) if array.dtype.kind != "f" else array, param_dtype)
    return flat


def load_tower(model_dir: str | os.PathLike, make: Callable[[], nnx.Module], read: Callable) -> nnx.Module:
    """The module `make()` builds (abstractly), holding the weights `read(source)` returns from
    the folder's safetensors."""
    source = SafetensorsSource(model_dir)
    try:
        flat = read(source)
    finally:
        source.close()
    graphdef, state = nnx.split(nnx.eval_shape(make))
    nnx.replace_by_pure_dict(state, flat_to_nested(flat))
    return nnx.merge(graphdef, state)

"""Save and restore converted parameters with orbax-checkpoint (OCDBT format), bit-exact.

`params` is a nested dict of arrays (numpy, including ml_dtypes.bfloat16, or jax.Array). A
restore target is the same tree of `jax.ShapeDtypeStruct`s; a leaf that carries `.sharding`
comes back as a jax.Array placed with that sharding (the mesh may differ from the one saved
with), a leaf without one comes back as a numpy array. Orbax itself would silently restore a
mismatched shape or dtype, so the target is checked against the saved metadata first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints_conv.errors import CheckpointError


def _leaves(tree: Any) -> dict[str, Any]:
    """Dotted key path ('layers.q_proj') -> leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in flat}


def save_params(path: str | Path, params: dict, *, overwrite: bool = False) -> Path:
    """Write the nested dict `params` to the directory `path` (made absolute); returns that path.

    An existing `path` raises CheckpointError unless `overwrite` is set.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path}: already exists (pass overwrite=True to replace it)")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params, force=overwrite)
        checkpointer.wait_until_finished()
    return path


def saved_param_shapes(path: str | Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Dotted param name -> (shape, dtype) as saved at `path`, without reading any array."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no orbax checkpoint directory here")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read orbax checkpoint metadata: {e}") from e
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in _leaves(tree).items()}


def restore_params(path: str | Path, abstract: dict, *, allow_cast: bool = False) -> dict:
    """Read the checkpoint at `path` into the structure of `abstract` (ShapeDtypeStructs).

    CheckpointError naming the param when a param is missing on disk or extra there, when
    shapes differ (both given), or when dtypes differ unless `allow_cast` is set.
    """
    path = Path(path).absolute()
    saved = saved_param_shapes(path)
    wanted = _leaves(abstract)
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise CheckpointError(f"{path}: params missing from the checkpoint: {missing}; in it but not asked for: {extra}")
    for name, leaf in wanted.items():
        shape, dtype = saved[name]
        if tuple(leaf.shape) != shape:
            raise CheckpointError(f"{path}: param {name!r} is saved with shape {shape}, the target wants {tuple(leaf.shape)}")
        if np.dtype(leaf.dtype) != dtype and not allow_cast:
            raise CheckpointError(
                f"{path}: param {name!r} is saved as {dtype}, the target wants {np.dtype(leaf.dtype)} (allow_cast=True to cast)"
            )
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract)

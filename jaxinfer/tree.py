"""Small utilities for parameter trees: flat dotted names <-> the nested dicts of nnx's pure state."""

from __future__ import annotations


def flat_to_nested(flat: dict) -> dict:
    """{"layers.q_proj": a} -> {"layers": {"q_proj": a}} (the shape of nnx's pure state dict)."""
    nested: dict = {}
    for name, value in flat.items():
        node = nested
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def nested_to_flat(nested: dict, prefix: str = "") -> dict:
    """The inverse of `flat_to_nested`."""
    flat = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(nested_to_flat(v, name + "."))
        else:
            flat[name] = v
    return flat

"""Workarounds for the installed JAX (0.10.2), in one place so they are easy to drop.

`TypedInt` (a Python int that carries a dtype inside traced code) lacks `.shape`, which the
Pallas HLO interpreter (`interpret=True`) reads when a kernel indexes a ref with a static int and
a mask, or uses a block wider than the array. The fix gives it the shape of a scalar. Kernels call
`patch_interpret_mode()` before building an interpreted `pallas_call`; it is a no-op once JAX has
the attribute.
"""

from __future__ import annotations


def patch_interpret_mode() -> None:
    from jax._src import literals

    if hasattr(literals, "TypedInt") and not hasattr(literals.TypedInt, "shape"):
        literals.TypedInt.shape = property(lambda self: ())

"""Pallas kernels, one folder each: `reference.py` (plain jnp, the truth, same signature as the
kernel), and later `tpu.py` / `gpu.py` with a dispatcher in the folder's `__init__`.

Depends on JAX alone.
"""

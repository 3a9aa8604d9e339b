"""Pallas kernels, one folder each: `reference.py` (plain jnp, the truth, same signature as the
kernels), `tpu.py` (Mosaic) and `gpu.py` (Triton), and `common.py` where the two kernels share
code. No folder dispatches on the backend: the model picks one version per platform through its
kernel table, `jaxinfer.ops.kernels`.

Depends on JAX alone.
"""

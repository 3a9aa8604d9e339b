"""Test-session settings.

- Eight CPU devices, so sharding tests build real meshes (data / sequence / expert / tensor) in
  this process; everything else runs on device 0 as before (measured: no slowdown).
- A persistent XLA compilation cache, so identical step variants compile once across runs.
"""

import os
from pathlib import Path

import jax

NUM_TEST_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)

_CACHE = Path(os.environ.get("JAXINFER_TEST_XLA_CACHE", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

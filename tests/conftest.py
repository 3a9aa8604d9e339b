"""Test-session settings.

- Eight CPU devices, so sharding tests build real meshes (data / sequence / expert / tensor) in
  this process; everything else runs on device 0 as before (measured: no slowdown).
- XLA:CPU's LLVM back end at optimization level 0: the suite's time is mostly compiling small
  step variants, and level 0 compiles them ~40% faster (measured: the SmolLM2 and engine tests
  went from 290 s to 219 s cold, runtime included). The HLO passes (fusion, in-place updates,
  sharding) are the same. JAXINFER_TEST_XLA_OPT=1 runs the tests with the default level.
- A persistent XLA compilation cache, so identical step variants compile once across runs.
"""

import os
from pathlib import Path

if os.environ.get("JAXINFER_TEST_XLA_OPT") != "1":  # before JAX starts its CPU backend
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

NUM_TEST_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)

_CACHE = Path(os.environ.get("JAXINFER_TEST_XLA_CACHE", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

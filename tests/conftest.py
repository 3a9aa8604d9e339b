"""Test-session settings.

- Eight CPU devices, so sharding tests build real meshes (data / sequence / expert / tensor) in
  this process; everything else runs on device 0 as before (measured: no slowdown).
- XLA:CPU compiles for speed of compiling: the suite's time is mostly compiling small step
  variants. The LLVM back end at optimization level 0 (~40% faster: the SmolLM2 and engine tests
  went from 290 s to 219 s cold, runtime included), and fusions emitted by the classic
  elemental emitters instead of the MLIR fusion emitters (the step's XLA compile 2.1x faster:
  53 s -> 25 s over the 39 variants of test_draft_models_change_no_greedy_token). The HLO
  passes (fusion, in-place updates, sharding) are the same. JAXINFER_TEST_XLA_OPT=1 runs the
  tests with XLA's defaults.
- A persistent XLA compilation cache, so identical step variants compile once across runs.
- Compiled code is released after every test module. XLA:CPU maps each kernel of an executable
  into memory on its own (about 450 memory mappings per step variant of a tiny model), and a
  process may hold at most vm.max_map_count (65530) mappings: past that, XLA crashes inside a
  compile or a cache write (SIGSEGV / SIGABRT). A module's LLMs die with its fixtures; clearing
  JAX's caches then drops the executables that module-level jitted functions still hold.
"""

import gc
import os
from pathlib import Path

# The CPU is the only platform tests run on: the TPU and CUDA plugins installed for ahead-of-time
# compiles (tests/test_aot.py) must not try to open a chip.
os.environ["JAX_PLATFORMS"] = "cpu"
if os.environ.get("JAXINFER_TEST_XLA_OPT") != "1":  # before JAX starts its CPU backend
    fast_compile = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fast_compile}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_TEST_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)

_CACHE = Path(os.environ.get("JAXINFER_TEST_XLA_CACHE", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Runs after the module's own fixtures are torn down (autouse fixtures are set up first)."""
    yield
    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="module")
def no_persistent_compilation_cache():
    """For a module that compiles for described chips (tests/test_aot.py): such executables
    cannot be loaded back here (no client to load them into), so they stay out of the session's
    compilation cache. The flag alone is read when the cache starts, so the (private) cache is
    reset after each change."""
    from jax._src import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()

"""Test-session settings: a persistent XLA compilation cache so identical step variants compile once."""

import os
from pathlib import Path

import jax

_CACHE = Path(os.environ.get("JAXINFER_TEST_XLA_CACHE", Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

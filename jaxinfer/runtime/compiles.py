"""Counts the executables this process had to produce, through jax.monitoring: JAX records its
backend-compile event for each program it compiles and for each one it loads from the persistent
compilation cache instead (a cache hit, which it also records apart). What proves that serving
compiles nothing after warm-up (tests read `compiles()` before and after), and that a restart
with a warm cache compiles nothing (`compiles() == cache_loads()`)."""

from __future__ import annotations

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_compiles = 0
_cache_loads = 0


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _compiles
    if event == BACKEND_COMPILE_EVENT:
        _compiles += 1


def _on_event(event: str, **kwargs) -> None:
    global _cache_loads
    if event == CACHE_HIT_EVENT:
        _cache_loads += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compiles() -> int:
    """Executables produced so far in this process (compiled, or loaded from the persistent
    cache), since this module was imported."""
    return _compiles


def cache_loads() -> int:
    """Of those, the ones loaded from the persistent compilation cache."""
    return _cache_loads

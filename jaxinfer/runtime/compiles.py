"""Counts the programs this process compiled, through jax.monitoring: each XLA compilation and
each executable loaded from the persistent compilation cache instead (a cache hit still means a
program that was not ready). What proves that serving compiles nothing after warm-up: tests read
`compiles()` before and after."""

from __future__ import annotations

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_count = 0


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        _count += 1


def _on_event(event: str, **kwargs) -> None:
    global _count
    if event == CACHE_HIT_EVENT:
        _count += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compiles() -> int:
    """Programs compiled (or loaded from the persistent cache) so far in this process, since
    this module was imported."""
    return _count

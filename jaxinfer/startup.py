"""Where the seconds of a start go: process start, imports, tokenizer, weights, compiles, first token.

`jaxinfer generate --verbose` prints this; `LLM.startup_seconds` holds the phases of building an
LLM. Compile time is read from JAX's own monitoring events (tracing, lowering to MLIR, and the
XLA compile or persistent-cache read of each program), so it counts whatever compiled, wherever.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

# JAX's monitoring events (jax._src.dispatch / jax._src.compiler) -> our names.
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",  # an XLA compile or a persistent-cache read
}


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms resolution), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class CompileTotals:
    """Seconds spent by JAX per phase of compiling, how many programs were compiled or read from
    the persistent cache (`programs`), and how many of them were read (`cache_hits`)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COMPILE_EVENTS.values(), 0.0))
    programs: int = 0
    cache_hits: int = 0

    def minus(self, other: "CompileTotals") -> "CompileTotals":
        return CompileTotals({k: v - other.seconds[k] for k, v in self.seconds.items()},
                             self.programs - other.programs, self.cache_hits - other.cache_hits)

    @property
    def total(self) -> float:
        return self.seconds["trace"] + self.seconds["lower"] + self.seconds["compile"]


_totals = CompileTotals()
_lock = threading.Lock()
_installed = False


def _on_duration(event: str, seconds: float, **_) -> None:
    name = _COMPILE_EVENTS.get(event)
    if name is None:
        return
    with _lock:
        _totals.seconds[name] += seconds
        if name == "compile":
            _totals.programs += 1


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _lock:
            _totals.cache_hits += 1


def compile_totals() -> CompileTotals:
    """What JAX has compiled in this process since the first call of this function."""
    global _installed
    import jax

    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _installed = True
        return CompileTotals(dict(_totals.seconds), _totals.programs, _totals.cache_hits)


class PhaseClock:
    """Wall-clock marks in order: `clock.mark("imports")` closes the phase that began at the last mark."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


def format_report(rows: list[tuple[str, float, str]], *, before_main: float | None, first_token: float | None,
                  compiles: CompileTotals) -> str:
    """The `--verbose` table: (phase, seconds, detail) rows in order, with the time since process
    start after each, then what compiling took across all of them."""
    if before_main is not None:
        rows = [("python start, cli import", before_main, "")] + rows
    width = max(len(r[0]) for r in rows)
    since = "process start" if before_main is not None else "the command started"
    lines = [f"jaxinfer startup: seconds per phase, seconds since {since}"]
    elapsed = 0.0
    for name, secs, detail in rows:
        elapsed += secs
        lines.append(f"  {name:<{width}}  {secs:6.2f}  {elapsed:6.2f}  {detail}".rstrip())
    if first_token is not None:
        lines.append(f"  {'first token printed':<{width}}  {'':6}  {first_token:6.2f}")
    c = compiles
    lines.append(f"  compiling, inside the phases above: {c.total:.2f} s ({c.programs} programs, "
                 f"{c.cache_hits} of them read from the compile cache; trace {c.seconds['trace']:.2f}, "
                 f"lower {c.seconds['lower']:.2f}, XLA or cache {c.seconds['compile']:.2f})")
    return "\n".join(lines)

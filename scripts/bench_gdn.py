"""CPU time of one Gated DeltaNet layer's delta rule at Qwen3.5's head shapes (16 key heads, 48
value heads, 128 dims each): a prefill in the chunked form against the recurrent form (a scan
over the tokens, what a naive implementation runs), and a decode step of N sequences (one token
each, vectorised over them: what every decode bucket runs).

    python scripts/bench_gdn.py                        # prints a markdown table
    python scripts/bench_gdn.py --tokens 256 1024 --heads 4 12   # fewer heads: a tensor shard's

Times are medians of --repeats runs of the jitted function, after one compile-and-run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.gated_delta_rule import reference as delta_rule  # noqa: E402


def inputs(T: int, hk: int, hv: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(T, hk, d)).astype(np.float32) for _ in range(2))
    q, k = delta_rule.prepare_qk(q, k, hv)
    v = jnp.asarray(rng.normal(size=(T, hv, d)), jnp.float32)
    g = jnp.asarray(-0.3 * np.abs(rng.normal(size=(T, hv))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(T, hv)))), jnp.float32)
    return q, k, v, g, beta, jnp.zeros((hv, d, d), jnp.float32)


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and run once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--decode", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--heads", nargs=2, type=int, default=[16, 48], metavar=("KEY", "VALUE"))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    hk, hv, d = *args.heads, args.dim
    chunked = jax.jit(delta_rule.chunked)
    recurrent = jax.jit(delta_rule.recurrent)
    step = jax.jit(delta_rule.step)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {hk} key heads, {hv} value heads, dims {d}")
    print()
    print("| prefill tokens | chunked ms | recurrent ms | recurrent / chunked |")
    print("|---:|---:|---:|---:|")
    for T in args.tokens:
        x = inputs(T, hk, hv, d)
        c, r = timed(chunked, *x, repeats=args.repeats), timed(recurrent, *x, repeats=args.repeats)
        print(f"| {T} | {c * 1e3:.1f} | {r * 1e3:.1f} | {r / c:.1f}x |")
    print()
    print("| decode sequences | step ms | ms per sequence |")
    print("|---:|---:|---:|")
    for n in args.decode:
        q, k, v, g, beta, state = inputs(n, hk, hv, d)
        states = jnp.broadcast_to(state, (n,) + state.shape)
        t = timed(step, q, k, v, g, beta, states, repeats=args.repeats)
        print(f"| {n} | {t * 1e3:.2f} | {t * 1e3 / n:.2f} |")


if __name__ == "__main__":
    main()

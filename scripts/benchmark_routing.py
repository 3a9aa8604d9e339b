"""A mixed workload through the routing policy of a two-model server, against the large model alone.

    python scripts/benchmark_routing.py                  # embedded SmolLM2-135M: float32 "large", int8 "small"
    python scripts/benchmark_routing.py --small-quantization w8a8 --threshold -4.0

Two routes served by one process (jaxinfer.server.multi_model over a real socket): "large" is the
model as loaded (float32 by default), "small" the same model quantized (--small-quantization; or
--small-model, another folder). The workload mixes short easy prompts (continuations the model is
sure of), short hard ones (odd text, low prompt logprobs) and long ones (over
--long-prompt-tokens). Every prompt is sent once with "model": "auto" (the policy: long -> large;
else the small model's mean prompt-token logprob, measured by a one-token prefill on it, below
--threshold -> large) and once with "model": "large", one request at a time, greedy, after an
untimed pass of the same prompts (compiles); the two runs interleave prompt by prompt, and every
prefix cache is emptied before each request (a probe's pages still serve its own request).

Printed per run and per route: requests, mean latency (seconds, client side), mean cost, and how
many answers equal the large model's. Cost is a stated proxy: bytes of weights read, i.e. the
answering model's parameter bytes x its forward passes (prefill chunks of --max-num-batched-tokens
+ one per generated token after the first), plus the small model's bytes x its prefill chunks for
each confidence probe. On the CPU the seconds are what this machine measures; the bytes are what
bounds a decode step on a TPU / GPU (memory-bound).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import serving  # noqa: E402  (the scripts' shared helpers)

EASY = ["The capital of France is", "One, two, three, four,", "Monday, Tuesday, Wednesday,", "The sun rises in the",
        "January, February, March,", "Twinkle, twinkle, little", "The opposite of hot is", "A, B, C, D,"]
HARD = ["zq xv 7#k Lpw ;; vortex-quine mod 13 =", "Qoph hiatus glorm sniv ebb-tide carafe yttrium",
        "fn psi(x)=>x<<3|~x&0x5f;// klat", "Pelagic borscht idempotent Tuvan quasar of the",
        "}}{{ 0xDEADBEEF ;; mov rax, [qwerty+", "gnu gnat: 47 fjord-lumens per bathyscaphe,"]
PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
             "books were made and read across Europe. Before it, scribes copied every page by hand, and a single "
             "book could take months to finish. ")


def workload(long_prompts: int) -> list[tuple[str, str]]:
    longs = [f"Document {i}. " + PARAGRAPH * 5 + f"Question {i}: in one sentence, what changed?" for i in range(long_prompts)]
    return [("easy", p) for p in EASY] + [("hard", p) for p in HARD] + [("long", p) for p in longs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="the large model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--small-model", default=None, help="the small model (default: --model, quantized)")
    p.add_argument("--small-quantization", default="int8", help="the small model's weights: int8 | int4 | w8a8 | none")
    p.add_argument("--threshold", type=float, default=-5.0, help="confidence threshold (mean prompt-token logprob)")
    p.add_argument("--long-prompt-tokens", type=int, default=128)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = p.parse_args()

    import httpx

    from jaxinfer import LLM
    from jaxinfer.ops.quantization import param_bytes
    from jaxinfer.server.multi_model import build_multi_model_app
    from jaxinfer.server.routing import RoutingPolicy

    # two models on one device: each sizes its pool within half of it (jaxinfer serve splits it the same way)
    settings = dict(max_model_len=1024, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=4, progress=False,
                    gpu_memory_utilization=0.45)
    quantization = None if args.small_quantization == "none" else args.small_quantization
    llms = {"small": LLM(args.small_model or args.model, quantization=quantization, **settings),
            "large": LLM(args.model, **settings)}
    weight_bytes = {name: param_bytes(llm.runner.params) for name, llm in llms.items()}
    policy = RoutingPolicy(["small", "large"], long_prompt_tokens=args.long_prompt_tokens,
                           confidence_threshold=args.threshold, threshold_min=-100.0)
    app = build_multi_model_app(llms, policy=policy)
    prompts = workload(args.long_prompts)
    chunk = args.max_num_batched_tokens

    def send(url, model, prompt) -> dict:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=600, json={"model": model, "prompt": prompt, "temperature": 0,
                                                                    "max_tokens": args.max_tokens})
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        body, reason = r.json(), r.headers["x-jaxinfer-route-reason"]
        route, usage = body["model"], body["usage"]
        chunks = math.ceil(usage["prompt_tokens"] / chunk)
        cost = weight_bytes[route] * (chunks + max(0, usage["completion_tokens"] - 1))
        if reason.startswith(("confident", "low_confidence")):  # the probe: a prefill on the small model
            cost += weight_bytes["small"] * chunks
        return {"route": route, "reason": reason, "seconds": seconds, "cost": cost, "text": body["choices"][0]["text"],
                "prompt_tokens": usage["prompt_tokens"]}

    def empty_prefix_caches():
        for llm in llms.values():
            with llm.engine.core._lock:
                for replica in llm.engine.core.replicas:
                    replica.block_manager.reset_prefix_cache()

    with serving(app) as url:
        for model in ("auto", "large"):  # untimed: every program these shapes need compiles here
            for _, prompt in prompts:
                send(url, model, prompt)
        policy.choices.clear()
        results = {"auto": [], "large": []}
        for kind, prompt in prompts:  # interleaved, so the machine's drift hits both runs alike
            for model in ("auto", "large"):
                empty_prefix_caches()  # each request as if first: only a probe's own pages are cached
                results[model].append((kind, send(url, model, prompt)))

    large_text = [r["text"] for _, r in results["large"]]
    print(f"small: {args.small_model or args.model or 'SmolLM2-135M-Instruct'} ({quantization or 'as loaded'}, "
          f"{weight_bytes['small'] / 2**20:.0f} MiB); large: {args.model or 'SmolLM2-135M-Instruct'} (as loaded, "
          f"{weight_bytes['large'] / 2**20:.0f} MiB); threshold {args.threshold}, long prompts > {args.long_prompt_tokens} "
          f"tokens, {args.max_tokens} tokens per answer\n")
    print("| kind | prompt tokens | auto's routes (reason) | mean confidence-probe logprob |")
    print("|---|---|---|---|")
    for kind in ("easy", "hard", "long"):
        rows = [r for k, r in results["auto"] if k == kind]
        routes = sorted({f"{r['route']} ({r['reason'].split(';')[0]})" for r in rows})
        confs = [float(r["reason"].split("logprob ")[1].split(" ")[0]) for r in rows if "logprob" in r["reason"]]
        print(f"| {kind} ({len(rows)}) | {statistics.mean(r['prompt_tokens'] for r in rows):.0f} | {', '.join(routes)} | "
              f"{statistics.mean(confs):.2f} |" if confs else
              f"| {kind} ({len(rows)}) | {statistics.mean(r['prompt_tokens'] for r in rows):.0f} | {', '.join(routes)} | - |")
    print()
    print("| run | requests | to small | to large | mean latency (s) | mean cost (MiB of weights read) | same answer as large |")
    print("|---|---|---|---|---|---|---|")
    for model in ("auto", "large"):
        for kind in ("easy", "hard", "long", None):
            mine = [(i, r) for i, (k, r) in enumerate(results[model]) if kind is None or k == kind]
            same = sum(r["text"] == large_text[i] for i, r in mine)
            to = lambda route: sum(r["route"] == route for _, r in mine)  # noqa: E731
            print(f"| {'auto' if model == 'auto' else 'all large'}: {kind or '**all**'} | {len(mine)} | {to('small')} | "
                  f"{to('large')} | {statistics.mean(r['seconds'] for _, r in mine):.3f} | "
                  f"{statistics.mean(r['cost'] for _, r in mine) / 2**20:.0f} | {same}/{len(mine)} |")
    auto, large = ([r for _, r in results[m]] for m in ("auto", "large"))
    print(f"\nauto vs all large: latency x{statistics.mean(r['seconds'] for r in auto) / statistics.mean(r['seconds'] for r in large):.2f}, "
          f"cost x{sum(r['cost'] for r in auto) / sum(r['cost'] for r in large):.2f}")


if __name__ == "__main__":
    main()

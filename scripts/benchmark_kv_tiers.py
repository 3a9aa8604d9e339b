"""Multi-turn time to first token with and without the KV tiers (jaxinfer.engine.kv_tiers).

    python scripts/benchmark_kv_tiers.py                       # embedded SmolLM2-135M, ~2 minutes on 2 CPU cores
    python scripts/benchmark_kv_tiers.py --model ./model --conversations 16 --turns 6

Each of `--conversations` conversations opens with its own system prompt and, every turn, sends
its whole history plus a new user message and takes a greedy reply; the turns go round-robin over
the conversations, one request at a time, so TTFT is the prefill of what the caches miss plus the
first token. The device pool holds only a few conversations' histories, so by a conversation's
next turn its pages have been evicted. Runs:

  device only      the small pool, nothing below it (histories recomputed)
  + host tier      the small pool, kv_offloading_size large enough for every history
  + disk tier      the small pool, a host tier of a few pages, kv_offloading_dir (a temporary one)
  large pool       every history stays on the device (the bound the tiers approach)

Prints, per run, the mean TTFT of the first turn and of the later ones, the prefix-cache hit rate
per tier (pages found / pages looked up) and the replies' agreement with the large pool's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def conversation_turns(args) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, per turn: (system prompt + earlier turns' messages, this turn's message)."""
    rng = np.random.default_rng(args.seed)
    draw = lambda n: [int(t) for t in rng.integers(100, 30000, n)]  # noqa: E731 - ordinary token ids
    return [[draw(args.system_tokens)] + [draw(args.message_tokens) for _ in range(args.turns)]
            for _ in range(args.conversations)]


def run(name: str, args, messages, **settings) -> dict:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.engine.kv_tiers import PageLayout

    llm = LLM(args.model, page_size=args.page_size, max_model_len=args.max_model_len, max_num_batched_tokens=512,
              max_num_seqs=4, warmup=True, progress=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    histories = [list(m[0]) for m in messages]
    ttft: list[list[float]] = [[] for _ in range(args.turns)]
    replies = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for c, conv in enumerate(messages):
            prompt = histories[c] + conv[turn + 1]
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ttft[turn].append(out.metrics.ttft)
            reply = list(out.outputs[0].token_ids)
            replies.append(reply)
            histories[c] = prompt + reply
    seconds = time.perf_counter() - t0
    s = llm.engine.get_stats()
    llm.close()
    return {"name": name, "first": statistics.mean(ttft[0]), "later": statistics.mean(t for turn in ttft[1:] for t in turn),
            "device": s.prefix_cache_hit_rate, "host": s.prefix_cache_host_hit_rate, "disk": s.prefix_cache_disk_hit_rate,
            "computed": s.num_prompt_tokens_computed, "seconds": seconds, "replies": replies,
            "page_bytes": PageLayout.of_pool(llm.runner.kv).nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--message-tokens", type=int, default=48)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-conversations", type=float, default=2.0,
                   help="the small pool holds about this many conversations' final histories (default 2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    final = args.system_tokens + args.turns * (args.message_tokens + args.reply_tokens)
    args.max_model_len = final + args.page_size
    history_pages = -(-final // args.page_size)
    small = int(args.device_conversations * history_pages) + 1
    messages = conversation_turns(args)

    from jaxinfer.engine.kv_tiers import GiB

    results = [run("device only", args, messages, num_pages=small)]
    page_bytes = results[0]["page_bytes"]
    results.append(run("+ host tier", args, messages, num_pages=small,
                       kv_offloading_size=args.conversations * history_pages * page_bytes / GiB))
    with tempfile.TemporaryDirectory(prefix="jaxinfer-kv-bench-") as directory:
        results.append(run("+ disk tier", args, messages, num_pages=small, kv_offloading_size=4 * page_bytes / GiB,
                           kv_offloading_dir=directory))
    results.append(run("large pool", args, messages, num_pages=args.conversations * history_pages + 1))
    reference = results[-1]["replies"]
    print(f"{args.conversations} conversations x {args.turns} turns: {args.system_tokens}-token system prompt, "
          f"{args.message_tokens}-token messages, {args.reply_tokens}-token replies; small pool {small - 1} pages "
          f"({history_pages} per final history)")
    print(f"{'run':<13} {'TTFT turn 1':>12} {'TTFT later':>11} {'hit device':>11} {'host':>6} {'disk':>6} "
          f"{'prompt tok computed':>20} {'same replies':>13}")
    for r in results:
        print(f"{r['name']:<13} {r['first'] * 1e3:>9.0f} ms {r['later'] * 1e3:>8.0f} ms {100 * r['device']:>10.0f}% "
              f"{100 * r['host']:>5.0f}% {100 * r['disk']:>5.0f}% {r['computed']:>20} {str(r['replies'] == reference):>13}")


if __name__ == "__main__":
    main()

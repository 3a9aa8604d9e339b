#!/usr/bin/env python
"""Result cache latency through the real HTTP server: a miss (the engine answers) against an
exact hit and a semantic hit (jaxinfer.server.result_cache), mean and p50 over N requests.

    python scripts/benchmark_result_cache.py                  # the embedded SmolLM2-135M, on this machine
    python scripts/benchmark_result_cache.py -n 24 --max-tokens 64 --model ./Qwen2.5-0.5B-Instruct \\
        --embedding-model ./Qwen3-Embedding-0.6B

One `LLM` (default: the embedded SmolLM2-135M-Instruct) is served twice on a loopback port, one
server after the other: first with an exact result cache (N distinct chat questions, greedy,
`max_tokens` tokens each, EOS ignored: the misses; then the same N again: the exact hits), then
with a semantic one (N other questions, of unlike forms: misses, which also embed the question;
then a near-duplicate of each, its first letter lower-cased: semantic hits). The embedding model
defaults to the same SmolLM2 as a pooling model (mean pooling), a stand-in for a real embedding
model. The threshold is measured first: between the least similarity of a near-duplicate to its
question and the greatest to another question when there is room, else just under the first
(then some questions hit another's answer: the table counts requests answered as expected).
Every request is timed from send to the whole response read, on one keep-alive connection, one
at a time; compiles are paid by warm-up requests first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import jax
import numpy as np

from jaxinfer import LLM
from jaxinfer.server.app import build_app
from jaxinfer.server.result_cache import ResultCache, llm_embedder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import serving  # noqa: E402  (the scripts' shared helpers)

SUBJECTS = ["the moon", "volcanoes", "honey bees", "the Roman empire", "photosynthesis", "jazz", "glaciers", "chess",
            "the printing press", "octopuses", "tea", "lightning", "the Silk Road", "coral reefs", "bicycles",
            "the violin", "deserts", "penguins", "paper money", "the telescope", "rainbows", "bread", "whales", "maps"]
QUESTIONS = [  # the semantic rows: questions of unlike forms, so that only a near-duplicate is near
    "How do I reverse a linked list in Python?", "Which planet has the most moons?",
    "Can you suggest a vegetarian dinner for four people?", "Why does ice float on water?",
    "Write a haiku about autumn leaves.", "What caused the fall of Constantinople in 1453?",
    "Explain the difference between TCP and UDP.", "How many minutes should I boil an egg for a soft yolk?",
    "Translate 'good morning' into Japanese.", "What is a good stretching routine after running?",
    "Summarize the plot of Hamlet in two sentences.", "Is it safe to charge a phone overnight?",
    "Give me three names for a black cat.", "How does compound interest work?",
    "What are the rules of offside in football?", "Recommend a science fiction novel for a teenager.",
    "Why is the sky blue during the day?", "How can I fix a squeaky door hinge?",
    "List the primary colors of light.", "What is the capital of Australia?",
    "Convert 72 degrees Fahrenheit to Celsius.", "Who painted the ceiling of the Sistine Chapel?",
    "How do vaccines train the immune system?", "Plan a two-day trip to Lisbon.",
]


def near_duplicate(question: str) -> str:
    return question[0].lower() + question[1:]


def timed(client: httpx.Client, url: str, question: str, max_tokens: int) -> tuple[float, str]:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    response.raise_for_status()
    return seconds, response.headers.get("x-result-cache", "")


def run(url: str, questions: list[str], max_tokens: int, expect: str) -> tuple[list[float], int]:
    """(seconds per request, how many answered as `expect`)."""
    times, as_expected = [], 0
    with httpx.Client(timeout=600) as client:
        for q in questions:
            seconds, outcome = timed(client, url, q, max_tokens)
            times.append(seconds)
            as_expected += outcome == expect
    return times, as_expected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the served model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--embedding-model", default=None, help="default: the served model's checkpoint as a pooling model")
    parser.add_argument("-n", "--num-requests", type=int, default=20, help="requests per row (at most 24)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    n = min(args.num_requests, len(SUBJECTS))
    first = [f"Why is {s} important?" for s in SUBJECTS[:n]]
    second = QUESTIONS[:n]
    settings = dict(max_model_len=512, max_num_seqs=8, progress=False)
    llm = LLM(args.model, **settings)
    pooling = dict(pooler_config={"pooling_type": "MEAN"}) if args.embedding_model is None else {}
    embed = llm_embedder(LLM(args.embedding_model or args.model, runner="pooling", **settings, **pooling))
    warm = ["Tell me a story about a cat.", "Describe a quiet morning in the city."]

    rows = []
    with serving(build_app(llm, result_cache=ResultCache(max_entries=1024))) as url:
        run(url, warm, args.max_tokens, "miss")
        times, ok = run(url, first, args.max_tokens, "miss")
        rows.append(("miss (engine), exact cache", times, ok))
        times, ok = run(url, first, args.max_tokens, "exact-hit")
        rows.append(("exact hit", times, ok))

    rows_e = embed(second)
    dups_e = embed([near_duplicate(q) for q in second])
    own = np.sum(rows_e * dups_e, axis=1)
    cross = rows_e @ dups_e.T
    np.fill_diagonal(cross, -1.0)
    least, most_other = float(own.min()), float(cross.max())  # a threshold between, if there is room
    threshold = (least + most_other) / 2 if least > most_other else least - 1e-4
    semantic = ResultCache(max_entries=1024, embed=embed, similarity=threshold)
    with serving(build_app(llm, result_cache=semantic)) as url:
        run(url, [q + "?" for q in warm], args.max_tokens, "miss")
        times, ok = run(url, second, args.max_tokens, "miss")
        rows.append(("miss (engine + embedding), semantic cache", times, ok))
        times, ok = run(url, [near_duplicate(q) for q in second], args.max_tokens, "semantic-hit")
        rows.append(("semantic hit (embedding + search)", times, ok))

    print(f"\nmodel: {args.model or 'SmolLM2-135M-Instruct (embedded)'}; embedding model: "
          f"{args.embedding_model or 'the same, mean pooling'}; device: {jax.devices()[0].device_kind}; "
          f"{n} chat requests per row, max_tokens {args.max_tokens} (EOS ignored), one at a time")
    print(f"semantic threshold {threshold:.4f} (near-duplicate similarity min {own.min():.4f}, mean {own.mean():.4f}; "
          f"most similar other question: {cross.max():.4f})\n")
    print(f"| {'request':<44} | mean ms | p50 ms | answered as expected |")
    print(f"|{'-' * 46}|--------:|-------:|---------------------:|")
    for name, times, ok in rows:
        ms = [t * 1000 for t in times]
        print(f"| {name:<44} | {statistics.mean(ms):7.1f} | {statistics.median(ms):6.1f} | {ok:>17}/{len(ms)} |")


if __name__ == "__main__":
    main()

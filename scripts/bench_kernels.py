#!/usr/bin/env python
"""Kernel microbenchmark: every implementation of each Pallas kernel family against its reference.

For each kernel family and shape it times every implementation that runs on the current backend
and prints one markdown table row per (shape, implementation): median time, achieved bandwidth
(GB/s, and % of the bandwidth measured by the probe below), FLOP rate (TFLOP/s), speedup over the
baseline, and the max abs error against the folder's reference.py.

  1. bandwidth probe: a large elementwise copy (`x + 1`, read + write) and a read-only reduction
     (`jnp.sum`); the faster of the two is the roofline every other row's "% BW" refers to. Also
     the time of a trivial jitted call (the dispatch floor: no row can be faster than that).
  2. ragged paged attention (pallas_kernels/ragged_paged_attention): pure decode batches
     (--batches x --contexts) and a mixed batch (--mixed: prefill chunks + decodes).
     Implementations: reference (jnp), split-kv (the XLA path the model runs on the CPU),
     pallas-gpu (Triton), pallas-tpu (Mosaic). Peers where available: JAX's own Pallas ops
     (`jax.experimental.pallas.ops.gpu.decode_attention.gqa` on a contiguous cache and
     `...gpu.paged_attention` on GPU, `...tpu.ragged_paged_attention` on TPU) and tokamax's
     `dot_product_attention` on a contiguous cache (decode only).
     Bytes = the KV actually read (sum(kv_lens) x Hkv x D x 2 x itemsize) + q + out;
     FLOPs = 4 x (visible query-key pairs) x Hq x D, causal (a chunk of q queries ending at
     position kv sees q*kv - q*(q-1)/2 pairs; a decode sees kv).
  3. flash attention (pallas_kernels/flash_attention): packed equal-length causal segments
     (--flash-segments). Implementations: reference (dense jnp, skipped when its [Hq, T, T]
     scores do not fit --reference-mem-gib), pallas-gpu, pallas-tpu; peers
     `jax.nn.dot_product_attention` (xla; cudnn on GPU) and tokamax's `dot_product_attention`.
     Bytes = q + k + v + out; FLOPs = 4 x sum(L(L+1)/2) x Hq x D.
  4. quantized matmul (pallas_kernels/quantized_matmul): x [M, K] @ w [K, N] for each M in --M and
     K x N in --KN. Baseline: the plain `jnp.dot` with the unquantized weight in the benchmark
     dtype ("dense"). Per mode (int8, int4 g128, fp8): reference (dequantize in f32, then dot),
     xla-dequant (dequantize to the benchmark dtype, then XLA's dot), pallas-gpu, pallas-tpu.
     Errors are against that mode's reference; speedups against dense.
     Bytes = x + weight as stored (+ scales) + out; FLOPs = 2 M N K.
  5. SwiGLU matmul (pallas_kernels/swiglu_matmul): silu(x @ W_gate) * (x @ W_up) for x [M, H] and
     w_gate_up [H, 2I] (--HI), M in --M. Baseline: XLA's unfused dot to [M, 2I], then silu * up
     ("xla unfused", what the model runs without the kernel). Bytes = x + weight + out;
     FLOPs = 4 M H I.
  6. fused add + RMSNorm (pallas_kernels/fused_rms_norm): x, residual [T, H] for T in --norm-rows, H
     from --HI. Baseline: the reference (XLA fuses it as it can). Bytes = 2 reads + 2 writes of [T, H].
  7. RoPE + KV write (pallas_kernels/rope_kv_write): q [T, Hq, D], k, v [T, Hkv, D] rotated and
     written to the T slots of a page pool just big enough for them (page 0 spare), in shuffled
     order, T in --norm-rows. Baseline: the reference (rotate, then XLA's scatter). The timed
     calls do not donate the pool, so every implementation also copies it once per call (the
     same for all; the pool is kept that small for this reason). Bytes = q, k, v, cos, sin read
     + q, k out + the K/V rows written.

The Pallas kernels of another platform (and all of them on the CPU, where none compiles) only run
with --interpret: once each, untimed (interpret mode is not a performance measurement), to print
their max error against the reference. Modules that do not exist yet (kernels being written) and
peers that are not installed are skipped and listed under the table.

Timing: each implementation is jitted; one call compiles, --warmup calls warm up, then each of
--reps repetitions launches `inner` back-to-back calls and waits for the last (inner is chosen so
a repetition lasts about --rep-ms); the time of a call is the median over repetitions of
elapsed / inner. Back-to-back launches hide most of the per-call dispatch cost, but a kernel
shorter than the dispatch floor is still measured at about that floor.

    PYTHONPATH=. python scripts/bench_kernels.py --quick                  # tiny shapes, seconds
    PYTHONPATH=. python scripts/bench_kernels.py --quick --interpret      # + Pallas kernels, correctness only
    PYTHONPATH=. python scripts/bench_kernels.py --kernels rpa --contexts 32768 --json rpa.json   # on a GPU
    PYTHONPATH=. python scripts/bench_kernels.py --kernels qmm --M 1 --KN 4096x14336

Defaults are backend-dependent: Llama-8B-like shapes in bfloat16 on GPU/TPU, smaller shapes in
float32 on the CPU (where the numbers measure XLA's CPU code, on whatever else shares the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import _fmt, _version, environment, log  # noqa: E402  (shared conventions)

KERNELS = ("rpa", "flash", "qmm", "swiglu", "norm", "rope_kv")
QMM_MODES = (("int8", None), ("int4", 128), ("fp8", None))


# ----------------------------------------------------------------------------- args
def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _pairs(s: str) -> list[tuple[int, int]]:
    """"4096x14336,14336x4096" -> [(4096, 14336), (14336, 4096)]"""
    return [tuple(int(v) for v in item.split("x")) for item in _csv(s)]


def _segments(s: str) -> list[tuple[int, int]]:
    """flash shapes, ";"-separated "LENxCOUNT" (or "LEN"): "4096;8192;2048x4" -> [(4096, 1), (8192, 1), (2048, 4)]"""
    out = []
    for item in s.split(";"):
        if item.strip():
            length, _, count = item.strip().partition("x")
            out.append((int(length), int(count or 1)))
    return out


def _mixed(s: str) -> list[tuple[int, int]]:
    """a batch as "q_len:kv_len" items, "NxQ:KV" for N equal ones: "512:2048,32x1:4096" -> [(512, 2048), (1, 4096) x 32]"""
    seqs = []
    for item in _csv(s):
        count, _, pair = item.rpartition("x")
        q, kv = (int(v) for v in pair.split(":"))
        if q > kv:
            raise argparse.ArgumentTypeError(f"{item}: q_len {q} > kv_len {kv}")
        seqs += [(q, kv)] * int(count or 1)
    return seqs


# Shapes per backend class: (accelerator, cpu, quick). Heads are (Hq, Hkv): GQA 4 everywhere.
DEFAULTS = {
    "accelerator": dict(
        batches=[8, 32, 64], contexts=[1024, 4096, 32768], mixed="512:2048,512:4096,1024:1024,32x1:4096",
        flash_segments="4096;8192;2048x4", M=[1, 8, 64, 512], KN="4096x14336,14336x4096",
        HI="4096x14336", norm_rows=[8, 512, 8192],
        heads=(32, 8), bandwidth_gib=2.0, reps=20,
    ),
    "cpu": dict(
        batches=[4, 16], contexts=[512, 2048], mixed="256:1024,256:256,8x1:1024",
        flash_segments="1024;512x2", M=[1, 8, 64], KN="1024x2816,2816x1024",
        HI="1024x2816", norm_rows=[8, 512],
        heads=(32, 8), bandwidth_gib=0.25, reps=10,
    ),
    "quick": dict(
        batches=[2, 4], contexts=[64, 256], mixed="32:128,32:32,2x1:128",
        flash_segments="256;128x2", M=[1, 8], KN="256x512",
        HI="256x256", norm_rows=[8, 64],
        heads=(8, 2), bandwidth_gib=1 / 32, reps=5,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=_csv, default=list(KERNELS), help=f"kernel families to run (default {','.join(KERNELS)})")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few reps: checks that the script runs")
    p.add_argument("--interpret", action="store_true",
                   help="also run the Pallas kernels that cannot compile on this backend (all of them on the CPU) in "
                   "interpret mode, once and untimed, and print their max error against the reference")
    p.add_argument("--dtype", default=None, help="activation / KV dtype (default bfloat16 on GPU/TPU, float32 on CPU)")
    p.add_argument("--batches", type=_csv_ints, default=None, help="decode batch sizes (sequences) for ragged paged attention")
    p.add_argument("--contexts", type=_csv_ints, default=None, help="decode context lengths (KV tokens per sequence)")
    p.add_argument("--mixed", type=_mixed, default=None,
                   help='mixed batch as "q_len:kv_len" items, "NxQ:KV" for N of them; "" to skip (default: prefill chunks + decodes)')
    p.add_argument("--mixed-query-block", type=int, default=16, help="num_queries_per_block for the mixed batch (default 16; decodes use 1)")
    p.add_argument("--flash-segments", type=_segments, default=None, help='flash attention shapes: ";"-separated LEN or LENxCOUNT segments')
    p.add_argument("--M", type=_csv_ints, default=None, help="quantized matmul rows (tokens)")
    p.add_argument("--KN", type=_pairs, default=None, help="quantized matmul weight shapes KxN, comma-separated")
    p.add_argument("--HI", type=_pairs, default=None, help="SwiGLU matmul shapes HxI (hidden x intermediate), comma-separated")
    p.add_argument("--norm-rows", type=_csv_ints, default=None, help="token counts for add+RMSNorm and RoPE + KV write")
    p.add_argument("--heads", type=_csv_ints, default=None, help="query heads, KV heads (default 32,8; quick 8,2)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head_dim (default 128)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (default 16)")
    p.add_argument("--bandwidth-gib", type=float, default=None, help="size of the bandwidth probe's array (0: skip the probe)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after the compiling one (default 2)")
    p.add_argument("--rep-ms", type=float, default=20.0, help="target length of one repetition; short kernels repeat inside it (default 20)")
    p.add_argument("--budget-s", type=float, default=10.0, help="stop repeating an implementation after this many seconds (at least 3 reps)")
    p.add_argument("--reference-mem-gib", type=float, default=None,
                   help="skip the dense flash reference (and jax.nn xla) when its score matrices need more (default: half the "
                   "device memory, 8 on the CPU)")
    p.add_argument("--json", dest="json_out", default=None, help="write rows and environment to this JSON file")
    a = p.parse_args(argv)
    unknown = set(a.kernels) - set(KERNELS)
    if unknown:
        p.error(f"unknown --kernels {sorted(unknown)}; choose from {KERNELS}")
    return a


def fill_defaults(args, backend: str) -> None:
    """Backend-dependent defaults for every option left unset."""
    d = DEFAULTS["quick" if args.quick else ("cpu" if backend == "cpu" else "accelerator")]
    for name in ("batches", "contexts", "M", "reps", "bandwidth_gib", "norm_rows"):
        if getattr(args, name) is None:
            setattr(args, name, d[name])
    args.mixed = _mixed(d["mixed"]) if args.mixed is None else args.mixed
    args.flash_segments = args.flash_segments or _segments(d["flash_segments"])
    args.KN = args.KN or _pairs(d["KN"])
    args.HI = args.HI or _pairs(d["HI"])
    args.heads = tuple(args.heads or d["heads"])
    args.dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")


# ----------------------------------------------------------------------------- measuring
@dataclasses.dataclass
class Candidate:
    """One implementation of one case: `fn(*args)` returns the output compared against `compare_to`."""

    impl: str
    fn: Callable
    args: tuple | Callable[[], tuple]  # arrays passed to the jitted fn (never closed over: they would become HLO
    # constants), or a function building them just before this candidate runs (a peer's own layout of the inputs)
    interpret: bool = False  # run once for correctness, untimed
    compare_to: str | None = "reference"  # the candidate whose output is the truth (None: no error column)
    bytes_moved: float | None = None  # overrides the case's (e.g. a weight stored in fewer bytes)


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    backend: str  # "cpu" | "gpu" | "tpu"
    dtype: Any
    peak_gbs: float | None = None  # the bandwidth probe's result
    device_mem_bytes: int | None = None
    rows: list = dataclasses.field(default_factory=list)
    skipped: dict = dataclasses.field(default_factory=dict)  # what -> why (printed once each)

    def pallas_mode(self, platform: str) -> str | None:
        """How a Pallas kernel written for `platform` runs here: "native", "interpret" or None (not at all)."""
        if self.backend == platform:
            return "native"
        return "interpret" if self.args.interpret else None

    def load(self, module: str, attr: str):
        """module.attr, imported now; None (and a note under the table) if it is missing or broken."""
        try:
            return getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001  (a kernel being written may not import yet)
            self.skipped.setdefault(f"{module}.{attr}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return None


def time_call(f, args, ctx: Context):
    """(output, median seconds per call, reps, inner) of the jitted f after compiling and warming up."""
    import jax

    a = ctx.args
    out = jax.block_until_ready(f(*args))  # compiles
    t = time.perf_counter()
    for _ in range(max(1, a.warmup)):
        out = jax.block_until_ready(f(*args))
    one = (time.perf_counter() - t) / max(1, a.warmup)
    inner = max(1, min(1000, int(a.rep_ms / 1e3 / max(one, 1e-7))))
    times, spent = [], 0.0
    while len(times) < a.reps and not (spent > a.budget_s and len(times) >= 3):
        t = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t
        times.append(elapsed / inner)
        spent += elapsed
    return out, statistics.median(times), len(times), inner


def max_abs_err(out, truth) -> float:
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - truth.astype(jnp.float32))))


def tolerance(ctx: Context, truth) -> float:
    """The error above which a row is flagged: relative to max|truth|, loose enough for the dtype."""
    import jax.numpy as jnp

    rel = 1e-3 if ctx.dtype == jnp.float32 else 3e-2
    return rel * max(float(jnp.max(jnp.abs(truth.astype(jnp.float32)))), 1e-6)


def run_case(ctx: Context, kernel: str, shape: str, candidates: list[Candidate], *, bytes_moved: float, flops: float,
             baseline: str = "reference") -> None:
    """Run every candidate of one case (in order: truths and baseline first) and append its row."""
    import jax

    outputs: dict[str, Any] = {}  # kept only for candidates others compare to
    needed = {c.compare_to for c in candidates}
    base_s = None
    for c in candidates:
        row = {"kernel": kernel, "impl": c.impl, "shape": shape, "ms": None, "gbs": None, "pct_bw": None, "tflops": None,
               "speedup": None, "max_abs_err": None, "err_ok": None, "note": ""}
        try:
            args = c.args() if callable(c.args) else c.args
            f = jax.jit(c.fn)
            if c.interpret:
                out = jax.block_until_ready(f(*args))
                row["note"] = "interpret: correctness only, not timed"
            else:
                out, sec, reps, inner = time_call(f, args, ctx)
                nbytes = c.bytes_moved if c.bytes_moved is not None else bytes_moved
                row.update(ms=sec * 1e3, gbs=nbytes / sec / 1e9 if nbytes else None,
                           tflops=flops / sec / 1e12 if flops else None, reps=reps, inner=inner)
                if ctx.peak_gbs and row["gbs"]:
                    row["pct_bw"] = 100 * row["gbs"] / ctx.peak_gbs
                if c.impl == baseline:
                    base_s = sec
                if base_s:
                    row["speedup"] = base_s / sec
            truth = outputs.get(c.compare_to)
            if truth is not None:
                row["max_abs_err"] = max_abs_err(out, truth)
                row["err_ok"] = row["max_abs_err"] <= tolerance(ctx, truth)
            if c.impl in needed:
                outputs[c.impl] = out
            del out, args
        except Exception as e:  # noqa: BLE001  (one failing kernel must not stop the others)
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            row["note"] = f"error: {type(e).__name__}: {msg}"
            log(f"!! {kernel} {c.impl} {shape}: {type(e).__name__}: {msg}")
        ctx.rows.append(row)
        log(f"  {kernel:>22} | {c.impl:<24} | {shape:<34} | {_fmt(row['ms'], '.3f'):>9} ms | "
            f"{_fmt(row['gbs'], '.1f'):>8} GB/s | err {_fmt(row['max_abs_err'], '.2e')} {row['note']}")


def case_failed(ctx: Context, kernel: str, shape: str, e: Exception) -> None:
    """Record a case whose inputs could not be built (out of device memory, say) and go on with the next."""
    msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    ctx.rows.append({"kernel": kernel, "impl": "(inputs)", "shape": shape, "ms": None, "gbs": None, "pct_bw": None,
                     "tflops": None, "speedup": None, "max_abs_err": None, "err_ok": None,
                     "note": f"error: {type(e).__name__}: {msg}"})
    log(f"!! {kernel} {shape}: building inputs: {type(e).__name__}: {msg}")


# ----------------------------------------------------------------------------- bandwidth probe
def bandwidth_probe(ctx: Context) -> None:
    """HBM (or DRAM) bandwidth of a large copy and a large read; the faster is the roofline."""
    import jax.numpy as jnp

    gib = ctx.args.bandwidth_gib
    if gib <= 0:
        return
    n = int(gib * 2**30) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    shape = f"{n * 4 / 2**30:.2f} GiB f32"
    cands = [
        Candidate("copy (x + 1)", lambda x: x + 1, (x,), compare_to=None, bytes_moved=2 * x.nbytes),
        Candidate("read (sum)", lambda x: jnp.sum(x), (x,), compare_to=None, bytes_moved=x.nbytes),
    ]
    run_case(ctx, "bandwidth", shape, cands, bytes_moved=x.nbytes, flops=0.0, baseline="")
    probe = ctx.rows[-2:]
    measured = [r["gbs"] for r in probe if r["gbs"]]
    ctx.peak_gbs = max(measured) if measured else None
    for r in probe:
        if r["gbs"] and ctx.peak_gbs:
            r["pct_bw"] = 100 * r["gbs"] / ctx.peak_gbs
    del x
    # the dispatch floor: a jitted call that does (almost) nothing
    tiny = jnp.zeros((8,), jnp.float32)
    run_case(ctx, "dispatch floor", "8 x f32", [Candidate("x + 1", lambda x: x + 1, (tiny,), compare_to=None)],
             bytes_moved=0.0, flops=0.0, baseline="")


# ----------------------------------------------------------------------------- ragged paged attention
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_batch(seqs: list[tuple[int, int]], *, heads, head_dim, page_size, dtype, seed=0) -> dict:
    """Random q and K/V pages for sequences (q_len, kv_len); each sequence's pages are scattered
    over the pool in random order (page 0 is left unused, as the engine's scratch page)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    Hq, Hkv = heads
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    pages_needed = [_cdiv(int(kv), page_size) for kv in kv_lens]
    pages_per_seq = max(pages_needed)
    num_pages = 1 + sum(pages_needed)
    order = np.random.default_rng(seed).permutation(np.arange(1, num_pages, dtype=np.int32))
    page_indices = np.zeros((len(seqs), pages_per_seq), np.int32)  # [S, pages_per_seq]
    start = 0
    for s, n in enumerate(pages_needed):
        page_indices[s, :n] = order[start: start + n]
        start += n
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    T = int(q_lens.sum())
    pool_shape = (num_pages, page_size, Hkv, head_dim)
    return dict(
        q=jax.random.normal(kq, (T, Hq, head_dim), dtype),  # [T, Hq, D]
        k_pages=jax.random.normal(kk, pool_shape, dtype),  # [P, page_size, Hkv, D]
        v_pages=jax.random.normal(kv, pool_shape, dtype),
        kv_lens=jnp.asarray(kv_lens),  # [S]
        page_indices=jnp.asarray(page_indices),  # [S, pages_per_seq]
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),  # [S + 1]
        num_seqs=jnp.array([len(seqs)], jnp.int32),  # [1]
    )


def attention_work(seqs, *, heads, head_dim, itemsize) -> tuple[float, float]:
    """(bytes, FLOPs) of ragged paged attention: KV read once, q read, out written; causal pairs."""
    Hq, Hkv = heads
    T = sum(q for q, _ in seqs)
    kv_bytes = sum(kv for _, kv in seqs) * Hkv * head_dim * 2 * itemsize
    qo_bytes = 2 * T * Hq * head_dim * itemsize
    pairs = sum(q * kv - q * (q - 1) // 2 for q, kv in seqs)  # query i of a chunk ending at kv sees kv - q + i + 1 keys
    return kv_bytes + qo_bytes, 4.0 * pairs * Hq * head_dim


def _power_of_two_splits(n: int, at_most: int = 16, min_len: int = 1) -> int:
    """The largest power of two <= at_most dividing n with n // splits >= min_len (JAX's ops need it)."""
    k = at_most
    while k > 1 and (n % k or n // k < min_len):
        k //= 2
    return k


def rpa_candidates(ctx: Context, b: dict, *, decode: bool, query_block: int, sm_scale: float) -> list[Candidate]:
    """reference, split-kv, this backend's Pallas kernels and the peers, all on one paged batch `b`."""
    from jaxinfer.ops.kernels import DECODE_KV_TOKENS_PER_ITEM, PREFILL_KV_TOKENS_PER_ITEM
    from pallas_kernels.ragged_paged_attention import reference, split_kv

    page_size = b["k_pages"].shape[1]
    args = (b["q"], b["k_pages"], b["v_pages"], b["kv_lens"], b["page_indices"], b["cu_q_lens"], b["num_seqs"])
    common = dict(sm_scale=sm_scale, num_queries_per_block=query_block)
    # split-kv with the model's settings (jaxinfer.ops.kernels.xla_ragged_attention): short work items for decodes
    kv_tokens, items = (DECODE_KV_TOKENS_PER_ITEM, 16) if decode else (PREFILL_KV_TOKENS_PER_ITEM, 8)
    cands = [
        Candidate("reference", functools.partial(reference.ragged_paged_attention, **common), args),
        Candidate("split-kv (xla)", functools.partial(
            split_kv.ragged_paged_attention, **common, num_kv_pages_per_block=max(1, kv_tokens // page_size),
            items_per_step=items), args),
    ]
    for platform in ("gpu", "tpu"):
        mode = ctx.pallas_mode(platform)
        kernel = mode and ctx.load(f"pallas_kernels.ragged_paged_attention.{platform}", "ragged_paged_attention")
        if kernel:
            cands.append(Candidate(f"pallas-{platform}", functools.partial(kernel, **common, interpret=mode == "interpret"),
                                   args, interpret=mode == "interpret"))
    cands += rpa_peers(ctx, b, decode=decode, query_block=query_block, sm_scale=sm_scale)
    return cands


def rpa_peers(ctx: Context, b: dict, *, decode: bool, query_block: int, sm_scale: float) -> list[Candidate]:
    """Other libraries' kernels for the same attention, each in its own input layout (built here, untimed)."""
    import jax.numpy as jnp

    peers = []
    S, pages_per_seq = b["page_indices"].shape
    page_size, Hkv, D = b["k_pages"].shape[1:]
    q = b["q"]  # decode: [S, Hq, D], one query per sequence

    def contiguous(pages):  # [P, page_size, Hkv, D] -> [S, pages_per_seq * page_size, Hkv, D]
        return pages[b["page_indices"]].reshape(S, pages_per_seq * page_size, Hkv, D)

    gpu_mode = ctx.pallas_mode("gpu")
    interpret = gpu_mode == "interpret"
    if decode and gpu_mode:
        gqa = ctx.load("jax.experimental.pallas.ops.gpu.decode_attention", "gqa")
        if gqa:
            L = pages_per_seq * page_size

            def jax_decode_attention(q, k, v, lens):  # k, v: contiguous [S, L, Hkv, D]
                return gqa(q, k, v, kv_seq_len=lens, sm_scale=sm_scale, k_splits=_power_of_two_splits(L, 16, 16),
                           interpret=interpret)

            peers.append(Candidate("jax gpu decode_attention", jax_decode_attention,
                                   lambda: (q, contiguous(b["k_pages"]), contiguous(b["v_pages"]), b["kv_lens"]),
                                   interpret=interpret))
        paged = ctx.load("jax.experimental.pallas.ops.gpu.paged_attention", "paged_attention")
        if paged:
            def jax_paged_attention(q, k, v, table, lens):  # k, v: [Hkv, P, page_size, D]; it applies no softmax scale
                return paged((q * sm_scale).astype(q.dtype), k, v, table, lens,
                             k_splits=_power_of_two_splits(pages_per_seq, 16), interpret=interpret)

            heads_first = lambda pages: jnp.transpose(pages, (2, 0, 1, 3))
            peers.append(Candidate("jax gpu paged_attention", jax_paged_attention,
                                   lambda: (q, heads_first(b["k_pages"]), heads_first(b["v_pages"]), b["page_indices"],
                                            b["kv_lens"]),
                                   interpret=interpret))

    if ctx.backend == "tpu":  # its wrapper asks for a TPU v4+, so it has no interpret mode on other backends
        rpa = ctx.load("jax.experimental.pallas.ops.tpu.ragged_paged_attention", "ragged_paged_attention")
        if rpa:
            # one pool with K and V interleaved along the head axis: [P, page_size, 2 * Hkv, D]
            kv_pages = lambda: jnp.stack([b["k_pages"], b["v_pages"]], axis=3).reshape(-1, page_size, 2 * Hkv, D)
            peers.append(Candidate("jax tpu ragged_paged_attn",
                                   functools.partial(rpa, sm_scale=sm_scale, num_queries_per_block=query_block),
                                   lambda: (q, kv_pages(), b["kv_lens"], b["page_indices"], b["cu_q_lens"], b["num_seqs"])))
    elif ctx.args.interpret:
        ctx.skipped.setdefault("jax.experimental.pallas.ops.tpu.ragged_paged_attention",
                               "TPU only: its wrapper checks the TPU version, so it cannot run in interpret mode here")

    if decode:
        tokamax_dpa = ctx.load("tokamax", "dot_product_attention")  # untested here: tokamax is not installed
        if tokamax_dpa:
            def tokamax_decode(q, k, v, lens):  # q [S, 1, Hq, D] against a contiguous cache masked to lens
                return tokamax_dpa(q[:, None], k, v, scale=sm_scale, key_value_seq_lengths=lens)[:, 0]

            peers.append(Candidate("tokamax dot_product_attn", tokamax_decode,
                                   lambda: (q, contiguous(b["k_pages"]), contiguous(b["v_pages"]), b["kv_lens"])))
    return peers


def bench_ragged_paged_attention(ctx: Context) -> None:
    import jax.numpy as jnp

    a = ctx.args
    cases = [(f"decode B={B} ctx={ctx_len}", [(1, ctx_len)] * B, True) for B in a.batches for ctx_len in a.contexts]
    if a.mixed:
        chunks = [s for s in a.mixed if s[0] > 1]
        T = sum(q for q, _ in a.mixed)
        cases.append((f"mixed T={T}: {len(chunks)} prefill chunks + {len(a.mixed) - len(chunks)} decodes", a.mixed, False))
    sm_scale = 1.0 / math.sqrt(a.head_dim)
    for shape, seqs, decode in cases:
        try:
            b = make_paged_batch(seqs, heads=a.heads, head_dim=a.head_dim, page_size=a.page_size, dtype=ctx.dtype)
        except Exception as e:  # noqa: BLE001
            case_failed(ctx, "ragged paged attention", shape, e)
            continue
        query_block = 1 if decode else a.mixed_query_block
        nbytes, flops = attention_work(seqs, heads=a.heads, head_dim=a.head_dim, itemsize=jnp.dtype(ctx.dtype).itemsize)
        cands = rpa_candidates(ctx, b, decode=decode, query_block=query_block, sm_scale=sm_scale)
        run_case(ctx, "ragged paged attention", shape, cands, bytes_moved=nbytes, flops=flops)
        del b, cands


# ----------------------------------------------------------------------------- flash attention
def bench_flash_attention(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.flash_attention import reference

    a = ctx.args
    Hq, Hkv = a.heads
    D = a.head_dim
    sm_scale = 1.0 / math.sqrt(D)
    itemsize = jnp.dtype(ctx.dtype).itemsize
    mem_limit = a.reference_mem_gib
    if mem_limit is None:
        mem_limit = ctx.device_mem_bytes / 2 / 2**30 if ctx.device_mem_bytes else 8.0
    for length, count in a.flash_segments:
        T = length * count
        shape = f"{count}x{length} tokens (T={T})"
        kq, kk, kv = jax.random.split(jax.random.key(1), 3)
        try:
            q = jax.random.normal(kq, (T, Hq, D), ctx.dtype)  # [T, Hq, D]
            k = jax.random.normal(kk, (T, Hkv, D), ctx.dtype)  # [T, Hkv, D]
            v = jax.random.normal(kv, (T, Hkv, D), ctx.dtype)
        except Exception as e:  # noqa: BLE001
            case_failed(ctx, "flash attention", shape, e)
            continue
        cu = jnp.asarray(np.arange(count + 1) * length, jnp.int32)  # [S + 1]
        num_seqs = jnp.array([count], jnp.int32)
        args = (q, k, v, cu, num_seqs)
        nbytes = 2 * T * (Hq + Hkv) * D * itemsize  # q, k, v, out
        flops = 4.0 * count * (length * (length + 1) // 2) * Hq * D

        cands = []
        dense_gib = 3 * Hq * T * T * 4 / 2**30  # scores, probabilities, weights in f32
        if dense_gib <= mem_limit:
            cands.append(Candidate("reference", functools.partial(reference.flash_attention, sm_scale=sm_scale), args))
        else:
            ctx.skipped.setdefault(f"flash reference at {shape}", f"needs ~{dense_gib:.0f} GiB > --reference-mem-gib {mem_limit:.0f}")
        for platform in ("gpu", "tpu"):
            mode = ctx.pallas_mode(platform)
            kernel = mode and ctx.load(f"pallas_kernels.flash_attention.{platform}", "flash_attention")
            if kernel:
                cands.append(Candidate(f"pallas-{platform}", functools.partial(
                    kernel, sm_scale=sm_scale, causal=True, interpret=mode == "interpret"), args,
                    interpret=mode == "interpret"))

        # peers on the same segments laid out as a batch: [count, length, heads, D]
        batched = (q.reshape(count, length, Hq, D), k.reshape(count, length, Hkv, D), v.reshape(count, length, Hkv, D))
        unbatch = lambda o: o.reshape(T, Hq, D)
        per_segment_gib = 3 * Hq * count * length * length * 4 / 2**30  # jax.nn's xla path: scores per segment
        jax_impls = (["xla"] if per_segment_gib <= mem_limit else []) + (["cudnn"] if ctx.backend == "gpu" else [])
        for impl in jax_impls:
            fn = functools.partial(jax.nn.dot_product_attention, scale=sm_scale, is_causal=True, implementation=impl)
            cands.append(Candidate(f"jax.nn dpa ({impl})", lambda q, k, v, fn=fn: unbatch(fn(q, k, v)), batched))
        tokamax_dpa = ctx.load("tokamax", "dot_product_attention")  # untested here: tokamax is not installed
        if tokamax_dpa:
            fn = functools.partial(tokamax_dpa, scale=sm_scale, is_causal=True)
            cands.append(Candidate("tokamax dot_product_attn", lambda q, k, v, fn=fn: unbatch(fn(q, k, v)), batched))
        run_case(ctx, "flash attention", shape, cands, bytes_moved=nbytes, flops=flops)
        del q, k, v, args, batched, cands


# ----------------------------------------------------------------------------- quantized matmul
def bench_quantized_matmul(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.ops.quantization import quantize
    from pallas_kernels.quantized_matmul import reference

    a = ctx.args
    itemsize = jnp.dtype(ctx.dtype).itemsize
    dense_name = f"dense {jnp.dtype(ctx.dtype).name} (jnp.dot)"
    kernels = {}
    for platform in ("gpu", "tpu"):
        mode = ctx.pallas_mode(platform)
        kernel = mode and ctx.load(f"pallas_kernels.quantized_matmul.{platform}", "quantized_matmul")
        if kernel:
            kernels[platform] = (kernel, mode == "interpret")

    def dense_dot(x, w):  # what the model does with an unquantized weight
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def xla_dequant_dot(x, qweight, scales, *, mode, group_size):  # dequantize to x's dtype, then XLA's dot
        w = reference.dequantize(qweight, scales, mode=mode, group_size=group_size)[: x.shape[1]]
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    for K, N in a.KN:
        w = jax.random.normal(jax.random.key(2), (K, N), jnp.float32) / math.sqrt(K)  # [K, N]
        w_dense = w.astype(ctx.dtype)
        quantized = {mode: quantize(w, mode, group_size) for mode, group_size in QMM_MODES}
        del w
        for M in a.M:
            x = jax.random.normal(jax.random.key(3), (M, K), ctx.dtype)  # [M, K]
            io_bytes = (M * K + M * N) * itemsize
            cands = [Candidate(dense_name, dense_dot, (x, w_dense), compare_to=None, bytes_moved=io_bytes + w_dense.nbytes)]
            for mode, group_size in QMM_MODES:
                qw = quantized[mode]
                label = mode if group_size is None else f"{mode}-g{group_size}"
                qargs = (x, qw.qweight, qw.scales)
                opts = dict(mode=mode, group_size=group_size)
                qbytes = io_bytes + qw.nbytes
                ref_name = f"{label} reference"
                cands.append(Candidate(ref_name, functools.partial(reference.quantized_matmul, **opts), qargs,
                                       compare_to=None, bytes_moved=qbytes))
                cands.append(Candidate(f"{label} xla-dequant", functools.partial(xla_dequant_dot, **opts), qargs,
                                       compare_to=ref_name, bytes_moved=qbytes))
                for platform, (kernel, interpret) in kernels.items():
                    cands.append(Candidate(f"{label} pallas-{platform}", functools.partial(kernel, **opts, interpret=interpret),
                                           qargs, interpret=interpret, compare_to=ref_name, bytes_moved=qbytes))
            run_case(ctx, "quantized matmul", f"M={M} K={K} N={N}", cands, bytes_moved=0.0, flops=2.0 * M * N * K,
                     baseline=dense_name)
            del x, cands
        del w_dense, quantized


# ----------------------------------------------------------------------------- SwiGLU matmul
def _pallas_kernels(ctx: Context, package: str, attr: str) -> dict[str, tuple[Callable, bool]]:
    """platform -> (the package's kernel for it, interpret?) for every platform whose kernel runs here."""
    kernels = {}
    for platform in ("gpu", "tpu"):
        mode = ctx.pallas_mode(platform)
        kernel = mode and ctx.load(f"pallas_kernels.{package}.{platform}", attr)
        if kernel:
            kernels[platform] = (kernel, mode == "interpret")
    return kernels


def bench_swiglu_matmul(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.swiglu_matmul import reference

    itemsize = jnp.dtype(ctx.dtype).itemsize
    kernels = _pallas_kernels(ctx, "swiglu_matmul", "swiglu_matmul")

    def xla_unfused(x, w):  # the model without the kernel: one dot to [M, 2I], then silu(gate) * up
        gate_up = jnp.dot(x, w, preferred_element_type=jnp.float32)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return (jax.nn.silu(gate) * up).astype(x.dtype)

    for H, I in ctx.args.HI:
        w = (jax.random.normal(jax.random.key(4), (H, 2 * I), jnp.float32) / math.sqrt(H)).astype(ctx.dtype)  # [H, 2I]
        for M in ctx.args.M:
            x = jax.random.normal(jax.random.key(5), (M, H), ctx.dtype)  # [M, H]
            cands = [
                Candidate("reference", reference.swiglu_matmul, (x, w), compare_to=None),
                Candidate("xla unfused", xla_unfused, (x, w)),
            ]
            for platform, (kernel, interpret) in kernels.items():
                cands.append(Candidate(f"pallas-{platform}", functools.partial(kernel, interpret=interpret), (x, w),
                                       interpret=interpret))
            run_case(ctx, "swiglu matmul", f"M={M} H={H} I={I}", cands, bytes_moved=(M * H + M * I) * itemsize + w.nbytes,
                     flops=4.0 * M * H * I, baseline="xla unfused")
            del x, cands
        del w


# ----------------------------------------------------------------------------- fused add + RMSNorm
def bench_fused_rms_norm(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.fused_rms_norm import reference

    kernels = _pallas_kernels(ctx, "fused_rms_norm", "add_rms_norm")
    H = ctx.args.HI[0][0]
    for T in ctx.args.norm_rows:
        x = jax.random.normal(jax.random.key(6), (T, H), ctx.dtype)  # [T, H]
        residual = jax.random.normal(jax.random.key(7), (T, H), ctx.dtype)
        weight = 1.0 + 0.1 * jax.random.normal(jax.random.key(8), (H,), ctx.dtype)
        normed = lambda fn: (lambda x, r, w: fn(x, r, w, eps=1e-6)[0])  # noqa: E731  (compare the normed output)
        cands = [Candidate("reference", normed(reference.add_rms_norm), (x, residual, weight), compare_to=None)]
        for platform, (kernel, interpret) in kernels.items():
            fn = functools.partial(kernel, interpret=interpret)
            cands.append(Candidate(f"pallas-{platform}", normed(fn), (x, residual, weight), interpret=interpret))
        run_case(ctx, "add + rms_norm", f"T={T} H={H}", cands, bytes_moved=4.0 * x.nbytes, flops=0.0)
        del x, residual, cands


# ----------------------------------------------------------------------------- RoPE + KV write
def bench_rope_kv_write(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.rope_kv_write import reference

    a = ctx.args
    Hq, Hkv = a.heads
    D, page_size = a.head_dim, a.page_size
    kernels = _pallas_kernels(ctx, "rope_kv_write", "rope_kv_write")
    itemsize = jnp.dtype(ctx.dtype).itemsize
    for T in a.norm_rows:
        P = _cdiv(T, page_size) + 1  # page 0 is the scratch page: never written here
        keys = jax.random.split(jax.random.key(9), 3)
        q = jax.random.normal(keys[0], (T, Hq, D), ctx.dtype)
        k = jax.random.normal(keys[1], (T, Hkv, D), ctx.dtype)
        v = jax.random.normal(keys[2], (T, Hkv, D), ctx.dtype)
        angles = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.linspace(1.0, 1e-4, D)[None, :]  # [T, D]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        slots = np.random.default_rng(0).permutation(np.arange(page_size, P * page_size))[:T]
        page, offset = jnp.asarray(slots // page_size, jnp.int32), jnp.asarray(slots % page_size, jnp.int32)
        pool = jnp.zeros((P, page_size, Hkv, D), ctx.dtype)
        args = (q, k, v, cos, sin, pool, pool, page, offset)

        def rotated_q_and_written_k(fn):  # the output compared: q_rot and the K rows the call wrote
            def run(*args):
                q_rot, _, k_pages, _ = fn(*args)
                page, offset = args[7], args[8]
                return jnp.concatenate([q_rot.reshape(T, -1), k_pages[page, offset].reshape(T, -1)], axis=1)
            return run

        cands = [Candidate("reference", rotated_q_and_written_k(reference.rope_kv_write), args, compare_to=None)]
        for platform, (kernel, interpret) in kernels.items():
            fn = functools.partial(kernel, interpret=interpret)
            cands.append(Candidate(f"pallas-{platform}", rotated_q_and_written_k(fn), args, interpret=interpret))
        nbytes = (2 * q.size + 3 * k.size + 2 * v.size) * itemsize + 2 * cos.size * 4
        run_case(ctx, "rope + kv write", f"T={T} Hq/Hkv={Hq}/{Hkv} D={D} page={page_size}", cands,
                 bytes_moved=nbytes, flops=0.0)
        del q, k, v, pool, args, cands


# ----------------------------------------------------------------------------- report
COLUMNS = ("kernel", "impl", "shape", "ms", "GB/s", "% BW", "TFLOP/s", "speedup", "max abs err", "note")


def _cells(r: dict) -> list[str]:
    err = _fmt(r["max_abs_err"], ".2e")
    if r["err_ok"] is False:
        err += " ✗"
    speed = "—" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    tflops = "—" if not r["tflops"] else f"{r['tflops']:.3g}"
    return [r["kernel"], r["impl"], r["shape"], _fmt(r["ms"], ".4f"), _fmt(r["gbs"], ".1f"), _fmt(r["pct_bw"], ".0f"),
            tflops, speed, err, r["note"]]


def render(ctx: Context, env: dict) -> str:
    a = ctx.args
    L = [f"## bench_kernels: {env['device_kind']} ({ctx.backend}, {env['device_count']} device(s)), {a.dtype}\n"]
    L.append(f"- date: {env['date']}; host cpu: {env['cpu']} ({env['cpu_count']} logical CPUs)")
    L.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    L.append(f"- shapes: heads {a.heads[0]}/{a.heads[1]} (GQA {a.heads[0] // a.heads[1]}), head_dim {a.head_dim}, "
             f"page_size {a.page_size}; reps {a.reps} (median), warm-up {a.warmup}, ~{a.rep_ms:g} ms per rep"
             + ("; --quick" if a.quick else "") + ("; --interpret" if a.interpret else ""))
    L.append(f"- measured bandwidth (the 100% of '% BW'): {_fmt(ctx.peak_gbs, '.1f')} GB/s")
    L.append("- speedup: against `reference` for attention, norm and RoPE + KV write, against the dense `jnp.dot` for "
             "quantized matmul, against XLA's unfused dot + silu * up for the SwiGLU matmul; "
             "max abs err: against the folder's reference.py (the quantized one for each matmul mode); "
             "✗ marks an error above "
             + ("1e-3" if a.dtype == "float32" else "3e-2") + " x max|reference|")
    if ctx.backend == "cpu":
        L.append("- CPU: the Pallas kernels compile for GPU/TPU only; with --interpret they run once in interpret mode "
                 "(correctness, not speed)")
    L.append("")
    L.append("| " + " | ".join(COLUMNS) + " |")
    L.append("|" + "---|" * len(COLUMNS))
    for r in ctx.rows:
        L.append("| " + " | ".join(_cells(r)) + " |")
    if ctx.skipped:
        L.append("\nSkipped:\n")
        L += [f"- {what}: {why}" for what, why in ctx.skipped.items()]
    return "\n".join(L)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    backend = jax.default_backend()
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    fill_defaults(args, backend)
    dev = jax.devices()[0]
    try:
        mem = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001  (not every backend has memory stats)
        mem = None
    ctx = Context(args=args, backend=backend, dtype=jnp.dtype(args.dtype), device_mem_bytes=mem)
    env = environment()
    env["versions"] = {d: _version(d) for d in ("jax", "jaxlib", "jax-cuda12-plugin", "libtpu", "numpy", "tokamax")}
    env.update(device_kind=dev.device_kind, device_count=jax.device_count(), backend=backend,
               device_memory_gib=mem and mem / 2**30)
    if args.interpret and not args.quick:
        log("note: --interpret without --quick runs the Pallas kernels interpreted at full size (slow)")

    t0 = time.perf_counter()
    log(f"== bandwidth probe ({args.bandwidth_gib:g} GiB)")
    bandwidth_probe(ctx)
    for name, bench in (("rpa", bench_ragged_paged_attention), ("flash", bench_flash_attention),
                        ("qmm", bench_quantized_matmul), ("swiglu", bench_swiglu_matmul), ("norm", bench_fused_rms_norm),
                        ("rope_kv", bench_rope_kv_write)):
        if name in args.kernels:
            log(f"== {name}")
            bench(ctx)
    env["total_seconds"] = time.perf_counter() - t0

    print(render(ctx, env))
    print(f"\ntotal {env['total_seconds']:.0f} s")
    if args.json_out:
        payload = {"args": {k: v for k, v in vars(args).items()}, "environment": env, "peak_gbs": ctx.peak_gbs,
                   "rows": ctx.rows, "skipped": ctx.skipped}
        Path(args.json_out).write_text(json.dumps(payload, indent=1, default=str))
        log(f"wrote {args.json_out}")
    failed = [r for r in ctx.rows if r["err_ok"] is False or r["note"].startswith("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

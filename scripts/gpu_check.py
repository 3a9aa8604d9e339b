"""One command for a machine with an NVIDIA GPU: every Triton kernel run on the hardware against
its jnp reference, then decode attention and the quantized matmul timed against the GPU's memory
bandwidth and against XLA's own path. Writes a markdown report.

    python scripts/gpu_check.py --out gpu_report.md            # on the GPU machine
    python scripts/gpu_check.py --interpret --small            # anywhere: the script's own smoke test

Correctness: each kernel at Llama-3.1-8B and SmolLM2 shapes (bf16, int8 / fp8 KV pages, every
quantized-matmul mode) against its reference, error relative to the largest reference entry; the
attention kernels with the newer families' options at their head shapes (windows, soft-capping,
sinks, head_dim 256 / 512). Speed also: decode attention with and without a sliding window.
Speed: the kernel's time (median of --iters after a warm-up) and the bytes it must move, as a
share of the GPU's peak bandwidth (`--peak-gbps`, default from the device name), beside XLA's
path for the same function (split-KV attention in jnp; dequantize-then-dot).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PEAK_GBPS = {"H100": 3352, "H200": 4800, "A100": 2039, "L4": 300}


def _rng_normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.normal(0, scale, shape).astype(np.float32)).astype(dtype)


def _attention_case(rng, *, seqs, context, q_len, Hq, Hkv, D, page_size, kv_dtype):
    """A batch of `seqs` sequences at `context` tokens, each with q_len new queries."""
    pages_per_seq = -(-context // page_size)
    num_pages = seqs * pages_per_seq + 1
    q = _rng_normal(rng, (seqs * q_len, Hq, D), jnp.bfloat16)
    scales = {}
    if kv_dtype == jnp.bfloat16:
        k, v = (_rng_normal(rng, (num_pages, page_size, Hkv, D), jnp.bfloat16) for _ in range(2))
    else:
        k, v = (_rng_normal(rng, (num_pages, page_size, Hkv, D), jnp.float32, 20.0).astype(kv_dtype) for _ in range(2))
        scales = dict(k_scale=0.05, v_scale=0.05)
    page_indices = jnp.asarray(1 + np.arange(seqs * pages_per_seq).reshape(seqs, pages_per_seq), jnp.int32)
    kv_lens = jnp.full((seqs,), context, jnp.int32)
    cu_q_lens = jnp.asarray(np.arange(seqs + 1) * q_len, jnp.int32)
    args = (q, k, v, kv_lens, page_indices, cu_q_lens, jnp.asarray([seqs], jnp.int32))
    return args, dict(sm_scale=D**-0.5, **scales), seqs * context * Hkv * D * 2 * jnp.dtype(kv_dtype).itemsize


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def _time(fn, *args, iters: int) -> float:
    """Median seconds of fn(*args) over `iters` runs after one warm-up (compile) run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def correctness_rows(interpret: bool, small: bool):
    """(kernel, case, relative error, tolerance) for every GPU kernel."""
    from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_reference
    from pallas_kernels.fused_rms_norm import add_rms_norm_gpu, add_rms_norm_reference
    from pallas_kernels.quantized_matmul import gpu as qmm_gpu
    from pallas_kernels.quantized_matmul import reference as qmm_ref
    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import reference as rpa_ref
    from pallas_kernels.rope_kv_write import rope_kv_write_gpu, rope_kv_write_reference
    from pallas_kernels.swiglu_matmul import swiglu_matmul_gpu, swiglu_matmul_reference
    from jaxinfer.ops.quantization import quantize

    rng = np.random.default_rng(0)
    families = {"smollm2-135m": (9, 3, 64, 576, 1536)} if small else {
        "llama-3.1-8b": (32, 8, 128, 4096, 14336), "smollm2-135m": (9, 3, 64, 576, 1536)}
    seqs, context, T = (2, 40, 16) if small else (16, 1000, 256)
    opts = dict(interpret=interpret)
    for family, (Hq, Hkv, D, H, F) in families.items():
        for kv_name, kv_dtype in (("bf16", jnp.bfloat16), ("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
            for bucket, q_len, Bq in (("decode", 1, 1), ("prefill chunk", 8, 8)):
                args, kw, _ = _attention_case(rng, seqs=seqs, context=context, q_len=q_len, Hq=Hq, Hkv=Hkv, D=D,
                                              page_size=16, kv_dtype=kv_dtype)
                got = rpa_gpu.ragged_paged_attention(*args, num_queries_per_block=Bq, **kw, **opts)
                want = rpa_ref.ragged_paged_attention(*args, **kw)
                yield "ragged_paged_attention", f"{family} {bucket} kv={kv_name}", _relative_error(got, want), 3e-2
        q = _rng_normal(rng, (T, Hq, D), jnp.bfloat16)
        k, v = _rng_normal(rng, (T, Hkv, D), jnp.bfloat16), _rng_normal(rng, (T, Hkv, D), jnp.bfloat16)
        cu, n = jnp.asarray([0, T // 2, T], jnp.int32), jnp.asarray([2], jnp.int32)
        got = flash_attention_gpu(q, k, v, cu, n, sm_scale=D**-0.5, causal=True, **opts)
        want = flash_attention_reference(q, k, v, cu, n, sm_scale=D**-0.5, causal=True)
        yield "flash_attention", f"{family} T={T}", _relative_error(got, want), 3e-2
        x, r, w = _rng_normal(rng, (T, H), jnp.bfloat16), _rng_normal(rng, (T, H), jnp.bfloat16), _rng_normal(rng, (H,), jnp.bfloat16)
        got, want = add_rms_norm_gpu(x, r, w, eps=1e-5, **opts), add_rms_norm_reference(x, r, w, eps=1e-5)
        yield "add_rms_norm", f"{family} H={H}", max(_relative_error(g, w_) for g, w_ in zip(got, want)), 3e-2
        wgu = _rng_normal(rng, (H, 2 * F), jnp.bfloat16, H**-0.5)
        got, want = swiglu_matmul_gpu(x, wgu, **opts), swiglu_matmul_reference(x, wgu)
        yield "swiglu_matmul", f"{family} {H}->{F}", _relative_error(got, want), 3e-2
        weight = _rng_normal(rng, (H, H), jnp.float32, H**-0.5)
        for mode in ("int8", "int4", "fp8"):
            group = 64 if mode == "int4" else None
            qw = quantize(weight, mode, group)
            got = qmm_gpu.quantized_matmul(x, qw.qweight, qw.scales, mode=mode, group_size=group, **opts)
            want = qmm_ref.quantized_matmul(x, qw.qweight, qw.scales, mode=mode, group_size=group)
            yield "quantized_matmul", f"{family} {mode} {H}->{H}", _relative_error(got, want), 3e-2
        # the grouped matmul over a stack of 8 experts (rows of a decode's (token, expert) pairs, some of no
        # expert), and block-scaled fp8 (DeepSeek-V3's 128-row blocks) in both matmuls where H allows
        from pallas_kernels.grouped_matmul import gpu as gmm_gpu
        from pallas_kernels.grouped_matmul import reference as gmm_ref
        experts = _rng_normal(rng, (8, H, H), jnp.float32, H**-0.5)
        group_of_row = jnp.asarray(rng.integers(0, 9, T), jnp.int32)
        for mode, group in (("int8", None), ("int4", 64), ("fp8", None)) + ((("fp8", 128),) if H % 128 == 0 else ()):
            if group == 128:
                qw = quantize(weight, mode, group)
                got = qmm_gpu.quantized_matmul(x, qw.qweight, qw.scales, mode=mode, group_size=group, **opts)
                want = qmm_ref.quantized_matmul(x, qw.qweight, qw.scales, mode=mode, group_size=group)
                yield "quantized_matmul", f"{family} fp8 g128 {H}->{H}", _relative_error(got, want), 3e-2
            qs = quantize(experts, mode, group)
            got = gmm_gpu.grouped_quantized_matmul(x, group_of_row, qs.qweight, qs.scales, mode=mode, group_size=qs.group_size,
                                                   **opts)
            want = gmm_ref.grouped_quantized_matmul(x, group_of_row, qs.qweight, qs.scales, mode=mode, group_size=qs.group_size)
            yield "grouped_matmul", f"{family} 8 experts {mode}{f' g{group}' if group else ''} {H}->{H}", \
                _relative_error(got, want), 3e-2
        pages = jnp.zeros((64, 16, Hkv, D), jnp.bfloat16)
        cos, sin = jnp.cos(jnp.ones((T, D))), jnp.sin(jnp.ones((T, D)))
        slots = jnp.arange(T, dtype=jnp.int32)
        rope_args = (q, k, v, cos, sin, pages, pages, 1 + slots // 16, slots % 16)
        got, want = rope_kv_write_gpu(*rope_args, **opts), rope_kv_write_reference(*rope_args)
        yield "rope_kv_write", f"{family} T={T}", max(_relative_error(g, w_) for g, w_ in zip(got, want)), 3e-2


# The attention options of the newer families at their real head shapes (Hq, Hkv, D, options):
# windows shorter than the context, soft-capped scores, attention sinks, chunks, head_dim 256 and 512.
ATTENTION_OPTION_CASES = {
    "gemma-2-9b (D=256, window, soft-cap 50)": (16, 8, 256, dict(sliding_window=256, soft_cap=50.0)),
    "gemma-3-27b (D=128, window)": (32, 16, 128, dict(sliding_window=256)),
    "gpt-oss-120b (D=64, window 128, sinks)": (64, 8, 64, dict(sliding_window=128, sinks=True)),
    "head_dim 512 (global layers of Gemma 4)": (8, 2, 512, {}),
    "llama-4-scout (D=128, chunk 64)": (40, 8, 128, dict(attention_chunk=64)),
}


def attention_option_rows(interpret: bool, small: bool):
    """(kernel, case, relative error, tolerance): the ragged and flash kernels with each option."""
    from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_reference
    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import reference as rpa_ref

    rng = np.random.default_rng(1)
    seqs, context, T = (2, 40, 16) if small else (8, 1000, 256)
    for name, (Hq, Hkv, D, options) in ATTENTION_OPTION_CASES.items():
        options = dict(options)
        if small and options.get("sliding_window"):
            options["sliding_window"] = 9
        if small and options.get("attention_chunk"):
            options["attention_chunk"] = 4
        if options.pop("sinks", False):
            options["sinks"] = jnp.asarray(rng.normal(0, 2, Hq), jnp.float32)
        for bucket, q_len, Bq in (("decode", 1, 1), ("prefill chunk", 8, 8)):
            args, kw, _ = _attention_case(rng, seqs=seqs, context=context, q_len=q_len, Hq=Hq, Hkv=Hkv, D=D,
                                          page_size=16, kv_dtype=jnp.bfloat16)
            got = rpa_gpu.ragged_paged_attention(*args, num_queries_per_block=Bq, interpret=interpret, **kw, **options)
            want = rpa_ref.ragged_paged_attention(*args, **kw, **options)
            yield "ragged_paged_attention", f"{name} {bucket}", _relative_error(got, want), 3e-2
        if "sinks" in options:
            continue  # the flash kernels have no sinks (a model with sinks never takes the flash path)
        q = _rng_normal(rng, (T, Hq, D), jnp.bfloat16)
        k, v = _rng_normal(rng, (T, Hkv, D), jnp.bfloat16), _rng_normal(rng, (T, Hkv, D), jnp.bfloat16)
        cu, n = jnp.asarray([0, T // 2, T], jnp.int32), jnp.asarray([2], jnp.int32)
        got = flash_attention_gpu(q, k, v, cu, n, sm_scale=D**-0.5, causal=True, interpret=interpret, **options)
        want = flash_attention_reference(q, k, v, cu, n, sm_scale=D**-0.5, causal=True, **options)
        yield "flash_attention", f"{name} T={T}", _relative_error(got, want), 3e-2


def _mla_case(rng, *, seqs, context, q_len, Hq, value_dim=512, rope=64, page_size=16):
    """DeepSeek-V3's latent attention: a batch over one latent row per token ([c | k_rope], bf16)."""
    pages_per_seq = -(-context // page_size)
    D = value_dim + rope
    q = _rng_normal(rng, (seqs * q_len, Hq, D), jnp.bfloat16)
    rows = _rng_normal(rng, (seqs * pages_per_seq + 1, page_size, D), jnp.bfloat16)
    page_indices = jnp.asarray(1 + np.arange(seqs * pages_per_seq).reshape(seqs, pages_per_seq), jnp.int32)
    args = (q, rows, jnp.full((seqs,), context, jnp.int32), page_indices,
            jnp.asarray(np.arange(seqs + 1) * q_len, jnp.int32), jnp.asarray([seqs], jnp.int32))
    return args, dict(value_dim=value_dim, sm_scale=D**-0.5), seqs * context * D * 2


def mla_rows(interpret: bool, small: bool):
    """(kernel, case, relative error, tolerance): the MLA kernel at DeepSeek-V3's 128 heads."""
    from pallas_kernels.mla_attention import gpu as mla_gpu
    from pallas_kernels.mla_attention import reference as mla_ref

    rng = np.random.default_rng(3)
    seqs, context = (2, 40) if small else (8, 1000)
    for bucket, q_len, Bq in (("decode", 1, 1), ("prefill chunk", 8, 8)):
        args, kw, _ = _mla_case(rng, seqs=seqs, context=context, q_len=q_len, Hq=128)
        got = mla_gpu.mla_attention(*args, num_queries_per_block=Bq, interpret=interpret, **kw)
        want = mla_ref.mla_attention(*args, **kw)
        yield "mla_attention", f"deepseek-v3 (128 heads, 512 + 64) {bucket}", _relative_error(got, want), 3e-2


def mla_speed_rows(interpret: bool, small: bool, iters: int, peak_gbps: float):
    """(what, kernel ms, kernel GB/s, % of peak, XLA ms, speed-up): MLA decode over the latent rows."""
    from pallas_kernels.mla_attention import gpu as mla_gpu
    from pallas_kernels.mla_attention.reference import as_kv_head
    from pallas_kernels.ragged_paged_attention import split_kv

    rng = np.random.default_rng(4)
    seqs, contexts = (2, (64,)) if small else (64, (1024, 4096))
    for context in contexts:
        args, kw, nbytes = _mla_case(rng, seqs=seqs, context=context, q_len=1, Hq=128)
        kernel = jax.jit(functools.partial(mla_gpu.mla_attention, num_queries_per_block=1, interpret=interpret, **kw))

        def xla(q, rows, *rest):
            kv = as_kv_head(rows, q.shape[-1])
            return split_kv.ragged_paged_attention(q, kv, kv, *rest, sm_scale=kw["sm_scale"],
                                                   num_queries_per_block=1)[..., : kw["value_dim"]]

        t_kernel, t_xla = _time(kernel, *args, iters=iters), _time(jax.jit(xla), *args, iters=iters)
        gbps = nbytes / t_kernel / 1e9
        yield (f"MLA decode, {seqs} seqs x {context} tokens, DeepSeek-V3 (128 heads, latent 512 + 64)",
               t_kernel * 1e3, gbps, 100 * gbps / peak_gbps, t_xla * 1e3, t_xla / t_kernel)


def window_speed_rows(interpret: bool, small: bool, iters: int, peak_gbps: float):
    """Decode attention over a long context with and without a sliding window (or a chunk, Llama 4):
    the windowed call should read (and take) about window / context of the full one's time."""
    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu

    rng = np.random.default_rng(2)
    seqs, context, window = (2, 64, 16) if small else (64, 8192, 1024)
    args, kw, full_bytes = _attention_case(rng, seqs=seqs, context=context, q_len=1, Hq=32, Hkv=16, D=128, page_size=16,
                                           kv_dtype=jnp.bfloat16)
    # a chunk as long as the window: the last position's chunk holds the last `window` tokens too
    for label, options, nbytes in (("full", {}, full_bytes),
                                   (f"window {window}", dict(sliding_window=window), full_bytes * window // context),
                                   (f"chunk {window}", dict(attention_chunk=window), full_bytes * window // context)):
        fn = jax.jit(functools.partial(rpa_gpu.ragged_paged_attention, num_queries_per_block=1, interpret=interpret,
                                       **kw, **options))
        seconds = _time(fn, *args, iters=iters)
        yield (f"decode attention, {seqs} seqs x {context} tokens, Gemma-3-27B heads (D=128), {label}",
               seconds * 1e3, nbytes / seconds / 1e9, 100 * nbytes / seconds / 1e9 / peak_gbps)


def speed_rows(interpret: bool, small: bool, iters: int, peak_gbps: float):
    """(what, kernel ms, kernel GB/s, % of peak, XLA ms, kernel speed-up over XLA)."""
    from pallas_kernels.quantized_matmul import gpu as qmm_gpu
    from pallas_kernels.quantized_matmul import reference as qmm_ref
    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import split_kv
    from jaxinfer.ops.quantization import quantize

    rng = np.random.default_rng(1)
    seqs, contexts = (2, (64,)) if small else (64, (1024, 4096))
    for context in contexts:
        for kv_name, kv_dtype in (("bf16", jnp.bfloat16), ("int8", jnp.int8)):
            args, kw, kv_bytes = _attention_case(rng, seqs=seqs, context=context, q_len=1, Hq=32, Hkv=8, D=128,
                                                 page_size=16, kv_dtype=kv_dtype)
            kernel = jax.jit(functools.partial(rpa_gpu.ragged_paged_attention, num_queries_per_block=1, interpret=interpret, **kw))
            xla = jax.jit(functools.partial(split_kv.ragged_paged_attention, num_queries_per_block=1, **kw))
            t_kernel, t_xla = _time(kernel, *args, iters=iters), _time(xla, *args, iters=iters)
            gbps = kv_bytes / t_kernel / 1e9
            yield (f"decode attention, {seqs} seqs x {context} tokens, Llama-3.1-8B heads, kv={kv_name}",
                   t_kernel * 1e3, gbps, 100 * gbps / peak_gbps, t_xla * 1e3, t_xla / t_kernel)
    K, N = (256, 512) if small else (4096, 14336)
    x = _rng_normal(rng, (16, K), jnp.bfloat16)
    weight = _rng_normal(rng, (K, N), jnp.float32, K**-0.5)
    for mode in ("int8", "int4", "fp8"):
        group = 128 if mode == "int4" else None
        qw = quantize(weight, mode, group)
        kernel = jax.jit(functools.partial(qmm_gpu.quantized_matmul, mode=mode, group_size=group, interpret=interpret))
        xla = jax.jit(functools.partial(qmm_ref.quantized_matmul, mode=mode, group_size=group))
        t_kernel, t_xla = _time(kernel, x, qw.qweight, qw.scales, iters=iters), _time(xla, x, qw.qweight, qw.scales, iters=iters)
        weight_bytes = qw.qweight.size * qw.qweight.dtype.itemsize + qw.scales.size * qw.scales.dtype.itemsize
        gbps = weight_bytes / t_kernel / 1e9
        yield (f"quantized matmul {mode}, 16 x {K} -> {N} (decode)", t_kernel * 1e3, gbps, 100 * gbps / peak_gbps,
               t_xla * 1e3, t_xla / t_kernel)


def tree_and_sparse_rows(interpret: bool, small: bool):
    """(kernel, case, relative error, tolerance): the ragged kernel under draft-tree masks (issue 42)
    and the 2:4 sparse matmul (issue 41) against their references."""
    from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
    from pallas_kernels.ragged_paged_attention import reference as rpa_ref
    from pallas_kernels.sparse24_matmul import gpu as s24_gpu
    from pallas_kernels.sparse24_matmul import reference as s24_ref

    rng = np.random.default_rng(2)
    seqs, context, q_len = (2, 40, 8) if small else (16, 1000, 16)
    Hq, Hkv, D = (9, 3, 64) if small else (32, 8, 128)  # SmolLM2's heads / Llama-3.1-8B's
    args, kw, _ = _attention_case(rng, seqs=seqs, context=context, q_len=q_len, Hq=Hq, Hkv=Hkv, D=D,
                                  page_size=16, kv_dtype=jnp.bfloat16)
    # each sequence's q_len new rows form a tree: row i sees itself and a random subset of rows < i
    base = np.repeat(np.full(seqs, context - q_len), q_len).astype(np.int32)
    bits = np.zeros(seqs * q_len, np.int64)
    for s in range(seqs):
        for i in range(q_len):
            bits[s * q_len + i] = (1 << i) | int(rng.integers(0, 1 << i)) if i else 1
    tree = dict(tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits.astype(np.int32)))
    for Bq in ((8,) if small else (1, 8)):
        got = rpa_gpu.ragged_paged_attention(*args, num_queries_per_block=Bq, interpret=interpret, **kw, **tree)
        want = rpa_ref.ragged_paged_attention(*args, **kw, **tree)
        yield "ragged_paged_attention", f"draft tree of {q_len} per seq, block {Bq}", _relative_error(got, want), 3e-2
    K, N = (256, 256) if small else (4096, 14336)
    weight = np.asarray(_rng_normal(rng, (K, N), jnp.float32, K**-0.5))
    values, mask = s24_ref.from_dense_24(jnp.asarray(weight), prune=True)
    for M in ((4,) if small else (16, 256)):
        x = _rng_normal(rng, (M, K), jnp.bfloat16)
        got = s24_gpu.sparse24_matmul(x, values.astype(jnp.bfloat16), mask, interpret=interpret)
        want = s24_ref.sparse24_matmul(x, values.astype(jnp.bfloat16), mask)
        yield "sparse24_matmul", f"{M} x {K} -> {N}", _relative_error(got, want), 3e-2


def sparse24_speed_rows(interpret: bool, small: bool, iters: int, peak_gbps: float):
    """(what, kernel ms, kernel GB/s, % of peak, dense XLA ms, speed-up over the dense bf16 matmul)."""
    from pallas_kernels.sparse24_matmul import gpu as s24_gpu
    from pallas_kernels.sparse24_matmul import reference as s24_ref

    rng = np.random.default_rng(3)
    K, N = (256, 512) if small else (4096, 14336)
    weight = _rng_normal(rng, (K, N), jnp.float32, K**-0.5)
    values, mask = s24_ref.from_dense_24(weight, prune=True)
    values = values.astype(jnp.bfloat16)
    dense = s24_ref.densify(values, mask, jnp.bfloat16)
    kernel = jax.jit(functools.partial(s24_gpu.sparse24_matmul, interpret=interpret))
    xla = jax.jit(jnp.dot)
    for M in ((16,) if small else (1, 16, 64)):
        x = _rng_normal(rng, (M, K), jnp.bfloat16)
        t_kernel, t_xla = _time(kernel, x, values, mask, iters=iters), _time(xla, x, dense, iters=iters)
        weight_bytes = values.size * 2 + mask.size
        gbps = weight_bytes / t_kernel / 1e9
        yield (f"2:4 sparse matmul bf16, {M} x {K} -> {N} (vs dense bf16 jnp.dot)", t_kernel * 1e3, gbps,
               100 * gbps / peak_gbps, t_xla * 1e3, t_xla / t_kernel)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_report.md")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the GPU's memory bandwidth (default: from its name)")
    parser.add_argument("--interpret", action="store_true", help="interpret mode (no GPU): checks the script itself")
    parser.add_argument("--small", action="store_true", help="small shapes (with --interpret)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.interpret:
        print(f"no GPU here ({device.platform}); run on a GPU machine, or pass --interpret to check the script", file=sys.stderr)
        return 2
    name = getattr(device, "device_kind", device.platform)
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), 1000.0)
    lines = [f"# GPU check: {name}", "", f"jax {jax.__version__}, peak bandwidth taken as {peak:.0f} GB/s"
             + (" (interpret mode: NOT a hardware run)" if args.interpret else ""), "",
             "## Kernels on the hardware against their references", "",
             "| kernel | case | max error (relative) | tolerance | |", "|---|---|---:|---:|---|"]
    failures = 0
    for kernel, case, error, tol in itertools.chain(correctness_rows(args.interpret, args.small),
                                                    attention_option_rows(args.interpret, args.small),
                                                    mla_rows(args.interpret, args.small),
                                                    tree_and_sparse_rows(args.interpret, args.small)):
        ok = error <= tol
        failures += not ok
        lines.append(f"| {kernel} | {case} | {error:.2e} | {tol:.0e} | {'ok' if ok else 'FAIL'} |")
        print(lines[-1], flush=True)
    lines += ["", "## Speed (median of %d runs)" % args.iters, "",
              "| what | kernel ms | kernel GB/s | % of peak | XLA path ms | kernel speed-up |", "|---|---:|---:|---:|---:|---:|"]
    for what, ms, gbps, share, xla_ms, speedup in itertools.chain(speed_rows(args.interpret, args.small, args.iters, peak),
                                                                  mla_speed_rows(args.interpret, args.small, args.iters, peak),
                                                                  sparse24_speed_rows(args.interpret, args.small, args.iters, peak)):
        lines.append(f"| {what} | {ms:.3f} | {gbps:.0f} | {share:.0f}% | {xla_ms:.3f} | {speedup:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "## Bytes read follow the window (median of %d runs)" % args.iters, "",
              "| what | kernel ms | GB/s of the bytes it must read | % of peak |", "|---|---:|---:|---:|"]
    for what, ms, gbps, share in window_speed_rows(args.interpret, args.small, args.iters, peak):
        lines.append(f"| {what} | {ms:.3f} | {gbps:.0f} | {share:.0f}% |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{failures} kernel checks failed; report: {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast XLA:CPU runs one layer's decode attention, written several ways, against reading the
same K and V bytes.

Every decoding sequence holds `--context` tokens; K and V are already gathered (contiguous per
sequence), so what is timed is the contraction itself, the part of the CPU decode step that
stays far from memory bandwidth. Prints one table: milliseconds per layer, the rate at which K and
V bytes are consumed, and GFLOP/s (QK and PV multiply-adds).

    python scripts/bench_attention_formulations.py --seqs 64 --context 512
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def formulations(dtype):
    """name -> (function(q, k, v), the layout k and v take: "token-major" [S, C, H, D] as pages
    store them, "head-major" [S, H, C, D], or "k-transposed" (K [S, H, D, C], V head-major))."""
    f32 = jnp.float32

    def reduce_token_major(q, k, v):  # what split_kv's contraction="reduce" does per item
        s = (k.astype(f32)[:, :, :, None, :] * q[:, None]).sum(-1)  # [S, C, H, G]
        p = jax.nn.softmax(s, axis=1)
        return (p[..., None] * v.astype(f32)[:, :, :, None, :]).sum(1)  # [S, H, G, D]

    def einsum_token_major(q, k, v):  # batched matmuls over (S, H): XLA transposes K and V first
        s = jnp.einsum("shgd,schd->shgc", q, k.astype(f32))
        return jnp.einsum("shgc,schd->shgd", jax.nn.softmax(s, axis=-1), v.astype(f32))

    def einsum_token_major_16bit(q, k, v):
        s = jnp.einsum("shgd,schd->shgc", q.astype(dtype), k, preferred_element_type=f32)
        p = jax.nn.softmax(s, axis=-1).astype(dtype)
        return jnp.einsum("shgc,schd->shgd", p, v, preferred_element_type=f32)

    def einsum_head_major(q, k, v):  # batch dimensions leading: no transpose
        s = jnp.einsum("shgd,shcd->shgc", q, k.astype(f32))
        return jnp.einsum("shgc,shcd->shgd", jax.nn.softmax(s, axis=-1), v.astype(f32))

    def reduce_k_transposed(q, kt, v):  # every reduction over a non-minor axis
        s = (kt.astype(f32)[:, :, None] * q[..., None]).sum(3)  # [S, H, G, C]
        p = jax.nn.softmax(s, axis=-1)
        return (p[..., None] * v.astype(f32)[:, :, None]).sum(3)  # [S, H, G, D]

    return {
        "products and sums, token-major (the CPU path)": (reduce_token_major, "token-major"),
        "einsum, token-major (transposes)": (einsum_token_major, "token-major"),
        "einsum, token-major, 16-bit inputs": (einsum_token_major_16bit, "token-major"),
        "einsum, head-major": (einsum_head_major, "head-major"),
        "products and sums, K transposed": (reduce_k_transposed, "k-transposed"),
    }


def time_it(fn, *args, repeats: int) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=3, help="SmolLM2-135M: 3 KV heads")
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head (SmolLM2-135M: 3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="K/V dtype")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    S, C, H, G, D = args.seqs, args.context, args.kv_heads, args.group, args.head_dim
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    token_major = [jnp.asarray(rng.standard_normal((S, C, H, D)), dtype) for _ in range(2)]
    head_major = [jnp.swapaxes(a, 1, 2) for a in token_major]
    layouts = {
        "token-major": token_major,
        "head-major": head_major,
        "k-transposed": [jnp.swapaxes(head_major[0], 2, 3), head_major[1]],
    }
    q = jnp.asarray(rng.standard_normal((S, H, G, D)), jnp.float32)
    kv_bytes = 2 * S * C * H * D * dtype.itemsize
    flops = 2 * 2 * S * C * H * G * D

    read = time_it(lambda k, v: k.astype(jnp.float32).sum() + v.astype(jnp.float32).sum(), *token_major,
                   repeats=args.repeats)
    print(f"- one layer: {S} sequences x {C} tokens, {H} KV heads x {G} queries, head dim {D}, K/V {args.dtype}: "
          f"{kv_bytes / 2**20:.1f} MiB of K and V, {flops / 1e6:.0f} MFLOP")
    print(f"- cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; jax {jax.__version__}")
    print()
    print("| formulation | ms per layer | K+V GB/s | GFLOP/s | x a plain read |")
    print("|---|---|---|---|---|")
    print(f"| read K and V once (a sum) | {read * 1e3:.2f} | {kv_bytes / read / 1e9:.1f} | — | 1.0 |")
    for name, (fn, layout) in formulations(dtype).items():
        t = time_it(fn, q, *layouts[layout], repeats=args.repeats)
        print(f"| {name} | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.1f} | {flops / t / 1e9:.1f} | {t / read:.1f} |")


if __name__ == "__main__":
    main()

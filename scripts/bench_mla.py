"""Multi-head latent attention of one layer, absorbed against expanded, timed on this machine.

    python scripts/bench_mla.py                 # CPU: the XLA paths; a GPU machine: the Triton kernels
    python scripts/bench_mla.py --config v3     # DeepSeek-V3's heads (128) instead of V2-Lite's (16)

For a fresh prefill of T tokens (two prompts of T/2, nothing cached) and for a decode step (64
sequences at a context of C tokens), the attention of one layer from the queries and latents on:

- absorbed (jaxinfer's path for every step on the CPU, for decodes and chunks over a prefix
  everywhere): q_nope @ W_UK per head, attention over the latent rows [c | k_rope] (r + rope
  dims, one row per token for all heads: `Kernels.mla_attention`), the result @ W_UV;
- expanded (a long fresh prefill on TPU / GPU): each head's K = [c @ W_UK | k_rope], V = c @ W_UV
  (padded to K's width), causal flash attention over them (nope + rope dims). A decode cannot run
  expanded without expanding its whole cached context each step, so only prefills have it.

On the CPU the absorbed attention is the split-KV XLA path and the expanded one the jnp flash
reference (dense scores); on a GPU, the MLA Triton kernel and the flash Triton kernel. Median of
--iters after a warm-up, milliseconds; the ratio is expanded / absorbed time.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_check import _time  # noqa: E402

from jaxinfer.ops.batch import RaggedBatch  # noqa: E402
from jaxinfer.ops.kernels import Kernels  # noqa: E402
from pallas_kernels.flash_attention import flash_attention_gpu  # noqa: E402
from pallas_kernels.flash_attention.reference import flash_attention as flash_attention_reference  # noqa: E402

CONFIGS = {  # heads, latent r, rope, nope, v
    "v2-lite": dict(heads=16, r=512, rope=64, nope=128, v=128),
    "v3": dict(heads=128, r=512, rope=64, nope=128, v=128),
}
PAGE = 16


def _ms(fn, *args, iters):
    return _time(fn, *args, iters=iters) * 1e3


def batch_of(q_lens, kv_lens) -> tuple[RaggedBatch, int]:
    """(a ragged batch, pages used + 1): sequence s has q_lens[s] queries ending at kv_lens[s], pages in order from 1."""
    S = len(q_lens)
    pages = [-(-n // PAGE) for n in kv_lens]
    table = np.zeros((S, max(pages)), np.int32)
    first = 1
    for s, n in enumerate(pages):
        table[s, :n] = np.arange(first, first + n)
        first += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(cu[-1])
    positions = np.concatenate([np.arange(k - q, k) for q, k in zip(q_lens, kv_lens)]).astype(np.int32)
    return RaggedBatch(token_ids=jnp.zeros(T, jnp.int32), positions=jnp.asarray(positions), cu_q_lens=jnp.asarray(cu),
                       kv_lens=jnp.asarray(kv_lens, jnp.int32), page_table=jnp.asarray(table),
                       num_seqs=jnp.asarray([S], jnp.int32), logits_indices=jnp.zeros(S, jnp.int32),
                       token_src=jnp.full(T, -1, jnp.int32)), first


def layer_fns(kernels: Kernels, flash, *, heads, r, rope, nope, v, query_block):
    scale = (nope + rope) ** -0.5

    @jax.jit
    def absorbed(q_nope, q_rope, latent_pages, w_uk, w_uv, batch):
        q_latent = jnp.einsum("thn,rhn->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
        q = jnp.concatenate([q_latent, q_rope], axis=-1)
        attn = kernels.mla_attention(q, latent_pages, batch.page_table, batch, value_dim=r, sm_scale=scale,
                                     query_block=query_block)
        return jnp.einsum("thr,rhv->thv", attn, w_uv, preferred_element_type=jnp.float32)

    @jax.jit
    def expanded(q_nope, q_rope, latent, k_rope, w_uk, w_uv, batch):
        T = latent.shape[0]
        k_nope = jnp.einsum("tr,rhn->thn", latent, w_uk, preferred_element_type=jnp.float32).astype(latent.dtype)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None], (T, heads, rope))], axis=-1)
        val = jnp.einsum("tr,rhv->thv", latent, w_uv, preferred_element_type=jnp.float32).astype(latent.dtype)
        val = jnp.pad(val, ((0, 0), (0, 0), (0, nope + rope - v)))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        return flash(q, k, val, batch.cu_q_lens, batch.num_seqs, causal=True, sm_scale=scale)[..., :v]

    return absorbed, expanded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="v2-lite")
    parser.add_argument("--prefill", type=int, nargs="+", default=None, help="fresh prefill tokens per step")
    parser.add_argument("--decode-context", type=int, nargs="+", default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--interpret", action="store_true", help="the GPU kernels in interpret mode (checks the script)")
    args = parser.parse_args(argv)
    gpu = jax.devices()[0].platform == "gpu" or args.interpret
    kernels = Kernels("gpu", interpret=args.interpret) if gpu else Kernels()
    flash = functools.partial(flash_attention_gpu, interpret=args.interpret) if gpu else flash_attention_reference
    dtype = jnp.bfloat16 if gpu else jnp.float32
    c = CONFIGS[args.config]
    heads, r, rope, nope, v = c["heads"], c["r"], c["rope"], c["nope"], c["v"]
    prefill = args.prefill or ([512, 2048, 8192] if gpu else [256, 512, 1024])
    contexts = args.decode_context or ([1024, 4096] if gpu else [512, 2048])
    rng = np.random.default_rng(0)
    normal = lambda *shape, scale=1.0: jnp.asarray(rng.normal(0, scale, shape), dtype)  # noqa: E731
    w_uk, w_uv = normal(r, heads, nope, scale=r**-0.5), normal(r, heads, v, scale=r**-0.5)
    print(f"# MLA attention, one layer: {args.config} ({heads} heads, latent {r} + rope {rope}, nope {nope}, v {v}), "
          f"{jax.devices()[0].device_kind}, {jnp.dtype(dtype).name}, jax {jax.__version__}\n")
    print("| step | absorbed ms | expanded ms | expanded / absorbed |")
    print("|---|---:|---:|---:|")
    for T in prefill:
        batch, num_pages = batch_of([T // 2, T - T // 2], [T // 2, T - T // 2])
        absorbed, expanded = layer_fns(kernels, flash, **c, query_block=64)
        latent, k_rope = normal(T, r), normal(T, rope)
        pages = jnp.zeros((num_pages + 1, PAGE, r + rope), dtype)
        slots = np.concatenate([(np.asarray(batch.page_table)[s, : -(-n // PAGE)][:, None] * PAGE + np.arange(PAGE)).reshape(-1)[:n]
                                for s, n in enumerate([T // 2, T - T // 2])])
        pages = pages.reshape(-1, r + rope).at[slots].set(jnp.concatenate([latent, k_rope], axis=-1)).reshape(pages.shape)
        q_nope, q_rope = normal(T, heads, nope), normal(T, heads, rope)
        a = _ms(absorbed, q_nope, q_rope, pages, w_uk, w_uv, batch, iters=args.iters)
        e = _ms(expanded, q_nope, q_rope, latent, k_rope, w_uk, w_uv, batch, iters=args.iters)
        print(f"| fresh prefill, 2 x {T // 2} tokens | {a:.2f} | {e:.2f} | {e / a:.2f} |", flush=True)
    for C in contexts:
        S = 64
        batch, num_pages = batch_of([1] * S, [C] * S)
        absorbed, _ = layer_fns(kernels, flash, **c, query_block=1)
        pages = normal(num_pages + 1, PAGE, r + rope)
        a = _ms(absorbed, normal(S, heads, nope), normal(S, heads, rope), pages, w_uk, w_uv, batch, iters=args.iters)
        print(f"| decode, {S} sequences x {C} tokens | {a:.2f} | (expands the whole context) | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

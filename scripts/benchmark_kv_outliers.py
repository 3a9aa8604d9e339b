"""Outlier-token KV compensation (kv_cache_outliers) against today's rotated int8 / fp8 KV cache.

    python scripts/benchmark_kv_outliers.py [--model PATH] [--slots 1,2,4] [--text FILE ...] [--decode]

Default: the embedded SmolLM2-135M-Instruct (float32 weights) scoring the repo's held-out text
(tests/data/perplexity_text.txt) and, as a second text, jaxinfer/calibration/calibration.txt (which
the KV cache's quantization never reads: nothing about it is calibrated). Each text is one
prefill whose K/V go through the pool and are read back (`jaxinfer.runtime.evaluate`), pages of 16.

One row per KV cache: float32, then int8 and fp8 each plain and with R residual slots per page.
Columns per text: perplexity, its change against the float32 pool, and the mean KL divergence of
the next-token distribution from the float32 pool's (nats per token: far more sensitive than
perplexity, which moves by noise both ways at this size); then the pool's bytes per token and
layer (pages of 16, `KVCache.page_bytes`). `--decode`: also the decode step's time per output
token at batch 1 and 32 (`quantization_quality.decode_ms`: greedy, 64-token prompts; one run each
on this machine's backend, compare within a run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "tests" / "data" / "perplexity_text.txt", ROOT / "jaxinfer" / "calibration" / "calibration.txt"]
PAGE_SIZE = 16
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--slots", default="1,2,4", help="residual slots per page to measure (comma-separated)")
    parser.add_argument("--text", action="append", default=None, help="text files to score (repeatable)")
    parser.add_argument("--decode", action="store_true", help="also time decode steps at batch 1 and 32")
    args = parser.parse_args()
    source = resolve_model(args.model)
    config = read_config(source)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    tokenizer = load_tokenizer(source)
    texts = [Path(t) for t in args.text] if args.text else TEXTS
    ids = [tokenizer.encode(t.read_text()) for t in texts]
    rows = [("float32", jnp.float32, 0)]
    for name, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
        rows += [(name, dtype, 0)] + [(f"{name} + {r} outlier slot{'s' * (r > 1)}/page", dtype, r)
                                      for r in map(int, args.slots.split(","))]
    layers = config.num_layers
    print(f"{source}: {', '.join(f'{t.name} {len(i)} tokens' for t, i in zip(texts, ids))}; pages of {PAGE_SIZE}")
    decode = " decode ms/token, batch 1 | batch 32 |" if args.decode else ""
    header = "| KV cache | " + " | ".join(f"{t.name}: ppl | change | KL (nats)" for t in texts) + " | bytes / token / layer |" + decode
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    base = None
    for name, dtype, slots in rows:
        logprobs = [prompt_log_softmax(config, graphdef, params, i, PAGE_SIZE, kv_dtype=dtype, kv_outliers=slots) for i in ids]
        if base is None:
            base = logprobs
        cells = []
        for lp, b, i in zip(logprobs, base, ids):
            ppl = float(np.exp(-np.mean(lp[np.arange(len(i) - 1), i[1:]])))
            ppl0 = float(np.exp(-np.mean(b[np.arange(len(i) - 1), i[1:]])))
            kl = float(np.mean(np.sum(np.exp(b) * (b - lp), axis=-1)))
            cells.append(f"{ppl:.4f} | {100 * (ppl / ppl0 - 1):+.3f} % | {kl:.2e}")
        cells.append(f"{KVCache.page_bytes(config, PAGE_SIZE, dtype, outliers=slots) / PAGE_SIZE / layers:.1f}")
        if args.decode:
            from quantization_quality import decode_ms, jaxinfer_generate
            llm = LLM(args.model, dtype="float32", kv_cache_dtype=jnp.dtype(dtype).name, kv_cache_outliers=slots,
                      page_size=PAGE_SIZE, max_num_seqs=32, progress=False)
            run = jaxinfer_generate(llm)
            cells.append(f"{decode_ms(run, 1):.1f} | {decode_ms(run, 32):.1f}")
            del llm
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

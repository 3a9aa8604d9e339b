"""KV cache bytes per token, and sequences per chip, as the engine's pool lays them out
(`KVCache.page_bytes`): DeepSeek-V3's latent cache against GQA models of about its size, and
against DeepSeek-V3 with its heads expanded (what a cache of per-head K and V would hold).

    python scripts/kv_bytes.py                     # prints a markdown table
    python scripts/kv_bytes.py --kv-gib 8 --context 32768

Bytes are per token over all layers, on one chip (a TPU pool's rows padded to 128 lanes; a
CPU / GPU pool's as they are). Tensor parallelism splits a GQA cache by KV heads; MLA's one latent
row is held whole on every shard (each shard attends for its own query heads), so it does not shrink
with tp: the table shows tp = 1 and tp = 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxinfer.aot.presets import PRESETS, read_model_config  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.ops.kernels import Kernels  # noqa: E402
from jaxinfer.ops.kv_cache import KVCache  # noqa: E402

LLAMA_405B = dict(PRESETS["llama-3.1-70b"], hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                  num_attention_heads=128, num_key_value_heads=8)


def models() -> dict[str, ModelConfig]:
    v3 = read_model_config("deepseek-v3")
    # the same model with each head's K (nope 128 + rope 64) and V (128) kept: 128 KV heads of 192
    # (values padded to 192 as one pool of K / V rows does)
    expanded = dataclasses.replace(v3, kv_lora_rank=0, num_kv_heads=v3.num_heads,
                                   head_dim=v3.qk_nope_head_dim + v3.rotary_dim, rotary_dim=0)
    return {
        "DeepSeek-V3 (671B), MLA latent row 512 + 64": v3,
        "DeepSeek-V3, heads expanded (128 K/V heads of 192)": expanded,
        "Llama-3.1-405B (GQA: 8 KV heads of 128)": ModelConfig.from_hf_dict(LLAMA_405B, source="llama-3.1-405b"),
        "Llama-3.1-70B (GQA: 8 KV heads of 128)": read_model_config("llama-3.1-70b"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV pool per chip")
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence")
    args = parser.parse_args(argv)
    page = 16
    print(f"| model | layers | bytes / token / layer (CPU, GPU) | bytes / token, tp=1 (TPU) | tp=8 (TPU) | "
          f"sequences of {args.context} in {args.kv_gib:g} GiB / chip, tp=8 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, config in models().items():
        per_token = {}
        for tp in (1, 8):
            for platform in ("reference", "tpu"):
                per_token[tp, platform] = KVCache.page_bytes(config, page, "bfloat16", tp=tp, kernels=Kernels(platform)) / page / tp
        per_layer = per_token[1, "reference"] / config.num_layers
        seqs = args.kv_gib * 2**30 / (per_token[8, "tpu"] * args.context)
        print(f"| {name} | {config.num_layers} | {per_layer:,.0f} | {per_token[1, 'tpu']:,.0f} | {per_token[8, 'tpu']:,.0f} | "
              f"{seqs:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

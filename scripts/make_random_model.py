#!/usr/bin/env python
"""A randomly initialised model of one of the newer families at SmolLM2-135M's shapes, saved as an
HF folder with SmolLM2's real tokenizer: the "small real-shaped configuration" the throughput
benchmark runs a windowed family on (the shared CPU workload is SmolLM2 token ids, so the
vocabulary and tokenizer are SmolLM2's).

    python scripts/make_random_model.py gemma2 /tmp/gemma2-smollm2-shape
    python scripts/benchmark_throughput.py --model /tmp/gemma2-smollm2-shape --limit 16 ...

Shapes: hidden 576, MLP 1536, 30 layers, 9 query / 3 KV heads of 64, vocabulary 49152; each
family's own layer pattern (Gemma 2: sliding / global alternating, window --window, default 256,
below most of the workload's contexts; Llama 4: chunks of --window on 3 layers of 4, 4 experts). Weights are transformers' random init (the tokens mean
nothing; the work per token is the real model's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def family_config(family: str, window: int):
    import transformers

    if family == "gemma2":
        return transformers.Gemma2Config(**SMOLLM2_SHAPES, sliding_window=window, query_pre_attn_scalar=64)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**SMOLLM2_SHAPES, sliding_window=window, query_pre_attn_scalar=64)
    if family == "olmo3":
        return transformers.Olmo3Config(**{**SMOLLM2_SHAPES, "num_key_value_heads": 9}, sliding_window=window)
    if family == "llama4":  # Scout's layout at these shapes: 4 experts (top 1) and a shared one in every layer, chunks of --window
        return transformers.Llama4TextConfig(**SMOLLM2_SHAPES, intermediate_size_mlp=1536, num_local_experts=4,
                                             num_experts_per_tok=1, attention_chunk_size=window)
    raise SystemExit(f"unknown family {family!r} (gemma2, gemma3, olmo3, llama4)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=("gemma2", "gemma3", "olmo3", "llama4"))
    p.add_argument("out", type=Path)
    p.add_argument("--window", type=int, default=256, help="the sliding layers' window (default 256)")
    args = p.parse_args(argv)
    import torch
    import transformers

    from jaxinfer.runtime.loading import default_model_path, resolve_model
    from jaxinfer.tokenizer import load_tokenizer

    config = family_config(args.family, args.window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(args.out)
    load_tokenizer(resolve_model(default_model_path())).save_pretrained(args.out)  # SmolLM2's, from its GGUF
    print(f"{args.family} at SmolLM2-135M's shapes (window {args.window}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

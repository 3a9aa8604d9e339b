"""Cache memory per sequence of a hybrid model (Gated DeltaNet layers between full-attention ones)
against the same model with every layer full attention, as the engine lays the cache out: the full
layers' K/V pages (`KVCache.page_bytes`, whole pages) plus a fixed recurrent state per sequence
(`LinearState.bytes_per_slot`: each linear layer's convolution inputs and its [Hv, Dk, Dv]
float32 state).

    python scripts/hybrid_memory.py                     # Qwen3.5-27B, Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B, bf16
    python scripts/hybrid_memory.py --contexts 4096 32768 131072 262144

Bytes are over the whole model (every chip together, tp = 1). The same figures come out of
`jaxinfer aot` per chip (its "recurrent states" and "KV pool" lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax.numpy as jnp  # noqa: E402

from jaxinfer.aot.presets import read_model_config  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.kv_groups import kv_groups  # noqa: E402
from jaxinfer.ops.kv_cache import KVCache  # noqa: E402
from jaxinfer.ops.linear_state import LinearState  # noqa: E402

PAGE_SIZE = 16
MiB = 2**20


def per_sequence(config: ModelConfig, context: int, dtype) -> tuple[int, int]:
    """(K/V page bytes, recurrent-state bytes) one sequence of `context` tokens holds."""
    pages = kv_groups(config).pages_held(context, PAGE_SIZE)
    state = LinearState.bytes_per_slot(config, dtype) if config.has_linear_layers else 0
    return pages * KVCache.page_bytes(config, PAGE_SIZE, dtype), state


def all_full_attention(config: ModelConfig) -> ModelConfig:
    """The same model with every layer full attention (its attention layers' shapes)."""
    return dataclasses.replace(config, layer_types=(), linear_conv_kernel=0, linear_key_heads=0, linear_value_heads=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    args = parser.parse_args()
    dtype = jnp.bfloat16
    print("| model | context | K/V pages MiB | recurrent state MiB | total MiB | all layers full attention MiB | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        config = read_model_config(name)
        full = all_full_attention(config)
        for context in args.contexts:
            kv, state = per_sequence(config, context, dtype)
            full_kv, _ = per_sequence(full, context, dtype)
            print(f"| {name} ({config.num_linear_layers} linear + {config.num_layers - config.num_linear_layers} full layers) "
                  f"| {context} | {kv / MiB:,.0f} | {state / MiB:,.0f} | {(kv + state) / MiB:,.0f} | {full_kv / MiB:,.0f} "
                  f"| {full_kv / (kv + state):.2f}x |")


if __name__ == "__main__":
    main()

"""What LoRA adapters cost: the delta's formulations on the projections' shapes, and the engine's
throughput with 0, 1, 4 and 8 distinct adapters in a batch of 32 against the base model alone.

Adapters are random PEFT-format folders (adapter_config.json + adapter_model.safetensors) on
every q/k/v/o/gate/up/down projection of SmolLM2-135M, written by this script (no torch).

1. Formulations of x @ A[slot] @ B[slot] for T tokens over N slots (SmolLM2's qkv projection:
   576 -> 960, rank 16, 9 slots): "dense over slots" (what the model runs: [T, K] x [K, N R],
   masked to each token's slot, then [T, N R] x [N R, O]), "gather" (each token's A and B
   gathered, then batched matvecs), "ragged_dot" (tokens sorted by slot, `jax.lax.ragged_dot`).
2. Throughput: 32 requests (prompt 64 tokens, 64 new tokens, greedy, ignore_eos), the base
   model without LoRA, then LLM(enable_lora=True, max_loras=8) with the requests spread over k
   adapters; best of two passes after a warm-up.

    python scripts/bench_lora.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A random LoRA adapter on every projection, in PEFT's files."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    H, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    dims = {"q_proj": (H, config.num_heads * D), "k_proj": (H, config.num_kv_heads * D), "v_proj": (H, config.num_kv_heads * D),
            "o_proj": (config.num_heads * D, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in dims.items():
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.01).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(dims), "bias": "none"}))


def formulations(args) -> None:
    import jax
    import jax.numpy as jnp

    from jaxinfer.models.lora import lora_delta

    K, O, R, N = 576, 960, 16, 9
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((N, K, R)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((N, R, O)), jnp.float32)

    def gather(x, a, b, slot):
        return jnp.einsum("tr,tro->to", jnp.einsum("tk,tkr->tr", x, a[slot]), b[slot])

    def ragged(x, a, b, slot):
        order = jnp.argsort(slot)
        sizes = jnp.bincount(slot, length=N).astype(jnp.int32)
        y = jax.lax.ragged_dot(jax.lax.ragged_dot(x[order], a, sizes), b, sizes)
        return jnp.zeros_like(y).at[order].set(y)

    print("| tokens | dense over slots ms | gather ms | ragged_dot ms | base matmul ms |")
    print("|---|---|---|---|---|")
    for T in (1, 32, 512):
        x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
        slot = jnp.asarray(rng.integers(0, N, T), jnp.int32)
        w = jnp.asarray(rng.standard_normal((K, O)), jnp.float32)
        ref = np.asarray(gather(x, a, b, slot))
        row = []
        for fn in (lora_delta, gather, ragged):
            c = jax.jit(fn).lower(x, a, b, slot).compile()
            assert np.allclose(np.asarray(c(x, a, b, slot)), ref, rtol=1e-3, atol=1e-2)
            row.append(_time(lambda: c(x, a, b, slot)))
        base = jax.jit(jnp.dot).lower(x, w).compile()
        row.append(_time(lambda: base(x, w)))
        print(f"| {T} | " + " | ".join(f"{t * 1e3:.3f}" for t in row) + " |")


def _time(fn, repeats: int = 30) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def throughput(args) -> None:
    from jaxinfer import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 40000, args.prompt_len)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch, progress=False)

    def run(llm, loras) -> float:
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # warm-up: compiles, fills slots
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        return best

    base = run(LLM(**common), None)
    print(f"- SmolLM2-135M {args.dtype}; {args.batch} requests x ({args.prompt_len} prompt + {args.max_tokens} new tokens); "
          f"adapters of rank {args.rank} on all seven projections; max_loras 8")
    print()
    print("| adapters in the batch | tok/s | ÷ base model alone |")
    print("|---|---|---|")
    print(f"| base model, LoRA off | {base:.1f} | 1.00 |")
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(enable_lora=True, max_loras=8, max_lora_rank=args.rank, **common)
        requests = []
        for i in range(8):
            write_adapter(Path(tmp) / f"a{i}", llm.config, args.rank, seed=i)
            requests.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        for k in (0, 1, 4, 8):
            loras = [requests[i % k] if k else None for i in range(args.batch)]
            rate = run(llm, loras)
            print(f"| {k} (LoRA on) | {rate:.1f} | {rate / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    import jax

    print(f"- cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print()
    formulations(args)
    if not args.skip_throughput:
        print()
        throughput(args)


if __name__ == "__main__":
    main()

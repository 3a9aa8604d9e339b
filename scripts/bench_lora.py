"""What LoRA adapters cost: the delta's formulations on the projections' shapes, and the engine's
throughput with 0, 1, 4 and 8 distinct adapters in a batch of 32 against the base model alone.

Adapters are random PEFT-format folders (adapter_config.json + adapter_model.safetensors) on
every q/k/v/o/gate/up/down projection of SmolLM2-135M, written by this script (no torch).

1. Formulations of x @ A[slot] @ B[slot] for T tokens over N slots (SmolLM2's qkv projection:
   576 -> 960, rank 16, 9 slots, --dtype), with one or eight adapters in use:
   "dense over slots" (the CPU's path, `pallas_kernels.lora_sgmv.xla`: [T, K] x [K, N R], masked
   to each token's slot, then [T, N R] x [N R, O]; below N - 1 tokens the gather),
   "gather" (the reference: each token's A and B gathered),
   "ragged_dot" (tokens sorted by slot, `jax.lax.ragged_dot`), "grouped blocks" (the kernels'
   layout in XLA: tokens in blocks of 32 of one slot, a batched dot per block). On a TPU or GPU,
   the platform's Pallas SGMV kernels too (`--formulations-only` runs just this table there,
   on JAX's default back end).
2. Step cost: decode steps of 1 and 32 sequences and a prefill step on the base model and over 4
   adapters (the one sequence: on adapter 1), alternated.
3. Throughput: 32 requests (prompt 64 tokens, 64 new tokens, greedy, ignore_eos), the base
   model without LoRA, then LLM(enable_lora=True, max_loras=M) for M in --max-loras with the
   requests spread over k adapters; best of three passes after a warm-up (the base model
   measured first and last, its best kept). In decode steps the delta's cost follows the
   table's size M (every slot computed, masked), not k.

    python scripts/bench_lora.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if "--formulations-only" not in sys.argv:  # the engine runs are CPU figures; the formulations run on any back end
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

    from pallas_kernels.lora_sgmv import lora_delta_gpu, lora_delta_reference, lora_delta_tpu, xla

    K, O, R, N = 576, 960, 16, 9
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((N, K, R)) / np.sqrt(K), dtype).at[0].set(0.0)  # slot 0: the base model
    b = jnp.asarray(rng.standard_normal((N, R, O)), dtype).at[0].set(0.0)

    def cpu_path(x, a, b, slot):  # the XLA path: every slot at once, masked; gathered below N - 1 tokens
        return xla.lora_delta(x, a, [b], slot)

    def gather(x, a, b, slot):  # the reference: each token's matrices gathered
        return lora_delta_reference(x, a, [b], slot)

    def ragged(x, a, b, slot):
        order = jnp.argsort(slot)
        sizes = jnp.bincount(slot, length=N).astype(jnp.int32)
        xa = jax.lax.ragged_dot(x[order], a, sizes, preferred_element_type=jnp.float32).astype(a.dtype)
        y = jax.lax.ragged_dot(xa, b, sizes, preferred_element_type=jnp.float32)
        return jnp.zeros_like(y).at[order].set(y)

    def grouped(x, a, b, slot):  # the kernels' layout in XLA: blocks of one slot, batched dots
        return xla.grouped_blocks(x, a, [b], slot)

    backend = jax.default_backend()
    kernel = {"tpu": lora_delta_tpu, "gpu": lora_delta_gpu, "cuda": lora_delta_gpu}.get(backend)

    def sgmv(x, a, b, slot):  # the platform's Pallas kernels (none compiles for the CPU)
        return kernel(x, a, [b], slot)

    impls = [cpu_path, gather, ragged, grouped] + ([sgmv] if kernel else [])
    print(f"x @ A[slot] @ B[slot], {K} -> {O}, rank {R}, {N - 1} adapter slots, {dtype.name}, on {backend}, ms:")
    print()
    print("| tokens | adapters used | dense over slots (the CPU's path) | per-token gather | ragged_dot | grouped blocks (XLA) | SGMV kernels "
          "| the base matmul |")
    print("|---|---|---|---|---|---|---|---|")
    for T in (1, 32, 512):
        for used in (1, N - 1):
            if used > T:
                continue
            x = jnp.asarray(rng.standard_normal((T, K)), dtype)
            slot = jnp.asarray(rng.integers(1, used + 1, T), jnp.int32)
            w = jnp.asarray(rng.standard_normal((K, O)), dtype)
            ref = np.asarray(gather(x, a, b, slot))
            row = []
            for fn in impls:
                c = jax.jit(fn).lower(x, a, b, slot).compile()
                assert np.allclose(np.asarray(c(x, a, b, slot)), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
                row.append(f"{_time(lambda c=c: c(x, a, b, slot)) * 1e3:.3f}")
            if not kernel:
                row.append(f"n/a on {backend}")
            base = jax.jit(jnp.dot).lower(x, w).compile()
            row.append(f"{_time(lambda: base(x, w)) * 1e3:.3f}")
            print(f"| {T} | {used} | " + " | ".join(row) + " |")


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
        for _ in range(3):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        return best

    base_llm = LLM(**common)
    base = run(base_llm, None)
    print(f"- SmolLM2-135M {args.dtype}; {args.batch} requests x ({args.prompt_len} prompt + {args.max_tokens} new tokens); "
          f"adapters of rank {args.rank} on all seven projections")
    print()
    print("| max_loras (table slots) | adapters in the batch | tok/s | ÷ base model alone |")
    print("|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        requests = []
        for max_loras in args.max_loras:
            llm = LLM(enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank, **common)
            while len(requests) < max_loras:
                i = len(requests)
                write_adapter(Path(tmp) / f"a{i}", llm.config, args.rank, seed=i)
                requests.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
            for k in sorted({0, 1, min(4, max_loras), max_loras}):
                loras = [requests[i % k] if k else None for i in range(args.batch)]
                rate = run(llm, loras)
                rows.append((max_loras, k, rate))
    base = max(base, run(base_llm, None))  # measured again last: the machine's speed drifts
    print(f"| LoRA off | — | {base:.1f} | 1.00 |")
    for max_loras, k, rate in rows:
        print(f"| {max_loras} | {k} | {rate:.1f} | {rate / base:.2f} |")


def step_costs(args) -> None:
    """Decode (32 sequences) and prefill (4 chunks of 128 tokens) steps with every sequence on the
    base model, then spread over 4 adapters (max_loras 4), alternated in one process: what the
    delta adds to a step, without the run-to-run drift of whole passes."""
    from jaxinfer import LLM, LoRARequest
    from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk
    from jaxinfer.ops.batch import SequenceChunk

    B, ctx, ps = 32, 128, 16
    pps = 512 // ps
    llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=4, max_lora_rank=args.rank, max_model_len=512,
              num_pages=1 + B * pps, max_num_seqs=64, progress=False)
    runner = llm.runner
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(4):
            write_adapter(Path(tmp) / f"a{i}", llm.config, args.rank, seed=i)
            lora = LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}"))
            llm.engine.lora.check(lora)
            llm.engine.lora.slot(lora.lora_int_id, set())
    pages = [list(range(1 + s * pps, 1 + (s + 1) * pps)) for s in range(B)]

    def decode(i, adapters):
        return [SequenceChunk([5], ctx + i, [pages[s][: -(-(ctx + i + 1) // ps)]], [0], lora_slot=s % 4 + 1 if adapters else 0)
                for s in range(B)]

    def decode_one(i, adapters):
        return decode(i, adapters)[:1]

    def prefill(i, adapters):
        return [SequenceChunk(list(range(100, 228)), 0, [pages[s][:8]], [127], lora_slot=s % 4 + 1 if adapters else 0)
                for s in range(4)]

    def timed(chunks):
        t0 = time.perf_counter()
        runner.execute([[ScheduledChunk(c, RowSampling()) for c in chunks]])
        return time.perf_counter() - t0

    print("| step | base model ms | 4 adapters ms | ratio |")
    print("|---|---|---|---|")
    for name, make in (("decode, 1 sequence x 128 tokens", decode_one), ("decode, 32 sequences x 128 tokens", decode),
                       ("prefill, 4 chunks of 128 tokens", prefill)):
        for adapters in (False, True):
            timed(make(0, adapters)), timed(make(1, adapters))  # compile
        best = {False: [], True: []}
        for rep in range(5):
            for adapters in (False, True):
                best[adapters].append(min(timed(make(2 + j, adapters)) for j in range(3)))
        base, lora = np.median(best[False]) * 1e3, np.median(best[True]) * 1e3
        print(f"| {name} | {base:.1f} | {lora:.1f} | {lora / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-loras", default="4,8", help="table sizes to run (default 4,8)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--formulations-only", action="store_true", help="only the delta's formulations (e.g. on a GPU or TPU)")
    args = ap.parse_args()
    args.max_loras = [int(m) for m in args.max_loras.split(",")]
    import jax

    print(f"- cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print()
    formulations(args)
    if args.formulations_only:
        return
    print()
    step_costs(args)
    if not args.skip_throughput:
        print()
        throughput(args)


if __name__ == "__main__":
    main()

"""Communication of the sharded step, read from the compiled program, and what it costs on real links.

    python scripts/comm_model.py                  # Llama-3-8B shape at tp=8, Mixtral-8x7B shape at ep=8
    python scripts/comm_model.py --tokens 1 64 512
    python scripts/comm_model.py --meshes-only     # by mesh axis: 8B and 70B at tp, pp x tp, dp x tp, sp x tp

For an 8B-shaped dense model (Llama-3-8B: H 4096, 32 layers, 32/8 heads, I 14336, vocab 128256)
at tensor parallelism 8, and a Mixtral-8x7B-shaped MoE (8 experts, top-2) at expert parallelism 8
(with tp 1), the real serving step (a decode bucket) is lowered and compiled (not run:
parameters are abstract, nothing is allocated) on 8 CPU devices in bfloat16, and the
collectives of its program are counted and sized (`sharding.hlo`): per layer and per step, in
bytes per token. The sizes are read from the program as lowered, before XLA:CPU's own passes
(which widen bfloat16 reductions to float32 on the CPU only); the compiled program has the same
collectives (tests/test_sharded_model.py counts them there).

Then an alpha-beta model turns them into link time on an 8xH100 NVLink box and on a TPU v5e-256
slice (8 chips of a ring along one torus axis): each collective costs a fixed latency alpha plus
the bytes a device sends divided by its link bandwidth (ring all-reduce sends 2 (n-1)/n of the
buffer, all-gather and all-to-all (n-1)/n). Next to it, the time the same step needs to stream
this device's weights from HBM, the floor of a decode step: when the links take longer than
that, more tensor parallelism no longer makes decoding faster. Link, latency and HBM figures are
published peak numbers and rough latencies, assumptions rather than measurements (HARDWARE
below); the byte counts come from the program.

The LM head (`lm_head_report`): the collectives the embedding and the LM head cost per step at
tp 8, for the 8B and a 70B shape (both V 128256), with the head split on the hidden dimension
(`lm_head_parallel="hidden"`: an all-reduce of the [R, V] float32 logits, an all-gather of the
embedded [T, H] tokens) and on the vocabulary ("vocab": a psum of the embedded tokens, and the
collectives of the vocabulary-split sampling programs, read from their compiled programs, each
counted as often as it runs: the bisection loops of top-k / top-p 32 times; every lax.cond
branch counted, so the worst case: random rows with top-k / top-p, min-p, 5 top logprobs, every
logits processor on).

Last, the expert exchange of one MoE layer at DeepSeek-V3's shapes (H 7168, 256 experts, top 8)
at ep 8 / 16 / 64: `sharding.expert_parallel.moe_experts` lowered for a TPU (ragged all-to-all)
and for the CPU (XLA:CPU lacks it: padded all-to-all blocks of T*k rows per destination), bytes
one device sends per layer and token, read from the two programs.

By mesh axis (issue 43, `mesh_report`): the 8B and Llama-3.1-70B shapes (H 8192, 80 layers, 64/8
heads, I 28672) at tensor, pipeline x tensor, data x tensor and sequence x tensor meshes, decode
steps: the engine's own step (jaxinfer.aot.step_compile.AbstractStep on CPU devices, reference
kernels) lowered, and each collective's bytes per step filed by the mesh axes its device groups
span and by whether it sits in the layer loops (Megatron's all-reduces, the pipeline's
stage-to-stage permutes) or not (the LM head's logits all-reduce, the embedding's all-gather, the
pipeline's broadcast of the last stage's rows): what would cross DCN when the pipeline stages
are slices (`jaxinfer aot --num-slices`) against what stays on ICI.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxinfer.ops.batch import BucketKey  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.runtime.loading import abstract_model  # noqa: E402
from jaxinfer.runtime.placement import param_partition_specs  # noqa: E402
from jaxinfer.runtime.step import StepFunction  # noqa: E402
from sharding.expert_parallel import moe_experts  # noqa: E402
from sharding.hlo import collectives, executions, split_by_layer_loop  # noqa: E402
from jaxinfer.engine.memory import lower_sampling  # noqa: E402
from sharding.mesh import ParallelConfig, make_mesh  # noqa: E402
from jaxinfer.aot.step_compile import AbstractStep, ServingShape  # noqa: E402
from jaxinfer.aot.targets import Chip, Target  # noqa: E402
from sharding.hlo import bytes_per_step_by_axis  # noqa: E402

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
MIXTRAL_8X7B = ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True)
LLAMA3_70B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                         num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)

# Published peak figures and rough per-collective latencies (assumptions, not measurements):
# per device, one direction.
HARDWARE = {
    # NVLink 4 through NVSwitch: 900 GB/s bidirectional per H100 SXM; HBM3 3.35 TB/s.
    "8xH100 NVLink": dict(link_GBps=450.0, latency_us=10.0, hbm_GBps=3350.0),
    # v5e: 1600 Gbps of ICI per chip (16x16 torus; a ring of 8 along one axis); HBM2e 819 GB/s.
    "TPU v5e-256 ICI": dict(link_GBps=200.0, latency_us=10.0, hbm_GBps=819.0),
}
# bytes a device sends per byte of the (per-device) result buffer, for a ring implementation on n devices
TRAFFIC = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0, "reduce-scatter": lambda n: (n - 1) / n}


def compiled_step_hlo(config: ModelConfig, parallel: ParallelConfig, num_tokens: int) -> str:
    """The HLO of the serving step (a decode bucket of num_tokens sequences) on CPU devices, as
    lowered (the collectives in the model's dtype), after checking that it compiles."""
    _, lowered = _cpu_step(config, parallel, num_tokens)
    lowered.compile()  # it compiles (the collectives below are those of a real program)
    return lowered.compiler_ir("hlo").as_hlo_text()


def _cpu_step(config: ModelConfig, parallel: ParallelConfig, num_tokens: int) -> tuple[Mesh, jax.stages.Lowered]:
    """The engine's own step (jaxinfer.aot.step_compile.AbstractStep: abstract bf16 weights, a pool
    of 2048 pages per replica, the engine's inputs) on the first CPU devices, with the reference
    kernels, lowered for a decode bucket of `num_tokens` sequences at a 4096-token context: (its mesh, the lowered step)."""
    target = Target("reference", f"{parallel.num_devices} CPU devices", jax.devices()[:parallel.num_devices],
                    Chip("cpu", 2**40, 10**12))
    shape = ServingShape(max_model_len=4096, max_num_seqs=num_tokens, max_num_batched_tokens=max(num_tokens, 8),
                         num_pages=2048)
    step = AbstractStep.build(config, target, parallel, shape)
    return step.mesh, step.lower(BucketKey(num_tokens, num_tokens, num_tokens, query_block=1))


def weight_bytes_per_device(config: ModelConfig, parallel: ParallelConfig, tokens: int) -> float:
    """Bytes of weights one device streams from HBM per step (bf16; MoE: the experts its tokens reach)."""
    _, state = abstract_model(config, jnp.bfloat16, jnp.bfloat16, parallel=parallel)
    total, experts = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = ".".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))
        size = leaf.size * leaf.dtype.itemsize
        if "experts_" in name:
            experts += size
        else:
            total += size
    per_device = total / parallel.tp
    if config.is_moe:  # each device holds E/ep experts; at least one token reaches each of them in a busy step
        reached = min(1.0, tokens * config.num_experts_per_tok / config.num_experts)
        per_device += experts / parallel.ep / parallel.tp * reached
    return per_device


def axis_size_of(kind: str, parallel: ParallelConfig) -> int:
    """Devices taking part in a collective of this kind in our step: expert all-to-alls over ep,
    tensor all-reduces / the embedding all-gather over tp, the replicas' logits gather over dp*ep."""
    if kind == "all-to-all":
        return parallel.ep
    return parallel.tp if parallel.tp > 1 else parallel.num_replicas


def report(name: str, config: ModelConfig, parallel: ParallelConfig, token_counts) -> None:
    print(f"\n## {name}, {parallel.describe()}, bfloat16\n")
    print("| tokens/step | collective | where | count | bytes each | sent/token/device |")
    print("|---|---|---|---|---|---|")
    summary = []
    for T in token_counts:
        in_loop, outside = split_by_layer_loop(compiled_step_hlo(config, parallel, T))
        groups = collections.Counter((op.kind, where, op.bytes) for where, ops in (("per layer", in_loop), ("per step", outside))
                                     for op in ops if op.bytes)  # zero-size: e.g. top logprobs when none are asked for
        sent, launches = 0.0, 0
        for (kind, where, size), count in sorted(groups.items()):
            times = config.num_layers if where == "per layer" else 1
            step_bytes = count * size * TRAFFIC[kind](axis_size_of(kind, parallel)) * times
            sent += step_bytes
            launches += count * times
            print(f"| {T} | {kind} | {where} | {count} | {size:,} | {step_bytes / T:,.0f} |")
        if config.is_moe:  # what a ragged all-to-all would send: each pair's row out and back
            ideal = 2 * config.num_experts_per_tok * config.hidden_size * 2 * TRAFFIC["all-to-all"](parallel.ep) * config.num_layers
            print(f"| {T} | all-to-all, ragged (no padding) | per layer | 2 | - | {ideal:,.0f} |")
        summary.append((T, sent, launches, weight_bytes_per_device(config, parallel, T)))
    print("\nPer step: link time (alpha per collective + bytes / bandwidth) vs streaming this device's weights from HBM\n")
    print("| tokens/step | collectives | sent/device | " + " | ".join(f"{hw} links / HBM ms" for hw in HARDWARE) + " |")
    print("|---|---|---|" + "---|" * len(HARDWARE))
    for T, sent, launches, weights in summary:
        cells = []
        for hw in HARDWARE.values():
            link_ms = sent / (hw["link_GBps"] * 1e9) * 1e3 + launches * hw["latency_us"] / 1e3
            hbm_ms = weights / (hw["hbm_GBps"] * 1e9) * 1e3
            cells.append(f"{link_ms:.2f} / {hbm_ms:.2f}")
        print(f"| {T} | {launches} | {sent / 2**20:,.1f} MiB | " + " | ".join(cells) + " |")


def exchange_bytes(hidden: int, num_experts: int, k: int, intermediate: int, ep: int, tokens: int, platform: str) -> dict:
    """Bytes one device sends in one MoE layer's exchange of `tokens` tokens (bf16 rows), from
    `moe_experts` lowered for `platform` over an expert axis of ep devices: {"padded": all-to-all
    buffers x (ep - 1) / ep} for the CPU's program; for a TPU's, {"ragged at most": the operands
    (out: this device's T*k rows and ids; back: its whole receive buffer, ep*T*k rows),
    "ragged": out as at most, back as many rows as went out (what every device receives, on average)}."""
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("expert")))  # noqa: E731
    args = (spec((ep * tokens, hidden), jnp.bfloat16), spec((ep * tokens, k), jnp.int32), spec((ep * tokens, k), jnp.float32),
            spec((num_experts, hidden, 2 * intermediate), jnp.bfloat16), spec((num_experts, intermediate, hidden), jnp.bfloat16))
    layer = jax.shard_map(lambda *a: moe_experts(*a, expert_axis="expert", num_experts=num_experts), mesh=mesh,
                          in_specs=(P("expert"),) * 5, out_specs=P("expert"), check_vma=False)  # as the step runs it
    hlo = jax.jit(layer).trace(*args).lower(lowering_platforms=(platform,)).compiler_ir("hlo").as_hlo_text()
    share = TRAFFIC["all-to-all"](ep)
    if platform == "cpu":
        return {"padded": sum(op.bytes for op in collectives(hlo) if op.kind == "all-to-all") * share}
    ids, rows, back = sorted(op.bytes for op in collectives(hlo) if op.kind == "ragged-all-to-all")
    return {"ragged at most": (ids + rows + back) * share, "ragged": (ids + 2 * rows) * share}


def exchange_report(token_counts) -> None:
    print("\n## The expert exchange of one MoE layer, DeepSeek-V3's shapes (H 7168, 256 experts, top 8, bf16)\n")
    print("| ep | tokens/device | padded all-to-all (CPU) | ragged, at most | ragged (TPU, GPU) | padded / ragged |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ep in (8, 16, 64):
        for T in token_counts:
            sizes = dict(hidden=7168, num_experts=256, k=8, intermediate=2048, ep=ep, tokens=T)
            got = exchange_bytes(**sizes, platform="cpu") | exchange_bytes(**sizes, platform="tpu")
            per_token = {name: value / T for name, value in got.items()}
            print(f"| {ep} | {T} | {per_token['padded']:,.0f} B/token | {per_token['ragged at most']:,.0f} | "
                  f"{per_token['ragged']:,.0f} | {got['padded'] / got['ragged']:.1f}x |")


def vocab_split_sampler_collectives(config: ModelConfig, tp: int, rows: int) -> tuple[float, int]:
    """(bytes one device sends, collective launches) of one step's sampling programs with the LM
    head split on the vocabulary over tp devices, `rows` logits rows (every processor on), read
    from the compiled programs (each collective times how often its computation runs)."""
    parallel = ParallelConfig(tp=tp)
    mesh = make_mesh(parallel)
    graphdef, state = abstract_model(config, jnp.bfloat16, jnp.bfloat16, parallel=parallel)
    specs = param_partition_specs(state, config, "vocab")
    step = StepFunction(graphdef, num_top_logprobs=5, max_rows=rows, mesh=mesh, param_specs=specs)
    assert step.vocab_split
    sent, launches = 0.0, 0
    for program in lower_sampling(step, rows, config.vocab_size, max_history=64):
        hlo = program.compile().as_text()
        times = executions(hlo)
        for op in collectives(hlo):
            n = times.get(op.computation, 1)
            sent += op.bytes * TRAFFIC[op.kind](tp) * n
            launches += n
    return sent, launches


def lm_head_report(token_counts, tp: int = 8) -> None:
    """The embedding's and LM head's collectives per step, split on the hidden dim vs on the vocabulary."""
    print(f"\n## The LM head at tp={tp}: split on the hidden dim vs on the vocabulary (bytes one device sends per step)\n")
    print("| model | rows/step | hidden: logits all-reduce [R, V] f32 + embed all-gather | vocab: sampler collectives + embed psum | "
          "launches hidden / vocab | " + " | ".join(f"{hw} hidden / vocab ms" for hw in HARDWARE) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(HARDWARE))
    sampler = {}
    for name, config in (("Llama-3-8B shape", LLAMA3_8B), ("Llama-3-70B shape", LLAMA3_70B)):
        V, H = config.vocab_size, config.hidden_size
        for R in token_counts:
            if (V, R) not in sampler:
                sampler[V, R] = vocab_split_sampler_collectives(config, tp, R)
            sampler_sent, sampler_launches = sampler[V, R]
            embed = R * H * 2  # a decode step: one token per row, bf16
            before = R * V * 4 * TRAFFIC["all-reduce"](tp) + embed * TRAFFIC["all-gather"](tp)
            after = sampler_sent + embed * TRAFFIC["all-reduce"](tp)
            cells = []
            for hw in HARDWARE.values():
                cost = lambda sent, n: sent / (hw["link_GBps"] * 1e9) * 1e3 + n * hw["latency_us"] / 1e3  # noqa: E731
                cells.append(f"{cost(before, 2):.3f} / {cost(after, sampler_launches + 1):.3f}")
            print(f"| {name} | {R} | {before:,.0f} | {after:,.0f} | 2 / {sampler_launches + 1} | " + " | ".join(cells) + " |")
    print("\nThe vocabulary split's launches are every branch's (the programs' worst case: random rows with top-k / "
          "top-p, 16 of them the threshold searches); at run time a greedy step without logprobs issues one sampler "
          "collective (the argmax), three more with logprobs, plain temperature rows one more (ops/sampling.py).")


# ----------------------------------------------------------------------------- meshes (issue 43)
MESHES = {  # (model, shape, meshes): tensor, pipeline and sequence (context) parallelism side by side
    "Llama-3-8B shape": (LLAMA3_8B, [ParallelConfig(tp=8), ParallelConfig(pp=2, tp=4), ParallelConfig(pp=2, tp=8),
                                     ParallelConfig(dp=2, tp=4), ParallelConfig(sp=4, tp=2),
                                     ParallelConfig(sp=4, tp=2, sp_attention="context")]),
    "Llama-3.1-70B shape": (LLAMA3_70B, [ParallelConfig(tp=8), ParallelConfig(pp=2, tp=4), ParallelConfig(pp=2, tp=8),
                                         ParallelConfig(pp=4, tp=8), ParallelConfig(sp=4, tp=8),
                                         ParallelConfig(sp=4, tp=8, sp_attention="context")]),
}
# what each (mesh axes, inside the layer loops) group is called in the table
AXIS_COLUMNS = (("tensor, layers", ("tensor",), True), ("tensor, LM head + embedding", ("tensor",), False),
                ("pipeline, layers", ("pipeline",), True), ("pipeline, rows broadcast", ("pipeline",), False),
                ("sequence", ("sequence",), None))


def mesh_step_bytes(config: ModelConfig, parallel: ParallelConfig, num_tokens: int) -> dict:
    """{(kind, mesh axes, in the layer loops): bytes per device} of one decode step of `num_tokens`
    sequences (the engine's own step, abstract weights and pool, on CPU devices with the reference
    kernels), read from the lowered program: every collective's buffer times how often its
    computation runs (a pipeline's iterations times a stage's layers), filed under the mesh axes
    its groups span (sharding.hlo.bytes_per_step_by_axis)."""
    mesh, lowered = _cpu_step(config, parallel, num_tokens)
    return bytes_per_step_by_axis(lowered.compiler_ir("hlo").as_hlo_text(), dict(mesh.shape))


def mesh_report(token_counts) -> None:
    """Bytes per step per device by mesh axis (tensor in the layers, the LM head's, the pipeline's
    permutes and broadcast, the sequence axis's) for the 8B and 70B shapes at several meshes."""
    print("\n## Collectives by mesh axis, decode steps (bytes one device's collectives move per step, bf16 weights)\n")
    print("Buffers as in the program (sharding.hlo), each collective counted as often as it runs; \"sent/device\": what a "
          "ring implementation sends, a permute its buffer once, an all-reduce 2(n-1)/n of it, an all-gather (n-1)/n.\n")
    print("| model | mesh | tokens | " + " | ".join(name for name, *_ in AXIS_COLUMNS)
          + " | other | total | per token | sent/device | pipeline share of sent |")
    print("|---|---|---:|" + "---:|" * (len(AXIS_COLUMNS) + 5))
    for name, (config, meshes) in MESHES.items():
        for parallel in meshes:
            for T in token_counts:
                if T % parallel.token_multiple:
                    continue
                got = mesh_step_bytes(config, parallel, T)
                cells, seen = [], set()
                for _, axes, looped in AXIS_COLUMNS:
                    keys = [k for k in got if k[1] == axes and (looped is None or k[2] == looped)]
                    seen.update(keys)
                    parts = collections.Counter()
                    for key in keys:
                        parts[key[0]] += got[key]
                    cells.append(", ".join(f"{kind} {_human(v)}" for kind, v in parts.most_common()) or "-")
                other = sum(v for k, v in got.items() if k not in seen)
                total = sum(got.values())
                sizes = dict(zip(("pipeline", "data", "sequence", "expert", "tensor"), parallel.axis_sizes))
                sent = {k: v * TRAFFIC[k[0]](int(np.prod([sizes[a] for a in k[1]]))) for k, v in got.items()}
                pipeline = sum(v for k, v in sent.items() if k[1] == ("pipeline",))
                print(f"| {name} | {parallel.describe()} | {T} | " + " | ".join(cells)
                      + f" | {_human(other) if other else '-'} | {_human(total)} | {_human(total / T)} | "
                      f"{_human(sum(sent.values()))} | {100 * pipeline / sum(sent.values()):.0f}% |")


def _human(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256], help="tokens per step (decode buckets)")
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--exchange-only", action="store_true", help="only the expert exchange table")
    parser.add_argument("--lm-head-only", action="store_true", help="only the LM head table (hidden vs vocabulary split)")
    parser.add_argument("--meshes-only", action="store_true",
                        help="only the table by mesh axis (8B and 70B shapes; tensor, pipeline, sequence meshes)")
    parser.add_argument("--mesh-tokens", type=int, nargs="+", default=[8, 64, 256], help="decode batches of the mesh table")
    args = parser.parse_args(argv)
    if args.meshes_only:
        mesh_report(args.mesh_tokens)
        return 0
    if args.lm_head_only:
        lm_head_report(args.tokens)
        return 0
    if args.exchange_only:
        exchange_report(args.tokens)
        return 0
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices (compiled only)")
    report("Llama-3-8B shape", LLAMA3_8B, ParallelConfig(tp=8), args.tokens)
    if not args.skip_moe:
        report("Mixtral-8x7B shape", MIXTRAL_8X7B, ParallelConfig(ep=8), args.tokens)
        exchange_report(args.tokens)
    lm_head_report(args.tokens)
    mesh_report(args.mesh_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Communication of the sharded step, read from the compiled program, and what it costs on real links.

    python scripts/comm_model.py                  # Llama-3-8B shape at tp=8, Mixtral-8x7B shape at ep=8
    python scripts/comm_model.py --tokens 1 64 512

For an 8B-shaped dense model (Llama-3-8B: H 4096, 32 layers, 32/8 heads, I 14336, vocab 128256)
at tensor parallelism 8, and a Mixtral-8x7B-shaped MoE (8 experts, top-2) at expert parallelism 8
(with tp 1), the real step is compiled (not run: parameters are abstract, nothing is allocated)
on 8 CPU devices in bfloat16, and the collectives of its HLO are counted and sized
(`sharding.hlo`): bytes per layer, per step, per token. Then a simple alpha-beta model (ring
all-reduce moves 2 (n-1)/n of the buffer per device, all-gather and all-to-all (n-1)/n) turns
them into link time on an 8xH100 NVLink box and a TPU v5e-256 slice, next to the time the
same step needs to stream the weights from HBM (the decode floor), so one can see when tensor
parallelism stops paying. Link and HBM figures are the vendors' published peak numbers, not
measurements (see HARDWARE below); the byte counts are measured from the compiled program.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.batch import RaggedBatch  # noqa: E402
from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.kv_cache import KVCache  # noqa: E402
from jaxinfer.loading import abstract_model  # noqa: E402
from jaxinfer.models.param_layout import num_kv_heads_stored  # noqa: E402
from jaxinfer.sampling import SamplingTensors  # noqa: E402
from jaxinfer.step import StepFunction, kv_partition_spec, param_partition_specs  # noqa: E402
from sharding import rules  # noqa: E402
from sharding.hlo import collectives, layer_loop_body  # noqa: E402
from sharding.mesh import ParallelConfig, make_mesh  # noqa: E402

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
MIXTRAL_8X7B = ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=32768,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True)

# Published peak figures (assumptions, not measurements): per-device, one direction.
HARDWARE = {
    # NVLink 4 through NVSwitch: 900 GB/s bidirectional per H100 SXM; HBM3 3.35 TB/s.
    "8xH100 (NVLink 4)": dict(link_GBps=450.0, latency_us=5.0, hbm_GBps=3350.0),
    # v5e: 1600 Gbps of ICI per chip on a 16x16 torus (an 8-chip ring along one axis); HBM2e 819 GB/s.
    "TPU v5e-256 (ICI)": dict(link_GBps=200.0, latency_us=10.0, hbm_GBps=819.0),
}
# bytes a device sends per byte of the (per-device) result buffer, for a ring implementation on n devices
TRAFFIC = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
           "all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0, "reduce-scatter": lambda n: (n - 1) / n}


def compiled_step_hlo(config: ModelConfig, parallel: ParallelConfig, num_tokens: int) -> str:
    """The optimized HLO of the serving step (a decode bucket of num_tokens sequences) on 8 CPU devices."""
    mesh = make_mesh(parallel)
    graphdef, state = abstract_model(config, jnp.bfloat16, jnp.bfloat16, parallel=parallel)
    specs = param_partition_specs(state, config)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, s)),
                          state, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    replicas = parallel.num_replicas
    page_size, pages_per_seq = 16, 256  # a 4096-token context
    kv_shape = (config.num_layers, replicas * 2048, page_size, num_kv_heads_stored(config, parallel.tp), config.head_dim)
    kv_sharding = jax.sharding.NamedSharding(mesh, kv_partition_spec().k)
    kv = KVCache(*(jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16, sharding=kv_sharding),) * 2)
    T = S = R = num_tokens

    def per_replica(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct((replicas, *shape), dtype, sharding=jax.sharding.NamedSharding(mesh, rules.per_replica(len(shape) + 1)))

    batch = RaggedBatch(per_replica((T,)), per_replica((T,)), per_replica((S + 1,)), per_replica((S,)),
                        per_replica((S, pages_per_seq)), per_replica((1,)), per_replica((R,)), per_replica((T,)))
    sampling = SamplingTensors(per_replica((R,), jnp.float32), per_replica((R,)), per_replica((R,), jnp.float32),
                               per_replica((R,), jnp.uint32), per_replica((R,)), per_replica((R,)),
                               min_p=per_replica((R,), jnp.float32), want_logprobs=per_replica((1,), jnp.bool_))
    step = StepFunction(graphdef, num_top_logprobs=0, max_rows=T, mesh=mesh, param_specs=specs)
    lowered = step._step.lower(params, kv, batch, sampling, per_replica((T,)), query_block=1)
    return lowered.compile().as_text()


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


def report(name: str, config: ModelConfig, parallel: ParallelConfig, token_counts) -> None:
    n_tp, n_ep = parallel.tp, parallel.ep
    print(f"\n## {name}, {parallel.describe()}, bfloat16\n")
    print("| tokens/step | collective (per layer unless noted) | count | bytes each | bytes/token/device sent |")
    print("|---|---|---|---|---|")
    summary = []
    for T in token_counts:
        hlo = compiled_step_hlo(config, parallel, T)
        ops = collectives(hlo)
        body = layer_loop_body(hlo)
        sent = 0.0
        groups = collections.Counter()
        sizes = {}
        for op in ops:
            where = "layer" if op.computation == body else "step"
            groups[(where, op.kind)] += 1
            sizes[(where, op.kind)] = op.bytes
        for (where, kind), count in sorted(groups.items()):
            n = n_ep if kind == "all-to-all" else n_tp if kind in ("all-reduce",) and n_tp > 1 else max(n_tp, n_ep)
            times = config.num_layers if where == "layer" else 1
            per_token = count * sizes[(where, kind)] * TRAFFIC[kind](n) * times / T
            sent += per_token * T
            label = kind if where == "layer" else f"{kind} (once per step)"
            print(f"| {T} | {label} | {count} | {sizes[(where, kind)]:,} | {per_token:,.0f} |")
        summary.append((T, sent, weight_bytes_per_device(config, parallel, T)))
    print("\nTime per step: links (alpha-beta, ring) vs streaming this device's weights from HBM\n")
    print("| tokens/step | bytes sent/device | " + " | ".join(f"{hw}: links ms / HBM ms" for hw in HARDWARE) + " |")
    print("|---|---|" + "---|" * len(HARDWARE))
    for T, sent, weights in summary:
        cells = []
        for hw in HARDWARE.values():
            hops = config.num_layers * 2 * (max(n_tp, n_ep) - 1) * 3  # rough: collectives x ring steps
            link_ms = sent / (hw["link_GBps"] * 1e9) * 1e3 + hops * hw["latency_us"] / 1e3
            hbm_ms = weights / (hw["hbm_GBps"] * 1e9) * 1e3
            cells.append(f"{link_ms:.3f} / {hbm_ms:.3f}")
        print(f"| {T} | {sent / 2**20:,.1f} MiB | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256], help="tokens per step (decode buckets)")
    parser.add_argument("--skip-moe", action="store_true")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices (compiled only)")
    report("Llama-3-8B shape", LLAMA3_8B, ParallelConfig(tp=8), args.tokens)
    if not args.skip_moe:
        report("Mixtral-8x7B shape", MIXTRAL_8X7B, ParallelConfig(ep=8), args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

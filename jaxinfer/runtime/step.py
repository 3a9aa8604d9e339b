"""The jitted step: forward over a ragged batch, then sampling. Pure, with the KV cache donated.

    step(params, kv, batch, sampling, prev_tokens, query_block=...) -> (SampleOutput, token_buffer, kv)

Every array here has a leading *replica* axis: a model runs as `num_replicas` independent
attention replicas (data parallelism; with MoE expert parallelism the expert axis counts too),
each with its own ragged batch, its own KV pages and its own sampled tokens. With one replica
that axis has size 1.

The step runs per device in `jax.shard_map` over the mesh (`sharding.mesh.make_mesh`; one device
by default), with the PartitionSpecs of `sharding.rules`: parameters split over "tensor" (and
experts over "expert"), the KV cache split on pages over the replica axes and on KV heads over
"tensor", batch and sampling inputs split on the replica axis. Inside, each device runs the
model on its shards (the collectives are in `jaxinfer.models.llama`), samples, and all-gathers
the sampled tokens over the replicas, so every device (every process, on several hosts) holds
all of them and the host reads them without a cross-host transfer.

Sampled tokens stay on the device: the step also returns them padded into a per-replica
`token_buffer` [replicas, max_rows], and the next step takes that buffer as `prev_tokens`,
reading the tokens its batch marks in `batch.token_src`. So the host can dispatch step N+1 before
it has read step N's tokens.

`params` is the model's nnx.State (a pytree of arrays); the model's structure (its graphdef) is
closed over. One compiled variant exists per bucket (the padded shapes of `batch` plus the static
attention query-block size); `StepFunction.num_compiles` counts them, so tests can assert that
steady-state serving compiles nothing new.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.ops.sampling import SampleOutput, sample
from jaxinfer.runtime.placement import kv_partition_spec, per_replica_specs, put_global
from sharding import rules
from sharding.mesh import ParallelConfig, make_mesh


def compiler_options(platform: str) -> dict[str, str] | None:
    """XLA options of the step's compilation on `platform`.

    On the CPU, while-loop invariant code motion is off: it hoists the bfloat16 -> float32
    conversion XLA:CPU puts before each dot out of the layer loop, so every step converted all
    stacked weights (the whole model) with a slow rounding convert before the first layer
    (SmolLM2, bfloat16, batch 1: 66 ms of a gate_up loop alone against 4.6 ms with the pass off).
    Nothing measured slower without the pass (float32 steps within the noise).
    """
    if platform == "cpu":
        return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
    return None


class StepFunction:
    def __init__(self, graphdef: nnx.GraphDef, num_top_logprobs: int, max_rows: int = 1, *,
                 mesh: Mesh | None = None, param_specs=None, return_hidden: bool = False):
        """`mesh` defaults to one device; `param_specs` (`param_partition_specs`) is needed with a
        mesh of more than one device (on one device every parameter is whole). `return_hidden`:
        the step's SampleOutput also carries the logits rows' hidden states (`hidden` [R, H])."""
        self.num_compiles = 0
        self.return_hidden = return_hidden
        self.max_rows = max_rows  # size of each replica's token buffer handed from one step to the next
        self.mesh = mesh if mesh is not None else make_mesh(ParallelConfig(), jax.devices()[:1])
        if param_specs is None and self.mesh.size > 1:
            raise ValueError("StepFunction on a mesh of several devices needs param_specs")
        self.param_specs = param_specs
        self.num_replicas = rules.num_replicas(self.mesh)
        replicas = rules.REPLICA_AXES

        def gather_replicas(x):  # [1, ...] per device -> [replicas, ...] on every device
            return jax.lax.all_gather(x[0], replicas, axis=0, tiled=False) if self.num_replicas > 1 else x

        def per_device_step(params, kv, batch, sampling, prev_tokens, query_block, spec_block):
            batch, sampling = jax.tree.map(lambda a: a[0], (batch, sampling))  # this replica's
            from_device = prev_tokens[0][jnp.maximum(batch.token_src, 0)]
            batch = dataclasses.replace(batch, token_ids=jnp.where(batch.token_src >= 0, from_device, batch.token_ids))
            model = nnx.merge(graphdef, params)
            logits, kv, *hidden = model(kv, batch, query_block=query_block, spec_block=spec_block, return_hidden=return_hidden)
            out = sample(logits, sampling, num_top_logprobs)
            if return_hidden:
                out = dataclasses.replace(out, hidden=hidden[0].astype(jnp.float32))
            token_buffer = jnp.zeros(max_rows, jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
            return jax.tree.map(lambda a: gather_replicas(a[None]), out), token_buffer[None], kv

        def per_device_forward(params, kv, batch, query_block, spec_block):
            batch = jax.tree.map(lambda a: a[0], batch)
            logits, kv, *hidden = nnx.merge(graphdef, params)(kv, batch, query_block=query_block, spec_block=spec_block,
                                                              return_hidden=return_hidden)
            return (gather_replicas(logits[None]), kv, *(gather_replicas(h[None]) for h in hidden))

        def step(params, kv, batch, sampling, prev_tokens, *, query_block: int, spec_block: int = 0):
            self.num_compiles += 1  # runs only while tracing, i.e. once per compiled variant
            kv_specs = kv_partition_spec(kv.quantized)
            out_specs = (rules.replicated(), rules.per_replica(2), kv_specs)  # every SampleOutput field replicated
            return jax.shard_map(
                lambda *a: per_device_step(*a, query_block, spec_block), mesh=self.mesh,
                in_specs=(self._specs(params), kv_specs, per_replica_specs(batch), per_replica_specs(sampling),
                          rules.per_replica(2)),
                out_specs=out_specs, check_vma=False,
            )(params, kv, batch, sampling, prev_tokens)

        def forward(params, kv, batch, *, query_block: int, spec_block: int = 0):
            """The raw logits [replicas, R, V] (for tests and scoring; with return_hidden also the
            rows' hidden states [replicas, R, H]); not the serving path."""
            kv_specs = kv_partition_spec(kv.quantized)
            return jax.shard_map(
                lambda *a: per_device_forward(*a, query_block, spec_block), mesh=self.mesh,
                in_specs=(self._specs(params), kv_specs, per_replica_specs(batch)),
                out_specs=(rules.replicated(), kv_specs) + ((rules.replicated(),) if return_hidden else ()), check_vma=False,
            )(params, kv, batch)

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("query_block", "spec_block"),
                             compiler_options=compiler_options(self.mesh.devices.flat[0].platform))
        # forward is also traced inside other programs (tests read its jaxpr), where JAX refuses
        # compiler options: it keeps XLA's defaults (scoring, not serving)
        self._forward = jax.jit(forward, donate_argnums=(1,), static_argnames=("query_block", "spec_block"))

    def _specs(self, params):
        if self.param_specs is None:  # one device: every parameter whole
            return jax.tree.map(lambda _: rules.replicated(), params)
        return self.param_specs

    def place_inputs(self, tree):
        """A tree of per-replica host arrays ([replicas, ...]: batches, sampling tensors) -> device
        arrays split over the replicas."""
        return put_global(tree, per_replica_specs(tree), self.mesh)

    def __call__(self, params, kv, batch, sampling, prev_tokens, *, query_block: int,
                 spec_block: int = 0) -> tuple[SampleOutput, jax.Array, KVCache]:
        return self._step(params, kv, batch, sampling, prev_tokens, query_block=query_block, spec_block=spec_block)

    def lower(self, params, kv, batch, sampling, prev_tokens, key) -> jax.stages.Lowered:
        """The step of bucket `key` (a BucketKey) lowered for these arguments, which may be
        abstract (jax.ShapeDtypeStruct with shardings, e.g. on a TPU topology: jaxinfer.aot)."""
        return self._step.lower(params, kv, batch, sampling, prev_tokens, query_block=key.query_block,
                                spec_block=key.spec_block)

    def input_shardings(self, tree):
        """NamedShardings of a per-replica input tree (batches, sampling tensors, token buffers)."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), per_replica_specs(tree),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def forward(self, params, kv, batch, *, query_block: int, spec_block: int = 0):
        return self._forward(params, kv, batch, query_block=query_block, spec_block=spec_block)

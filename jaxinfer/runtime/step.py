"""The jitted step: forward over a ragged batch, then sampling. Pure, with the KV cache donated.

    step(params, kv, batch, sampling, prev_tokens, query_block=...) -> (SampleOutput, token_buffer, kv)

A step runs as a chain of programs, all asynchronous on the device, none reading back to the host:

1. the model program: the forward over the batch -> logits rows [replicas, R, V] (and with
   return_hidden the rows' hidden states), the cache donated. One compiled variant per bucket
   (the padded shapes of `batch` plus the static attention query-block size) and LoRA switch.
2. the logits processors the step's `sampling` tensors switch on (penalties, held-back ids, the
   structured-output mask: `ops.sampling.LOGITS_PROCESSORS`), each a program of its own over the
   logits rows: one variant per row count R.
3. the sampler: one token per row, with logprobs (of the raw logits). One variant per row count
   R (and with drafts to verify, another).

Split this way the variants add instead of multiplying (buckets + processors x row counts, not
buckets x 2^features), so warm-up can compile every one of them (`ModelRunner.warmup`) and no
request a client sends compiles anything. The cost: each optional processor's extra dispatch and
one more write and read of the logits rows, small beside the model.

Every array here has a leading *replica* axis: a model runs as `num_replicas` independent
attention replicas (data parallelism; with MoE expert parallelism the expert axis counts too),
each with its own ragged batch, its own KV pages and its own sampled tokens. With one replica
that axis has size 1.

Each program runs per device in `jax.shard_map` over the mesh (`sharding.mesh.make_mesh`; one
device by default), with the PartitionSpecs of `sharding.rules`: parameters split over "tensor"
(and experts over "expert"), the KV cache split on pages over the replica axes and on KV heads
over "tensor", batch, sampling inputs and logits rows split on the replica axis. Inside, each
device runs the model on its shards (the collectives are in `jaxinfer.models.llama`); the sampler
all-gathers the sampled tokens over the replicas, so every device (every process, on several
hosts) holds all of them and the host reads them without a cross-host transfer.

With a vocabulary-split LM head (lm_head_parallel="vocab": `vocab_split`) the model program
returns the logits rows split on the vocabulary too (`sharding.rules.VOCAB_LOGITS`, [replicas, R,
V / tp] per device) instead of all-reducing them, and the processors and the sampler run on those
blocks (`jaxinfer.ops.sampling.Vocab`: per-shard reductions and top candidates merged with small
collectives); the sampled tokens, logprobs and top-logprobs come out whole on every device, as
before. Programs outside shard_map read such logits as one global array (GSPMD gathers them).

Sampled tokens stay on the device: the sampler also returns them padded into a per-replica
`token_buffer` [replicas, max_rows], and the next step's model program takes that buffer as
`prev_tokens`, reading the tokens its batch marks in `batch.token_src`. So the host can dispatch
step N+1 before it has read step N's tokens.

`params` is the model's nnx.State (a pytree of arrays); the model's structure (its graphdef) is
closed over. `StepFunction.num_compiles` counts the variants traced (`num_model_compiles` the
model's), so tests can assert that steady-state serving compiles nothing new.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.ops.sampling import LOGITS_PROCESSORS, SampleOutput, Vocab, sample, without_processors
from jaxinfer.runtime.placement import cache_spec, per_replica_specs, put_global
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
    if platform == "tpu":
        return TPU_COMPILER_OPTIONS
    return None


# On a TPU with SparseCores (v6e), XLA offloads scatters to them (the penalties' token counts),
# and libtpu's SparseCore code generator overflowed its stack while other programs compiled
# beside it (measured: `jaxinfer aot` of Llama-3.1-8B and -3.2-1B on a v6e died with SIGSEGV in
# `sparse_core::TranslateModuleToTpuLlvmIr`, in some runs, with and without this change's KV
# layout; alone it compiled). Warm-up and `jaxinfer aot` compile in threads, so every program of
# the step keeps its scatters on the TensorCore (small: a step's KV rows, a [R, V] count table).
TPU_COMPILER_OPTIONS = {"xla_tpu_enable_offloading_scatter_to_sparsecore": "false"}


class StepFunction:
    def __init__(self, graphdef: nnx.GraphDef, num_top_logprobs: int, max_rows: int = 1, *,
                 mesh: Mesh | None = None, param_specs=None, return_hidden: bool = False,
                 return_stream: bool | tuple[int, ...] = False, pooling: bool = False, vocab_split: bool | None = None):
        """`mesh` defaults to one device; `param_specs` (`param_partition_specs`) is needed with a
        mesh of more than one device (on one device every parameter is whole). `return_hidden`:
        the step's SampleOutput also carries the logits rows' hidden states (`hidden` [R, H]).
        `return_stream`: the model program also returns every token's residual stream before the
        final norm, [replicas, max_rows, H] (rows past the batch's tokens: padding), left on the
        device for the next program that reads it (`__call__`'s fourth result; models.deepseek_mtp);
        a tuple of layer indices instead: the streams at the input of those layers side by side,
        [replicas, max_rows, len * H] (EAGLE-3's auxiliary hidden states: models.eagle3).
        `pooling` (runner="pooling"): the step returns the rows' hidden states alone (the
        SampleOutput's `hidden`, its other fields None): no LM head is computed (XLA drops it, its
        logits being unused), nothing is sampled, the token buffer passes through unchanged.
        `vocab_split`: the LM head is split on the vocabulary over "tensor" (lm_head_parallel=
        "vocab"), so the logits stay split on it and are sampled there; None: read from param_specs
        (`is_vocab_split`)."""
        self.num_compiles = 0  # programs traced (each compiled variant of each program)
        self.num_model_compiles = 0  # of which model programs (one per bucket and LoRA switch)
        if pooling and return_stream:
            raise ValueError("a pooling step returns the rows' hidden states, not every token's stream")
        self.pooling = pooling
        self.return_hidden = return_hidden = return_hidden or pooling
        self.return_stream = return_stream
        self.max_rows = max_rows  # size of each replica's token buffer handed from one step to the next
        self.mesh = mesh if mesh is not None else make_mesh(ParallelConfig(), jax.devices()[:1])
        if param_specs is None and self.mesh.size > 1:
            raise ValueError("StepFunction on a mesh of several devices needs param_specs")
        self.param_specs = param_specs
        self.num_replicas = rules.num_replicas(self.mesh)
        replicas = rules.REPLICA_AXES
        rows_spec = rules.per_replica(3)  # logits [replicas, R, V] and hidden states [replicas, R, H]
        if vocab_split is None:
            vocab_split = is_vocab_split(param_specs)
        self.vocab_split = vocab_split = bool(vocab_split) and self.mesh.shape["tensor"] > 1
        tp = self.mesh.shape["tensor"]
        # the logits rows as the model program returns them: split on the vocabulary too with a vocabulary-split head
        logits_spec = rules.VOCAB_LOGITS if vocab_split else rows_spec
        self._logits_spec = logits_spec

        def vocab_of(logits):  # the sampler's view of a device's logits columns (None: whole rows)
            return Vocab(logits.shape[-1] * tp, "tensor") if vocab_split else None
        platform = self.mesh.devices.flat[0].platform
        options = compiler_options(platform)
        sampling_options = None if platform == "cpu" else options  # (the CPU's option is the layer loop's)

        def gather_replicas(x):  # [1, ...] per device -> [replicas, ...] on every device
            return jax.lax.all_gather(x[0], replicas, axis=0, tiled=False) if self.num_replicas > 1 else x

        def per_device_model(params, kv, batch, prev_tokens, *prev_stream, query_block, spec_block):
            batch = jax.tree.map(lambda a: a[0], batch)  # this replica's
            from_device = prev_tokens[0][jnp.maximum(batch.token_src, 0)]
            batch = dataclasses.replace(batch, token_ids=jnp.where(batch.token_src >= 0, from_device, batch.token_ids))
            # a hidden state per token from a stream on the device (batch.hidden_src: its rows)
            input_hidden = prev_stream[0][0][batch.hidden_src] if prev_stream else None
            logits, kv, *extras = nnx.merge(graphdef, params)(
                kv, batch, query_block=query_block, spec_block=spec_block, return_hidden=return_hidden,
                return_stream=return_stream, input_hidden=input_hidden)
            if pooling:  # the hidden rows where the logits would be: the LM head is dead code
                return extras[0][None].astype(jnp.float32), kv
            out = (logits[None], kv)
            if return_hidden:
                out += (extras.pop(0)[None].astype(jnp.float32),)
            if return_stream:  # [T, H] -> [1, max_rows, H]: one shape whatever the bucket
                stream = extras.pop(0)
                out += (jnp.zeros((1, max_rows, stream.shape[-1]), stream.dtype).at[0, : stream.shape[0]].set(stream),)
            return out

        def model(params, kv, batch, prev_tokens, *prev_stream, query_block: int, spec_block: int = 0):
            self.num_compiles += 1  # runs only while tracing, i.e. once per compiled variant
            self.num_model_compiles += 1
            kv_specs = cache_spec(kv)
            return jax.shard_map(
                lambda *a: per_device_model(*a, query_block=query_block, spec_block=spec_block), mesh=self.mesh,
                in_specs=(self._specs(params), kv_specs, per_replica_specs(batch), rules.per_replica(2),
                          *(rows_spec for _ in prev_stream)),
                out_specs=(rows_spec if pooling else logits_spec, kv_specs)
                + ((rows_spec,) if return_hidden and not pooling else ())
                + ((rows_spec,) if return_stream else ()),
                check_vma=False,
            )(params, kv, batch, prev_tokens, *prev_stream)

        def processor_program(processor):
            def program(logits, *fields):  # [replicas, R, V], each field [replicas, R, ...]
                self.num_compiles += 1
                return jax.shard_map(
                    lambda lg, *f: processor(lg[0], *(a[0] for a in f), vocab=vocab_of(lg))[None], mesh=self.mesh,
                    in_specs=(logits_spec, *per_replica_specs(fields)), out_specs=logits_spec, check_vma=False,
                )(logits, *fields)
            return jax.jit(program, compiler_options=sampling_options)

        def per_device_sample(raw, processed, sampling, *hidden):
            raw, processed, sampling = jax.tree.map(lambda a: a[0], (raw, processed, sampling))
            out = sample(processed, sampling, num_top_logprobs, raw_logits=raw, vocab=vocab_of(raw))
            if hidden:
                out = dataclasses.replace(out, hidden=hidden[0][0])
            token_buffer = jnp.zeros(max_rows, jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
            return jax.tree.map(lambda a: gather_replicas(a[None]), out), token_buffer[None]

        def sampler(raw, processed, sampling, *hidden):
            self.num_compiles += 1
            return jax.shard_map(
                per_device_sample, mesh=self.mesh,
                in_specs=(logits_spec, logits_spec, per_replica_specs(sampling), *(rows_spec for _ in hidden)),
                out_specs=(rules.replicated(), rules.per_replica(2)), check_vma=False,  # every SampleOutput field replicated
            )(raw, processed, sampling, *hidden)

        def per_device_forward(params, kv, batch, query_block, spec_block):
            batch = jax.tree.map(lambda a: a[0], batch)
            logits, kv, *hidden = nnx.merge(graphdef, params)(kv, batch, query_block=query_block, spec_block=spec_block,
                                                              return_hidden=return_hidden)
            if vocab_split:  # the whole rows: this is not the serving path
                logits = jax.lax.all_gather(logits, "tensor", axis=-1, tiled=True)
            return (gather_replicas(logits[None]), kv, *(gather_replicas(h[None]) for h in hidden))

        def forward(params, kv, batch, *, query_block: int, spec_block: int = 0):
            """The raw logits [replicas, R, V] (for tests and scoring; with return_hidden also the
            rows' hidden states [replicas, R, H]); not the serving path."""
            kv_specs = cache_spec(kv)
            return jax.shard_map(
                lambda *a: per_device_forward(*a, query_block, spec_block), mesh=self.mesh,
                in_specs=(self._specs(params), kv_specs, per_replica_specs(batch)),
                out_specs=(rules.replicated(), kv_specs) + ((rules.replicated(),) if return_hidden else ()), check_vma=False,
            )(params, kv, batch)

        self._model = jax.jit(model, donate_argnums=(1,), static_argnames=("query_block", "spec_block"),
                              compiler_options=options)
        self._processors = [(fields, processor_program(processor)) for fields, processor in LOGITS_PROCESSORS]
        self._sampler = jax.jit(sampler, compiler_options=sampling_options)
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

    def __call__(self, params, kv, batch, sampling, prev_tokens, *prev_stream, query_block: int,
                 spec_block: int = 0) -> tuple[SampleOutput, jax.Array, KVCache, jax.Array | None]:
        """One step: (SampleOutput, token_buffer, kv, the stream [replicas, max_rows, H] with
        return_stream, else None). `prev_stream`: with a batch whose `hidden_src` is set, the stream
        its rows point into (another step's)."""
        logits, kv, *extras = self._model(params, kv, batch, prev_tokens, *prev_stream, query_block=query_block,
                                          spec_block=spec_block)
        if self.pooling:  # (`logits` holds the rows' hidden states [replicas, R, H])
            return SampleOutput(None, None, None, None, hidden=logits), prev_tokens, kv, None
        stream = extras.pop() if self.return_stream else None
        out, token_buffer = self.sample(logits, sampling, *extras)
        return out, token_buffer, kv, stream

    def sample(self, logits: jax.Array, sampling, *hidden) -> tuple[SampleOutput, jax.Array]:
        """The sampling half of a step: the logits processors `sampling` switches on, each its own
        program, then the sampler. logits [replicas, R, V]; returns (SampleOutput, token_buffer)."""
        processed = logits
        for fields, program in self._processors:
            if getattr(sampling, fields[0]) is not None:
                processed = program(processed, *(getattr(sampling, f) for f in fields))
        return self._sampler(logits, processed, without_processors(sampling), *hidden)

    def lower(self, params, kv, batch, prev_tokens, key) -> jax.stages.Lowered:
        """The model program of bucket `key` (a BucketKey) lowered for these arguments, which may
        be abstract (jax.ShapeDtypeStruct with shardings, e.g. on a TPU topology: jaxinfer.aot);
        `lower_sampling` lowers the sampling programs."""
        return self._model.lower(params, kv, batch, prev_tokens, query_block=key.query_block, spec_block=key.spec_block)

    def lower_sampling(self, logits, sampling, hidden=None) -> list[jax.stages.Lowered]:
        """The sampling programs a step with these (possibly abstract) `sampling` tensors runs
        after the model, lowered for logits like `logits` [replicas, R, V]: each logits processor
        it switches on, then the sampler."""
        lowered = [program.lower(logits, *(getattr(sampling, f) for f in fields))
                   for fields, program in self._processors if getattr(sampling, fields[0]) is not None]
        return lowered + [self._sampler.lower(logits, logits, without_processors(sampling),
                                              *(() if hidden is None else (hidden,)))]

    def logits_layout(self, num_rows: int, vocab: int) -> jax.ShapeDtypeStruct:
        """The model program's logits [replicas, num_rows, vocab], abstract, placed as it returns them."""
        return jax.ShapeDtypeStruct((self.num_replicas, num_rows, vocab), jnp.float32,
                                    sharding=NamedSharding(self.mesh, self._logits_spec))

    def input_shardings(self, tree):
        """NamedShardings of a per-replica input tree (batches, sampling tensors, token buffers)."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), per_replica_specs(tree),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def forward(self, params, kv, batch, *, query_block: int, spec_block: int = 0):
        return self._forward(params, kv, batch, query_block=query_block, spec_block=spec_block)


def is_vocab_split(param_specs) -> bool:
    """Do these parameter PartitionSpecs (`placement.param_partition_specs`) split the embedding
    table on the vocabulary over "tensor" (lm_head_parallel="vocab", param_layout.VOCAB_SPLIT_AXES)?"""
    if param_specs is None:
        return False
    leaves = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    for path, spec in leaves:
        if ".".join(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)) != "embed":
            continue
        field = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else None
        if field == "qweight":  # a quantized table [H, V]
            return len(spec) == 2 and spec[1] == "tensor"
        if field in (None, "value", "raw_value"):  # [V, H]
            return len(spec) == 2 and spec[0] == "tensor"
    return False

"""The serving step built for a target chip with nothing real in it: abstract weights, KV pool and
inputs, the engine's own StepFunction and buckets, compiled bucket by bucket.

    plan = AbstractStep.build(config, compile_target("v6e:2x2"), ParallelConfig(tp=4), ServingShape(...))
    compiled = plan.compile(plan.buckets.all_keys()[0])
    compiled.memory_analysis()

No weight is read and nothing touches `jax.devices()`: parameters come from `abstract_model`
(`nnx.eval_shape`), quantization runs under `jax.eval_shape`, and every array is a
`jax.ShapeDtypeStruct` carrying its NamedSharding on the target's mesh. The step is the one
`LLM` serves with (`jaxinfer.runtime.step.StepFunction`, the same buckets, the same donation of the KV
cache), with the target platform's Pallas kernels compiled for real (`interpret=False`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.kv_groups import kv_groups, window_pages
from jaxinfer.aot.targets import Target
from jaxinfer.ops.batch import BucketKey, Buckets
from jaxinfer.config import ModelConfig
from jaxinfer.engine.memory import GPU_MEMORY_UTILIZATION, abstract_inputs, abstract_pool, bytes_per_device, lower_sampling
from jaxinfer.models.lora import LoraTable
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache, page_factors
from jaxinfer.ops.quantization import QuantizedWeight, quantize_model, replace_weights
from jaxinfer.ops.sparsity import SPARSE24_WEIGHT_NAMES, Sparse24Weight
from jaxinfer.runtime.loading import QUANTIZABLE, abstract_model
from jaxinfer.tree import nested_to_flat
from jaxinfer.runtime.placement import param_partition_specs
from jaxinfer.runtime.step import StepFunction
from sharding.mesh import ParallelConfig, make_mesh

NUM_TOP_LOGPROBS = 20  # LLM's default max_logprobs: part of the compiled step


def weights_as_stored(graphdef, params, stored: str):
    """(graphdef, abstract params) with the weights as the checkpoint stores them and a TPU / GPU
    loads them (jaxinfer.runtime.loading): `stored` "mxfp4" (GPT-OSS): the expert stacks as E2M1
    nibbles [..., K / 2, N] with an exponent byte per 32 rows [..., K / 32, N]; "fp8" (block-scaled):
    every matmul weight the loader keeps (projections, dense and expert MLPs) as e4m3 [..., Kp, N]
    with a float32 scale per 128 rows [..., Kp / 128, N]."""
    new_graphdef = []

    def as_stored(shape) -> QuantizedWeight:
        *lead, K, N = shape
        if stored == "mxfp4":
            return QuantizedWeight(jnp.zeros((*lead, K // 2, N), jnp.uint8), jnp.zeros((*lead, K // 32, N), jnp.uint8),
                                   mode="mxfp4", group_size=32, in_features=K)
        groups = -(-K // 128)
        return QuantizedWeight(jnp.zeros((*lead, groups * 128, N), jnp.float8_e4m3fn), jnp.zeros((*lead, groups, N), jnp.float32),
                               mode="fp8", group_size=128, in_features=K)

    # what the loader keeps: GPT-OSS's routed experts; an fp8 release's every quantizable matrix but
    # the embedding and LM head, which it ships in bf16
    kept = {"experts_gate_up", "experts_down"} if stored == "mxfp4" else QUANTIZABLE - {"embed", "lm_head"}

    def replace(state):
        flat = nested_to_flat(nnx.to_pure_dict(state))
        g, new_state = replace_weights(graphdef, state, {n: as_stored(a.shape) for n, a in flat.items()
                                                         if n.rsplit(".", 1)[-1] in kept})
        new_graphdef.append(g)
        return new_state

    params = jax.eval_shape(replace, params)
    return new_graphdef[0], params


def weights_as_sparse24(graphdef, params):
    """(graphdef, abstract params) with the projections (qkv, o, gate/up, down: what a 2:4 pruned
    checkpoint stores 2:4; not the embedding or LM head) as 2:4 Sparse24Weights, as a TPU / GPU
    keeps them: values [..., 4, K / 8, N] in the weight's dtype and a uint8 mask [..., K / 8, N]."""
    new_graphdef = []

    def as_sparse(a) -> Sparse24Weight:
        *lead, K, N = a.shape
        return Sparse24Weight(jnp.zeros((*lead, 4, K // 8, N), a.dtype), jnp.zeros((*lead, K // 8, N), jnp.uint8))

    def replace(state):
        flat = nested_to_flat(nnx.to_pure_dict(state))
        g, new_state = replace_weights(graphdef, state, {n: as_sparse(a) for n, a in flat.items()
                                                         if n.rsplit(".", 1)[-1] in SPARSE24_WEIGHT_NAMES and a.shape[-2] % 8 == 0})
        new_graphdef.append(g)
        return new_state

    params = jax.eval_shape(replace, params)
    return new_graphdef[0], params


@dataclasses.dataclass(frozen=True)
class ServingShape:
    """What the deployment serves: the engine arguments that decide compiled shapes."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_prefix_states: int | None = None  # a hybrid model's saved recurrent states per replica (None: max_num_seqs)
    # The KV pool per replica, as the engine sizes it (jaxinfer.engine.memory; aot.plan.size_pool):
    # num_pages > kv_cache_memory_bytes > gpu_memory_utilization of the chip's HBM.
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    dtype: str = "bfloat16"  # weights and activations
    kv_cache_dtype: str | None = None  # default: dtype
    quantization: str | None = None  # "int8" | "int4" | "fp8" | "w8a8" weights
    keep_checkpoint_quantization: bool = True  # weights a checkpoint stores mxfp4 / fp8 stay so, as a TPU / GPU loads them
    group_size: int = 128  # int4's groups (the other modes: one scale per output column)
    max_loras: int = 0  # > 0: the LoRA slot table of LLM(enable_lora=True, max_loras=..., max_lora_rank=...)
    max_lora_rank: int = 16
    sparsity: str | None = None  # "2:4": the projections 2:4 sparse, kept compressed (the sparse24_matmul kernel)

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected a fraction in (0, 1]")
        if self.sparsity not in (None, "2:4"):
            raise ValueError(f"sparsity={self.sparsity!r}: expected None or '2:4'")
        if self.sparsity and self.quantization:
            raise ValueError(f"sparsity={self.sparsity!r} with quantization={self.quantization!r}: 2:4 weights are kept as "
                             f"float values (quantized 2:4 matrices are not supported)")

    def state_slots(self, max_num_seqs: int) -> int:
        """A hybrid model's recurrent-state slots per replica, as the engine makes them: the
        scratch slot, one per sequence and the prefix cache's saved states."""
        return 1 + max_num_seqs + (max_num_seqs if self.num_prefix_states is None else self.num_prefix_states)

    def keeps_stored_weights(self, config: ModelConfig) -> bool:
        """Whether weights load as the checkpoint stores them (mxfp4 experts, fp8), not as `dtype`."""
        return bool(config.stored_quantization) and self.quantization is None and self.keep_checkpoint_quantization

    def weights_name(self, config: ModelConfig) -> str:
        """The weights' dtype or quantization, as the plan prints it."""
        if self.sparsity:
            return f"{self.dtype} (projections {self.sparsity} sparse, compressed)"
        if not self.keeps_stored_weights(config):
            return self.quantization or self.dtype
        what = "experts mxfp4" if config.stored_quantization == "mxfp4" else "fp8 in 128 x 128 blocks"
        return f"{self.dtype} ({what})"

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def sequence_pages(self, windows: tuple = (None,), factors: tuple = ()) -> int:
        """Pages (every KV layer group, `jaxinfer.kv_groups`) one sequence of max_model_len holds at
        most: a full group all of it, a sliding group its window and a prefill chunk (a group of
        page factor f in pages of f * page_size tokens)."""
        return sum(window_pages(w, self.max_model_len, self.page_size * f, self.max_num_batched_tokens)
                   for w, f in zip(windows, factors or (1,) * len(windows)))

    def pages_needed(self, windows: tuple = (None,), factors: tuple = ()) -> int:
        return self.max_num_seqs * self.sequence_pages(windows, factors) + 1


@dataclasses.dataclass
class AbstractStep:
    config: ModelConfig
    target: Target
    parallel: ParallelConfig
    shape: ServingShape
    mesh: jax.sharding.Mesh
    step: StepFunction
    params: object  # nnx.State of ShapeDtypeStructs, sharded
    kv: KVCache  # of ShapeDtypeStructs, sharded
    buckets: Buckets
    num_pages: int  # per replica

    @classmethod
    def build(cls, config: ModelConfig, target: Target, parallel: ParallelConfig, shape: ServingShape) -> "AbstractStep":
        jax.clear_caches()  # kernels read the chip (VMEM, MXU width) while tracing: no trace of another target's
        dtype = jnp.dtype(shape.dtype)
        kv_dtype = jnp.dtype(shape.kv_cache_dtype or shape.dtype)
        kernels = Kernels(platform=target.platform, interpret=False)
        mesh = make_mesh(parallel, target.mesh_devices(parallel))  # several slices: the outer axes across them
        lora = LoraTable(shape.max_loras + 1, shape.max_lora_rank) if shape.max_loras else None
        graphdef, params = abstract_model(config, dtype, dtype, kernels, parallel, lora=lora)
        if shape.quantization is not None:
            quantized_graphdef = []

            def quantize(state):
                group_size = shape.group_size if shape.quantization == "int4" else None
                new_graphdef, new_state = quantize_model(graphdef, state, shape.quantization, group_size)
                quantized_graphdef.append(new_graphdef)
                return new_state

            params = jax.eval_shape(quantize, params)
            graphdef = quantized_graphdef[0]
        elif shape.sparsity == "2:4":
            graphdef, params = weights_as_sparse24(graphdef, params)
        elif shape.keeps_stored_weights(config):
            graphdef, params = weights_as_stored(graphdef, params, config.stored_quantization)
        specs = param_partition_specs(params, config)
        params = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
                              params, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        groups = kv_groups(config)
        factors = page_factors(groups, tp=parallel.tp, combined=kernels.combines_kv)
        num_pages = shape.num_pages or shape.pages_needed(groups.windows, factors)  # plan.size_pool resizes it
        shards = parallel.kv_shards
        num_pages = -(-num_pages // shards) * shards  # (context parallelism: every device of the axis a block)
        max_num_seqs = min(shape.max_num_seqs, shape.max_num_batched_tokens)
        kv = abstract_pool(config, num_pages * parallel.num_replicas, shape.page_size, kv_dtype, tp=parallel.tp,
                           kernels=kernels, mesh=mesh, state_slots=shape.state_slots(max_num_seqs) * parallel.num_replicas,
                           state_dtype=dtype, sequence=shards > 1)
        buckets = Buckets.default(shape.max_num_batched_tokens, max_num_seqs,
                                  shape.pages_per_seq, token_multiple=parallel.token_multiple, num_groups=groups.num_groups)
        step = StepFunction(graphdef, NUM_TOP_LOGPROBS, max_rows=buckets.max_tokens, mesh=mesh, param_specs=specs)
        return cls(config, target, parallel, shape, mesh, step, params, kv, buckets, num_pages)

    def with_num_pages(self, num_pages: int) -> "AbstractStep":
        """The same step over a KV pool of `num_pages` pages per replica (context parallelism: rounded up
        to a multiple of the sequence axis)."""
        shards = self.parallel.kv_shards
        num_pages = -(-num_pages // shards) * shards
        shape = dataclasses.replace(self.shape, num_pages=num_pages)
        kv = self.kv.map_pages(lambda a: jax.ShapeDtypeStruct((a.shape[0], num_pages * self.parallel.num_replicas) + a.shape[2:],
                                                              a.dtype, sharding=a.sharding))
        return dataclasses.replace(self, shape=shape, kv=kv, num_pages=num_pages)

    # ------------------------------------------------------------------ per chip
    def weight_bytes_per_chip(self) -> int:
        return bytes_per_device(self.params)

    def layer_weight_bytes_per_chip(self) -> int:
        """The stacked decoder layers' part of weight_bytes_per_chip (with pipeline stages: one stage's layers)."""
        return bytes_per_device(self.params["layers"]) if "layers" in self.params else 0

    def kv_bytes_per_chip(self) -> int:
        return bytes_per_device(self.kv.page_arrays())  # K, V and a quantized pool's scales

    def sparse24_bytes_per_chip(self) -> tuple[int, int]:
        """(bytes the 2:4 weights take as stored: values and masks, bytes the same matrices take
        dense) per chip; (0, 0) without 2:4 weights."""
        sparse = [w for w in jax.tree.leaves(self.params, is_leaf=lambda x: isinstance(x, Sparse24Weight))
                  if isinstance(w, Sparse24Weight)]
        return bytes_per_device([(w.values, w.mask) for w in sparse]), 2 * bytes_per_device([w.values for w in sparse])

    def state_bytes_per_chip(self) -> int:
        """A hybrid model's recurrent states (`ServingShape.state_slots` per replica), whatever the pages."""
        return bytes_per_device(self.kv.state) if self.kv.state is not None else 0

    @property
    def windows(self) -> tuple:
        """Each KV layer group's sliding window (None: full attention)."""
        return kv_groups(self.config).windows

    @property
    def page_factors(self) -> tuple:
        """Each group's pages hold page_size times this many tokens (groups of another shape)."""
        kernels = Kernels(platform=self.target.platform, interpret=False)
        return page_factors(kv_groups(self.config), tp=self.parallel.tp, combined=kernels.combines_kv)

    def pages_held(self, context: int, chunk: int = 1) -> int:
        """Pages (all groups) one sequence of `context` tokens holds."""
        return sum(window_pages(w, context, self.shape.page_size * f, chunk) for w, f in zip(self.windows, self.page_factors))

    def kv_bytes_per_page_per_chip(self) -> int:
        # a chip holds its replica's num_pages pages (context parallelism: 1 / sp of them, so a page costs a chip 1 / sp)
        return self.kv_bytes_per_chip() // self.num_pages

    def kv_pool_elements_per_chip(self) -> int:
        return math.prod(self.kv.pages.sharding.shard_shape(self.kv.pages.shape))

    # ------------------------------------------------------------------ compiling
    @property
    def with_rope_positions(self) -> bool:
        """Every batch carries M-RoPE positions (`rope_positions`): a Qwen2.5-VL / Qwen3-VL model, as the engine builds it."""
        return getattr(self.config, "mrope_section", None) is not None

    def inputs(self, key: BucketKey, image_inputs: tuple[int, int, bool] | None = None):
        """(batch, prev_tokens) of bucket `key`, abstract and sharded as the model program takes them;
        `image_inputs` (width, deepstack rows, span_end; `VisionSpec.image_inputs`): its image variant."""
        return abstract_inputs(self.step, key, self.buckets, with_lora=self.shape.max_loras > 0,
                               with_rope_positions=self.with_rope_positions, image_inputs=image_inputs)

    def lower(self, key: BucketKey, image_inputs: tuple[int, int, bool] | None = None) -> jax.stages.Lowered:
        with jax.set_mesh(self.mesh):  # Pallas asks the mesh's chip for its facts (VMEM, generation)
            return self.step.lower(self.params, self.kv, *self.inputs(key, image_inputs), key)

    def compile(self, key: BucketKey, image_inputs: tuple[int, int, bool] | None = None) -> jax.stages.Compiled:
        lowered = self.lower(key, image_inputs)
        with jax.set_mesh(self.mesh):
            return lowered.compile()

    def compile_sampling(self, num_rows: int) -> list[jax.stages.Compiled]:
        """The sampling programs of a step of `num_rows` logits rows, every logits processor on
        (the engine's warm-up compiles the same: jaxinfer.engine.model_runner)."""
        with jax.set_mesh(self.mesh):
            programs = lower_sampling(self.step, num_rows, self.config.vocab_size,
                                      self.buckets.pages_per_seq * self.shape.page_size)
            return [program.compile() for program in programs]

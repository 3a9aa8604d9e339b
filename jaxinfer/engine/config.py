"""`EngineConfig`: every engine setting in one validated, frozen object.

    config = EngineConfig(model="./Llama-3.2-1B", tensor_parallel_size=4, max_num_seqs=128)
    engine = build_engine(config)            # jaxinfer.engine.build; LLM(**same keywords) does this

Built once from `LLM(...)` keywords or the CLI's flags; `resolved(model_config)` fills in what
depends on the model (dtypes for this backend, max_model_len, the KV pool size), after which
every field is concrete (but for a TPU / GPU pool sized from the devices' memory, which
build_engine measures once the weights are placed). The names are vLLM's where vLLM has the setting (`dtype`,
`kv_cache_dtype`, `quantization`, `max_model_len`, `max_num_batched_tokens`, `max_num_seqs`,
`max_logprobs`, `enable_prefix_caching`, `preemption_mode`, `seed`, `tensor_parallel_size`,
`data_parallel_size`, `enable_expert_parallel`, `speculative_config`, `kv_cache_memory_bytes`,
`gpu_memory_utilization`, `num_gpu_blocks_override`, `revision`, `enable_lora`, `max_loras`,
`max_lora_rank`, `kv_offloading_size`);
jaxinfer's own: `page_size` (vLLM's `block_size`), `kv_cache_outliers`, `num_pages` (= `num_gpu_blocks_override`,
per data-parallel replica), `compute_dtype`,
`quantization_group_size`, `quantization_symmetric`, `keep_checkpoint_quantization`, `kernel_impl` (alias `attention_impl`),
`check_kernels`, `xla_kernels`, `sequence_parallel_size`,
`expert_parallel_size`, `sequence_parallel_attention`, `lm_head_parallel`, `warmup`, `log_stats_interval`, `num_prefix_states`,
`kv_offloading_dir`, `kv_offloading_disk_size`, `kv_eviction` (with `kv_eviction_window`,
`kv_eviction_sink_tokens`, `kv_eviction_heavy_tokens`: jaxinfer.ops.kv_eviction); vLLM's `runner` ("generate" | "pooling") and
`pooler_config`; for images vLLM's `limit_mm_per_prompt`,
`max_num_encoder_input_tokens`, `encoder_cache_size`, `allowed_media_domains`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import KVEviction, ModelConfig
from jaxinfer.engine.memory import CPU_KV_CACHE_MEMORY_BYTES, GPU_MEMORY_UTILIZATION, pages_for_bytes
from jaxinfer.engine.spec_decode import SpeculativeConfig
from jaxinfer.kv_groups import kv_groups
from jaxinfer.models.param_layout import LM_HEAD_PARALLEL
from jaxinfer.ops.batch import Buckets
from jaxinfer.ops.kernels import KERNEL_IMPLS, OPERATIONS, Kernels, resolve_kernels
from jaxinfer.ops.kv_cache import KVCache, check_outliers, is_quantized, page_factors
from jaxinfer.ops.quantization import QUANTIZATION_GROUP_SIZES, QUANTIZATION_MODES, default_group_size
from sharding.mesh import ParallelConfig, ShardingError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
KV_DTYPES = {**DTYPES, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "float8_e4m3fn": jnp.float8_e4m3fn}
PREEMPTION_MODES = ("recompute", "swap")
KV_EVICTION_METHODS = ("streaming", "h2o")
# RoPE tables whose angle is the position times a fixed frequency: StreamingLLM's cache positions are then
# a rotation of the query alone (jaxinfer.ops.kv_eviction); dynamic NTK and LongRoPE change with the length
KV_EVICTION_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
RUNNERS = ("generate", "pooling")


def dtype_of(name: str | Any | None, what: str = "dtype", names: dict = DTYPES):
    """"auto" | "float32" | "bfloat16" | "float16" | a numpy/jax dtype -> the jnp scalar type
    ("auto": float32 on the CPU, bfloat16 elsewhere); None stays None. `names`: the names allowed
    (KV_DTYPES for kv_cache_dtype: also "int8" and "fp8")."""
    if name is None:
        return None
    if not isinstance(name, str):
        return jnp.dtype(name).type
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in names:
        raise ValueError(f"{what}={name!r}: expected one of 'auto', {', '.join(map(repr, names))}")
    return names[name]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """See `jaxinfer.llm.LLM` for what each setting does."""

    model: str | os.PathLike | None = None
    revision: str | None = None  # a Hub id's branch, tag or commit (default: main)
    dtype: Any = "auto"
    compute_dtype: Any = None  # default: float32 on the CPU, bfloat16 elsewhere
    kv_cache_dtype: Any = None  # default: compute_dtype
    # int8 / fp8 KV: residual slots per page for its worst-quantized tokens, kept in bfloat16 (ops.kv_cache; 0: off)
    kv_cache_outliers: int = 0
    quantization: str | None = None
    quantization_group_size: int | None = None  # default: int4 128, int8 one scale per output column
    quantization_symmetric: bool = True
    keep_checkpoint_quantization: bool | None = None  # None: on TPU / GPU, not on the CPU (see the property)
    kernel_impl: str = "auto"
    # Each Pallas kernel run on the device against its reference before serving (jaxinfer.runtime.
    # kernel_selfcheck); None: when the kernels compile for this chip (TPU, GPU), True: also in interpret mode
    check_kernels: bool | None = None
    xla_kernels: tuple[str, ...] = ()  # kernel-table operations on their XLA path (the check adds those that fail)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    page_size: int = 16
    # The KV pool per replica (engine/memory.py): num_pages (= num_gpu_blocks_override) >
    # kv_cache_memory_bytes > gpu_memory_utilization of each device's memory (TPU / GPU); the CPU's
    # default is CPU_KV_CACHE_MEMORY_BYTES.
    num_pages: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    num_prefix_states: int | None = None  # a hybrid model's saved recurrent states per replica (None: max_num_seqs)
    preemption_mode: str = "recompute"
    # KV tiers (engine/kv_tiers.py): GiB of host memory keeping prefix pages the device evicts (None / 0: off),
    # a directory every such page is also written to (needs the host tier), and that directory's bound in GiB
    kv_offloading_size: float | None = None
    kv_offloading_dir: str | os.PathLike | None = None
    kv_offloading_disk_size: float | None = None  # None: unbounded
    log_stats_interval: float | None = None
    seed: int = 0
    warmup: bool = False
    progress: bool = True
    compilation_cache_dir: str | os.PathLike | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int | None = None
    enable_expert_parallel: bool = False
    sequence_parallel_attention: str = "allgather"
    # how tensor parallelism splits the embedding table and LM head: "hidden" (all-reduce the
    # [R, V] logits every step) or "vocab" (vLLM's VocabParallelEmbedding / ParallelLMHead: the
    # logits stay split on the vocabulary and are sampled there; docs/parallelism.md)
    lm_head_parallel: str = "hidden"
    speculative_config: SpeculativeConfig | dict | None = None
    enable_lora: bool = False  # LoRA adapters per request (LoRARequest), in a slot table on the device
    max_loras: int = 4  # adapters the table holds at once (the batch's distinct adapters at most)
    max_lora_rank: int = 16  # every adapter's rank is padded to this
    # images (a vision model: jaxinfer.engine.multimodal)
    limit_mm_per_prompt: dict | None = None  # {"image": N}: images one prompt may hold (default 16)
    max_num_encoder_input_tokens: int | None = None  # image tokens encoded per step (default max_num_batched_tokens)
    encoder_cache_size: int | None = None  # encoder rows kept by image hash (default max(4096, 4 x max_num_batched_tokens))
    allowed_media_domains: tuple[str, ...] = ()  # domains an image URL may be fetched from (default: none)
    # what the engine runs: "generate" (text) or "pooling" (embeddings and classifier scores, engine.pooling)
    runner: str = "generate"
    pooler_config: dict | None = None  # runner="pooling": {"pooling_type", "normalize"} over the model's own
    # KV eviction for unbounded streams (jaxinfer.ops.kv_eviction): None (off), "streaming" (StreamingLLM: the first
    # kv_eviction_sink_tokens tokens, default 4, and the last kv_eviction_window) or "h2o" (the
    # kv_eviction_heavy_tokens, default the window, with the most accumulated attention, and the last kv_eviction_window)
    kv_eviction: str | None = None
    kv_eviction_window: int | None = None
    kv_eviction_sink_tokens: int | None = None
    kv_eviction_heavy_tokens: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if self.quantization == "none":
            set_("quantization", None)
        if self.quantization not in (None, *QUANTIZATION_MODES):
            raise ValueError(f"quantization={self.quantization!r}: expected 'none', {', '.join(map(repr, QUANTIZATION_MODES))}")
        if self.quantization is not None:
            if self.quantization_group_size is None:
                set_("quantization_group_size", default_group_size(self.quantization))
            allowed = QUANTIZATION_GROUP_SIZES[self.quantization]
            if self.quantization_group_size not in allowed:
                raise ValueError(f"quantization_group_size={self.quantization_group_size!r}: expected one of {allowed} "
                                 f"for quantization={self.quantization!r} (None: one scale per output column)")
            if not self.quantization_symmetric and self.quantization_group_size is None:
                raise ValueError(f"quantization_symmetric=False needs a quantization_group_size (offsets are per group)")
        for field in ("dtype", "compute_dtype"):
            dtype_of(getattr(self, field), field)  # raises for an unknown name
        dtype_of(self.kv_cache_dtype, "kv_cache_dtype", KV_DTYPES)
        if self.kv_cache_outliers:
            # (the kernels and the model are checked in `resolved`: "auto" names need the backend)
            named = self.kv_cache_dtype not in (None, "auto")
            check_outliers(self.kv_cache_outliers, self.page_size, dtype_of(self.kv_cache_dtype, "kv_cache_dtype", KV_DTYPES)
                           if named else jnp.float32)
            if self.sequence_parallel_size > 1 and self.sequence_parallel_attention in ("ring", "context"):
                raise ValueError(f"kv_cache_outliers={self.kv_cache_outliers} with sequence_parallel_attention="
                                 f"{self.sequence_parallel_attention!r}: the ring writes its blocks in each device's own "
                                 f"order, and the context-parallel pool is not read with outliers; "
                                 f"use sequence_parallel_attention='allgather'")
        if self.keep_checkpoint_quantization and (self.quantization is not None or self.dtype != "auto"):
            raise ValueError("keep_checkpoint_quantization=True runs the checkpoint's own grid: it takes neither a "
                             f"quantization ({self.quantization!r}) nor a dtype ({self.dtype!r}) of its own")
        if self.kernel_impl not in KERNEL_IMPLS:
            raise ValueError(f"kernel_impl={self.kernel_impl!r}: expected one of {', '.join(map(repr, KERNEL_IMPLS))}")
        set_("allowed_media_domains", (self.allowed_media_domains,) if isinstance(self.allowed_media_domains, str)
             else tuple(self.allowed_media_domains))
        if self.limit_mm_per_prompt is not None and (not isinstance(self.limit_mm_per_prompt, dict) or set(self.limit_mm_per_prompt) - {"image"}
                                                     or not all(isinstance(v, int) and v >= 0 for v in self.limit_mm_per_prompt.values())):
            raise ValueError(f"limit_mm_per_prompt={self.limit_mm_per_prompt!r}: expected {{'image': N}} with N >= 0")
        for field in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)!r}: expected a positive number of tokens")
        set_("xla_kernels", (self.xla_kernels,) if isinstance(self.xla_kernels, str) else tuple(self.xla_kernels))
        if set(self.xla_kernels) - set(OPERATIONS):
            raise ValueError(f"xla_kernels={self.xla_kernels!r}: expected names among {', '.join(map(repr, OPERATIONS))}")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        if self.num_gpu_blocks_override is not None:
            if self.num_pages is not None and self.num_pages != self.num_gpu_blocks_override:
                raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override} and num_pages={self.num_pages}: "
                                 f"two names of one setting, give one")
            set_("num_pages", self.num_gpu_blocks_override)
            set_("num_gpu_blocks_override", None)  # folded into num_pages, the one field read
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: need at least 2 (page 0 is the scratch page)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected a fraction in (0, 1] "
                             f"of each device's memory")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: expected 'recompute' or 'swap'")
        if self.lm_head_parallel not in LM_HEAD_PARALLEL:
            raise ValueError(f"lm_head_parallel={self.lm_head_parallel!r}: expected one of {LM_HEAD_PARALLEL}")
        for field in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        if self.num_prefix_states is not None and (not isinstance(self.num_prefix_states, int) or self.num_prefix_states < 0):
            raise ValueError(f"num_prefix_states={self.num_prefix_states!r} must be an int >= 0")
        set_("max_num_seqs", min(self.max_num_seqs, self.max_num_batched_tokens))  # a sequence needs a token
        self._check_kv_offloading()
        self._check_runner()
        self._check_kv_eviction()
        if isinstance(self.speculative_config, dict) or self.speculative_config is None:
            set_("speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.enable_lora:
            for field in ("max_loras", "max_lora_rank"):
                if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                    raise ValueError(f"{field}={getattr(self, field)!r} must be an integer >= 1")

    def _check_runner(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r}: expected one of {RUNNERS}")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to runner='pooling'")
            return
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError(f"pooler_config={self.pooler_config!r}: expected a dict with 'pooling_type' and / or 'normalize'")
        refused = [(self.speculative_config is not None, "speculative_config (nothing is generated)"),
                   (self.enable_lora, "enable_lora"), (self.kv_offloading_size is not None, "kv_offloading_size"),
                   (self.sequence_parallel_size > 1, "sequence_parallel_size > 1")]
        for at_fault, setting in refused:
            if at_fault:
                raise ValueError(f"runner='pooling' with {setting} is not supported")

    def _check_kv_eviction(self) -> None:
        """The KV eviction settings, alone and against the other settings (the model: `with_kv_eviction`)."""
        method = self.kv_eviction
        given = [name for name in ("kv_eviction_window", "kv_eviction_sink_tokens", "kv_eviction_heavy_tokens")
                 if getattr(self, name) is not None]
        if method is None:
            if given:
                raise ValueError(f"{given[0]}={getattr(self, given[0])!r} without kv_eviction: set kv_eviction="
                                 f"'streaming' or 'h2o'")
            return
        if method not in KV_EVICTION_METHODS:
            raise ValueError(f"kv_eviction={method!r}: expected None, 'streaming' (StreamingLLM's attention sinks) or 'h2o' "
                             f"(heavy hitters)")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        other = "kv_eviction_heavy_tokens" if method == "streaming" else "kv_eviction_sink_tokens"
        if getattr(self, other) is not None:
            raise ValueError(f"{other}={getattr(self, other)!r} does not apply to kv_eviction={method!r}")
        if self.kv_eviction_window is None:
            raise ValueError(f"kv_eviction={method!r} needs kv_eviction_window: the recent tokens every query sees (its own included)")
        if method == "streaming" and self.kv_eviction_sink_tokens is None:
            set_("kv_eviction_sink_tokens", 4)
        if method == "h2o" and self.kv_eviction_heavy_tokens is None:
            set_("kv_eviction_heavy_tokens", self.kv_eviction_window)
        for name, least in (("kv_eviction_window", 1), ("kv_eviction_sink_tokens", 0), ("kv_eviction_heavy_tokens", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name}={value!r}: expected an integer >= {least}")
        named_kv = self.kv_cache_dtype not in (None, "auto")
        refused = [(self.kernels.pallas, f"kernel_impl={self.kernel_impl!r} (the Pallas attention kernels have no KV eviction: "
                                         f"its attention runs on the XLA path; use kernel_impl='reference')"),
                   (named_kv and is_quantized(dtype_of(self.kv_cache_dtype, "kv_cache_dtype", KV_DTYPES)),
                    f"kv_cache_dtype={self.kv_cache_dtype!r} (it reads float K and V pools)"),
                   (self.kv_cache_outliers > 0, f"kv_cache_outliers={self.kv_cache_outliers}"),
                   (self.enable_lora, "enable_lora"),
                   (self.speculative_config is not None, "speculative_config (a draft's rollback and H2O's slots do not mix)"),
                   (self.sequence_parallel_size > 1, "sequence_parallel_size > 1"),
                   (self.preemption_mode == "swap", "preemption_mode='swap' (use 'recompute')"),
                   (self.kv_offloading_size is not None, "kv_offloading_size (the KV tiers keep prefix-cache pages)"),
                   (self.runner != "generate", f"runner={self.runner!r}")]
        for at_fault, setting in refused:
            if at_fault:
                raise ValueError(f"kv_eviction={method!r} with {setting} is not supported")

    def with_kv_eviction(self, model_config: ModelConfig) -> ModelConfig:
        """The model's config with this engine's KV eviction (`ModelConfig.kv_eviction`), after
        checking the model: full attention in every layer (no sliding, chunked, latent, linear or
        KV-shared layers, no learned sinks) with a RoPE table linear in the position (or none)."""
        if self.kv_eviction is None:
            return model_config
        c, what = model_config, f"kv_eviction={self.kv_eviction!r}"
        kinds = c.layer_kinds()
        refused = [(c.is_mla, "multi-head latent attention (MLA)"),
                   (c.has_linear_layers, "Gated DeltaNet (linear attention) layers"),
                   (any(k.window is not None or k.chunk is not None for k in kinds), "sliding-window or chunked layers"),
                   (c.kv_shared_layers > 0, "KV-shared layers"),
                   (c.attention_sinks, "learned attention sinks"),
                   (len({(c.kind_head_dim(k), c.kind_kv_heads(k)) for k in kinds}) > 1, "layers of several K/V shapes"),
                   (any(k.rope == "local" for k in kinds), "a second RoPE table"),
                   (c.mrope_section is not None, "M-RoPE"),
                   (c.rope_scaling.rope_type not in KV_EVICTION_ROPE_TYPES,
                    f"rope_type {c.rope_scaling.rope_type!r} (its angles change with the sequence's length; supported: "
                    f"{', '.join(KV_EVICTION_ROPE_TYPES)})")]
        for at_fault, feature in refused:
            if at_fault:
                raise ValueError(f"{what}: {c.model_type}'s {feature} are not supported; it runs full-attention "
                                 f"(Llama-family) models")
        keep = self.kv_eviction_sink_tokens if self.kv_eviction == "streaming" else self.kv_eviction_heavy_tokens
        return dataclasses.replace(c, kv_eviction=KVEviction(self.kv_eviction, keep, self.kv_eviction_window))

    def _check_kv_offloading(self) -> None:
        """The KV tiers' settings (engine/kv_tiers.py), alone and against the others."""
        for field in ("kv_offloading_size", "kv_offloading_disk_size"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
                                      or value == float("inf")):
                raise ValueError(f"{field}={value!r}: expected a size in GiB (a number >= 0; None or 0: off for "
                                 f"kv_offloading_size, unbounded for kv_offloading_disk_size)")
        if not self.kv_offloading_size:
            object.__setattr__(self, "kv_offloading_size", None)
        if self.kv_offloading_disk_size == 0:
            object.__setattr__(self, "kv_offloading_disk_size", None)
        if self.kv_offloading_dir is not None and self.kv_offloading_size is None:
            raise ValueError(f"kv_offloading_dir={str(self.kv_offloading_dir)!r}: the disk tier sits behind the host tier; "
                             f"give kv_offloading_size (GiB of host memory) too")
        if self.kv_offloading_disk_size is not None and self.kv_offloading_dir is None:
            raise ValueError(f"kv_offloading_disk_size={self.kv_offloading_disk_size}: bounds the disk tier, which needs "
                             f"kv_offloading_dir")
        if self.kv_offloading_size is None:
            return
        if not self.enable_prefix_caching:
            raise ValueError(f"kv_offloading_size={self.kv_offloading_size}: the KV tiers keep prefix-cache pages; "
                             f"it needs enable_prefix_caching=True")
        if self.kv_offloading_dir is not None and self.enable_lora:
            raise ValueError(f"kv_offloading_dir with enable_lora: an adapter's pages are keyed by its lora_int_id, which "
                             f"another process may give another adapter; use the host tier alone (kv_offloading_size)")

    # ------------------------------------------------------------------ what follows from the settings
    @property
    def param_dtype(self):
        return dtype_of(self.dtype)

    @property
    def keeps_checkpoint_quantization(self) -> bool:
        """Whether matrices a checkpoint stores quantized (GGUF blocks, GPTQ, AWQ, compressed-
        tensors) run in their own grid rather than dequantized at load. Asked for explicitly, or
        by default on TPU / GPU when no dtype or quantization of our own is given. Not by default
        on the CPU: XLA:CPU has no fused dequantizing matmul, every step writes each matrix out
        as float32 before its dot (measured on SmolLM2 Q4_1, 2 cores: decode 109 vs 29 ms per
        step at batch 1, 200 vs 105 at batch 32, scripts/bench_step.py --dtypes float32,gguf)."""
        if self.keep_checkpoint_quantization is not None:
            return self.keep_checkpoint_quantization
        return self.dtype == "auto" and self.quantization is None and jax.default_backend() != "cpu"

    @property
    def keeps_w8a8_checkpoint(self) -> bool:
        """Whether a W8A8 checkpoint's matrices (compressed-tensors int-quantized: int8 weights and
        activations, SmoothQuant's) run as stored even where other grids are dequantized: on every
        backend by default (no float copy is made for its int8 x int8 dot; on the CPU it is the
        fastest matmul, as the w8a8 mode is), unless keep_checkpoint_quantization=False, a dtype or
        a quantization of our own is given."""
        return self.keep_checkpoint_quantization is not False and self.dtype == "auto" and self.quantization is None

    @property
    def activation_dtype(self):
        return dtype_of(self.compute_dtype) or (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)

    @property
    def kv_dtype(self):
        return dtype_of(self.kv_cache_dtype, "kv_cache_dtype", KV_DTYPES) or self.activation_dtype

    @property
    def kernels(self) -> Kernels:
        return resolve_kernels(self.kernel_impl, xla=self.xla_kernels)

    def kv_page_factors(self, model_config: ModelConfig) -> tuple[int, ...]:
        """Per KV layer group: how many times page_size tokens its pages hold on this engine's mesh
        and pool layout (jaxinfer.ops.kv_cache.page_factors)."""
        return page_factors(kv_groups(model_config), tp=self.tensor_parallel_size, combined=self.kernels.combines_kv)

    def parallel(self, model_config: ModelConfig) -> ParallelConfig:
        """The mesh sizes, checked against the model. Without an expert_parallel_size,
        enable_expert_parallel turns the data-parallel replicas into expert-parallel ones (as vLLM)."""
        ep, dp = self.expert_parallel_size, self.data_parallel_size
        if ep is None:
            ep, dp = (dp, 1) if self.enable_expert_parallel else (1, dp)
        if ep > 1 and not model_config.is_moe:
            raise ShardingError(f"expert parallelism (size {ep}) needs a mixture-of-experts model; "
                                f"{model_config.model_type} has no experts")
        parallel = ParallelConfig(dp=dp, tp=self.tensor_parallel_size, sp=self.sequence_parallel_size, ep=ep,
                                  sp_attention=self.sequence_parallel_attention, pp=self.pipeline_parallel_size)
        parallel.check_model(model_config)
        return parallel

    @property
    def pool_sized_by(self) -> str:
        """Which setting decides the KV pool's size (see engine/memory.py)."""
        if self.num_pages is not None:
            return "num_gpu_blocks_override"
        if self.kv_cache_memory_bytes is not None:
            return f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}"
        if jax.default_backend() == "cpu":
            return f"the CPU's default of {CPU_KV_CACHE_MEMORY_BYTES >> 20} MiB"
        return f"gpu_memory_utilization={self.gpu_memory_utilization}"

    def resolved(self, model_config: ModelConfig) -> "EngineConfig":
        """This config with what depends on the model filled in: max_model_len and num_pages (per
        replica: as given, or what kv_cache_memory_bytes holds (the CPU's default
        CPU_KV_CACHE_MEMORY_BYTES), at most every sequence at max_model_len). On a TPU or GPU
        with neither given num_pages stays None: build_engine sizes the pool from the devices'
        memory once the weights are placed (gpu_memory_utilization)."""
        model_config = self.with_kv_eviction(model_config)  # (checks the model; build_engine runs the model with it)
        max_model_len = self.max_model_len if self.max_model_len is not None else model_config.max_position_embeddings
        if not 0 < max_model_len <= model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {model_config.max_position_embeddings}] "
                             f"(the model's max_position_embeddings)")
        self._check_lm_head_parallel(model_config)
        if self.kv_cache_outliers:
            check_outliers(self.kv_cache_outliers, self.page_size, self.kv_dtype, kernels=self.kernels, config=model_config)
        if model_config.index_topk and is_quantized(self.kv_dtype):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} with {model_config.model_type}'s sparse attention, which "
                             "reads a float latent pool; leave kv_cache_dtype at 'auto'")
        # KV eviction: no prefix caching (H2O rewrites its kept pages; block_manager)
        enable_prefix_caching, num_prefix_states = self.enable_prefix_caching and self.kv_eviction is None, 0
        if model_config.has_linear_layers:  # its prefix hits resume saved recurrent states (engine.block_manager)
            self._check_linear_attention(model_config)
            num_prefix_states = self.max_num_seqs if self.num_prefix_states is None else self.num_prefix_states
            enable_prefix_caching = enable_prefix_caching and num_prefix_states > 0
            num_prefix_states *= enable_prefix_caching
        groups = kv_groups(model_config)
        if self.kv_offloading_size is not None and (model_config.has_linear_layers or groups.windows != (None,)):
            kind = ("Gated DeltaNet (linear attention) layers, whose prefix hits also need recurrent states"
                    if model_config.has_linear_layers else "sliding-window or chunked layers, whose pages are given back as the window moves")
            raise ValueError(f"kv_offloading_size with {model_config.model_type}'s {kind}: the KV tiers keep one "
                             f"full-attention page per prefix key; not supported yet")
        if self.preemption_mode == "swap" and groups.windows != (None,):
            raise ValueError(f"preemption_mode='swap' with {model_config.model_type}'s sliding-window or chunked layers: their "
                             f"pages are given back as the window moves, and swapping keeps one full page-table row; use "
                             f"preemption_mode='recompute'")
        pages_per_seq = groups.pages_held(max_model_len, self.page_size, self.max_num_batched_tokens,
                                          self.kv_page_factors(model_config))
        num_pages = self.num_pages
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and jax.default_backend() == "cpu":
            kv_bytes = CPU_KV_CACHE_MEMORY_BYTES
        if num_pages is None and kv_bytes is not None:
            page_bytes = KVCache.page_bytes(model_config, self.page_size, self.kv_dtype, tp=self.tensor_parallel_size,
                                            kernels=self.kernels, outliers=self.kv_cache_outliers)
            context = self.sequence_parallel_size if self.sequence_parallel_attention == "context" else 1  # (pool shards)
            num_pages = pages_for_bytes(kv_bytes, page_bytes, self.max_num_seqs * pages_per_seq + 1, context)
        return dataclasses.replace(self, max_model_len=max_model_len, num_pages=num_pages,
                                   enable_prefix_caching=enable_prefix_caching, num_prefix_states=num_prefix_states)

    def _check_lm_head_parallel(self, model_config: ModelConfig) -> None:
        """What lm_head_parallel="vocab" does not run with yet."""
        tp, spec = self.tensor_parallel_size, self.speculative_config
        if self.lm_head_parallel != "vocab" or tp == 1:
            return
        refused = [(model_config.vocab_size % tp, f"tensor_parallel_size={tp}, which does not divide the vocabulary "
                                                  f"({model_config.vocab_size} tokens)"),
                   (spec is not None and spec.method not in ("ngram", "draft_model"),
                    f"speculative_config method {getattr(spec, 'method', None)!r} (its heads read the target's LM head "
                    "whole; ngram and draft_model work)"),
                   (self.pipeline_parallel_size > 1, "pipeline_parallel_size > 1")]
        for at_fault, setting in refused:
            if at_fault:
                raise ValueError(f"lm_head_parallel='vocab' with {setting} is not supported yet; use lm_head_parallel='hidden'")

    def _check_linear_attention(self, model_config: ModelConfig) -> None:
        """What a hybrid model's recurrent states (Gated DeltaNet layers) do not run with yet."""
        what = f"{model_config.model_type}'s Gated DeltaNet (linear attention) layers"
        spec = self.speculative_config
        refused = [(spec is not None and spec.method == "draft_model" and spec.model is None,
                    "speculative_config method 'draft_model' drafting with the model itself (a draft model cannot roll "
                    "back recurrent states yet; ngram, eagle and medusa speculation, or a full-attention draft model, work)"),
                   (self.enable_lora, "enable_lora"),
                   (is_quantized(self.kv_dtype), f"kv_cache_dtype={self.kv_cache_dtype!r}"),
                   (self.sequence_parallel_size > 1, "sequence_parallel_size > 1"),
                   (model_config.linear_key_heads % self.tensor_parallel_size, f"tensor_parallel_size="
                    f"{self.tensor_parallel_size} (it must divide the {model_config.linear_key_heads} linear key heads)")]
        for at_fault, setting in refused:
            if at_fault:
                raise ValueError(f"{setting} with {what} is not supported yet")

    def buckets(self, parallel: ParallelConfig, num_groups: int = 1) -> Buckets:
        """The shape buckets every step is padded to (a resolved config), with a page-table row for
        each of the model's `num_groups` KV layer groups (jaxinfer.kv_groups)."""
        spec = self.speculative_config
        return Buckets.default(self.max_num_batched_tokens, self.max_num_seqs, -(-self.max_model_len // self.page_size),
                               token_multiple=parallel.token_multiple, spec_block=spec.spec_block if spec else 0,
                               num_groups=num_groups)

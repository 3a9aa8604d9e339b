"""The offline API, in vLLM's shape: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat()`."""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import Buckets
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.model_runner import ModelRunner
from jaxinfer.engine.spec_decode import SpeculativeConfig
from jaxinfer.kernels import resolve_kernels
from jaxinfer.kv_cache import KVCache
from jaxinfer.loading import load_params, read_config, resolve_model
from jaxinfer.outputs import RequestOutput
from jaxinfer.quantization import INT4_GROUP_SIZES, MODES, quantize_model
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.startup import PhaseClock
from jaxinfer.step import kv_partition_spec, param_partition_specs, put_global
from jaxinfer.tokenizer import cache_root, load_tokenizer
from sharding.mesh import ParallelConfig, ShardingError, make_mesh

if TYPE_CHECKING:
    from jaxinfer.beam_search import BeamSearchParams

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

PromptType = str | Sequence[int] | dict


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def _dtype(name, what: str):
    if name is None:
        return None
    if not isinstance(name, str):
        return jnp.dtype(name).type
    if name == "auto":
        return jnp.float32 if _on_cpu() else jnp.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"{what}={name!r}: expected one of 'auto', {', '.join(map(repr, _DTYPES))}")
    return _DTYPES[name]


def enable_compilation_cache(path: str | os.PathLike | None = None) -> None:
    """Turns on JAX's persistent compilation cache (unless the user configured one already)."""
    if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    jax.config.update("jax_compilation_cache_dir", str(path or cache_root() / "xla"))
    # Every program, however quick to compile: a warm start then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _parallel_config(tp, dp, sp, ep, enable_expert_parallel, sp_attention, config) -> ParallelConfig:
    """The mesh sizes from LLM's vLLM-style arguments, checked against the model."""
    if ep is None:
        ep, dp = (dp, 1) if enable_expert_parallel else (1, dp)
    if ep > 1 and not config.is_moe:
        raise ShardingError(f"expert parallelism (size {ep}) needs a mixture-of-experts model; {config.model_type} has no experts")
    parallel = ParallelConfig(dp=dp, tp=tp, sp=sp, ep=ep, sp_attention=sp_attention)
    parallel.check_model(config)
    return parallel


def _first_layers(graphdef, params, config, num_layers: int, llm: "LLM"):
    """(graphdef, params, config) of a model made of the first num_layers layers of another (the
    same embedding, final norm and LM head): self-speculation's draft."""
    import dataclasses

    from flax import nnx

    from jaxinfer.loading import abstract_model
    from jaxinfer.models.llama import flat_to_nested, nested_to_flat

    truncated = dataclasses.replace(config, num_layers=num_layers)
    flat = nested_to_flat(nnx.to_pure_dict(params))
    flat = {name: jax.tree.map(lambda a: a[:num_layers], value) if name.startswith("layers.") else value
            for name, value in flat.items()}
    new_graphdef, state = abstract_model(truncated, llm.param_dtype, llm.compute_dtype, llm.kernels, llm.parallel)
    nnx.replace_by_pure_dict(state, flat_to_nested(flat))
    return new_graphdef, state, truncated


def _check_quantized_split(config, tp: int, mode: str, group_size: int) -> None:
    """int4 groups run along a weight's input dim: a row-parallel weight (o, down, LM head) split
    over tp shards needs each shard's rows to be whole groups."""
    if tp == 1 or mode != "int4":
        return
    for what, rows in (("o_proj", config.num_heads * config.head_dim), ("down_proj", config.intermediate_size),
                       ("lm_head", config.hidden_size)):
        if (rows // tp) % group_size:
            raise ShardingError(
                f"quantization='int4' with tensor_parallel_size={tp}: {what} has {rows} input rows, {rows // tp} per shard, "
                f"not a multiple of quantization_group_size={group_size}; use int8 / fp8 or a smaller group size"
            )


class LLM:
    """An LLM with its paged KV cache, ready to generate.

    Args:
      model: None (the embedded SmolLM2-135M-Instruct), an HF folder, a .gguf file, or a folder
        written by `jaxinfer convert`.
      dtype: parameter (and matmul input) dtype: "auto" (float32 on CPU, bfloat16 on TPU/GPU),
        "float32", "bfloat16", "float16".
      compute_dtype: dtype of activations, norms and the residual stream (default: float32 on
        CPU, where bfloat16 elementwise work is slow, bfloat16 elsewhere).
      kv_cache_dtype: dtype of the KV pages (default: compute_dtype).
      quantization: weight-only quantization of the matmul weights after loading: None / "none",
        "int8" (per output channel), "int4" (per group of `quantization_group_size` input rows,
        packed two per byte) or "fp8" (e4m3, per output channel). The embedding stays in `dtype`.
      quantization_group_size: int4 group size, 32, 64 or 128.
      attention_impl: "auto" (Pallas kernels on TPU and GPU, the XLA reference paths on the CPU),
        "reference", "pallas" (on the CPU: the TPU kernels in interpret mode, slow), or
        "pallas-tpu" / "pallas-gpu" to pick a platform's kernels (interpret mode elsewhere). Covers
        attention and the quantized matmul; see jaxinfer.kernels.
      max_model_len: longest prompt + output (default: the model's max_position_embeddings).
      page_size: tokens per KV page. num_pages: pages in each replica's pool (default: what fits
        in kv_cache_memory_bytes per replica, 1 GiB unless given; with tensor parallelism each
        device holds 1 / tp of it).
      tensor_parallel_size / data_parallel_size / sequence_parallel_size / expert_parallel_size:
        the device mesh (sharding.mesh; vLLM's names where vLLM has them). Tensor: Megatron
        sharding of heads and MLP. Data: independent replicas, each with its own KV pages, the
        requests balanced over them. Sequence: a step's tokens split over devices (long
        prefills), `sequence_parallel_attention` "allgather" or "ring". Expert (MoE models):
        experts split over devices, tokens dispatched with all_to_all; the expert axis is also
        data parallel for attention. `enable_expert_parallel=True` without an
        expert_parallel_size turns the data-parallel replicas into expert-parallel ones, as in
        vLLM (ep = data_parallel_size). The mesh spans every process's devices (call
        `sharding.mesh.initialize_distributed` first on several hosts; every process then runs
        the same `LLM` calls in lockstep).
      max_num_batched_tokens / max_num_seqs: per-step token and sequence budgets; the token
        budget is also the largest shape bucket.
      enable_prefix_caching: share the KV pages of common prompt prefixes (on by default).
      preemption_mode: when the KV pool runs dry, "recompute" a preempted sequence's cache on
        readmission (default) or "swap" its pages to host memory and back.
      log_stats_interval: seconds between engine stats lines on the "jaxinfer" logger (None: off).
      seed: seeds the per-request seeds of requests that give none.
      warmup: compile every shape bucket now rather than on first use.
      speculative_config: speculative decoding, as vLLM configures it: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} (see
        jaxinfer.engine.spec_decode). Output stays exactly the target model's: token for token
        under greedy decoding, in distribution under sampling.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "auto",
        compute_dtype: str | None = None,
        kv_cache_dtype: str | None = None,
        quantization: str | None = None,
        quantization_group_size: int = 128,
        attention_impl: str = "auto",
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        max_logprobs: int = 20,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        log_stats_interval: float | None = None,
        seed: int = 0,
        warmup: bool = False,
        progress: bool = True,
        compilation_cache_dir: str | os.PathLike | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        sequence_parallel_size: int = 1,
        expert_parallel_size: int | None = None,
        enable_expert_parallel: bool = False,
        sequence_parallel_attention: str = "allgather",
        speculative_config: dict | None = None,
    ):
        enable_compilation_cache(compilation_cache_dir)
        clock = PhaseClock()
        self.source = resolve_model(model)
        self.config = config = read_config(self.source)
        self.param_dtype = _dtype(dtype, "dtype")
        self.compute_dtype = _dtype(compute_dtype, "compute_dtype") or (jnp.float32 if _on_cpu() else jnp.bfloat16)
        self.kv_cache_dtype = _dtype(kv_cache_dtype, "kv_cache_dtype") or self.compute_dtype
        if _on_cpu() and self.param_dtype != jnp.float32:
            warnings.warn(
                f"dtype={jnp.dtype(self.param_dtype).name} on the CPU: XLA:CPU runs small-batch 16-bit matmuls "
                "several times slower than float32 (scripts/bench_step.py shows it); use it to save memory, not time",
                stacklevel=2,
            )

        if quantization == "none":
            quantization = None
        if quantization not in (None, *MODES):
            raise ValueError(f"quantization={quantization!r}: expected 'none', {', '.join(map(repr, MODES))}")
        if quantization == "int4" and quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size={quantization_group_size!r}: expected one of {INT4_GROUP_SIZES}")
        self.quantization = quantization
        self.kernels = resolve_kernels(attention_impl)
        self.speculative_config = spec = SpeculativeConfig.from_dict(speculative_config)
        self.parallel = parallel = _parallel_config(
            tensor_parallel_size, data_parallel_size, sequence_parallel_size, expert_parallel_size,
            enable_expert_parallel, sequence_parallel_attention, config,
        )
        self.mesh = make_mesh(parallel)

        if max_model_len is None:
            max_model_len = config.max_position_embeddings
        if not 0 < max_model_len <= config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} must be in [1, {config.max_position_embeddings}] "
                f"(the model's max_position_embeddings)"
            )
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.max_model_len = max_model_len
        pages_per_seq = -(-max_model_len // page_size)
        if num_pages is None:  # per replica
            itemsize = jnp.dtype(self.kv_cache_dtype).itemsize
            kv_shape = KVCache.shape(config, 1, page_size, self.kv_cache_dtype, tp=parallel.tp, kernels=self.kernels)
            page_bytes = 2 * math.prod(kv_shape) * itemsize
            num_pages = max(2, min(kv_cache_memory_bytes // page_bytes, max_num_seqs * pages_per_seq + 1))
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the scratch page)")
        max_num_seqs = min(max_num_seqs, max_num_batched_tokens)

        clock.mark("config")
        # The tokenizer (mostly importing transformers) loads in a thread while the weights load.
        tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-tokenizer")
        tokenizer_future = tokenizer_thread.submit(_timed, load_tokenizer, self.source)
        tokenizer_thread.shutdown(wait=False)
        graphdef, params = load_params(
            self.source, config, self.param_dtype, self.compute_dtype, kernels=self.kernels, parallel=parallel,
            mesh=self.mesh, progress=progress,
        )
        if quantization is not None:
            _check_quantized_split(config, parallel.tp, quantization, quantization_group_size)
            graphdef, params = quantize_model(graphdef, params, quantization, quantization_group_size)
        param_specs = param_partition_specs(params, config)
        params = put_global(params, param_specs, self.mesh)  # quantized weights: onto their shards
        clock.mark("weights")
        self.tokenizer, self.tokenizer_seconds = tokenizer_future.result()
        clock.mark("tokenizer (what it took beyond the weights)")
        kv_sharding = jax.sharding.NamedSharding(self.mesh, kv_partition_spec().k)
        kv = KVCache.create(config, num_pages * parallel.num_replicas, page_size, self.kv_cache_dtype, tp=parallel.tp,
                            sharding=kv_sharding, kernels=self.kernels)
        self.buckets = Buckets.default(max_num_batched_tokens, max_num_seqs, pages_per_seq, token_multiple=parallel.sp,
                                       spec_block=spec.spec_block if spec else 0)
        self.runner = ModelRunner(graphdef, params, kv, self.buckets, num_top_logprobs=max_logprobs, mesh=self.mesh,
                                  param_specs=param_specs, return_hidden=spec is not None and spec.method in ("eagle", "medusa"))
        self._draft_geometry = dict(num_pages=num_pages * parallel.num_replicas, page_size=page_size, kv_sharding=kv_sharding,
                                    group_size=quantization_group_size, progress=progress)
        proposer = self.make_proposer(spec) if spec is not None else None
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine = LLMEngine(
            self.runner,
            self.tokenizer,
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            eos_token_ids=sorted(eos),
            max_logprobs=max_logprobs,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            seed=seed,
            log_stats_interval=log_stats_interval,
            speculative_config=spec,
            proposer=proposer,
        )
        clock.mark("KV cache and engine")
        self.load_seconds = time.perf_counter() - clock.t0
        if warmup:
            self.runner.warmup()
            clock.mark("warmup (compiling every bucket)")
        # Seconds per phase of this constructor (config, weights, tokenizer, KV cache and engine, warmup);
        # tokenizer_seconds is the tokenizer's own time, spent in a thread beside the weights.
        self.startup_seconds = clock.phases

    def make_proposer(self, spec: SpeculativeConfig | dict):
        """The proposer of a speculative_config for this model (see jaxinfer.engine.spec_decode)."""
        from jaxinfer.engine.spec_decode import make_proposer

        spec = SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
        if spec.method == "draft_model":
            return make_proposer(spec, self.make_draft_runner(spec))
        if spec.method in ("eagle", "medusa"):
            from jaxinfer.engine.draft_head import DraftHeadProposer
            from jaxinfer.models.draft_heads import load_heads

            if not self.runner.step_fn.return_hidden:
                raise ValueError(f"speculative_config: method {spec.method!r} reads the target's hidden states, which this "
                                 f"LLM's step does not return; build the LLM with a speculative_config of method {spec.method!r}")
            heads = load_heads(spec.model, self.config.hidden_size, kind=spec.method)
            params = self.runner.params
            tied = self.config.tie_word_embeddings
            embed = params["embed"].get_value()
            proposer = DraftHeadProposer(heads, embed if tied else params["lm_head"].get_value(), tied, embed,
                                         confidence_threshold=spec.draft_confidence_threshold)
            if proposer.max_k < spec.num_speculative_tokens:
                raise ValueError(f"speculative_config: num_speculative_tokens={spec.num_speculative_tokens} but "
                                 f"{spec.model} has {proposer.max_k} heads")
            return proposer
        return make_proposer(spec)

    def make_draft_runner(self, spec: SpeculativeConfig | dict) -> ModelRunner:
        """The draft model of speculative decoding (method "draft_model") on the target's mesh and
        buckets, with a KV pool of the target's page geometry: another model, or the target (here
        already loaded) truncated to its first `num_layers` layers and / or quantized."""
        spec = SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
        g = self._draft_geometry
        num_pages, page_size, kv_sharding, group_size, progress = (
            g["num_pages"], g["page_size"], g["kv_sharding"], g["group_size"], g["progress"])
        config, graphdef, params = self.config, self.runner.graphdef, self.runner.params
        if spec.model is not None:
            source = resolve_model(spec.model)
            config = read_config(source)
            if config.vocab_size != self.config.vocab_size:
                raise ValueError(
                    f"speculative_config['model']={spec.model!r}: vocabulary of {config.vocab_size} tokens, the target's has "
                    f"{self.config.vocab_size}; a draft model must share the target's tokenizer"
                )
            graphdef, params = load_params(source, config, self.param_dtype, self.compute_dtype, kernels=self.kernels,
                                           parallel=self.parallel, mesh=self.mesh, progress=progress)
        if spec.num_layers is not None:
            if spec.num_layers >= config.num_layers:
                raise ValueError(f"speculative_config['num_layers']={spec.num_layers}: the model has only {config.num_layers} layers")
            graphdef, params, config = _first_layers(graphdef, params, config, spec.num_layers, self)
        if spec.quantization is not None:
            graphdef, params = quantize_model(graphdef, params, spec.quantization, group_size)
        param_specs = param_partition_specs(params, config)
        params = put_global(params, param_specs, self.mesh)
        kv = KVCache.create(config, num_pages, page_size, self.kv_cache_dtype, tp=self.parallel.tp, sharding=kv_sharding,
                            kernels=self.kernels)
        return ModelRunner(graphdef, params, kv, self.buckets, num_top_logprobs=1, mesh=self.mesh, param_specs=param_specs)

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for one prompt or a list of them.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt.
        Every prompt is checked before any work starts; a bad one raises ValueError naming it.
        """
        prompts, params = self._pair(prompts, sampling_params)
        request_ids = self._add_requests(prompts, params)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", leave=False)
        while len(finished) < len(request_ids):
            for out in self.engine.step():
                if out.finished and out.request_id in request_ids:
                    finished[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [finished[r] for r in request_ids]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: "BeamSearchParams") -> list:
        """Beam search over the engine (see jaxinfer.beam_search); returns one BeamSearchOutput per prompt."""
        from jaxinfer.beam_search import beam_search

        prompts, _ = self._pair(prompts, None)
        return beam_search(self, prompts, params)

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ):
        """Like `generate`, but yields each RequestOutput as it advances (text so far, finished flag),
        so callers can print tokens as they come. Stopping the iteration aborts what is left."""
        prompts, params = self._pair(prompts, sampling_params)
        request_ids = set(self._add_requests(prompts, params))
        remaining = set(request_ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.request_id in request_ids:
                        if out.finished:
                            remaining.discard(out.request_id)
                        yield out
        finally:
            for request_id in remaining:
                self.engine.abort_request(request_id)

    def _pair(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return prompts, params

    def _add_requests(self, prompts: list, params: list[SamplingParams]) -> list[str]:
        """Checks every prompt first (a bad one raises ValueError naming its index, before any
        work), then queues them all."""
        tokenized = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self.engine.tokenize(prompt, f"prompt {i}")
            self.engine.validate(ids, p, f"prompt {i}")
            tokenized.append({"prompt": text, "prompt_token_ids": ids})
        return [self.engine.add_request(None, t, p).request_id for t, p in zip(tokenized, params)]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of {"role", "content"}
        dicts) or a list of conversations, and generates the assistant's replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> dict:
        """One conversation rendered by the chat template, as a prompt `generate` and `stream` take:
        {"prompt": text, "prompt_token_ids": ids}."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
        )
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

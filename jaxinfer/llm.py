"""The offline API, in vLLM's shape: `LLM(model).generate(prompts, SamplingParams(...))` and `.chat()`."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxinfer.beam_search import BeamSearchParams, beam_search
from jaxinfer.engine.build import build_draft_runner, build_engine, make_proposer
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.model_runner import ModelRunner
from jaxinfer.engine.multimodal import split_images
from jaxinfer.engine.pooling import cosine
from jaxinfer.engine.spec_decode import SpeculativeConfig
from jaxinfer.generation_defaults import generation_defaults
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import (PoolingRequestOutput, RequestFailedError, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.startup import PhaseClock
from jaxinfer.tokenizer import cache_root

PromptType = str | Sequence[int] | dict


def enable_compilation_cache(path: str | os.PathLike | None = None) -> None:
    """Turns on JAX's persistent compilation cache (unless the user configured one already)."""
    if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    jax.config.update("jax_compilation_cache_dir", str(path or cache_root() / "xla"))
    # Every program, however quick to compile: a warm start then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


class LLM:
    """An LLM with its paged KV cache, ready to generate.

    Args:
      model: None (the embedded SmolLM2-135M-Instruct), an HF folder, a .gguf file, a folder
        written by `jaxinfer convert`, or a Hugging Face Hub id that is no local path: "org/name"
        (its configs, tokenizer and safetensors) or "org/name:file.gguf" (one file of a GGUF
        repository), from huggingface_hub's cache or downloaded into it (HF_HUB_OFFLINE=1: the
        cache alone; gated models through HF_TOKEN or `hf auth login`; jaxinfer.runtime.hub).
      revision: a Hub id's branch, tag or commit (default: main).
      dtype: parameter (and matmul input) dtype: "auto" (float32 on CPU, bfloat16 on TPU/GPU),
        "float32", "bfloat16", "float16".
      compute_dtype: dtype of activations, norms and the residual stream (default: float32 on
        CPU, where bfloat16 elementwise work is slow, bfloat16 elsewhere).
      kv_cache_dtype: dtype of the KV pages (default: compute_dtype).
      kv_cache_outliers: with kv_cache_dtype "int8" / "fp8", R residual slots per page: a token
        whose rows quantize among the worst of its last page_size tokens (and the first token of a
        sequence) keeps its quantization error in bfloat16, added back when attended (default 0:
        off; the XLA attention reads them, not the TPU kernels; jaxinfer.ops.kv_cache).
      quantization: weight-only quantization of the matmul weights after loading (round to
        nearest): None / "none", "int8" (per output channel, or per group of
        `quantization_group_size` input rows), "int4" (per group, packed two per byte) or "fp8"
        (e4m3, per output channel). The embedding stays in `dtype`.
      quantization_group_size: groups of input rows sharing a scale: int4 32, 64 or 128 (default
        128); int8 16..128 (default: one scale per output column).
      quantization_symmetric: False: a scale and an offset per group (int4, grouped int8).
      keep_checkpoint_quantization: run the matrices a checkpoint stores quantized (GGUF blocks,
        GPTQ, AWQ, compressed-tensors) in their own integer grid, no float copy made (True), or
        dequantize them at load (False). Default: on TPU / GPU yes, unless a dtype or quantization
        is given; on the CPU no (XLA:CPU dequantizes a whole matrix to float32 before every dot,
        which makes a Q4_1 decode step 3.8x slower than the float one), except W8A8 checkpoints
        (compressed-tensors int-quantized, `jaxinfer quantize --method smoothquant`): their int8 x
        int8 matmul makes no float copy, so they run as stored on every backend unless False. A
        sparse-24-bitmask checkpoint's 2:4 projections are kept compressed the same way (True:
        values + bitmask, the 2:4 matmul kernel on TPU / GPU; jaxinfer.ops.sparsity).
      kernel_impl (alias attention_impl): "auto" (Pallas kernels on TPU and GPU, the XLA paths on
        the CPU), "reference", "pallas" (on the CPU: the TPU kernels in interpret mode, slow), or
        "pallas-tpu" / "pallas-gpu" to pick a platform's kernels (interpret mode elsewhere). Covers
        every entry of the kernel table (jaxinfer.ops.kernels): attention, RoPE + KV write, norm,
        SwiGLU and the quantized matmul.
      max_model_len: longest prompt + output (default: the model's max_position_embeddings).
      page_size: tokens per KV page. The KV pool (pages per data-parallel replica; page 0 is a
        scratch page) is, first to last: `num_pages` (alias `num_gpu_blocks_override`, vLLM's
        name); what `kv_cache_memory_bytes` holds (per replica, each tensor-parallel device 1 / tp
        of it; at most every sequence at max_model_len); on a TPU / GPU, what each device's memory
        leaves at `gpu_memory_utilization` (default 0.9; of `memory_stats()['bytes_limit']`, which
        on a GPU is XLA_PYTHON_CLIENT_MEM_FRACTION of it) after the weights and the step's
        scratch, measured by compiling the largest bucket once (jaxinfer.engine.memory); on the
        CPU, 1 GiB. The start-up log line ("jaxinfer" logger, INFO; `engine.kv_cache_summary`)
        says its pages, tokens and sequences at max_model_len.
      tensor_parallel_size / data_parallel_size / sequence_parallel_size / expert_parallel_size /
        pipeline_parallel_size: the device mesh (sharding.mesh; vLLM's names where vLLM has them).
        Pipeline: the layers split into stages, micro-batches passed stage to stage inside the
        step (jaxinfer.models.pipeline). Tensor: Megatron
        sharding of heads and MLP. Data: independent replicas, each with its own KV pages, the
        requests balanced over them. Sequence: a step's tokens split over devices (long
        prefills), `sequence_parallel_attention` "allgather" or "ring" (KV pool replicated over
        the axis) or "context" (context parallelism: the KV pool split over it). Expert (MoE models):
        experts split over devices, tokens dispatched with all_to_all; the expert axis is also
        data parallel for attention. `enable_expert_parallel=True` without an
        expert_parallel_size turns the data-parallel replicas into expert-parallel ones, as in
        vLLM (ep = data_parallel_size). The mesh spans every process's devices (call
        `sharding.mesh.initialize_distributed` first on several hosts; every process then runs
        the same `LLM` calls in lockstep).
      max_num_batched_tokens / max_num_seqs: per-step token and sequence budgets; the token
        budget is also the largest shape bucket.
      enable_prefix_caching: share the KV pages of common prompt prefixes (on by default).
      num_prefix_states: a hybrid model's (Qwen3.5, Qwen3-Next) prefix cache also needs the
        recurrent states at a hit's end: it keeps this many saved states per replica (default
        max_num_seqs; each as large as a running sequence's states; 0 turns its prefix caching off).
      preemption_mode: when the KV pool runs dry, "recompute" a preempted sequence's cache on
        readmission (default) or "swap" its pages to host memory and back.
      kv_offloading_size: GiB of host memory keeping the prefix-cache pages the device pool evicts
        (vLLM's name; None or 0: off). A prompt whose next pages are there has them copied back
        instead of computed (jaxinfer.engine.kv_tiers; stats: prefix_cache_host_hits).
      kv_offloading_dir: a directory every page reaching host memory is also written to (one file
        per page, by a background thread; the interpreter's exit writes what is queued, `close()`
        also the pages still cached on the device), read back after host memory, and by later
        processes of the same model and settings. Needs kv_offloading_size. `kv_offloading_disk_size`: its bound in GiB, least
        recently used files deleted first (default: unbounded). Not with hybrid (Gated DeltaNet) or
        sliding-window models; the disk not with enable_lora nor on several processes.
      kv_eviction: KV eviction for unbounded streams (jaxinfer.ops.kv_eviction; default None: off).
        "streaming" (StreamingLLM): each sequence keeps its first `kv_eviction_sink_tokens` tokens
        (default 4, the attention sinks) and its last `kv_eviction_window` (the query's own
        included), RoPE on positions inside that cache; "h2o" (Heavy-Hitter Oracle):
        `kv_eviction_heavy_tokens` slots (default the window) of the tokens with the most attention
        received so far, per layer and KV head, and the last `kv_eviction_window`. Every other page is
        given back as the sequence runs, so it holds ceil(keep / page_size) + ceil(window /
        page_size) + 1 pages while decoding, however long. Outputs change (tokens past the window
        are gone): SmolLM2 on held-out text, window 64: perplexity 22.1 with every token kept, 23.2
        with 4 sinks, 42.7 with the window alone. Full-attention (Llama-family) models on the XLA
        attention path only (kernel_impl 'reference' on TPU / GPU); no prefix caching (turned off),
        quantized KV, LoRA, speculative decoding, sequence parallelism or swap preemption; h2o one
        completion per request.
      log_stats_interval: seconds between engine stats lines on the "jaxinfer" logger (None: off).
      seed: seeds the per-request seeds of requests that give none.
      warmup: compile now, rather than on first use, every program serving can run: the step of
        every shape bucket (with and without LoRA, with prompt-logprob rows), every sampling
        program (penalties, held-back ids, structured outputs, logprobs) and the page copies, so
        that no request compiles anything. (A draft model's own programs still compile on first use.)
      speculative_config: speculative decoding, as vLLM configures it: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} (see
        jaxinfer.engine.spec_decode). Output stays exactly the target model's: token for token
        under greedy decoding, in distribution under sampling.
      runner: "generate" (default) or "pooling": an embedding or reranking model, which `embed`,
        `classify`, `score` and `encode` run (and `generate` refuses): each prompt computed once,
        its final-normed hidden states pooled as the folder's sentence-transformers config says
        (last token, mean or first; normalized or not; default last token, normalized), a
        `*ForSequenceClassification` checkpoint's head applied for scores, its pages freed as soon
        as it is read (jaxinfer.engine.pooling). `pooler_config` ({"pooling_type", "normalize"})
        overrides the folder's.

    The keywords make an `EngineConfig` (jaxinfer.engine.config, vLLM's names), validated before
    anything loads; `engine_config` holds it resolved for the model.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, attention_impl: str | None = None, **settings: Any):
        if attention_impl is not None:  # the option's first name, when it chose attention only
            settings.setdefault("kernel_impl", attention_impl)
        config = EngineConfig(model=model, **settings)
        enable_compilation_cache(config.compilation_cache_dir)
        clock = PhaseClock()
        self.engine = engine = build_engine(config, clock)
        self.load_seconds = time.perf_counter() - clock.t0
        if config.warmup:
            runner = engine.runner
            runner.warmup(drafts=config.speculative_config is not None)
            if engine.core.image_encoder is not None:
                engine.core.image_encoder.warmup()
            runner.warmup_page_ops(max_copies=runner.buckets.max_num_seqs * runner.num_replicas,
                                   max_swapped=runner.buckets.pages_per_seq if config.preemption_mode == "swap" else 0,
                                   max_offloaded=runner.buckets.pages_per_seq if config.kv_offloading_size else 0)
            clock.mark("warmup (compiling every bucket and sampling program)")
        # Seconds per phase of this constructor (config, weights, tokenizer, KV cache and engine, warmup);
        # tokenizer_seconds is the tokenizer's own time, spent in a thread beside the weights.
        self.startup_seconds = clock.phases
        self.tokenizer_seconds = engine.tokenizer_seconds
        self.config = engine.model_config  # the model's ModelConfig
        self.engine_config = engine.config  # resolved: every setting concrete
        self.source, self.mesh, self.parallel = engine.source, engine.mesh, engine.parallel
        self.tokenizer, self.runner = engine.tokenizer, engine.runner

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def buckets(self):
        return self.runner.buckets

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.engine_config.speculative_config

    @property
    def quantization(self) -> str | None:
        return self.engine_config.quantization

    @property
    def kernels(self):
        return self.engine_config.kernels

    @property
    def param_dtype(self):
        return self.engine_config.param_dtype

    @property
    def compute_dtype(self):
        return self.engine_config.activation_dtype

    @property
    def kv_cache_dtype(self):
        return self.engine_config.kv_dtype

    def make_proposer(self, spec: SpeculativeConfig | dict):
        """The proposer of a speculative_config for this model (see jaxinfer.engine.spec_decode)."""
        return make_proposer(spec, self.config, self.engine_config, self.runner)

    def make_draft_runner(self, spec: SpeculativeConfig | dict) -> ModelRunner:
        """The draft model of speculative decoding (method "draft_model"); see engine.build."""
        spec = SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
        return build_draft_runner(spec, self.config, self.engine_config, self.runner)

    def close(self) -> None:
        """With kv_offloading_dir: writes the device's cached prefix pages and those queued to the
        directory and stops its writer (the queued ones are also written at the interpreter's
        exit); the LLM still generates afterwards, without writing to disk."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling fields the model's generation_config.json sets
        (vLLM's reading of it: jaxinfer.generation_defaults); what generate / stream / chat use
        when given none."""
        folder = self.source.path if self.source is not None and self.source.kind != "gguf" else None
        return SamplingParams(**generation_defaults("auto", folder))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for one prompt or a list of them.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        `sampling_params` is one SamplingParams for all prompts or a list with one per prompt;
        `lora_request` likewise (LLM(enable_lora=True); None: the base model).
        Every prompt is checked before any work starts; a bad one raises ValueError naming it.
        """
        prompts, params = self._pair(prompts, sampling_params)
        request_ids = self._add_requests(prompts, params, self._loras(lora_request, len(prompts)))
        return self._run(request_ids, "Generating" if use_tqdm else None)

    def _run(self, request_ids: list[str], progress: str | None) -> list:
        """Steps the engine until these requests finish; their final outputs, in order. Any error
        (or an interrupt) leaves none of them queued; a failed one raises RequestFailedError."""
        finished: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc=progress, unit="req", leave=False)
        try:
            while len(finished) < len(request_ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in request_ids:
                        self._raise_if_failed(out, request_ids)
                        finished[out.request_id] = out
                        if bar:
                            bar.update(1)
        finally:  # an error (or an interrupt) leaves none of these requests queued
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            if bar:
                bar.close()
        return [finished[r] for r in request_ids]

    # ------------------------------------------------------------------ pooling (runner="pooling")
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Pools each prompt into one vector (an LLM built with runner="pooling"; see
        jaxinfer.engine.pooling): `outputs.data` per prompt, in order. Prompts as `generate`
        takes them; `pooling_params` one for all or one per prompt. Each prompt's pages are freed
        as soon as it is computed."""
        prompts, params = self._pair(prompts, pooling_params if pooling_params is not None else PoolingParams())
        return self._run(self._add_requests(prompts, params), "Pooling" if use_tqdm else None)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Embeddings (`outputs.embedding`, a list of floats per prompt): the prompt's hidden states
        pooled as the model's sentence-transformers config says (last token, mean or first),
        normalized unless it says otherwise; `PoolingParams` may override either and truncate
        to `dimensions` (models trained for it)."""
        return self.encode(prompts, dataclasses.replace(pooling_params or PoolingParams(), task="embed"), use_tqdm=use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A sequence-classification model's label probabilities per prompt (`outputs.probs`)."""
        return self.encode(prompts, PoolingParams(task="classify"), use_tqdm=use_tqdm)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one score per pair, pairing one text with each of several (1 to N)
        or texts one for one (N to N). A sequence-classification model (a cross-encoder reranker)
        scores each pair as one prompt, the tokenizer's encoding of the pair (`tokenizer(a, b)`),
        its first label's probability (a sigmoid of its logit for a one-label reranker); an
        embedding model gives the cosine similarity of the two texts' embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"score: {len(first)} first texts for {len(second)} second texts: give one first text, "
                             f"or as many as second texts (and at least one)")
        if self.engine.core.pooler is not None and self.engine.core.pooler.classifier is not None:
            pairs = [{"prompt_token_ids": self.tokenizer(a, b)["input_ids"]} for a, b in zip(first, second)]
            outs = self.encode(pairs, PoolingParams(task="classify"), use_tqdm=use_tqdm)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.outputs.score)) for o in outs]
        unique = list(dict.fromkeys(first + second))
        vectors = dict(zip(unique, (np.asarray(o.outputs.embedding) for o in self.embed(unique, use_tqdm=use_tqdm))))
        return [ScoringRequestOutput(f"score-{i}", [], ScoringOutput(cosine(vectors[a], vectors[b])))
                for i, (a, b) in enumerate(zip(first, second))]

    @staticmethod
    def _raise_if_failed(out: RequestOutput, request_ids: list[str]) -> None:
        if out.error is not None:
            raise RequestFailedError(f"prompt {request_ids.index(out.request_id)} (request {out.request_id!r}) "
                                     f"failed: {out.error}")

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams) -> list:
        """Beam search over the engine (see jaxinfer.beam_search); returns one BeamSearchOutput per prompt."""
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
        request_ids = self._add_requests(prompts, params)
        remaining = set(request_ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.request_id in remaining:
                        if out.finished:
                            remaining.discard(out.request_id)
                            self._raise_if_failed(out, request_ids)
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
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return prompts, params

    def _add_requests(self, prompts: list, params: list[SamplingParams], loras: list | None = None) -> list[str]:
        """Checks every prompt first (a bad one raises ValueError naming its index, before any
        work), then queues them all."""
        loras = loras or [None] * len(prompts)
        tokenized = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            text, ids, images = self.engine.process(prompt, f"prompt {i}")  # (images: decoded and preprocessed once)
            self.engine.validate(ids, p, f"prompt {i}", lora)
            if images is not None:
                self.engine.input.validate_images(images, f"prompt {i}")
            tokenized.append({"prompt": text, "prompt_token_ids": ids, "mm_inputs": images})
        return [self.engine.add_request(None, t, p, lora_request=lora).request_id for t, p, lora in zip(tokenized, params, loras)]

    @staticmethod
    def _loras(lora_request, n: int) -> list:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
        return loras

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
        dicts) or a list of conversations, and generates the assistant's replies. A vision
        model's messages may hold OpenAI image parts in their content lists
        ({"type": "image_url", "image_url": {"url": "data:..." or a file path}}, or {"type":
        "image", "image": a PIL image / array / path / bytes})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None) -> dict:
        """One conversation rendered by the chat template, as a prompt `generate` and `stream` take:
        {"prompt": text, "prompt_token_ids": ids}. `tools`: OpenAI-style function definitions the
        template shows the model."""
        messages, images = split_images(messages)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            **({"tools": tools} if tools else {}),
        )
        if images:  # tokenized once its image placeholders are expanded (engine.multimodal)
            return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

"""Input processing: a user's prompt and SamplingParams -> a checked `Request`, before it reaches the core.

A prompt is a string, a list of token ids, or a dict with "prompt" and / or
"prompt_token_ids". `validate` raises ValueError, naming the request and the field, for anything
the engine cannot run (an empty prompt or one over max_model_len, prompt or stop token ids outside
the vocabulary, a top_k over the vocabulary (as vLLM), more logprobs or completions than the engine
allows, more ids held back by min_tokens than the sampler's fixed width, a request that cannot
fit the KV cache, a structured_outputs constraint that does not compile), so a bad request never
reaches the scheduler and costs no other request anything; `SamplingParams` has already checked
each field on its own. A request's seed becomes the sampler's (`seeds.sampler_seed`). A pooling
engine's requests take `PoolingParams` instead (a prompt of up to max_model_len tokens, nothing
sampled: engine.pooling). Runs in the caller's thread.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.grammar import GrammarBackend, GrammarError
from jaxinfer.engine.lora import LoraManager
from jaxinfer.engine.multimodal import MultiModalInputs, PromptImages, prompt_key_ids
from jaxinfer.engine.pooling import PoolerConfig
from jaxinfer.engine.request import Request, RequestMetrics, Sequence, SpecState
from jaxinfer.engine.seeds import sampler_seed
from jaxinfer.kv_groups import window_pages
from jaxinfer.lora_request import LoRARequest
from jaxinfer.ops.sampling import MAX_BANNED_IDS
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams, is_integer


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, *, vocab_size: int, pages_per_replica: int,
                 grammar: GrammarBackend | None = None, lora: LoraManager | None = None, eos_token_ids=(),
                 kv_windows: tuple = (None,), kv_page_factors: tuple = (), images: PromptImages | None = None,
                 pooler: PoolerConfig | None = None, kv_shards: int = 1):
        self.config = config
        self.pooler = pooler  # runner="pooling": requests take PoolingParams (engine.pooling)
        self.images = images  # a vision model's prompt processing (jaxinfer.engine.multimodal); None: text only
        self.eos_token_ids = set(eos_token_ids)  # held back with the stop ids until min_tokens
        self.grammar = grammar  # compiles structured_outputs constraints (None: refused)
        self.lora = lora  # reads a request's LoRA adapter (None: the engine has no LoRA table)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # page 0 is the scratch page (with context parallelism each of the kv_shards blocks has one, and a
        # sequence takes its pages from the blocks in turn: engine.block_manager)
        self.num_usable_pages = pages_per_replica - kv_shards
        self.kv_windows = kv_windows  # each KV layer group's window (jaxinfer.kv_groups)
        self.kv_page_sizes = tuple(self.config.page_size * f for f in kv_page_factors or (1,) * len(kv_windows))
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # requests may come from several threads

    def make_request(self, request_id: str | None, prompt, params: SamplingParams | None = None, *, priority: int = 0,
                     arrival_time: float | None = None, seed: int | None = None,
                     lora_request: LoRARequest | None = None) -> Request:
        """A checked Request (one Sequence, for its prompt); ValueError naming it if it cannot run.
        Its seed: `seed` if given (another process's request, replayed), else params.seed as the
        sampler takes it (`sampler_seed`), else drawn."""
        params = params or (PoolingParams() if self.pooler is not None else SamplingParams())
        with self._lock:
            counter = next(self._ids)
        request_id = str(counter) if request_id is None else str(request_id)
        label = f"request {request_id!r}"
        # its adapter pinned from now until the core finishes or aborts it (EngineCore.release): no
        # other thread's request can drop it from the host between its check and its step
        pinned = isinstance(lora_request, LoRARequest) and self.lora is not None
        if pinned:
            self.lora.pin(lora_request.lora_int_id)
        try:
            text, ids, mm = self.process(prompt, label)
            self.validate(ids, params, label, lora_request)
            if isinstance(params, PoolingParams):
                if mm is not None:
                    raise ValueError(f"{label}: a pooling request takes text, not images")
                return self._pooling_request(request_id, text, ids, params, priority, arrival_time)
            if mm is not None:
                self.validate_images(mm, label)
            if seed is None and params.seed is not None:
                seed = sampler_seed(params.seed)
            elif seed is None:
                with self._lock:
                    seed = int(self._seed_rng.integers(0, 2**31))
            max_model_len = self.config.max_model_len
            limit = max_model_len if params.max_tokens is None else min(max_model_len, len(ids) + params.max_tokens)
            request = Request(request_id, text, ids, params, seed, limit, priority,
                              RequestMetrics(arrival_time if arrival_time is not None else time.time()), lora=lora_request)
            if mm is not None:
                request.images, request.cache_key_ids = mm.images, prompt_key_ids(ids, mm.images)
                request.rope_positions, request.rope_delta = mm.rope_positions, mm.rope_delta
            seq = Sequence(request, 0, list(ids), seed)
            if params.structured_outputs is not None:  # compiled by validate: a cache hit here
                grammar = self.grammar.compile(params.structured_outputs)
                seq.grammar = self._grammar_errors(label, lambda: self.grammar.matcher(grammar))
            k = self.draft_length(params) if mm is None or not mm.images else 0  # (drafts see no images)
            if k:
                seq.spec = SpecState(max_k=k, k=k)
            request.seqs.append(seq)
            return request
        except BaseException:
            if pinned:
                self.lora.unpin(lora_request.lora_int_id)
            raise

    def _pooling_request(self, request_id: str, text: str | None, ids: list[int], params: PoolingParams, priority: int,
                         arrival_time: float | None) -> Request:
        """A checked pooling request: its prompt computed once, nothing sampled (engine.pooling)."""
        request = Request(request_id, text, ids, SamplingParams(max_tokens=1, detokenize=False), 0, len(ids), priority,
                          RequestMetrics(arrival_time if arrival_time is not None else time.time()))
        request.pooling = self.pooler.state(params, len(ids))
        request.seqs.append(Sequence(request, 0, list(ids), 0))
        return request

    def process(self, prompt, label: str) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """(text or None, token ids, its images or None) of a prompt; `tokenize` for text, and a
        dict with "multi_modal_data" (its text holding one placeholder per image) through the
        model's image processing. A dict a former `process` made ("mm_inputs") is taken as is."""
        if isinstance(prompt, dict) and prompt.get("mm_inputs") is not None:
            return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"], label), prompt["mm_inputs"]
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            if self.images is None:
                raise ValueError(f"{label}: multi_modal_data given, but this model takes no images")
            text = prompt.get("prompt")
            if not isinstance(text, str) or "prompt_token_ids" in prompt:
                raise ValueError(f"{label}: a prompt with multi_modal_data must be given as text ('prompt'), holding one "
                                 f"{self.images.placeholder!r} per image")
            ids, mm = self.images.process(text, prompt["multi_modal_data"], label,
                                          add_special_tokens=prompt.get("add_special_tokens", True))
            return text, ids, mm
        text, ids = self.tokenize(prompt, label)
        return text, ids, None

    def validate_images(self, mm: "MultiModalInputs", label: str) -> None:
        """Images the scheduler could never run: an image over the encoder's per-step budget, or
        (attended both ways, so computed in one chunk) over the step's token budget."""
        c = self.config
        for i, image in enumerate(mm.images):
            limit = c.max_num_encoder_input_tokens or c.max_num_batched_tokens
            if image.length > limit:
                raise ValueError(f"{label}: image {i} is {image.length} tokens, over max_num_encoder_input_tokens={limit}")
            if image.both_ways and image.length > c.max_num_batched_tokens:
                raise ValueError(f"{label}: image {i} is {image.length} tokens, computed in one step, over "
                                 f"max_num_batched_tokens={c.max_num_batched_tokens}")

    def tokenize(self, prompt, label: str) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as a string, token ids, or a dict."""
        if isinstance(prompt, str):
            return prompt, (self.tokenizer.encode(prompt) if prompt else [])
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{label}: 'prompt' must be a string, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                return text, self._token_ids(prompt["prompt_token_ids"], label)
            return text, self.tokenizer.encode(text or "")
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, self._token_ids(prompt, label)
        raise ValueError(f"{label}: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _token_ids(ids, label: str) -> list[int]:
        """Prompt token ids as Python ints: integers (NumPy's too), not bools, floats or strings."""
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(
            type(t) is int or is_integer(t) for t in ids
        ):  # (plain ints, by far the most common, skip the slower abstract-class check)
            raise ValueError(f"{label}: prompt token ids must be a list of integers")
        return [int(t) for t in ids]

    def validate(self, ids: list[int], p: SamplingParams, label: str, lora_request: LoRARequest | None = None) -> None:
        """Raises ValueError, starting with `label`, for a prompt the engine cannot run (with its
        adapter, which this reads and fuses the first time)."""
        c = self.config
        if not ids:
            raise ValueError(f"{label}: the prompt is empty (0 tokens)")
        if isinstance(p, PoolingParams) or self.pooler is not None:
            return self._validate_pooling(ids, p, label, lora_request)
        if len(ids) >= c.max_model_len:
            raise ValueError(
                f"{label}: the prompt has {len(ids)} tokens, over max_model_len={c.max_model_len} "
                f"(a prompt needs at most max_model_len - 1 tokens to leave room for one generated token)"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{label}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(p, field)
            if v is not None and v > c.max_logprobs:
                raise ValueError(f"{label}: SamplingParams.{field}={v} exceeds max_logprobs={c.max_logprobs}")
        if p.n > c.max_num_seqs:
            raise ValueError(f"{label}: SamplingParams.n={p.n} exceeds max_num_seqs={c.max_num_seqs}")
        if p.top_k > self.vocab_size:
            raise ValueError(f"{label}: SamplingParams.top_k={p.top_k} exceeds the vocabulary size {self.vocab_size} "
                             f"(0 or -1: every token)")
        bad = [t for t in p.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"{label}: SamplingParams.stop_token_ids holds {bad[0]}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if p.min_tokens:
            held_back = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_token_ids)
            if len(held_back) > MAX_BANNED_IDS:
                raise ValueError(
                    f"{label}: SamplingParams.stop_token_ids: with min_tokens={p.min_tokens} at most {MAX_BANNED_IDS} "
                    f"token ids (EOS included) can be held back until then; this request holds back {len(held_back)}"
                )
        spec = c.speculative_config
        if p.num_speculative_tokens and spec and p.num_speculative_tokens > spec.num_speculative_tokens:
            raise ValueError(
                f"{label}: SamplingParams.num_speculative_tokens={p.num_speculative_tokens} exceeds the engine's "
                f"num_speculative_tokens={spec.num_speculative_tokens}"
            )
        if p.structured_outputs is not None:
            if self.grammar is None:
                raise ValueError(f"{label}: this engine takes no structured_outputs")
            self._grammar_errors(label, lambda: self.grammar.compile(p.structured_outputs))  # cached by its text
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"{label}: a LoRARequest needs an engine built with enable_lora=True")
            try:
                self.lora.check(lora_request)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
        if p.n > 1 and any(getattr(w, "method", None) == "h2o" for w in self.kv_windows):
            raise ValueError(f"{label}: n={p.n} with kv_eviction='h2o': completions would share the prompt's heavy-hitter "
                             f"pages, which each rewrites; ask for one completion per request")
        total = min(c.max_model_len, len(ids) + (p.max_tokens or c.max_model_len))
        # its pages in every layer group (a sliding group's: its window and a chunk), and a partial
        # page per group for each extra completion
        need = sum(window_pages(w, total, ps, c.max_num_batched_tokens) for w, ps in zip(self.kv_windows, self.kv_page_sizes))
        need += (p.n - 1) * len(self.kv_windows)
        if need > self.num_usable_pages:
            raise ValueError(
                f"{label}: needs {need} KV pages but the cache has {self.num_usable_pages} (per replica); "
                f"raise num_pages or lower max_tokens"
            )

    def _validate_pooling(self, ids: list[int], p: PoolingParams, label: str, lora_request: LoRARequest | None) -> None:
        """`validate` for a pooling engine's requests: PoolingParams, a prompt of at most
        max_model_len tokens (nothing is generated after it)."""
        c = self.config
        if self.pooler is None:
            raise ValueError(f"{label}: PoolingParams need an engine built with runner='pooling' (LLM(runner='pooling'), "
                             f"jaxinfer serve --runner pooling)")
        if not isinstance(p, PoolingParams):
            raise ValueError(f"{label}: this model runs as a pooling model (runner='pooling'): it embeds and scores "
                             f"(LLM.embed / LLM.score, /v1/embeddings, /v1/score, /v1/rerank) and does not generate")
        if lora_request is not None:
            raise ValueError(f"{label}: LoRA adapters with runner='pooling' are not supported")
        if len(ids) > c.max_model_len:
            raise ValueError(f"{label}: the prompt has {len(ids)} tokens, over max_model_len={c.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{label}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        self.pooler.check(p, label)
        need = sum(window_pages(w, len(ids), ps, c.max_num_batched_tokens) for w, ps in zip(self.kv_windows, self.kv_page_sizes))
        if need > self.num_usable_pages:
            raise ValueError(f"{label}: needs {need} KV pages but the cache has {self.num_usable_pages} (per replica); "
                             f"raise num_pages")

    @staticmethod
    def _grammar_errors(label: str, fn):
        """fn(), a GrammarError becoming a ValueError naming the request."""
        try:
            return fn()
        except GrammarError as e:
            raise ValueError(f"{label}: {e}") from None

    def draft_length(self, p: SamplingParams) -> int:
        """A new request's maximum draft length (0: it does not speculate). Constrained requests
        speculate too: their drafts are cut by the grammar and each verification row gets the
        mask of the state after the drafts before it (engine.core `_fill_allowed_tokens`)."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return 0  # penalties depend on every token before: verified rows could not apply them
        k = spec.num_speculative_tokens if p.num_speculative_tokens is None else p.num_speculative_tokens
        return min(k, spec.num_speculative_tokens)

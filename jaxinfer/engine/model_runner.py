"""The model runner: owns the parameters, the KV cache and the compiled step variants.

A driver (today `engine.driver`, later the continuous-batching scheduler) hands it a list of
`ScheduledChunk`s per iteration; the runner packs them into a padded `RaggedBatch`, builds the
per-row sampling tensors, runs the jitted step with the cache donated, and returns per-chunk
results as numpy. It keeps no per-request state.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.batch import BucketKey, Buckets, RaggedBatch, SequenceChunk, pack_batch
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SampleOutput, SamplingTensors
from jaxinfer.step import StepFunction

BANNED_IDS_MULTIPLE = 8  # banned-id columns are padded to a multiple of this (one variant for up to 8)


@dataclasses.dataclass
class RowSampling:
    """Sampling parameters for the logits rows of one chunk."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | Sequence[int] = 0  # one seed, or one per logits row
    counter: int = 0  # tokens this sequence has sampled so far
    target_ids: Sequence[int] = ()  # per logits row: the token whose logprob to report, -1 = sampled one
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; on prompt and output tokens
    presence_penalty: float = 0.0  # 0 = off; on output tokens
    frequency_penalty: float = 0.0  # 0 = off; on output tokens
    banned_ids: Sequence[int] = ()  # never sampled (min_tokens: EOS and stop ids)
    history: Sequence[int] = ()  # prompt ids then output ids so far; only read when a penalty is on
    num_prompt_history: int = 0  # how many leading `history` ids are the prompt

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclasses.dataclass
class ScheduledChunk:
    chunk: SequenceChunk
    sampling: RowSampling


@dataclasses.dataclass
class RowResult:
    token: int
    logprob: float
    top_ids: np.ndarray  # [K]
    top_logprobs: np.ndarray  # [K]


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose results have not been read yet."""

    out: SampleOutput  # device arrays
    rows_of_chunk: list[list[int]]
    want_logprobs: bool


class ModelRunner:
    def __init__(self, graphdef, params, kv: KVCache, buckets: Buckets, *, num_top_logprobs: int = 20):
        self.graphdef = graphdef
        self.params = params
        self.kv = kv
        self.buckets = buckets
        self.num_top_logprobs = num_top_logprobs
        self.step_fn = StepFunction(graphdef, num_top_logprobs, max_rows=buckets.max_tokens)
        self.token_buffer = jnp.zeros(buckets.max_tokens, jnp.int32)  # the last step's sampled tokens, on the device
        self.compile_seconds: dict[BucketKey, float] = {}
        self.keys_seen: set[BucketKey] = set()  # bucket variants executed so far

    @property
    def num_compiles(self) -> int:
        return self.step_fn.num_compiles

    def dispatch(self, scheduled: Sequence[ScheduledChunk], *, want_logprobs: bool = False) -> "InFlightStep":
        """Packs and launches one step without waiting for it (JAX dispatch is asynchronous).

        Tokens marked in a chunk's `device_tokens` are read on the device from the previous
        dispatched step's sampled tokens. `collect` reads the results.
        """
        key, batch, rows_of_chunk = pack_batch([s.chunk for s in scheduled], self.buckets, self.kv.page_size)
        sampling = self._sampling_tensors(key, scheduled, rows_of_chunk, want_logprobs)
        self.keys_seen.add(key)
        compiles_before = self.step_fn.num_compiles
        t0 = time.perf_counter()
        out, self.token_buffer, self.kv = self.step_fn(
            self.params, self.kv, batch, sampling, self.token_buffer, query_block=key.query_block
        )
        if self.step_fn.num_compiles != compiles_before:  # tracing and compiling happen at dispatch
            self.compile_seconds[key] = time.perf_counter() - t0
        return InFlightStep(out, rows_of_chunk, want_logprobs)

    def collect(self, step: "InFlightStep") -> list[list[RowResult]]:
        """Waits for a dispatched step; per chunk, one RowResult per requested logits row. Only the
        sampled tokens (and logprobs when asked for) come to the host."""
        out = step.out
        if step.want_logprobs:
            tokens, logprobs, top_ids, top_lps = jax.device_get((out.tokens, out.logprobs, out.top_ids, out.top_logprobs))
        else:
            tokens = np.asarray(out.tokens)
            logprobs = np.zeros(len(tokens), np.float32)
            top_ids = top_lps = np.zeros((len(tokens), 0))
        return [
            [RowResult(int(tokens[r]), float(logprobs[r]), top_ids[r], top_lps[r]) for r in rows] for rows in step.rows_of_chunk
        ]

    def execute(self, scheduled: Sequence[ScheduledChunk], *, want_logprobs: bool = False) -> list[list[RowResult]]:
        """Runs one step and waits for it."""
        return self.collect(self.dispatch(scheduled, want_logprobs=want_logprobs))

    def _sampling_tensors(self, key: BucketKey, scheduled, rows_of_chunk, want_logprobs: bool = False) -> SamplingTensors:
        R = key.num_logits
        temperature = np.zeros(R, np.float32)
        top_k = np.zeros(R, np.int32)
        top_p = np.ones(R, np.float32)
        seed = np.zeros(R, np.uint32)
        counter = np.zeros(R, np.int32)
        target_ids = np.full(R, -1, np.int32)
        min_p = np.zeros(R, np.float32)
        for s, rows in zip(scheduled, rows_of_chunk):
            p = s.sampling
            temperature[rows], top_k[rows], top_p[rows] = p.temperature, p.top_k, p.top_p
            seed[rows], counter[rows], min_p[rows] = p.seed, p.counter, p.min_p
            if p.target_ids:
                target_ids[rows] = p.target_ids
        st = SamplingTensors(
            temperature, top_k, top_p, seed, counter, target_ids, min_p=min_p, want_logprobs=np.array([want_logprobs])
        )
        # Static switches: the fields stay None (a separate, cheaper compiled variant) unless some row needs them.
        max_banned = max((len(s.sampling.banned_ids) for s in scheduled), default=0)
        if max_banned:
            st.banned_ids = np.full((R, -(-max_banned // BANNED_IDS_MULTIPLE) * BANNED_IDS_MULTIPLE), -1, np.int32)
            for s, rows in zip(scheduled, rows_of_chunk):
                st.banned_ids[np.asarray(rows)[:, None], np.arange(len(s.sampling.banned_ids))] = s.sampling.banned_ids
        if any(s.sampling.uses_penalties for s in scheduled):
            H = self.buckets.pages_per_seq * self.kv.page_size  # the longest a sequence can be
            st.history_ids = np.full((R, H), -1, np.int32)
            st.num_prompt_history = np.zeros(R, np.int32)
            st.repetition_penalty = np.ones(R, np.float32)
            st.presence_penalty = np.zeros(R, np.float32)
            st.frequency_penalty = np.zeros(R, np.float32)
            for s, rows in zip(scheduled, rows_of_chunk):
                p = s.sampling
                if not p.uses_penalties:
                    continue
                if len(p.history) > H:
                    raise ValueError(f"history of {len(p.history)} tokens exceeds the maximum sequence length {H}")
                st.history_ids[np.asarray(rows)[:, None], np.arange(len(p.history))] = p.history
                st.num_prompt_history[rows] = p.num_prompt_history
                st.repetition_penalty[rows], st.presence_penalty[rows] = p.repetition_penalty, p.presence_penalty
                st.frequency_penalty[rows] = p.frequency_penalty
        return st

    def _empty_inputs(self, key: BucketKey) -> tuple[RaggedBatch, SamplingTensors]:
        """A batch of the key's shapes with no sequences in it (every token writes to scratch)."""
        T, S, R = key.num_tokens, key.num_seqs, key.num_logits
        batch = RaggedBatch(
            token_ids=np.zeros(T, np.int32),
            positions=np.zeros(T, np.int32),
            cu_q_lens=np.zeros(S + 1, np.int32),
            kv_lens=np.zeros(S, np.int32),
            page_table=np.zeros((S, self.buckets.pages_per_seq), np.int32),
            num_seqs=np.zeros(1, np.int32),
            logits_indices=np.zeros(R, np.int32),
            token_src=np.full(T, -1, np.int32),
        )
        sampling = SamplingTensors(
            np.zeros(R, np.float32), np.zeros(R, np.int32), np.ones(R, np.float32),
            np.zeros(R, np.uint32), np.zeros(R, np.int32), np.full(R, -1, np.int32), min_p=np.zeros(R, np.float32),
            want_logprobs=np.array([False]),
        )  # the variant without penalties or banned ids, which is what most batches use
        return batch, sampling

    def warmup(self, keys: Sequence[BucketKey] | None = None) -> None:
        """Compiles the step for every bucket (or the given ones) by running an empty batch."""
        for key in keys or self.buckets.all_keys():
            batch, sampling = self._empty_inputs(key)
            t0 = time.perf_counter()
            out, self.token_buffer, self.kv = self.step_fn(
                self.params, self.kv, batch, sampling, self.token_buffer, query_block=key.query_block
            )
            jax.block_until_ready(out.tokens)
            self.compile_seconds[key] = time.perf_counter() - t0

    def compiled_hlo(self, key: BucketKey) -> str:
        """The optimized HLO of one bucket's step (for inspection; compiles if needed)."""
        batch, sampling = self._empty_inputs(key)
        lowered = self.step_fn._step.lower(self.params, self.kv, batch, sampling, self.token_buffer, query_block=key.query_block)
        return lowered.compile().as_text()

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies whole pages (every layer, K and V) src -> dst on the device, in place.

        Used for copy-on-write. The list is padded to a power of two with scratch-to-scratch
        copies so only a few sizes ever compile.
        """
        n = 1 << max(0, (len(copies) - 1).bit_length())
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies)
        self.kv = _copy_pages(self.kv, src, dst)


    def read_pages(self, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """K and V of the given pages, all layers, on the host: [L, len(pages), page_size, Hkv, D] each."""
        idx = np.asarray(pages, np.int32)
        return np.asarray(self.kv.k[:, idx]), np.asarray(self.kv.v[:, idx])

    def write_pages(self, pages: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        """Writes host K/V (as read_pages returns them) into the given pages, in place."""
        self.kv = _write_pages(self.kv, np.asarray(pages, np.int32), k, v)


@functools.partial(jax.jit, donate_argnums=0)
def _write_pages(kv: KVCache, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    return KVCache(k=kv.k.at[:, pages].set(k.astype(kv.k.dtype)), v=kv.v.at[:, pages].set(v.astype(kv.v.dtype)))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_pages(kv: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return KVCache(k=kv.k.at[:, dst].set(kv.k[:, src]), v=kv.v.at[:, dst].set(kv.v[:, src]))

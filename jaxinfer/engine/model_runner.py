"""The model runner: owns the parameters, the KV cache and the compiled step variants.

The engine hands it, per iteration, one list of `ScheduledChunk`s per replica (one replica
without data parallelism); the runner packs each replica's chunks into a `RaggedBatch` padded to
one shared bucket, stacks them on a leading replica axis, builds the per-row sampling tensors
and runs the jitted step with the cache donated. `dispatch` writes each chunk's logits rows into
the chunk (`ScheduledChunk.rows`), `collect` its results (`ScheduledChunk.results`, numpy on the
host). It keeps no per-request state.

Compiled programs (runtime/step.py): the model per bucket (`BucketKey`, prompt-logprob rows
included) and LoRA switch; per logits-row count, each logits processor a step may switch on
(penalties, banned ids, an allowed-token mask) and the sampler (with drafts to verify, another).
Every array width comes from the configuration (buckets, max_model_len, max_logprobs, the
vocabulary, `MAX_BANNED_IDS`), never from a request's values, and page copies and swaps pad to
powers of two, so the programs are a small fixed set: `warmup` and `warmup_page_ops` compile them
all, after which no request compiles anything.

Page ids in chunks are the replica's own (each replica's block manager hands out 1 ..
pages_per_replica - 1, page 0 being its scratch page); the cache holds the replicas' pools one
after the other on its page axis, split over the replica axes of the mesh.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.batch import BucketKey, Buckets, RaggedBatch, SequenceChunk, pack_batch, shared_key, stack_replicas
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.ops.linear_state import commit_drafts
from jaxinfer.ops.sampling import MAX_BANNED_IDS, MAX_TREE_CHILDREN, SampleOutput, SamplingTensors
from jaxinfer.runtime.placement import kv_partition_spec, kv_shardings
from jaxinfer.runtime.step import StepFunction
from jaxinfer.sampling_params import SamplingParams


@dataclasses.dataclass
class RowSampling:
    """Sampling parameters for the logits rows of one chunk."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | Sequence[int] = 0  # one seed, or one per logits row
    counter: int | Sequence[int] = 0  # tokens this sequence has sampled so far (per row: the token each row makes)
    target_ids: Sequence[int] = ()  # per logits row: the token whose logprob to report, -1 = sampled one
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; on prompt and output tokens
    presence_penalty: float = 0.0  # 0 = off; on output tokens
    frequency_penalty: float = 0.0  # 0 = off; on output tokens
    banned_ids: Sequence[int] = ()  # never sampled (min_tokens: EOS and stop ids), at most MAX_BANNED_IDS
    history: Sequence[int] = ()  # prompt ids then output ids so far; only read when a penalty is on
    num_prompt_history: int = 0  # how many leading `history` ids are the prompt
    draft_tokens: Sequence[int] = ()  # per logits row: the drafted token it verifies, -1 = none (speculative decoding)
    draft_src: Sequence[int] = ()  # per logits row: its draft's distribution, a row of dispatch's draft_buffer (-1 = one-hot)
    tree_children: Sequence[Sequence[int]] = ()  # draft trees: per logits row (a tree node), its children's tokens in rank order
    # int32 [ceil(V / 32)]: bitmask of the tokens its rows may sample (structured outputs); [rows, ceil(V / 32)]: one per row
    allowed_tokens: np.ndarray | None = None

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_params(cls, p: SamplingParams, **rows) -> "RowSampling":
        """A request's SamplingParams as row settings; `rows`: the per-row fields (seed, counter,
        target_ids, banned_ids, draft_tokens, ...)."""
        return cls(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                   repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                   frequency_penalty=p.frequency_penalty, **rows)


@dataclasses.dataclass(eq=False)
class ScheduledChunk:
    """One sequence's chunk of a step, and what the step gives back for it."""

    chunk: SequenceChunk
    sampling: RowSampling
    rows: list[int] = dataclasses.field(default_factory=list)  # its logits rows in the step (set by dispatch)
    first_token: int = 0  # the row of its first token in the step's tokens (set by dispatch)
    results: list["RowResult"] = dataclasses.field(default_factory=list)  # one per row (set by collect)


@dataclasses.dataclass
class RowResult:
    token: int  # sampled (for a row verifying a draft: the replacement, used if the draft was rejected)
    logprob: float  # of the emitted token (the draft if accepted)
    top_ids: np.ndarray  # [K]
    top_logprobs: np.ndarray  # [K]
    accepted: bool = False  # the row's drafted token was accepted
    child: int = -1  # draft trees: the index of the row's accepted child among its children (-1: none)
    hidden: np.ndarray | None = None  # [H] float32: its final-normed hidden state (a pooling runner's rows)


@dataclasses.dataclass
class PackedStep:
    """A step's host-side inputs, ready to launch (ModelRunner.pack)."""

    key: BucketKey
    batch: RaggedBatch  # [replicas, ...] host arrays
    sampling: SamplingTensors
    draft_src: np.ndarray | None  # [replicas, R] rows of the draft buffer, or None
    chunks: list[list[ScheduledChunk]]  # per replica
    want_logprobs: bool


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose results have not been read yet."""

    out: SampleOutput  # device arrays, [replicas, R]
    chunks: list[list[ScheduledChunk]]  # per replica, holding their logits rows
    want_logprobs: bool
    stream: jax.Array | None = None  # with return_stream: every token's stream [replicas, max_rows, H], on the device


class ModelRunner:
    def __init__(self, graphdef, params, kv: KVCache, buckets: Buckets, *, num_top_logprobs: int = 20,
                 mesh=None, param_specs=None, return_hidden: bool = False, return_stream: bool = False,
                 kv_windows: tuple = (None,), kv_page_factors: tuple = (), pooling: bool = False):
        """kv: the whole cache, [slots, replicas * pages_per_replica, ...], placed on `mesh` (default:
        one device) with the step's KV sharding; kv_windows: each KV layer group's window
        (`jaxinfer.kv_groups`; one entry per page-table row of `buckets`), kv_page_factors: how many
        times page_size tokens each group's pages hold (default 1 each). `pooling`: steps return
        their rows' hidden states instead of sampling (runner="pooling"; runtime.step)."""
        if len(kv_windows) != buckets.num_groups:
            raise ValueError(f"{len(kv_windows)} KV layer groups but buckets with {buckets.num_groups} page-table rows")
        self.kv_windows = tuple(kv_windows)
        self.kv_page_factors = tuple(kv_page_factors or (1,) * len(kv_windows))
        self.graphdef = graphdef
        self.params = params
        self.kv = kv
        # the pool's shapes, dtypes and shardings, to re-create it if a failed step consumed it (recover)
        self._kv_layout = jax.tree.map(_layout, kv)
        self.buckets = buckets
        self.num_top_logprobs = num_top_logprobs
        self.step_fn = StepFunction(graphdef, num_top_logprobs, max_rows=buckets.max_tokens, mesh=mesh, param_specs=param_specs,
                                    return_hidden=return_hidden, return_stream=return_stream, pooling=pooling)
        self.num_replicas = self.step_fn.num_replicas
        if kv.num_pages % self.num_replicas:
            raise ValueError(f"{kv.num_pages} KV pages do not split over {self.num_replicas} replicas")
        self.pages_per_replica = kv.num_pages // self.num_replicas
        # devices sharing a replica's pages, each its block of them (context parallelism: engine.block_manager)
        self.kv_shards = self.step_fn.mesh.shape["sequence"] if kv.sequence_sharded else 1
        # the last step's sampled tokens, on the device: [replicas, max_rows]
        self.token_buffer = self._put(np.zeros((self.num_replicas, buckets.max_tokens), np.int32))
        # On one device of one process the jitted step takes the host arrays itself (JAX's C++
        # dispatch copies them), which costs a fraction of placing each of the ~16 leaves from Python.
        self.pass_host_inputs = self.step_fn.mesh.size == 1 and jax.process_count() == 1
        self.compile_seconds: dict[BucketKey, float] = {}
        self.keys_seen: set[BucketKey] = set()  # bucket variants executed so far
        self.lora_enabled = "lora" in params  # the model holds a LoRA slot table (jaxinfer.models.lora)
        self._lora_layout = ({name: _layout(var.get_value()) for name, var in params["lora"].items()}
                             if self.lora_enabled else {})
        self._write_lora = None
        self.with_rope_positions = False  # every batch carries M-RoPE positions (a Qwen2.5-VL model: build_runner)
        # every batch carries tree masks (speculative decoding with draft trees: build_engine), so
        # that steps verifying trees and the others run the same compiled variants
        self.with_tree = False
        self.max_tree_moves = 0  # draft trees: the most token rows one step's verifications move (move_kv_rows)
        # a vision model's image steps: (rows' width, deepstack rows, span_end) of their batches (build_engine)
        self.image_inputs: tuple[int, int, bool] | None = None

    def write_lora_slot(self, slot: int, arrays: dict[str, np.ndarray]) -> None:
        """Puts one adapter (`models.lora.fuse_adapter`'s arrays, name -> [L, ...]) into slot
        `slot` of every stack of the table, in place; one compiled program whatever the slot."""
        if self._write_lora is None:
            def write(table, slot, arrays):
                return {name: table[name].at[:, slot].set(arrays[name].astype(table[name].dtype)) for name in table}
            self._write_lora = jax.jit(write, donate_argnums=(0,))
        table = {name: var.get_value() for name, var in self.params["lora"].items()}
        new = self._write_lora(table, np.int32(slot), {name: arrays[f"lora.{name}"] for name in table})
        for name, var in self.params["lora"].items():
            var.set_value(new[name])

    @property
    def num_compiles(self) -> int:
        return self.step_fn.num_compiles

    @property
    def _tree_switch(self) -> dict:
        """pack_batch's keyword for tree masks (only passed when on)."""
        return {"with_tree": True} if self.with_tree else {}

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def _put(self, tree):
        return self.step_fn.place_inputs(tree)

    def dispatch(self, scheduled: Sequence[Sequence[ScheduledChunk]], *, want_logprobs: bool = False,
                 return_probs: bool = False, draft_buffer: jax.Array | None = None,
                 stream: jax.Array | None = None) -> "InFlightStep":
        """Packs and launches one step without waiting for it (JAX dispatch is asynchronous).

        `scheduled`: one list of chunks per replica. Tokens marked in a chunk's `device_tokens`
        are read on the device from the previous dispatched step's sampled tokens of the same
        replica. `collect` reads the results. `return_probs`: the step also returns each row's
        sampling distribution (`InFlightStep.out.probs`, on the device: a draft model's q).
        `draft_buffer` [replicas, N, V]: draft distributions the chunks' `draft_src` rows point into.
        `stream` [replicas, max_rows, H]: the hidden states the chunks' `hidden_src` rows point into
        (another step's `InFlightStep.stream`).
        """
        return self.launch(self.pack(scheduled, want_logprobs=want_logprobs, return_probs=return_probs,
                                     with_draft_src=draft_buffer is not None, with_hidden=stream is not None),
                           draft_buffer, stream)

    def pack(self, scheduled: Sequence[Sequence[ScheduledChunk]], *, want_logprobs: bool = False,
             return_probs: bool = False, with_draft_src: bool = False, with_hidden: bool = False) -> "PackedStep":
        """The host half of `dispatch`: the step's input arrays (nothing runs on the device, the
        runner's state is untouched, so a failure here leaves the engine as it was)."""
        if len(scheduled) != self.num_replicas:
            raise ValueError(f"got chunks for {len(scheduled)} replicas, the runner has {self.num_replicas}")
        key = shared_key([[s.chunk for s in chunks] for chunks in scheduled], self.buckets)
        # LoRA only in steps where some sequence has an adapter (the others run the base variant)
        with_lora = self.lora_enabled and any(s.chunk.lora_slot for chunks in scheduled for s in chunks)
        page_sizes = [self.page_size * f for f in self.kv_page_factors]  # each group's tokens per page
        # images only in steps where some chunk reaches image tokens (the others run the text variant)
        chunks_of_step = [s.chunk for chunks in scheduled for s in chunks]
        mm_width = max((rows.shape[1] for c in chunks_of_step for _, rows, _ in c.mm_rows), default=0)
        mm_deepstack = max((len(ds) for c in chunks_of_step for _, _, ds in c.mm_rows if ds is not None), default=0)
        span_end = any(c.span_ends for c in chunks_of_step)
        packed = [pack_batch([s.chunk for s in chunks], self.buckets, page_sizes, key, with_lora=with_lora,
                             with_hidden=with_hidden, mm_width=mm_width, mm_deepstack=mm_deepstack, with_span_end=span_end,
                             with_rope_positions=self.with_rope_positions, **self._tree_switch) for chunks in scheduled]
        rows_of_chunk = [rows for _, _, rows in packed]
        for chunks, (_, replica_batch, replica_rows) in zip(scheduled, packed):
            for s, rows, first in zip(chunks, replica_rows, replica_batch.cu_q_lens):
                s.rows, s.first_token = rows, int(first)
        batch = stack_replicas([b for _, b, _ in packed])
        everything = [s for chunks in scheduled for s in chunks]  # the optional sampling features are per step
        num_banned = max((len(s.sampling.banned_ids) for s in everything), default=0)
        penalties = any(s.sampling.uses_penalties for s in everything)
        drafts = any(s.sampling.draft_tokens for s in everything)
        trees = any(s.sampling.tree_children for s in everything)
        mask_words = max((s.sampling.allowed_tokens.shape[-1] for s in everything if s.sampling.allowed_tokens is not None), default=0)
        sampling = jax.tree.map(lambda *a: np.stack(a), *(
            self._sampling_tensors(key, chunks, rows, want_logprobs, max_banned=num_banned, penalties=penalties,
                                  drafts=drafts, mask_words=mask_words, trees=trees)
            for chunks, rows in zip(scheduled, rows_of_chunk)
        ))
        if return_probs:
            sampling.return_probs = np.ones((self.num_replicas, 1), bool)
        src = None
        if with_draft_src:
            src = np.full((self.num_replicas, key.num_logits), -1, np.int32)
            for i, (chunks, replica_rows) in enumerate(zip(scheduled, rows_of_chunk)):
                for s, rows in zip(chunks, replica_rows):
                    if s.sampling.draft_src:
                        src[i, rows] = s.sampling.draft_src
        return PackedStep(key, batch, sampling, src, [list(chunks) for chunks in scheduled], want_logprobs)

    def launch(self, packed: "PackedStep", draft_buffer: jax.Array | None = None,
               stream: jax.Array | None = None) -> "InFlightStep":
        """The device half of `dispatch`: runs the packed step, the cache donated."""
        key, batch, sampling = packed.key, packed.batch, packed.sampling
        if not self.pass_host_inputs:
            batch, sampling = self._put((batch, sampling))
        if packed.draft_src is not None:
            sampling.draft_probs = _gather_rows(draft_buffer, self._put(packed.draft_src))
        self.keys_seen.add(key)
        compiles_before = self.step_fn.num_compiles
        t0 = time.perf_counter()
        out, self.token_buffer, self.kv, new_stream = self.step_fn(
            self.params, self.kv, batch, sampling, self.token_buffer, *(() if stream is None else (stream,)),
            query_block=key.query_block, spec_block=key.spec_block,
        )
        if self.step_fn.num_compiles != compiles_before:  # tracing and compiling happen at dispatch
            self.compile_seconds[key] = time.perf_counter() - t0
        return InFlightStep(out, packed.chunks, packed.want_logprobs, new_stream)

    def recover(self) -> "Recovered":
        """After a step (or a page copy, or a LoRA slot write) that failed: re-creates what the
        failure consumed (donated to a program that did not finish, or computed by one that
        failed), as zeros: the token buffer, the KV pool (every page's contents are then gone:
        the sequences holding pages must be recomputed), the LoRA table (its slots hold nothing)."""
        if not _usable(self.token_buffer):
            self.token_buffer = self._put(np.zeros((self.num_replicas, self.buckets.max_tokens), np.int32))
        pool = not _usable(self.kv)
        if pool:
            self.kv = _zeros(self._kv_layout)
        table = self.params["lora"] if self.lora_enabled else {}
        lora_table = not _usable({name: var.get_value() for name, var in table.items()})
        if lora_table:
            fresh = _zeros(self._lora_layout)
            for name, var in table.items():
                var.set_value(fresh[name])
        return Recovered(pool, lora_table)

    def collect(self, step: "InFlightStep") -> None:
        """Waits for a dispatched step and fills each chunk's `results`: one RowResult per logits
        row. Only the sampled tokens (and logprobs when asked for) come to the host."""
        out = step.out
        if self.step_fn.pooling:  # the rows' hidden states, nothing sampled
            hidden, none = np.asarray(out.hidden), np.zeros(0)
            for i, chunks in enumerate(step.chunks):
                for s in chunks:
                    s.results = [RowResult(0, 0.0, none, none, hidden=hidden[i, r]) for r in s.rows]
            return
        if step.want_logprobs:
            tokens, logprobs, top_ids, top_lps = jax.device_get((out.tokens, out.logprobs, out.top_ids, out.top_logprobs))
        else:
            tokens = np.asarray(out.tokens)
            logprobs = np.zeros(tokens.shape, np.float32)
            top_ids = top_lps = np.zeros(tokens.shape + (0,))
        accepted = np.zeros(tokens.shape, bool) if out.accepted is None else np.asarray(out.accepted)
        child = np.full(tokens.shape, -1, np.int32) if out.accepted_child is None else np.asarray(out.accepted_child)
        for i, chunks in enumerate(step.chunks):
            for s in chunks:
                s.results = [RowResult(int(tokens[i, r]), float(logprobs[i, r]), top_ids[i, r], top_lps[i, r],
                                       bool(accepted[i, r]), int(child[i, r])) for r in s.rows]

    def execute(self, scheduled: Sequence[Sequence[ScheduledChunk]], *, want_logprobs: bool = False) -> list[list[list[RowResult]]]:
        """Runs one step and waits for it; per replica, per chunk, its results."""
        self.collect(self.dispatch(scheduled, want_logprobs=want_logprobs))
        return [[s.results for s in chunks] for chunks in scheduled]

    def _sampling_tensors(self, key: BucketKey, scheduled, rows_of_chunk, want_logprobs: bool = False, **switches) -> SamplingTensors:
        return sampling_tensors(key.num_logits, scheduled, rows_of_chunk, self.max_history, want_logprobs, **switches)

    @property
    def max_history(self) -> int:
        """The longest a sequence can be: the penalties' history width."""
        return self.buckets.pages_per_seq * self.kv.page_size

    def _empty_batch(self, key: BucketKey, with_lora: bool | None = None, with_images: bool = False) -> RaggedBatch:
        """`empty_inputs` as `dispatch` passes a batch (host arrays, or placed on the mesh): the
        jitted model keys its compiled variants on that too. `with_images`: the image variant
        (`image_inputs`' fields, zeros)."""
        with_lora = self.lora_enabled if with_lora is None else with_lora
        batch = empty_inputs(key, self.buckets.pages_per_seq, self.num_replicas, with_lora, self.buckets.num_groups,
                             with_rope_positions=self.with_rope_positions,
                             image_inputs=self.image_inputs if with_images else None, with_tree=self.with_tree)
        return batch if self.pass_host_inputs else self._put(batch)

    def warmup(self, keys: Sequence[BucketKey] | None = None, *, drafts: bool = False) -> None:
        """Compiles every program a step can run, so that no request compiles anything.

        The model program of every bucket (default: `Buckets.all_keys()`, prompt-logprob rows
        included), and its LoRA variant when the model holds a LoRA table, compiled without
        running, as many at once as there are CPU cores (JAX keeps what `lower(...).compile()`
        traced, lowered and compiled, so the first real step dispatches at once; running an empty
        batch cost ~4 s over the default buckets on 2 cores). Then, for each count of logits rows, the sampling programs, run once on zero
        logits: every logits processor (penalties, held-back ids, the structured-output mask) and
        the sampler; with `drafts` also the sampler that verifies drafted tokens (proposers with
        one-hot drafts: n-gram, EAGLE, Medusa). With LoRA, also the program that loads an adapter.
        A vision model's prefill and mixed buckets also compile their image variant (`image_inputs`)."""
        keys = list(keys or self.buckets.all_keys())
        if self.lora_enabled:  # the program that writes an adapter into a slot: zeros into slot 0 (no adapter)
            self.write_lora_slot(0, {f"lora.{name}": np.zeros(a.shape[:1] + a.shape[2:], np.float32)
                                     for name, a in self._lora_layout.items()})

        def compile_model(job: tuple[BucketKey, bool, bool]):
            key, with_lora, with_images = job
            batch = self._empty_batch(key, with_lora, with_images)
            t0 = time.perf_counter()
            lowered = self.step_fn.lower(self.params, self.kv, batch, self.token_buffer, key)
            lowered.compile()
            return key, time.perf_counter() - t0, lowered.out_info

        jobs = [(key, with_lora, with_images) for key in keys for with_lora in ((False, True) if self.lora_enabled else (False,))
                for with_images in ((False, True) if self.image_inputs and key.query_block > 1 else (False,))]
        after_model = {}  # R -> (a bucket with R logits rows, the model program's logits and hidden states)
        # XLA compiles outside the GIL: one thread per core (at most 8: each holds a compile's host
        # memory) compiles that many buckets at once
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1, 8))) as pool:
            for key, seconds, out_info in pool.map(compile_model, jobs):
                self.compile_seconds[key] = self.compile_seconds.get(key, 0.0) + seconds
                after_model.setdefault(key.num_logits, (key, out_info))
        if self.step_fn.pooling:
            return  # (nothing samples)
        for key, (logits, _, *hidden) in after_model.values():
            hidden = hidden[:1] if self.step_fn.return_hidden else []  # (not the stream: the sampler never reads it)
            rows, vocab = key.num_logits, logits.shape[-1]
            sharding = self.step_fn.logits_layout(rows, vocab).sharding
            outputs = _zeros([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (logits, *hidden)])
            for with_drafts in (False, True) if drafts else (False,):  # (an engine with draft trees verifies trees)
                sampling = every_processor_sampling(rows, vocab, self.max_history, self.num_replicas,
                                                    drafts=with_drafts and not self.with_tree, trees=with_drafts and self.with_tree)
                sampling = sampling if self.pass_host_inputs else self._put(sampling)
                jax.block_until_ready(self.step_fn.sample(outputs[0], sampling, *outputs[1:]))

    def compiled_hlo(self, key: BucketKey) -> str:
        """The optimized HLO of one bucket's step (for inspection; compiles if needed)."""
        return self.step_fn.lower(self.params, self.kv, self._empty_batch(key), self.token_buffer, key).compile().as_text()

    # ------------------------------------------------------------------ whole pages (copy-on-write, swapping)
    def _global_pages(self, replica: int, pages: Sequence[int]) -> np.ndarray:
        """A replica's page ids -> ids on the cache's page axis (replica r's pool starts at r * P)."""
        return replica * self.pages_per_replica + np.asarray(pages, np.int32)

    def copy_pages(self, copies: Sequence[tuple[int, tuple[int, int]]]) -> None:
        """Copies whole pages (every layer, K and V) src -> dst on the device, in place; `copies`
        holds (replica, (src, dst)) pairs of that replica's page ids.

        Used for copy-on-write. The list is padded to a power of two with scratch-to-scratch
        copies so only a few sizes ever compile (`warmup_page_ops` compiles them).
        """
        n = _power_of_two(len(copies))
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        for i, (replica, (s, d)) in enumerate(copies):
            src[i], dst[i] = self._global_pages(replica, [s, d])
        self.kv = self._page_ops().copy(self.kv, src, dst)

    @property
    def state_slots_per_replica(self) -> int:
        """A hybrid model's recurrent-state slots per replica, scratch included (0: no states)."""
        return self.kv.state.num_slots // self.num_replicas if self.kv.state is not None else 0

    def copy_states(self, copies: Sequence[tuple[int, tuple[int, int]]]) -> None:
        """Copies recurrent-state slots src -> dst (a forked sequence continues its parent's
        state), in place; `copies`: (replica, (src, dst)) pairs of that replica's slots."""
        if not copies:
            return
        n = self.state_slots_per_replica
        src = np.zeros(_power_of_two(len(copies)), np.int32)  # (padded with scratch-to-scratch copies: few sizes compile)
        dst = np.zeros_like(src)
        for i, (r, (a, b)) in enumerate(copies):
            src[i], dst[i] = r * n + a, r * n + b
        self.kv = _copy_states(self.kv, src, dst)

    def commit_drafts(self, commits: Sequence[tuple[int, tuple[int, int]]]) -> None:
        """Advances the slots of verified chunks by the tokens kept (jaxinfer.ops.linear_state.
        commit_drafts), in place; `commits`: (replica, (slot, tokens kept)). Padded to a power of
        two with scratch-slot entries that keep nothing."""
        if not commits:
            return
        n = self.state_slots_per_replica
        slots = np.zeros(_power_of_two(len(commits)), np.int32)
        kept = np.zeros_like(slots)
        for i, (r, (slot, count)) in enumerate(commits):
            slots[i], kept[i] = r * n + slot, count
        self.kv = _commit_drafts(self.kv, slots, kept)

    def move_kv_rows(self, moves: Sequence[tuple[int, Sequence[Sequence[int]], Sequence[int], int, int]]) -> None:
        """Moves single tokens' K/V within their sequences' pages, in place: every layer, every KV
        layer group, a quantized pool's scales too. Draft trees: the accepted nodes' rows go from
        the slots they were verified in to the positions right after the root (engine.core).
        `moves`: (replica, the sequence's page-table rows per group and their page_offsets (as its
        chunk held them: `SequenceChunk.pages`), from position, to position). All sources are
        read before any row is written. Padded with scratch-to-scratch moves to `max_tree_moves`
        (one compiled size, `warmup_page_ops`; a power of two past it)."""
        if not moves:
            return
        n, G = _power_of_two(max(len(moves), self.max_tree_moves)), len(self.kv_page_factors)
        src = np.zeros((2, G, n), np.int32)  # (global page, offset in it) per group and move
        dst = np.zeros((2, G, n), np.int32)
        for i, (replica, rows, offsets, a, b) in enumerate(moves):
            for g, row in enumerate(rows):
                size = self.page_size * self.kv_page_factors[g]  # the group's tokens per page
                first = offsets[g] if offsets else 0
                for out, pos in ((src, a), (dst, b)):
                    out[0, g, i] = replica * self.pages_per_replica + row[pos // size - first]
                    out[1, g, i] = pos % size
        mover = row_mover(self.step_fn.mesh, self.kv.quantized, self.kv.combined, self.kv.outliers > 0,
                          self.kv.evict_score is not None, self.kv.state is not None,
                          self.kv.state is not None and self.kv.state.drafts is not None, self.kv_page_factors,
                          self.kv.sequence_sharded)
        self.kv = mover(self.kv, src, dst)

    def read_state(self, replica: int, slot: int):
        """One sequence slot's recurrent states, every linear layer, on the host (numpy arrays [L_lin, 1, ...])."""
        return jax.device_get(_read_state(self.kv, np.int32(replica * self.state_slots_per_replica + slot)))

    def write_state(self, replica: int, slot: int, saved) -> None:
        """Writes host states (as read_state returns them) into a sequence slot, in place."""
        self.kv = _write_state(self.kv, np.int32(replica * self.state_slots_per_replica + slot), saved)

    def _page_ops(self) -> "PageOps":
        state = self.kv.state
        return page_ops(self.step_fn.mesh, self.kv.quantized, self.kv.combined, state is not None,
                        state is not None and state.drafts is not None, self.kv.outliers > 0, self.kv.evict_score is not None,
                        self.kv.sequence_sharded)

    def read_pages(self, replica: int, pages: Sequence[int]) -> KVCache:
        """A replica's pages, all layers, on the host: a KVCache of numpy arrays, k and v
        [slots, len(pages), page_size, Hkv, D] (and a quantized pool's scales) (all KV heads,
        gathered from their tensor shards; every process gets them). The page list is padded to
        a power of two with the scratch page, as `copy_pages` does."""
        padded = np.zeros(_power_of_two(len(pages)), np.int32)
        padded[: len(pages)] = pages
        saved = self._page_ops().read(self.kv, self._global_pages(replica, padded))
        return jax.tree.map(lambda a: np.asarray(a)[:, : len(pages)], saved)

    def gather_pages(self, replica: int, pages: Sequence[int]) -> KVCache:
        """A replica's pages, all layers, as new device arrays (read_pages without the trip to the
        host: a prefill instance's handoff, engine.kv_handoff)."""
        padded = np.zeros(_power_of_two(len(pages)), np.int32)
        padded[: len(pages)] = pages
        saved = self._page_ops().read(self.kv, self._global_pages(replica, padded))
        return jax.tree.map(lambda a: a[:, : len(pages)], saved)

    def write_pages(self, replica: int, pages: Sequence[int], saved: KVCache) -> None:
        """Writes pages (as read_pages or gather_pages return them: host or device arrays) into a
        replica's pages, in place (the list padded to a power of two with writes of zeros to the
        scratch page)."""
        n = _power_of_two(len(pages))
        padded = np.zeros(n, np.int32)
        padded[: len(pages)] = pages
        everywhere = jax.sharding.NamedSharding(self.step_fn.mesh, jax.sharding.PartitionSpec())

        def pad(a):  # device arrays stay on the devices: on this mesh's (another engine's handoff)
            if isinstance(a, jax.Array):
                return jnp.pad(jax.device_put(a, everywhere), [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
            return np.pad(a, [(0, 0), (0, n - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

        saved = jax.tree.map(pad, saved)
        self.kv = self._page_ops().write(self.kv, self._global_pages(replica, padded), saved)

    # ------------------------------------------------------------------ single pages to and from host memory (engine.kv_tiers)
    @functools.cached_property
    def reads_to_pinned_host(self) -> bool:
        """Whether `read_pages_to_host` leaves pages in pinned host memory without waiting (every
        device of the mesh offers that memory kind, one process); else it reads to numpy."""
        return jax.process_count() == 1 and all(
            any(m.kind == "pinned_host" for m in d.addressable_memories()) for d in self.step_fn.mesh.devices.flat)

    def read_pages_to_host(self, replica: int, pages: Sequence[int]) -> list[dict]:
        """Each page's arrays (every layer: K and V, a quantized pool's scales) in host memory, one
        dict per page: array name -> [slots, page_size, ...]. In reads of at most pages_per_seq
        pages (padded to powers of two: `warmup_page_ops` compiles them); pinned host memory and no
        waiting where `reads_to_pinned_host`, else numpy (`read_pages`)."""
        out, most = [], self.buckets.pages_per_seq
        for chunk in (pages[i : i + most] for i in range(0, len(pages), most)):
            if not self.reads_to_pinned_host:
                saved = self.read_pages(replica, chunk)
                fields = [(f.name, getattr(saved, f.name)) for f in dataclasses.fields(saved)
                          if f.name not in ("state", "sequence_sharded")]  # (page arrays only)
                out += [{name: np.ascontiguousarray(a[:, i]) for name, a in fields if a is not None} for i in range(len(chunk))]
                continue
            padded = np.zeros(_power_of_two(len(chunk)), np.int32)
            padded[: len(chunk)] = chunk
            read = _reader_to_host(self.step_fn.mesh, self.kv.quantized, self.kv.combined, len(padded), self.kv.outliers > 0)
            out += read(self.kv.page_arrays(), self._global_pages(replica, padded))[: len(chunk)]
        return out

    def write_pages_from_host(self, replica: int, pages: Sequence[int], contents: Sequence[dict]) -> None:
        """Writes pages' contents (as read_pages_to_host returns them) into a replica's pages, in
        place, in writes of at most pages_per_seq pages. Contents in pinned host memory are copied
        to the devices asynchronously (the copies overlap a step still running there; the write
        waits for them, the next step for the write); numpy contents are sent as the write starts."""
        most = self.buckets.pages_per_seq
        on_devices = jax.sharding.NamedSharding(self.step_fn.mesh, jax.sharding.PartitionSpec())
        for i in range(0, len(pages), most):
            chunk = contents[i : i + most]
            if all(isinstance(a, jax.Array) for c in chunk for a in c.values()):
                stacked = {name: jnp.stack([jax.device_put(c[name], on_devices) for c in chunk], axis=1) for name in chunk[0]}
            else:
                stacked = {name: np.stack([np.asarray(c[name]) for c in chunk], axis=1) for name in chunk[0]}
            self.write_pages(replica, pages[i : i + most], KVCache(**stacked))

    def warmup_page_ops(self, *, max_copies: int, max_swapped: int = 0, max_offloaded: int = 0) -> None:
        """Compiles the page programs for every padded size: copies of up to `max_copies` pages
        (copy-on-write: a step copies at most a page per sequence) and, with swapping, reads and
        writes of up to `max_swapped` pages (a sequence's), with the KV tiers reads to host memory
        of up to `max_offloaded`, with draft trees the move of token rows (`move_kv_rows`). Each
        runs once on the scratch page. A hybrid model's state
        programs too (a fork's copy, a swap's read and write), on the scratch slot."""
        for n in _powers_of_two_to(max_copies):
            self.copy_pages([(0, (0, 0))] * n)
        if self.max_tree_moves:  # draft trees' accepted nodes (one size: scratch to scratch)
            self.move_kv_rows([(0, [[0]] * len(self.kv_page_factors), (), 0, 0)])
        for n in _powers_of_two_to(max(max_swapped, max_offloaded)):
            self.write_pages(0, [0] * n, self.read_pages(0, [0] * n))
        for n in _powers_of_two_to(min(max_offloaded, self.buckets.pages_per_seq)):
            self.read_pages_to_host(0, [0] * n)
        if self.kv.state is not None:
            for n in _powers_of_two_to(max_copies):  # forks, prefix hits' restores and saves; verified drafts
                self.copy_states([(0, (0, 0))] * n)
                if self.kv.state.drafts is not None:
                    self.commit_drafts([(0, (0, 0))] * n)
            if max_swapped:
                self.write_state(0, 0, self.read_state(0, 0))


def _power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def _powers_of_two_to(n: int) -> list[int]:
    """1, 2, 4, ... up to the padded size of n (none for n = 0)."""
    return [1 << i for i in range(_power_of_two(n).bit_length())] if n > 0 else []

def sampling_tensors(num_rows: int, scheduled, rows_of_chunk, max_history: int, want_logprobs: bool = False,
                      max_banned: int | None = None, penalties: bool | None = None,
                      drafts: bool | None = None, mask_words: int | None = None, trees: bool | None = None) -> SamplingTensors:
    """One replica's sampling tensors for `num_rows` logits rows (host arrays); `max_history`: the
    longest a sequence can be (the penalties' history width). The optional fields are switched on by
    `max_banned` (the most banned ids of a row; always MAX_BANNED_IDS columns), `penalties`,
    `drafts`, `trees` (draft trees' children) and `mask_words` (the allowed-token bitmask's width), by default when one of these
    chunks needs them; a step passes what any replica needs, so the replicas' trees stack."""
    if max_banned is None:
        max_banned = max((len(s.sampling.banned_ids) for s in scheduled), default=0)
    if penalties is None:
        penalties = any(s.sampling.uses_penalties for s in scheduled)
    if drafts is None:
        drafts = any(s.sampling.draft_tokens for s in scheduled)
    if trees is None:
        trees = any(s.sampling.tree_children for s in scheduled)
    if mask_words is None:
        mask_words = max((s.sampling.allowed_tokens.shape[-1] for s in scheduled if s.sampling.allowed_tokens is not None), default=0)
    R = num_rows
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
    if mask_words:
        st.allowed_tokens = np.full((R, mask_words), -1, np.int32)  # every bit set: unconstrained rows
        for s, rows in zip(scheduled, rows_of_chunk):
            if s.sampling.allowed_tokens is not None:
                st.allowed_tokens[rows] = s.sampling.allowed_tokens
    if drafts:
        st.draft_token = np.full(R, -1, np.int32)
        for s, rows in zip(scheduled, rows_of_chunk):
            if s.sampling.draft_tokens:
                st.draft_token[rows] = s.sampling.draft_tokens
    if trees:
        st.tree_children = np.full((R, MAX_TREE_CHILDREN), -1, np.int32)
        for s, rows in zip(scheduled, rows_of_chunk):
            for row, children in zip(rows, s.sampling.tree_children):
                st.tree_children[row, : len(children)] = children
    if max_banned:
        if max_banned > MAX_BANNED_IDS:  # the input checks refuse such a request
            raise ValueError(f"{max_banned} banned ids in one row; the sampler holds at most {MAX_BANNED_IDS}")
        st.banned_ids = np.full((R, MAX_BANNED_IDS), -1, np.int32)
        for s, rows in zip(scheduled, rows_of_chunk):
            # (rows as ints: a prefill chunk short of its prompt's end has none)
            st.banned_ids[np.asarray(rows, np.int64)[:, None], np.arange(len(s.sampling.banned_ids))] = s.sampling.banned_ids
    if penalties:
        H = max_history
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


def empty_inputs(key: BucketKey, pages_per_seq: int, num_replicas: int, with_lora: bool = False,
                 num_groups: int = 1, *, with_rope_positions: bool = False,
                 image_inputs: tuple[int, int, bool] | None = None, with_tree: bool = False) -> RaggedBatch:
    """A host batch of the key's shapes with no sequences in it (every token writes to scratch),
    stacked over the replicas: what warm-up compiles the model for and what ahead-of-time
    compiles take the shapes of. `image_inputs` (width, deepstack rows, span_end): the image
    variant, as `ModelRunner.image_inputs` describes it (its fields, zeros). `with_tree`: with
    tree masks (every row plain causal attention: `pack_batch(with_tree=True)` of no chunks)."""
    T, S, R = key.num_tokens, key.num_seqs, key.num_logits
    batch = RaggedBatch(
        token_ids=np.zeros(T, np.int32),
        positions=np.zeros(T, np.int32),
        cu_q_lens=np.zeros(S + 1, np.int32),
        kv_lens=np.zeros(S, np.int32),
        page_table=np.zeros((num_groups, S, pages_per_seq), np.int32),
        num_seqs=np.zeros(1, np.int32),
        logits_indices=np.zeros(R, np.int32),
        token_src=np.full(T, -1, np.int32),
        lora_slots=np.zeros(S, np.int32) if with_lora else None,
        state_slots=np.zeros(S, np.int32),
        verifies=np.zeros(S, bool),
        rope_positions=np.zeros((3, T), np.int32) if with_rope_positions else None,
    )
    if image_inputs:
        width, deepstack, span_end = image_inputs
        batch.mm_embeds, batch.mm_mask = np.zeros((T, width), np.float32), np.zeros(T, bool)
        batch.mm_deepstack = np.zeros((deepstack, T, width), np.float32) if deepstack else None
        batch.span_end = np.zeros(T, np.int32) if span_end else None
    if with_tree:  # (the fields pack_batch gives a batch of no chunks)
        buckets = Buckets((T,), S, pages_per_seq, num_groups=num_groups)
        _, empty, _ = pack_batch([], buckets, 1, key, with_tree=True)
        for field in dataclasses.fields(empty):
            if field.name.startswith("tree"):
                setattr(batch, field.name, getattr(empty, field.name))
    return jax.tree.map(lambda a: np.stack([a] * num_replicas), batch)


def every_processor_sampling(num_rows: int, vocab: int, max_history: int, num_replicas: int, *,
                             drafts: bool = False, trees: bool = False) -> SamplingTensors:
    """Host sampling tensors of `num_rows` rows, stacked over the replicas, with every logits
    processor switched on (penalties, held-back ids, the allowed-token mask) and with `drafts`
    draft verification (`trees`: draft trees' verification): what warm-up runs the sampling
    programs on and memory sizing measures."""
    st = sampling_tensors(num_rows, [], [], max_history, penalties=True, max_banned=1, drafts=drafts,
                          mask_words=-(-vocab // 32), trees=trees)
    return jax.tree.map(lambda a: np.stack([a] * num_replicas), st)


class Recovered(NamedTuple):
    """What ModelRunner.recover re-created."""

    pool: bool  # the KV pool: its pages' contents are gone
    lora_table: bool  # the LoRA slot table: every slot is empty


def _layout(a: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def _zeros(layout):
    """Zeros of a tree of ShapeDtypeStructs, placed with their shardings."""
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layout),
                   out_shardings=jax.tree.map(lambda s: s.sharding, layout))()


def _usable(tree) -> bool:
    """Whether every array of `tree` is alive and was computed without error."""
    try:
        if any(a.is_deleted() for a in jax.tree.leaves(tree)):
            return False
        jax.block_until_ready(tree)
        return True
    except Exception:  # noqa: BLE001 - an array whose computation failed raises its error here
        return False


@jax.jit
def _gather_rows(buffer: jax.Array, src: jax.Array) -> jax.Array:
    """buffer [replicas, N, V], src [replicas, R] (-1: any row) -> [replicas, R, V]."""
    return jax.vmap(lambda b, s: b[jnp.maximum(s, 0)])(buffer, src)


class PageOps(NamedTuple):
    """Jitted whole-page operations on the cache of one mesh (it keeps the step's sharding)."""

    copy: Callable  # (kv, src [n], dst [n]) -> kv, in place: copy-on-write
    write: Callable  # (kv, pages [n], saved: KVCache of [L, n, ...]) -> kv, in place: swap-in
    read: Callable  # (kv, pages [n]) -> KVCache of [L, n, ...], replicated so every process can fetch it: swap-out


@functools.partial(jax.jit, donate_argnums=0)
def _copy_states(kv: KVCache, src, dst) -> KVCache:
    state = jax.tree.map(lambda a: a.at[:, dst].set(a[:, src]), kv.state)
    return dataclasses.replace(kv, state=state)


@functools.partial(jax.jit, donate_argnums=0)
def _commit_drafts(kv: KVCache, slots, kept) -> KVCache:
    return dataclasses.replace(kv, state=commit_drafts(kv.state, slots, kept))


@jax.jit
def _read_state(kv: KVCache, slot):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), kv.state)


@functools.partial(jax.jit, donate_argnums=0)
def _write_state(kv: KVCache, slot, saved) -> KVCache:
    state = jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), slot, axis=1), kv.state, saved)
    return dataclasses.replace(kv, state=state)


@functools.cache
def _reader_to_host(mesh, quantized: bool, combined: bool, n: int, outliers: bool = False) -> Callable:
    """Jitted (page arrays, pages [n]) -> n dicts, array name -> that page's [slots, page_size, ...]
    in pinned host memory, each its own buffer, split over the tensor axis as the pool is."""
    specs = kv_partition_spec(quantized, combined, outliers=outliers)
    fields = [(f.name, getattr(specs, f.name)) for f in dataclasses.fields(specs) if f.name not in ("state", "sequence_sharded")]
    fields = [(name, tuple(spec)) for name, spec in fields if spec is not None]
    per_page = {name: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[:1], *spec[2:]),
                                                 memory_kind="pinned_host") for name, spec in fields}

    def read(kv: KVCache, pages):
        return [{name: getattr(kv, name)[:, pages[i]] for name, _ in fields} for i in range(n)]

    return jax.jit(read, out_shardings=[per_page] * n)


@functools.cache
def page_ops(mesh, quantized: bool, combined: bool = False, linear: bool = False, drafts: bool = False,
             outliers: bool = False, eviction: bool = False, sequence: bool = False) -> PageOps:
    """Every page array of the cache (K, V and a quantized pool's scales) shares the [L, P] leading
    axes, so each operation is the same on all of them; a hybrid model's recurrent states
    (`linear`) stay as they are."""
    kv_sharding = kv_shardings(mesh, quantized, combined, linear, drafts, outliers, eviction, sequence)  # (sequence: context parallelism)
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def copy(kv: KVCache, src, dst) -> KVCache:
        return kv.map_pages(lambda a: a.at[:, dst].set(a[:, src]))

    def write(kv: KVCache, pages, saved: KVCache) -> KVCache:
        return kv.map_pages(lambda a, b: a.at[:, pages].set(b.astype(a.dtype)), saved)

    def read(kv: KVCache, pages) -> KVCache:
        return jax.tree.map(lambda a: a[:, pages], kv.page_arrays())

    return PageOps(copy=jax.jit(copy, donate_argnums=0, out_shardings=kv_sharding),
                   write=jax.jit(write, donate_argnums=0, out_shardings=kv_sharding),
                   read=jax.jit(read, out_shardings=everywhere))


@functools.cache
def row_mover(mesh, quantized: bool, combined: bool, outliers: bool, eviction: bool, linear: bool, drafts: bool,
              factors: tuple[int, ...], sequence: bool = False) -> Callable:
    """Jitted (kv, src [2, G, n], dst [2, G, n]) -> kv, donated: for each KV layer group g and move i,
    the token row at (page src[0, g, i], offset src[1, g, i]) of every slot copied to dst's, in every
    page array. A group whose pages hold page_size * f tokens (`factors`: jaxinfer.kv_groups) sees
    each page as that many rows (`KVCache.group_view`: the same bytes); a combined pool's scales
    [slots, P, Hkv * 2 * page_size] run (head, K|V, token), so their token is the last axis."""
    if outliers or eviction:
        raise ValueError("moving single tokens' K/V (draft trees) is not supported with kv_cache_outliers or KV eviction")
    kv_sharding = kv_shardings(mesh, quantized, combined, linear, drafts, False, False, sequence)  # (sequence: context parallelism)

    def move_rows(kv: KVCache, src, dst) -> KVCache:
        def move(name: str, a: jax.Array) -> jax.Array:
            slots, pages = a.shape[:2]
            for g, f in enumerate(factors):
                (sp, so), (dp, do) = src[:, g], dst[:, g]
                if name == "kv_scale":  # [slots, P, Hkv * 2, page_size]: the token is the last axis
                    view = a.reshape(slots, pages, -1, kv.page_size)
                    a = view.at[:, dp, :, do].set(view[:, sp, :, so]).reshape(a.shape)
                else:  # [slots, P, page_size * f, the rest]
                    view = a.reshape(slots, pages, a.shape[2] * f, -1)
                    a = view.at[:, dp, do].set(view[:, sp, so]).reshape(a.shape)
            return a

        arrays = kv.page_arrays()
        moved = {f.name: move(f.name, getattr(arrays, f.name)) for f in dataclasses.fields(arrays)
                 if f.name not in ("state", "sequence_sharded") and getattr(arrays, f.name) is not None}
        return dataclasses.replace(kv, **moved)

    return jax.jit(move_rows, donate_argnums=0, out_shardings=kv_sharding)

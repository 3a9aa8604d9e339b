"""Requests and the sequences they run as.

A `Request` is what a user submitted: a prompt and its `SamplingParams`. It runs as one or more
`Sequence`s: one while its prompt is prefilled, then `n` of them (the first sequence is forked
after prefill, sharing every prompt page). A sequence's life:

    WAITING --admitted--> RUNNING --finished--> FINISHED
       ^                     |
       +----preempted--------+   (pages freed; recomputed from its tokens when readmitted)
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Any

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.grammar import Matcher
from jaxinfer.engine.pooling import PoolState
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import PositionLogprobs
from jaxinfer.sampling_params import SamplingParams

_seq_ids = itertools.count()
PENDING = -1  # placeholder for a sampled token still on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones, and what follows from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (s)."""
        if self.last_token_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e(self) -> float | None:
        """Arrival to finish (s)."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass(eq=False)
class SwappedKV:
    """A preempted sequence's computed pages, saved on the host (ModelRunner.read_pages: a KVCache
    of numpy arrays [L, pages, ...])."""

    pages: object
    num_computed: int
    state: object = None  # a hybrid model's recurrent states of its slot (ModelRunner.read_state), or None


@dataclasses.dataclass
class SpecState:
    """One sequence's speculation: how many tokens to draft now, and a running acceptance rate.

    Back-off: after each verification the acceptance rate (accepted / drafted, an exponential
    average) is updated; below `SpecState.LOW` the draft length halves, at 1 it pauses for
    `PAUSE` steps of plain decoding and then tries again with 1; above `HIGH` it grows by one
    up to the configured maximum. A proposer that finds nothing to draft `EMPTY` times in a row
    (prompt lookup in text that does not repeat) pauses it too: a sequence that may draft makes
    the engine read each step before scheduling the next, which a paused one does not."""

    max_k: int
    k: int
    acceptance: float = 1.0
    pause: int = 0  # plain steps left before drafting again
    empty: int = 0  # proposals in a row that drafted nothing
    draft: list[int] = dataclasses.field(default_factory=list)  # drafted tokens to verify in its next step
    draft_src: list[int] = dataclasses.field(default_factory=list)  # their rows of the step's draft_buffer (draft models)
    draft_parents: list[int] = dataclasses.field(default_factory=list)  # a draft tree's: each draft's parent (-1: root); [] = a chain
    # rows after the tree's nodes, never accepted (lookahead's window: spec_decode.ExtraRows; its
    # tokens are the last ones of `draft`); None: none
    draft_extra: Any = None
    draft_computed: int = 0  # tokens a draft model's own cache holds for it
    hidden_row: int | None = None  # draft heads: the logits row (of step hidden_step) its newest token came from
    hidden_step: int = -1
    LOW = 0.3
    HIGH = 0.7
    PAUSE = 8
    EMPTY = 4
    SMOOTHING = 0.5

    @property
    def drafts_next_step(self) -> bool:
        return self.pause == 0

    def proposed(self, num_drafted: int) -> None:
        """What the proposer drafted this step."""
        self.empty = 0 if num_drafted else self.empty + 1
        if self.empty >= self.EMPTY:
            self.pause, self.empty = self.PAUSE, 0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.acceptance = self.SMOOTHING * self.acceptance + (1 - self.SMOOTHING) * accepted / drafted
        if self.acceptance < self.LOW:
            if self.k == 1:
                self.pause, self.acceptance = self.PAUSE, (self.LOW + self.HIGH) / 2
            self.k = max(1, self.k // 2)
        elif self.acceptance > self.HIGH:
            self.k = min(self.max_k, self.k + 1)

    def tick(self) -> bool:
        """Whether to draft this step (counts down a pause)."""
        if self.pause:
            self.pause -= 1
            return False
        return True


@dataclasses.dataclass(eq=False)
class Sequence:
    request: "Request"
    index: int  # completion index within the request
    token_ids: list[int]  # prompt + output
    seed: int
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    output_logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    num_preemptions: int = 0
    swapped: SwappedKV | None = None  # K/V saved to host memory when preempted in swap mode
    # tokens sampled by a dispatched step not read back yet: index in token_ids -> row of that
    # step's sampled tokens (their entry in token_ids is PENDING until then)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)
    hold: bool = False  # its pending token ends it (length): don't schedule it again
    spec: "SpecState | None" = None  # speculative decoding: its drafts and draft length (None: it never speculates)
    grammar: "Matcher | None" = None  # structured outputs: where its tokens so far leave it in its grammar

    @property
    def lora_id(self) -> int:
        """Its request's LoRA adapter id (0: the base model)."""
        return self.request.lora.lora_int_id if self.request.lora is not None else 0

    def cache_ids(self, token_ids: list[int] | None = None) -> list[int]:
        """Its tokens (or `token_ids`, its tokens plus more) as prefix-cache keys read them: a
        prompt's image tokens stand for their image (multimodal.PromptImage.key_ids)."""
        ids = self.token_ids if token_ids is None else token_ids
        keys = self.request.cache_key_ids
        return ids if keys is None else keys + ids[len(keys):]

    @property
    def prefix_salt(self) -> bytes:
        """What its prefix-cache keys chain from: pages computed under another adapter differ."""
        return f"lora:{self.lora_id}".encode() if self.lora_id else b""

    @property
    def max_cached_tokens(self) -> int | None:
        """How many of its leading tokens may take their K/V from cache (prefix-cache pages, or its
        own pages swapped out) instead of being computed; None: all of them. While its request
        still collects prompt logprobs, only the tokens before the row that scores the first
        missing entry: a fresh request computes its whole prompt (vLLM skips the prefix-cache
        lookup for it too) and a preempted one resumes where its entries stop."""
        if self.request.pooling is not None:  # (the rows its pooling still reads must be computed)
            return self.request.pooling.cached_tokens
        if not self.request.wants_prompt_logprobs:
            return None
        return len(self.request.prompt_logprobs) - 1

    @property
    def draft(self) -> list[int]:
        """Drafted tokens to verify in its next step."""
        return self.spec.draft if self.spec is not None else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        """True while more than the newest token is uncomputed (a prompt, or a recompute)."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the seed of completion 0; others derive from it
    max_len: int  # prompt + tokens it may generate, within max_model_len
    priority: int = 0  # lower runs first (vLLM's convention)
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(time.time()))
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    # one entry per prompt token scored so far (with params.prompt_logprobs; else None); entry 0,
    # the first token's, is None: nothing comes before it
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    forked: bool = False  # the n completions exist
    replica: int = 0  # the data-parallel replica its sequences run on (its pages live there)
    lora: "LoRARequest | None" = None  # the LoRA adapter it runs with (None: the base model)
    error: str | None = None  # why the engine failed it (its sequences' finish_reason is "error")
    # prefill/decode disaggregation (engine.kv_handoff): hand its prompt's pages off when it finishes
    export_kv: bool = False
    exported_kv: object = None  # the KVHandoff made when it finished (export_kv)
    # images (jaxinfer.engine.multimodal): each image's run of tokens in the prompt and its pixels
    images: list = dataclasses.field(default_factory=list)
    cache_key_ids: list[int] | None = None  # the prompt as prefix-cache keys read it (images: their hashes)
    rope_positions: "np.ndarray | None" = None  # [3, prompt length]: M-RoPE positions of the prompt (Qwen2.5-VL)
    rope_delta: int = 0  # a generated token at position p has M-RoPE position p + rope_delta (all three)
    # a pooling request (runner="pooling", engine.pooling): its pooling so far, then its vector
    pooling: "PoolState | None" = None
    pooled: list[float] | None = None

    def __post_init__(self):
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        done = all(s.finished for s in self.seqs)
        return done and (self.forked or self.pooling is not None or any(s.finish_reason in ("abort", "error") for s in self.seqs))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still collecting prompt logprobs (until every prompt token has its entry)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

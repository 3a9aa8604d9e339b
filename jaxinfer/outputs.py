"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution (None if not in the top-n)
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the chosen token and the top-n alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None  # engine.request.RequestMetrics: arrival, first token, finish; ttft / tpot / e2e
    error: str | None = None  # set when the engine failed the request (finish_reason "error"): why
    kv_handoff: Any = None  # a prefill instance's: its prompt's pages (engine.kv_handoff.KVHandoff)


class RequestFailedError(RuntimeError):
    """A request the engine failed (its RequestOutput.error); `LLM.generate` raises it after
    aborting its other requests."""


@dataclasses.dataclass
class PoolingOutput:
    """A pooled vector: `embedding` (task "embed"), or a classifier's `probs` over its labels
    (task "classify"; `score` is the first label's, what a one-label reranker gives)."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def probs(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        return self.data[0]


@dataclasses.dataclass
class PoolingRequestOutput:
    """What `LLM.embed` / `LLM.classify` / `LLM.encode` return per prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None  # None until it finishes (or when it failed)
    finished: bool
    metrics: Any = None
    error: str | None = None


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair: a reranker's relevance, or the cosine similarity of two
    embeddings."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True

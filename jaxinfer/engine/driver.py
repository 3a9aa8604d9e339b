"""A simple driver: runs a fixed list of sequences through the paged step to completion.

Each iteration it admits waiting sequences FCFS while their pages fit, then fills a token budget
with one decode token per running sequence and prefill chunks after that (so prefills are
chunked and mixed with decodes in one ragged step), runs the step, and appends the sampled
tokens. Pages for a sequence's whole length (prompt + max_tokens) are reserved when it is
admitted, so nothing is ever preempted; the continuous-batching scheduler with a block manager,
prefix caching and preemption replaces this loop in the engine issue, driving the same
`ModelRunner`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from jaxinfer.batch import SequenceChunk
from jaxinfer.engine.model_runner import ModelRunner, RowResult, RowSampling, ScheduledChunk
from jaxinfer.outputs import Logprob, PositionLogprobs
from jaxinfer.sampling_params import SamplingParams


@dataclasses.dataclass
class SequenceState:
    """One completion being generated (a request with n > 1 has n of them)."""

    request_index: int
    index: int  # completion index within its request
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + tokens it may generate
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_token_ids)


class PagePool:
    """A free list of page ids; page 0 is the scratch page and never handed out."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, 0, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} pages, {len(self.free)} free")
        split = len(self.free) - n
        pages, self.free = self.free[split:], self.free[:split]
        return pages[::-1]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


class SimpleDriver:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: Sequence[int],
        detokenize: Callable[[list[int], bool], str],
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ):
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.page_size = runner.kv.page_size
        self.pool = PagePool(runner.kv.num_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def run(self, seqs: list[SequenceState], on_finish: Callable[[SequenceState], None] = lambda s: None) -> None:
        waiting = collections.deque(seqs)
        running: list[SequenceState] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                need = self.pages_for(waiting[0].max_len)
                if need > len(self.pool.free):
                    if not running:
                        raise RuntimeError(
                            f"the KV cache ({self.runner.kv.num_pages - 1} usable pages of {self.page_size} tokens) "
                            f"cannot hold one sequence of {waiting[0].max_len} tokens; raise num_pages"
                        )
                    break
                seq = waiting.popleft()
                seq.pages = self.pool.allocate(need)
                running.append(seq)

            scheduled = self._schedule(running)
            want_logprobs = any(
                s.params.logprobs is not None or (s.params.prompt_logprobs is not None and s.prefilling) for s, _ in scheduled
            )
            results = self.runner.execute([sc for _, sc in scheduled], want_logprobs=want_logprobs)
            for (seq, sc), rows in zip(scheduled, results):
                self._advance(seq, sc, rows)
            for seq in [s for s in running if s.finish_reason]:
                running.remove(seq)
                self.pool.release(seq.pages)
                seq.pages = []
                on_finish(seq)

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, running: list[SequenceState]) -> list[tuple[SequenceState, ScheduledChunk]]:
        """Decodes first (one token each), then prefill chunks in the budget left."""
        budget = self.max_num_batched_tokens
        out = []
        for seq in sorted(running, key=lambda s: s.prefilling):  # stable: decodes, then prefills in order
            if budget == 0:
                break
            tokens = seq.all_token_ids
            n = min(len(tokens) - seq.num_cached, budget)
            budget -= n
            chunk_tokens = tokens[seq.num_cached : seq.num_cached + n]
            end = seq.num_cached + n
            rows, targets = [], []
            if seq.params.prompt_logprobs is not None:
                # row i scores the token after it, while that token is still part of the prompt
                for i in range(n):
                    nxt = seq.num_cached + i + 1
                    if nxt < len(seq.prompt_token_ids):
                        rows.append(i)
                        targets.append(seq.prompt_token_ids[nxt])
            if end == len(tokens):  # the chunk reaches the newest token: sample the next one
                rows.append(n - 1)
                targets.append(-1)
            p = seq.params
            sampling = RowSampling(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seq.seed,
                counter=len(seq.output_token_ids), target_ids=targets,
            )
            out.append((seq, ScheduledChunk(SequenceChunk(chunk_tokens, seq.num_cached, seq.pages, rows), sampling)))
        return out

    # ------------------------------------------------------------------ outputs
    def _advance(self, seq: SequenceState, sc: ScheduledChunk, rows: list[RowResult]) -> None:
        seq.num_cached += len(sc.chunk.token_ids)
        p = seq.params
        for row, target in zip(rows, sc.sampling.target_ids):
            if target >= 0:  # a prompt-logprobs row scoring the next prompt token
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]  # the first prompt token has no logprob
                seq.prompt_logprobs.append(self._position_logprobs(target, row, p.prompt_logprobs))
            else:  # the row that samples the next token
                seq.output_token_ids.append(row.token)
                seq.cumulative_logprob += row.logprob
                if p.logprobs is not None:
                    seq.output_logprobs.append(self._position_logprobs(row.token, row, p.logprobs))
                self._check_stop(seq, row.token)

    def _position_logprobs(self, token: int, row: RowResult, n: int) -> PositionLogprobs:
        entry: PositionLogprobs = {}
        top_ids = [int(t) for t in row.top_ids[:n]]
        for rank, (tid, lp) in enumerate(zip(top_ids, row.top_logprobs[:n]), start=1):
            entry[tid] = Logprob(float(lp), rank, self.detokenize([tid], False))
        if token not in entry:
            rank = top_ids.index(token) + 1 if token in top_ids else None
            entry = {token: Logprob(row.logprob, rank, self.detokenize([token], False)), **entry}
        else:
            entry = {token: entry[token], **{k: v for k, v in entry.items() if k != token}}
        return entry

    def _check_stop(self, seq: SequenceState, token: int) -> None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif len(seq.all_token_ids) >= seq.max_len:
            seq.finish_reason = "length"
        if p.stop:
            text = self.detokenize(seq.output_token_ids, p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, stop = min(hits)
                seq.text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return
        if seq.finish_reason:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop":  # the EOS / stop token ends the text, it is not part of it
                ids = ids[:-1]
            seq.text = self.detokenize(ids, p.skip_special_tokens)

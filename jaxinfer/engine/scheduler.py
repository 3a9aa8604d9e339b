"""Iteration-level scheduler (Orca-style continuous batching with chunked prefill).

Each call to `schedule()` decides what one step computes, within two budgets:
`max_num_batched_tokens` (tokens in the step) and `max_num_seqs` (running sequences).

1. Running sequences that decode (one uncomputed token) go first, best priority first.
2. Then running sequences still prefilling (a prompt, or a recompute after preemption) get
   chunks of what budget is left, at most `max_prefill_chunks` multi-token chunks per step (the
   attention's prefill pass is sized for that many; see batch.py).
3. Then waiting sequences are admitted in order (priority, arrival) while pages and budgets
   allow; their prompt's cached prefix pages are reused and only the rest is prefilled (a
   request collecting prompt logprobs reuses none: each prompt token needs its row). Admission
   takes a full-attention group's pages for the whole prompt, a sliding group's for the first
   chunk (later chunks reserve theirs as decodes do: `BlockManager.reserve`). A
   sequence that does not fit blocks those behind it (FCFS), and nothing is admitted in a step
   that had to preempt. With LoRA, a sequence whose adapter would make more than `max_loras`
   distinct adapters run at once waits, and those behind it may go first.

A hybrid model (recurrent states beside the pages) resumes a cached prefix only where a state was
saved: a sequence's chunk ends at each position its state is to be saved at
(`BlockManager.next_checkpoint`), and a prefix hit's saved state is copied into the sequence's
slot before its first chunk (`SchedulerOutput.state_restores`).

Images (jaxinfer.engine.multimodal): a chunk stops before an image the step's encoder budget
(`max_num_encoder_input_tokens`, images already cached cost nothing) cannot take, and before an
image attended both ways (Gemma 3) that would not end inside it; a chunk that would start there
waits for a later step.

Speculative decoding: a decoding sequence holding drafted tokens (`seq.draft`) contributes its
newest token plus the drafts (what the budget leaves of them), and pages for all of them; such
verification chunks do not count against `max_prefill_chunks` (they are short and have an
attention pass of their own).

When a running sequence needs a page and none is free, the lowest-priority running sequence
not yet scheduled this step is preempted: its pages are freed and it goes back to waiting with
its tokens. With preemption_mode="recompute" (the default) its K/V are recomputed (with
whatever prefix pages are still cached) when it is readmitted; with "swap" the engine first
copies its pages to host memory and, on readmission, back into the new pages. Either way a
request collecting prompt logprobs resumes no later than its first position without an entry
(`Sequence.max_cached_tokens`), so each prompt token gets exactly one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS
from jaxinfer.engine.block_manager import BlockManager, OutOfPagesError
from jaxinfer.engine.request import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # computed this step, starting at `start` (drafted tokens included)
    num_draft: int = 0  # of those, drafted tokens to verify (the last ones)
    start: int = dataclasses.field(init=False)  # seq.num_computed when scheduled
    samples: bool = dataclasses.field(init=False)  # the chunk reaches the newest token: sample the next one
    # what the step computes for it (model_runner.ScheduledChunk: its tokens and rows, then its
    # results), set when the step is planned (engine.step_plan)
    chunk: Any = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        self.start = self.seq.num_computed
        self.samples = self.start + self.num_tokens - self.num_draft == len(self.seq.token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    page_copies: list[tuple[int, int]]  # (src, dst) device page copies to do before the step
    preempted: list[Sequence]
    # swap mode: (seq, its computed pages, tokens computed, its recurrent-state slot or 0): copy to host before anything writes
    swap_out: list[tuple[Sequence, list[int], int, int]] = dataclasses.field(default_factory=list)
    # swap mode: (seq, index of its first page to restore, the pages to restore its saved K/V into)
    swap_in: list[tuple[Sequence, int, list[int]]] = dataclasses.field(default_factory=list)
    # a hybrid model's prefix hits: (saved-state slot, the sequence's slot) copies to do before the step
    state_restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def priority_order(seq: Sequence) -> tuple:
    return (seq.request.priority, seq.request.metrics.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 preemption_mode: str = "recompute", max_prefill_chunks: int = MAX_PREFILL_CHUNKS,
                 max_loras: int | None = None, max_num_encoder_input_tokens: int | None = None, is_encoded=None):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={preemption_mode!r}: expected 'recompute' or 'swap'")
        self.preemption_mode = preemption_mode
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunks = max_prefill_chunks  # multi-token chunks per step (see batch.py)
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: no LoRA)
        # images: image tokens the vision encoder may compute per step, and whether an image's rows
        # are cached (by its hash: jaxinfer.engine.multimodal)
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens or max_num_batched_tokens
        self.is_encoded = is_encoded or (lambda key: False)
        self._encoder_left = self.max_num_encoder_input_tokens  # this step's (schedule)
        self._encoding: set[bytes] = set()  # images this step encodes
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (it already holds pages)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.block_manager.seqs:
            self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def requeue_running(self) -> list[Sequence]:
        """Every running sequence back to the queue, to be computed again from its tokens (the
        KV pool they held pages in was lost: EngineCore._recover). Returns them."""
        requeued = list(self.running)
        for seq in requeued:
            self._preempt(seq)
        return requeued

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        swap_out: list[tuple[Sequence, list[int], int, int]] = []
        swap_in: list[tuple[Sequence, int, list[int]]] = []
        state_restores: list[tuple[int, int]] = []
        self._encoder_left, self._encoding = self.max_num_encoder_input_tokens, set()

        # decodes first, then prefill chunks; best priority first within each group
        queue = sorted((s for s in self.running if not s.hold), key=lambda s: (s.is_prefill, priority_order(s)))
        num_chunks = 0  # scheduled multi-token chunks
        rows_left = self.max_num_batched_tokens  # logits rows: a step's rows must fit its largest bucket too
        while queue and budget > 0 and len(scheduled) < self.max_num_seqs:
            seq = queue.pop(0)
            num_draft = 0 if seq.is_prefill else max(0, min(len(seq.draft), budget - 1, rows_left - 1))
            n = self._chunk_size(seq, budget, rows_left) + num_draft
            if n == 0:
                continue  # its next image does not fit this step
            rows = self._logits_rows(seq, n, num_draft)
            if rows > rows_left:
                continue  # waits for a later step
            if seq.is_prefill and n > 1 and num_chunks >= self.max_prefill_chunks:
                continue  # waits for a later step
            num_chunks += seq.is_prefill and n > 1
            end = seq.num_computed + n  # slots the step computes up to (the block manager reserves them)
            while not bm.can_reserve(seq.seq_id, end):
                victim = max(queue + [seq], key=priority_order)
                if self.preemption_mode == "swap" and victim.num_computed > 0:  # one full-attention group (EngineConfig)
                    pages = bm.page_table(victim.seq_id)[0][: bm.pages_needed(victim.num_computed)]
                    swap_out.append((victim, pages, victim.num_computed, bm.state_slot(victim.seq_id)))
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                queue.remove(victim)
            if seq in preempted:
                continue
            copies += bm.reserve(seq.seq_id, end)
            self._encode(seq, n)
            scheduled.append(ScheduledSeq(seq, n, num_draft))
            budget -= n
            rows_left -= rows

        if not preempted:
            occupied = sum(self._forks(s) for s in self.running)  # a request that will fork holds n places
            adapters = {s.lora_id for s in self.running} - {0}
            for seq in sorted(self.waiting, key=priority_order):
                if self.max_loras is not None and seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                    continue  # its adapter needs a slot that running sequences hold: later (others may go first)
                slots = self._forks(seq)
                if budget == 0 or occupied + slots > self.max_num_seqs or len(scheduled) >= self.max_num_seqs:
                    break
                if num_chunks >= self.max_prefill_chunks or self._admission_rows(seq, budget, rows_left) > rows_left:
                    break
                try:
                    seq.num_computed = bm.allocate(seq.seq_id, seq.cache_ids(), salt=seq.prefix_salt,
                                                   max_cached_tokens=seq.max_cached_tokens, lookahead=budget)
                except OutOfPagesError:
                    break
                adapters |= {seq.lora_id} - {0}
                if bm.restore_slot(seq.seq_id):  # its prefix hit resumes a saved recurrent state
                    state_restores.append((bm.restore_slot(seq.seq_id), bm.state_slot(seq.seq_id)))
                restored = self._swapped_tokens(seq)
                if restored > seq.num_computed:
                    # restore its saved K/V instead of recomputing them; prefix-cache hits (shared,
                    # read-only pages) keep their content, only the pages after them are written
                    first = seq.num_computed // bm.page_size
                    last = bm.pages_needed(restored)
                    swap_in.append((seq, first, bm.page_table(seq.seq_id)[0][first:last]))
                    seq.num_computed = restored
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                occupied += slots
                n = self._chunk_size(seq, budget, rows_left)
                if n == 0:
                    continue  # admitted; its next image does not fit this step
                self._encode(seq, n)
                scheduled.append(ScheduledSeq(seq, n))
                num_chunks += n > 1
                budget -= n
                rows_left -= self._logits_rows(seq, n)
        return SchedulerOutput(scheduled, copies, preempted, swap_out, swap_in, state_restores)

    def _admission_rows(self, seq: Sequence, budget: int, rows_left: int) -> int:
        """Logits rows of a waiting sequence's first chunk, were it admitted now (its cached prefix
        and swapped-out K/V are not recomputed)."""
        bm = self.block_manager
        start = bm.num_cached_prefix_pages(seq.cache_ids(), salt=seq.prefix_salt,
                                           max_cached_tokens=seq.max_cached_tokens) * bm.page_size
        start = max(start, self._swapped_tokens(seq))
        saved, seq.num_computed = seq.num_computed, start
        try:
            return self._logits_rows(seq, self._chunk_size(seq, budget, rows_left))
        finally:
            seq.num_computed = saved

    @staticmethod
    def _swapped_tokens(seq: Sequence) -> int:
        """Leading tokens whose K/V a readmitted sequence restores from host memory (swap mode)."""
        if seq.swapped is None:
            return 0
        limit = seq.max_cached_tokens
        return seq.swapped.num_computed if limit is None else min(seq.swapped.num_computed, limit)

    @staticmethod
    def _forks(seq: Sequence) -> int:
        """Rows the chunk that completes `seq`'s prompt samples: n before its request forks."""
        return 1 if seq.request.forked else seq.request.params.n

    def _chunk_size(self, seq: Sequence, budget: int, rows_left: int) -> int:
        """Tokens of `seq` to compute now (drafts aside): what the budget allows, and with prompt
        logprobs (a row per token) what leaves room for the completing chunk's sampled rows."""
        n = min(seq.num_uncomputed, budget)
        if seq.request.wants_prompt_logprobs:
            n = min(n, max(1, rows_left - self._forks(seq)))
        elif seq.request.pooling is not None and seq.request.pooling.pooling_type == "MEAN":  # a row per token
            n = min(n, max(1, rows_left))
        checkpoint = self.block_manager.next_checkpoint(seq.seq_id, seq.num_computed)  # a hybrid model saves its state there
        if checkpoint is not None:
            n = min(n, checkpoint - seq.num_computed)
        if seq.request.images:
            n = self._image_cut(seq, n)
        return n

    def _image_cut(self, seq: Sequence, n: int) -> int:
        """A chunk of n tokens from seq.num_computed, cut where an image must wait: one the encoder's
        budget left this step cannot encode, one attended both ways that would not end in the chunk
        (its tokens must be computed together). 0: nothing of it runs this step."""
        start = seq.num_computed
        end, left = start + n, self._encoder_left
        for image in seq.request.images:
            if image.end <= start or image.offset >= end:
                continue
            if not (self.is_encoded(image.key) or image.key in self._encoding):
                if image.length > left:
                    return max(image.offset - start, 0)
                left -= image.length
            if image.both_ways and end < image.end:
                return max(image.offset - start, 0)
        return n

    def _encode(self, seq: Sequence, n: int) -> None:
        """Counts the images a scheduled chunk reaches against this step's encoder budget."""
        start = seq.num_computed
        for image in seq.request.images:
            if image.offset < start + n and image.end > start and not (self.is_encoded(image.key) or image.key in self._encoding):
                self._encoding.add(image.key)
                self._encoder_left -= image.length

    def _logits_rows(self, seq: Sequence, n: int, num_draft: int = 0) -> int:
        """Logits rows a chunk of n tokens (num_draft of them drafts) asks the step for."""
        if seq.request.pooling is not None:
            return len(seq.request.pooling.rows(seq.num_computed, n))
        rows = num_draft
        if seq.num_computed + n - num_draft == len(seq.token_ids):  # it reaches the newest token: it samples
            rows += self._forks(seq)
        if seq.request.wants_prompt_logprobs:
            rows += n
        return rows

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

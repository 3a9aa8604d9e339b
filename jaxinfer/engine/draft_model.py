"""The draft-model proposer of speculative decoding: a second model drafts k tokens autoregressively.

    LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                    "model": "./small-model"})          # another model
        ... {"method": "draft_model", "quantization": "int4"}            # the target quantized
        ... {"method": "draft_model", "num_layers": 8}                   # its first 8 layers

The draft is an ordinary model behind its own `ModelRunner`: same mesh, same buckets, its own
paged KV pool with the target's page geometry, so a sequence's draft K/V live at the same page
ids as its target K/V (the target's block manager owns the pages of both; rollback rewinds
both). For each sequence that speculates, before the step:

1. slots are reserved (in the target's block manager) for its newest token x and k drafts;
2. catch-up: the draft computes whatever of the sequence it has not yet (the whole prompt the
   first time, then usually nothing), in chunks within the token budget;
3. k rounds, each a decode step of the draft runner: round 1 computes x and samples d1, round i
   computes d(i-1) (read on the device from round i-1's sampled tokens) and samples d(i). Each
   round samples with the request's temperature / top-k / top-p / min-p, with a seed of its
   own (independent of the target's draws), and keeps the distribution q it sampled from on
   the device (`SamplingTensors.return_probs`);
4. the drafted tokens come to the host; their q rows form the `draft_buffer` the target's
   verification step reads (rejection sampling with the draft's real q: exact in distribution).

After verification the draft's cache is valid up to the target's accepted length (or to what it
drafted, whichever is shorter), `SpecState.draft_computed`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.engine.model_runner import ModelRunner, RowSampling, ScheduledChunk
from jaxinfer.engine.seeds import DRAFT_SEED_SALT, child_seed
from jaxinfer.engine.spec_decode import DraftContext, Drafts
from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS, SequenceChunk


class DraftModelProposer:
    on_device = True  # drafts after the previous step is read, into slots it reserves itself

    def __init__(self, runner: ModelRunner):
        self.runner = runner  # the draft model's runner (its own KV pool, the target's page geometry)

    def propose(self, ctx: DraftContext, asked: list[tuple[object, int]]) -> Drafts:
        reserved = [(seq, k) for seq, k in asked if self._reserve(ctx, seq, k)]
        if not reserved:
            return Drafts([[] for _ in asked])
        self._catch_up(ctx, reserved)
        drafted, src, buffer = self._draft(ctx, reserved)
        return Drafts([drafted.get(id(seq), []) for seq, _ in asked], buffer, [src.get(id(seq), []) for seq, _ in asked])

    # ------------------------------------------------------------------ the steps
    def _reserve(self, ctx: DraftContext, seq, k: int) -> bool:
        """Slots for the newest token and k drafts (the verification step's); False when out of pages."""
        copies = ctx.reserve(seq, len(seq.token_ids) + k)
        if copies is None:
            return False
        if copies:  # copy-on-write of a shared partial page: the target's pool did it, so does the draft's
            self.runner.copy_pages(copies)
        return True

    def _catch_up(self, ctx: DraftContext, reserved) -> None:
        """Compute, in the draft's cache, every token before the newest one it has not computed."""
        budget = self.runner.buckets.max_tokens
        while True:
            rounds = [[] for _ in range(ctx.num_replicas)]
            used = [0] * ctx.num_replicas
            multi = [0] * ctx.num_replicas
            for seq, _ in reserved:
                r = seq.request.replica
                start = seq.spec.draft_computed
                room = min(len(seq.token_ids) - 1 - start, budget - used[r])
                if room <= 0 or len(rounds[r]) >= self.runner.buckets.max_num_seqs or (room > 1 and multi[r] >= MAX_PREFILL_CHUNKS):
                    continue
                chunk = SequenceChunk(seq.token_ids[start : start + room], start, ctx.page_table(seq), [])
                rounds[r].append(ScheduledChunk(chunk, RowSampling()))
                seq.spec.draft_computed += room
                used[r] += room
                multi[r] += room > 1
            if not any(rounds):
                return
            self.runner.collect(self.runner.dispatch(rounds))

    def _draft(self, ctx: DraftContext, reserved) -> tuple[dict, dict, object]:
        """k rounds of one token per sequence: x, then each draft, sampling the next. Returns
        (id(seq) -> drafted tokens, id(seq) -> their rows in the buffer, the buffer)."""
        handles, placed = [], []  # per round: the dispatch, and (seq, its chunk) of each sequence in it
        last_row: dict[int, int] = {}  # id(seq) -> row of its newest draft in the previous round
        for i in range(max(k for _, k in reserved)):
            rounds, where = [[] for _ in range(ctx.num_replicas)], []
            for seq, k in reserved:
                if i >= k:
                    continue
                sampling = RowSampling.from_params(seq.request.params, seed=child_seed(seq.seed, DRAFT_SEED_SALT),
                                                   counter=len(seq.output_token_ids) + i)
                token, device = (seq.token_ids[-1], {}) if i == 0 else (0, {0: last_row[id(seq)]})
                entry = ScheduledChunk(SequenceChunk([token], len(seq.token_ids) - 1 + i, ctx.page_table(seq), [0], device), sampling)
                rounds[seq.request.replica].append(entry)
                where.append((seq, entry))
            handle = self.runner.dispatch(rounds, return_probs=True)
            for seq, entry in where:
                [last_row[id(seq)]] = entry.rows
            handles.append(handle)
            placed.append(where)

        drafted, src, buffer = collect_rounds(self.runner, handles, placed)
        for seq, k in reserved:
            seq.spec.draft_computed = len(seq.token_ids) - 1 + k  # x and the first k - 1 drafts are in its cache
        return drafted, src, buffer


def collect_rounds(runner: ModelRunner, handles, placed) -> tuple[dict, dict, object]:
    """Reads drafting rounds back: `handles` the dispatched steps, `placed` per step the (seq,
    its chunk) whose last logits row drew a draft. Returns (id(seq) -> its drafts in order,
    id(seq) -> their rows in the buffer, the buffer: every step's distributions [replicas, N, V],
    left on the device)."""
    offsets = [0]
    for handle in handles[:-1]:
        offsets.append(offsets[-1] + handle.out.probs.shape[1])
    buffer = jnp.concatenate([h.out.probs for h in handles], axis=1)
    drafted, src = {}, {}
    for i, (handle, where) in enumerate(zip(handles, placed)):
        runner.collect(handle)
        for seq, entry in where:
            drafted.setdefault(id(seq), []).append(entry.results[-1].token)
            src.setdefault(id(seq), []).append(offsets[i] + entry.rows[-1])
    return drafted, src, buffer

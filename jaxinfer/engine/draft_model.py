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
drafted, whichever is shorter), `Sequence.draft_computed`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.batch import MAX_PREFILL_CHUNKS, SequenceChunk
from jaxinfer.engine.block_manager import OutOfPagesError
from jaxinfer.engine.model_runner import ModelRunner, RowSampling, ScheduledChunk
from jaxinfer.engine.spec_decode import Drafts

DRAFT_SEED_SALT = 0x5EED_D4AF  # draft rows sample with _child_seed(seq seed, this): not the target's draws


class DraftModelProposer:
    on_device = True  # drafts after the previous step is read, into slots it reserves itself

    def __init__(self, runner: ModelRunner):
        self.runner = runner  # the draft model's runner (its own KV pool, the target's page geometry)

    def propose(self, engine, asked: list[tuple[object, int]]) -> Drafts:
        reserved = [(seq, k) for seq, k in asked if self._reserve(engine, seq, k)]
        if not reserved:
            return Drafts([[] for _ in asked])
        self._catch_up(engine, reserved)
        drafted, src, buffer = self._draft(engine, reserved)
        return Drafts([drafted.get(id(seq), []) for seq, _ in asked], buffer, [src.get(id(seq), []) for seq, _ in asked])

    # ------------------------------------------------------------------ the steps
    def _reserve(self, engine, seq, k: int) -> bool:
        """Slots for the newest token and k drafts (the verification step's); False when out of pages."""
        replica = engine._replica(seq)
        bm = replica.block_manager
        extra = len(seq.token_ids) + k - bm.seqs[seq.seq_id].num_tokens
        if extra <= 0:
            return True
        try:
            copies = bm.prepare_append(seq.seq_id, extra)
        except OutOfPagesError:
            return False
        if copies:  # copy-on-write of a shared partial page: in both pools
            index = engine.replicas.index(replica)
            engine.runner.copy_pages([(index, c) for c in copies])
            self.runner.copy_pages([(index, c) for c in copies])
        return True

    @staticmethod
    def _pages(engine, seq) -> list[int]:
        return engine._replica(seq).block_manager.page_table(seq.seq_id)

    def _catch_up(self, engine, reserved) -> None:
        """Compute, in the draft's cache, every token before the newest one it has not computed."""
        budget = self.runner.buckets.max_tokens
        while True:
            rounds = [[] for _ in engine.replicas]
            used = [0] * len(engine.replicas)
            multi = [0] * len(engine.replicas)
            for seq, _ in reserved:
                r = seq.request.replica
                start = seq.draft_computed
                room = min(len(seq.token_ids) - 1 - start, budget - used[r])
                if room <= 0 or len(rounds[r]) >= self.runner.buckets.max_num_seqs or (room > 1 and multi[r] >= MAX_PREFILL_CHUNKS):
                    continue
                chunk = SequenceChunk(seq.token_ids[start : start + room], start, self._pages(engine, seq), [])
                rounds[r].append(ScheduledChunk(chunk, RowSampling()))
                seq.draft_computed += room
                used[r] += room
                multi[r] += room > 1
            if not any(rounds):
                return
            self.runner.collect(self.runner.dispatch(rounds))

    def _draft(self, engine, reserved) -> tuple[dict, dict, object]:
        """k rounds of one token per sequence: x, then each draft, sampling the next. Returns
        (id(seq) -> drafted tokens, id(seq) -> their rows in the buffer, the buffer)."""
        from jaxinfer.engine.engine import _child_seed

        handles, placed = [], []  # per round: the dispatch, and (seq, replica, chunk index) of each chunk
        last_row: dict[int, int] = {}  # id(seq) -> row of its newest draft in the previous round
        for i in range(max(k for _, k in reserved)):
            rounds, where = [[] for _ in engine.replicas], []
            for seq, k in reserved:
                if i >= k:
                    continue
                r, p = seq.request.replica, seq.request.params
                sampling = RowSampling(
                    temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                    seed=_child_seed(seq.seed, DRAFT_SEED_SALT), counter=len(seq.output_token_ids) + i,
                )
                token, device = (seq.token_ids[-1], {}) if i == 0 else (0, {0: last_row[id(seq)]})
                chunk = SequenceChunk([token], len(seq.token_ids) - 1 + i, self._pages(engine, seq), [0], device)
                where.append((seq, r, len(rounds[r])))
                rounds[r].append(ScheduledChunk(chunk, sampling))
            handle = self.runner.dispatch(rounds, return_probs=True)
            for seq, r, c in where:
                [last_row[id(seq)]] = handle.rows_of_chunk[r][c]
            handles.append(handle)
            placed.append(where)

        offsets = [0]
        for handle in handles[:-1]:
            offsets.append(offsets[-1] + handle.out.probs.shape[1])
        buffer = jnp.concatenate([h.out.probs for h in handles], axis=1)  # [replicas, N, V], stays on the device
        drafted, src = {}, {}
        for i, (handle, where) in enumerate(zip(handles, placed)):
            results = self.runner.collect(handle)
            for seq, r, c in where:
                [row] = handle.rows_of_chunk[r][c]
                drafted.setdefault(id(seq), []).append(results[r][c][0].token)
                src.setdefault(id(seq), []).append(offsets[i] + row)
        for seq, k in reserved:
            seq.draft_computed = len(seq.token_ids) - 1 + k  # x and the first k - 1 drafts are in its cache
        return drafted, src, buffer

"""The multi-token-prediction proposer of speculative decoding (method "mtp"): DeepSeek-V3's MTP layer drafts.

    LLM("deepseek-ai/DeepSeek-V3", speculative_config={"method": "mtp", "num_speculative_tokens": 1})

The checkpoint's MTP module (`jaxinfer.models.deepseek_mtp`) guesses t_{p+2} at position p from
the target's hidden state h_p and the token t_{p+1}. It is a one-layer model behind its own
`ModelRunner`: the target's buckets and page geometry, its own latent pool, so a sequence's MTP
rows live at the same page ids as its target rows (the target's block manager owns the pages of
both; page copies are mirrored into its pool: `copy_pages`). It runs in lockstep with the target:

1. **ingest**, after each target step is read (`EngineCore._process`): for every speculating
   sequence of that step, the rows the target computed and kept (a chunk's tokens; of a
   verification, the newest token and the accepted drafts) go through the module at the same
   positions, each row p reading h_p from the target step's stream (`StepFunction(return_stream=True)`,
   still on the device) and t_{p+1} (now known). Its cache is then valid up to position L - 2 for a
   sequence of L tokens (the newest, t_{L-1}, is not computed yet), and that last row's logits
   are the first draft's distribution: sampled in the same step, with the request's sampling
   settings under a seed of its own, q kept on the device.
2. **propose**, for a sequence that drafts k tokens: the first came with the ingest; guess i + 1
   is one more module step at position L - 2 + i, reading guess i (on the device, from the
   previous step's sampled tokens) and, for lack of the target's h there, the module's own
   stream at the previous position (as DeepSeek and vLLM chain it). Those rows are overwritten by
   the next ingest, which follows the target's verification.

Only the module's latest step's tokens and streams are on the device, so a sequence drafts only
right after its ingest (`_ready`); one that sat out drafts nothing that step. The drafts' q rows
form the `draft_buffer` the verification reads: exact under greedy, in distribution under
sampling, like every proposer.

Where the module's cache can be stale (drafts get worse, never wrong): the position before a
prefix-cache hit's first computed token holds the K/V of whatever token followed it when it was
cached; a forked completion's last prompt row holds its parent's first token; a sequence swapped
out and back in (preemption_mode "swap") has no MTP rows restored.
"""

from __future__ import annotations

from jaxinfer.engine.draft_model import collect_rounds
from jaxinfer.engine.model_runner import InFlightStep, ModelRunner, RowSampling, ScheduledChunk
from jaxinfer.engine.request import PENDING
from jaxinfer.engine.seeds import DRAFT_SEED_SALT, child_seed
from jaxinfer.engine.spec_decode import DraftContext, Drafts
from jaxinfer.ops.batch import SequenceChunk


class MTPProposer:
    on_device = True

    def __init__(self, runner: ModelRunner):
        self.runner = runner  # the MTP module's runner (one layer, its own latent pool, returns its stream)
        self._ingest: InFlightStep | None = None  # the module's last step, while it is the latest (see _ready)
        self._ready: dict[int, ScheduledChunk] = {}  # id(seq) -> its chunk of that step: the first draft's row

    def copy_pages(self, copies) -> None:
        """The target's page copies (copy-on-write), done in the module's pool too."""
        self.runner.copy_pages(copies)

    # ------------------------------------------------------------------ after each target step
    def ingest(self, ctx: DraftContext, plans, step: InFlightStep) -> None:
        """Runs the module over the rows the target's `step` (read; its `plans` per replica)
        computed and kept, from the step's stream (see the module docstring)."""
        rounds = [[] for _ in range(ctx.num_replicas)]
        owners = []
        for r, plan in enumerate(plans):
            for s in plan.scheduled:
                chunk = self._ingest_chunk(ctx, s)
                if chunk is not None:
                    rounds[r].append(chunk)
                    owners.append((s.seq, chunk))
        self._ingest, self._ready = None, {}
        if owners:
            self._ingest = self.runner.dispatch(rounds, return_probs=True, stream=step.stream)
            self._ready = {id(seq): chunk for seq, chunk in owners}

    def _ingest_chunk(self, ctx: DraftContext, s) -> ScheduledChunk | None:
        """The module's chunk for the rows of one target chunk `s`: positions start .. start + n - 1,
        each reading the next token and its target row's stream; None when nothing is kept."""
        seq = s.seq
        if seq.spec is None or seq.finished:
            return None
        n = s.num_tokens
        if s.num_draft:  # verification: the newest token and the drafts accepted
            n = 1 + next((i for i, row in enumerate(s.chunk.results[: s.num_draft]) if not row.accepted), s.num_draft)
        if not ctx.holds(seq, s.start + n):  # preempted (or rewound) meanwhile
            return None
        next_tokens = seq.token_ids[s.start + 1 : s.start + n + 1]
        if len(next_tokens) < n or PENDING in next_tokens:
            return None
        sampling = RowSampling.from_params(seq.request.params, seed=child_seed(seq.seed, DRAFT_SEED_SALT),
                                           counter=len(seq.output_token_ids))
        rows = [s.chunk.first_token + i for i in range(n)]  # the target step's token rows: h_p
        return ScheduledChunk(SequenceChunk(next_tokens, s.start, ctx.page_table(seq), [n - 1], hidden_src=rows), sampling)

    # ------------------------------------------------------------------ before each target step
    def propose(self, ctx: DraftContext, asked) -> Drafts:
        ready = [(seq, k) for seq, k in asked if id(seq) in self._ready and self._reserve(ctx, seq, k)]
        ingest, first = self._ingest, self._ready
        self._ingest, self._ready = None, {}  # the steps below replace the module's tokens and streams
        if not ready:
            return Drafts([[] for _ in asked])
        budget = {id(seq): k for seq, k in ready}
        handles, placed = [ingest], [[(seq, first[id(seq)]) for seq, _ in ready]]
        for i in range(1, max(budget.values())):  # guess i + 1 from guess i
            rounds, where = [[] for _ in range(ctx.num_replicas)], []
            for seq, entry in placed[-1]:
                if budget[id(seq)] <= i:
                    continue
                sampling = RowSampling.from_params(seq.request.params, seed=child_seed(seq.seed, DRAFT_SEED_SALT),
                                                   counter=len(seq.output_token_ids) + i)
                last = entry.first_token + len(entry.chunk.token_ids) - 1  # the stream row of its previous guess
                chunk = SequenceChunk([0], len(seq.token_ids) - 2 + i, ctx.page_table(seq), [0], {0: entry.rows[0]},
                                      hidden_src=[last])
                new = ScheduledChunk(chunk, sampling)
                rounds[seq.request.replica].append(new)
                where.append((seq, new))
            handles.append(self.runner.dispatch(rounds, return_probs=True, stream=handles[-1].stream))
            placed.append(where)

        drafted, src, buffer = collect_rounds(self.runner, handles, placed)
        return Drafts([drafted.get(id(seq), []) for seq, _ in asked], buffer, [src.get(id(seq), []) for seq, _ in asked])

    def _reserve(self, ctx: DraftContext, seq, k: int) -> bool:
        """Slots for the newest token and k drafts (the verification step's); False when out of pages."""
        copies = ctx.reserve(seq, len(seq.token_ids) + k)
        if copies is None:
            return False
        if copies:
            self.runner.copy_pages(copies)
        return True

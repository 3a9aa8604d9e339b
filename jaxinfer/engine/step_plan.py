"""One replica's part of a step, as the runner takes it: each scheduled sequence's chunk and rows.

The scheduler decides how many tokens each sequence computes (`ScheduledSeq`); `plan_chunk`
turns that into the `ScheduledChunk` the runner packs: the chunk's tokens (drafts appended, or
marked to be read on the device from the previous step), its pages, its logits rows and how
each row samples. The chunk then carries its rows and results back (`ScheduledChunk.rows`,
`.results`), so the engine reads a step's outcome from the same entries it planned.

Logits rows of a chunk, in order:
- prompt logprobs (first pass over a prompt that asks for them): one row per token that scores
  the next prompt token (`target_ids`);
- verification (speculative decoding): the last num_draft + 1 rows, row i verifying draft i and
  the last one sampling the bonus token;
- sampling: the last token's row, n times before the request forks into its n completions (one
  seed each);
- pooling (runner="pooling"): the rows whose hidden states the request's pooling reads
  (engine.pooling.PoolState.rows); nothing samples.
"""

from __future__ import annotations

import time

from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk
from jaxinfer.engine.scheduler import ScheduledSeq
from jaxinfer.engine.seeds import child_seed
from jaxinfer.ops.batch import SequenceChunk


def plan_chunk(s: ScheduledSeq, page_offsets: list[int], pages: list[list[int]], eos_token_ids: set[int]) -> ScheduledChunk:
    """The chunk of a scheduled sequence whose page-table rows, per KV layer group, are `pages`
    from index `page_offsets` on (BlockManager.held_rows)."""
    seq, request = s.seq, s.seq.request
    p = request.params
    start = s.start
    if request.metrics.first_scheduled_time is None:
        request.metrics.first_scheduled_time = time.time()
    if request.pooling is not None:
        rows = request.pooling.rows(start, s.num_tokens)
        tokens = seq.token_ids[start : start + s.num_tokens]
        return ScheduledChunk(SequenceChunk(tokens, start, pages, rows, {}, page_offsets=page_offsets),
                              RowSampling(target_ids=[-1] * len(rows)))
    rows, targets = [], []
    if request.wants_prompt_logprobs and seq.index == 0:
        have = len(request.prompt_logprobs)  # entries so far (a recompute skips the rows that scored them)
        for i in range(s.num_tokens):
            nxt = start + i + 1  # the row at offset i scores token nxt
            if have <= nxt < len(request.prompt_token_ids):
                rows.append(i)
                targets.append(request.prompt_token_ids[nxt])
    num_out = len(seq.output_token_ids)
    seed: int | list[int] = seq.seed
    counter: int | list[int] = num_out
    draft_tokens: list[int] = []
    draft_src: list[int] = []
    if s.num_draft:  # verification: row i verifies draft i and samples output token num_out + i
        rows = list(range(s.num_tokens - s.num_draft - 1, s.num_tokens))
        targets = [-1] * len(rows)
        counter = [num_out + i for i in range(len(rows))]
        draft_tokens = seq.draft[: s.num_draft] + [-1]  # the last row: the bonus token
        draft_src = seq.spec.draft_src[: s.num_draft] + [-1] if seq.spec.draft_src else []
    elif s.samples:  # the last row samples; before its request forks, it samples all n completions
        n = 1 if request.forked else p.n
        rows += [s.num_tokens - 1] * n
        targets += [-1] * n
        # prompt-logprob rows keep the sequence's seed; sample row j gets completion j's seed
        seed = [seq.seed] * (len(rows) - n) + [child_seed(seq.seed, j) for j in range(n)]
    banned = ()
    if num_out < p.min_tokens:  # min_tokens: EOS (unless ignored) and the stop ids are banned until then
        banned = tuple(sorted(set(p.stop_token_ids or ()) | (set() if p.ignore_eos else eos_token_ids)))
    sampling = RowSampling.from_params(p, seed=seed, counter=counter, target_ids=targets, banned_ids=banned,
                                       draft_tokens=draft_tokens, draft_src=draft_src)
    if sampling.uses_penalties:  # history as of the sampled row: everything up to this chunk's end
        sampling.history = seq.token_ids[: start + s.num_tokens]
        sampling.num_prompt_history = min(len(request.prompt_token_ids), start + s.num_tokens)
    tokens = seq.token_ids[start : start + s.num_tokens - s.num_draft] + seq.draft[: s.num_draft]
    device_tokens = {i: seq.pending[start + i] for i in range(s.num_tokens) if start + i in seq.pending}
    return ScheduledChunk(SequenceChunk(tokens, start, pages, rows, device_tokens, page_offsets=page_offsets), sampling)

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
  the last one sampling the bonus token; for a draft tree (`SpecState.draft_parents`), the root
  (the newest token) and every node, each verifying its children (`RowSampling.tree_children`),
  with tree masks and RoPE positions root + depth on the chunk (`tree_chunk`); after the nodes,
  a tree may bring extra rows that verify nothing and are never accepted (`SpecState.draft_extra`:
  lookahead's window), each with its own mask and RoPE position; they sample a token each, which
  the proposer reads back (`spec_layout`);
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
from jaxinfer.engine.spec_decode import ExtraRows, tree_children, tree_depths, tree_masks
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
    children: list[list[int]] = []
    parents, extra = spec_layout(seq.spec, s.num_draft)
    if parents or extra:  # a draft tree: row i (0: the root) verifies its children, and samples output token num_out + depth
        rows = list(range(s.num_tokens - s.num_draft - 1, s.num_tokens))
        targets = [-1] * len(rows)
        counter = [num_out + depth for depth in tree_depths(parents)]
        children = [[seq.draft[c - 1] for c in row] for row in tree_children(parents)]
        if extra:  # rows with no children: each samples the token after its own context (as if output num_out + offset)
            counter += [num_out + offset for offset in extra.offsets]
            children += [[] for _ in extra.tokens]
    elif s.num_draft:  # verification: row i verifies draft i and samples output token num_out + i
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
                                       draft_tokens=draft_tokens, draft_src=draft_src, tree_children=children)
    if sampling.uses_penalties:  # history as of the sampled row: everything up to this chunk's end
        sampling.history = seq.token_ids[: start + s.num_tokens]
        sampling.num_prompt_history = min(len(request.prompt_token_ids), start + s.num_tokens)
    tokens = seq.token_ids[start : start + s.num_tokens - s.num_draft] + seq.draft[: s.num_draft]
    device_tokens = {i: seq.pending[start + i] for i in range(s.num_tokens) if start + i in seq.pending}
    chunk = SequenceChunk(tokens, start, pages, rows, device_tokens, page_offsets=page_offsets)
    if parents or extra:
        tree_chunk(chunk, parents, extra)
    return ScheduledChunk(chunk, sampling)


def spec_layout(spec, num_draft: int) -> tuple[list[int], ExtraRows | None]:
    """A verification chunk of num_draft drafted rows (what the scheduler kept of `spec.draft`):
    its tree's parents ([] for a chain, or a tree of no node) and the extra rows after the nodes
    (None: none). A cut that reaches the nodes drops every extra row; one within the extra rows
    keeps their first ones (an extra row sees only rows before it)."""
    if not num_draft or spec is None:
        return [], None
    extra = spec.draft_extra
    if extra is None or not extra.tokens:
        return spec.draft_parents[:num_draft], None
    num_nodes = len(spec.draft) - len(extra.tokens)
    kept = num_draft - num_nodes
    if kept <= 0:
        return spec.draft_parents[:num_draft], None
    return spec.draft_parents[:num_nodes], ExtraRows(extra.tokens[:kept], extra.masks[:kept], extra.offsets[:kept])


def tree_chunk(chunk: SequenceChunk, parents: list[int], extra: ExtraRows | None = None) -> SequenceChunk:
    """Sets a verification chunk's tree fields: its last len(parents) tokens (before the extra
    rows, if any) are a draft tree's nodes (parents first; `parents[i]` the index of node i's
    parent, -1 = the root, the token before them). Node i sits at slot root + 1 + i; it sees the
    keys before the root, the root, its ancestors and itself (bit j of its mask: the key at
    root + j), and rotates as the token at root + its depth. Extra row j sits at slot
    root + 1 + len(parents) + j with its own mask and RoPE position root + its offset. Tokens
    before the root attend causally (mask 0: only keys before it)."""
    E = len(extra.tokens) if extra is not None else 0
    n, N = len(chunk.token_ids), len(parents) + E
    root = chunk.start_pos + n - N - 1
    chunk.tree_base = root
    chunk.tree_masks = [0] * (n - N - 1) + tree_masks(parents) + (list(extra.masks) if E else [])
    chunk.tree_positions = (list(range(chunk.start_pos, root)) + [root + d for d in tree_depths(parents)]
                            + ([root + offset for offset in extra.offsets] if E else []))
    return chunk

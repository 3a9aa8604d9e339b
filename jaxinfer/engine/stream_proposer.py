"""Proposers that draft with a small model reading the target's hidden states, in lockstep with the
target: DeepSeek's multi-token-prediction layer (jaxinfer.engine.mtp) and EAGLE-3 heads
(jaxinfer.engine.eagle3) work the same way, here.

The module guesses t_{p+2} at position p from a hidden state of the target at p (its stream after
the last layer for MTP, three layers' streams for EAGLE-3: `StepFunction(return_stream=...)`) and
the token t_{p+1}. It is a one-layer model behind its own `ModelRunner`: the target's buckets and
page geometry, its own KV pool, so a sequence's module rows live at the same page ids as its
target rows (the target's block manager owns the pages of both; page copies are mirrored into its
pool: `copy_pages`). It runs in lockstep with the target:

1. **ingest**, after each target step is read (`EngineCore._process`): for every speculating
   sequence of that step, the rows the target computed and kept (a chunk's tokens; of a
   verification, the newest token and the accepted drafts) go through the module at the same
   positions, each row p reading the target step's stream at p (still on the device) and
   t_{p+1} (now known). Its cache is then valid up to position L - 2 for a sequence of L tokens
   (the newest, t_{L-1}, is not computed yet), and that last row's logits are the first draft's
   distribution: sampled in the same step, with the request's sampling settings under a seed of
   its own, q kept on the device.
2. **propose**, for a sequence that drafts k tokens: the first came with the ingest; guess i + 1
   is one more module step at position L - 2 + i, reading guess i (on the device, from the
   previous step's sampled tokens) and, for lack of the target's states there, the module's own
   stream at the previous position (as DeepSeek, EAGLE-3 and vLLM chain it). Those rows are
   overwritten by the next ingest, which follows the target's verification.

Only the module's latest step's tokens and streams are on the device, so a sequence drafts only
right after its ingest (`_ready`); one that sat out drafts nothing that step. The drafts' q rows
form the `draft_buffer` the verification reads: exact under greedy, in distribution under
sampling, like every proposer.

Where the module's cache can be stale (drafts get worse, never wrong): the position before a
prefix-cache hit's first computed token holds the K/V of whatever token followed it when it was
cached; a forked completion's last prompt row holds its parent's first token; a sequence swapped
out and back in (preemption_mode "swap") has no module rows restored.

**Draft trees** (`tree`: a static tree's paths or "dynamic", engine.spec_decode; EAGLE-3 heads):
the module ranks tokens instead of sampling one, as the draft heads do (engine.draft_head). For
a sequence of L tokens the tree's root is the ingest's last row (slot and position L - 2: its
distribution ranks the first level). A node that has children gets a module row of its own:
level d's such nodes are one module step (one chunk per sequence, its rows at fresh slots
L - 1, L, ... after the earlier levels' rows), each row reading the node's token and the stream
of its parent's row (the chain's input), at RoPE position L - 2 + d, and seeing the committed
prefix, the root, its ancestors' rows and itself (the chunk's tree masks: `tree_base` = L - 2,
bit j + 1 = the tree's j-th row). Its distribution (at temperature 1, whatever the request's
sampling: only ranks and scores are read, on the device: `_ranked`) ranks its children:

- a static tree: node (r1 .. rd) is the rd-th ranked token of its parent's distribution; a
  sequence allowed k drafts takes the first k nodes (breadth-first, so still a tree);
- a dynamic tree (EAGLE-2): level 1 is the root's `tree_top_k` best tokens; each further level
  expands the top_k best nodes of the level above (by cumulative log-probability) into their
  top_k children each; after `tree_depth` levels the k candidates of the highest cumulative
  log-probability (ties: the shallower, then the earlier) are the tree, parents first. The last
  expansion skips nodes outside the k best so far (their children cannot be kept).

The rows live in the N + 1 slots the verification reserves (newest token + N nodes), at most
31 of them (a tree mask's bits past the root): a dynamic tree whose expansions need more rows
expands its best nodes that fit and stops (a shallower tree, never a wrong one). The drafts are
deterministic (top-ranked tokens: `Drafts.parents`, no distributions), so the verification
treats them as one-hot proposals and stays exact at any temperature. The tree's rows are
overwritten by the next ingest, which re-runs the accepted path's tokens at their committed
positions (each row reading the target's stream of its verification row); a tree row only
reads the committed prefix (ingested) and rows of its own tree (written before it), never a
stale one. One host round trip per level (the ranks decide the next level's tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.draft_model import collect_rounds
from jaxinfer.engine.model_runner import InFlightStep, ModelRunner, RowSampling, ScheduledChunk
from jaxinfer.engine.request import PENDING
from jaxinfer.engine.seeds import DRAFT_SEED_SALT, child_seed
from jaxinfer.engine.spec_decode import MAX_TREE_TOKENS, DraftContext, Drafts, accepted_path, tree_parents
from jaxinfer.ops.batch import SequenceChunk


class StreamChainProposer:
    on_device = True

    def __init__(self, runner: ModelRunner, *, tree=None, tree_top_k: int | None = None, tree_depth: int | None = None):
        """tree: None (chains), "dynamic" (with tree_top_k and tree_depth) or a static tree's
        paths in breadth-first order (`spec_decode.parse_token_tree`)."""
        self.runner = runner  # the module's runner (one layer, its own KV pool, returns its stream)
        self._ingest: InFlightStep | None = None  # the module's last step, while it is the latest (see _ready)
        self._ready: dict[int, ScheduledChunk] = {}  # id(seq) -> its chunk of that step: the first draft's row
        self.tree, self.tree_top_k, self.tree_depth = tree, tree_top_k, tree_depth
        if tree is not None:
            runner.with_tree = True  # its tree levels' chunks carry tree masks (every batch has the fields)
            if tree != "dynamic":
                self.tree_paths = tuple(tuple(p) for p in tree)
                self.tree_parents = tree_parents(self.tree_paths)

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
        kept = list(range(s.num_tokens))  # the chunk's tokens whose rows the target kept, in position order
        if s.num_draft:  # verification: the tokens up to the newest, and the drafts accepted
            root = s.num_tokens - s.num_draft - 1  # the newest token's index in the chunk
            c = s.chunk.chunk
            if c.tree_base >= 0:  # a draft tree: the accepted path's nodes (committed at root + 1, root + 2, ...)
                path = accepted_path(_parents_of(c.tree_masks[root + 1 :]), [row.child for row in s.chunk.results])
            else:
                path = range(1, 1 + next((i for i, row in enumerate(s.chunk.results[: s.num_draft]) if not row.accepted),
                                         s.num_draft))
            kept = list(range(root + 1)) + [root + row for row in path]
        n = len(kept)
        if not ctx.holds(seq, s.start + n):  # preempted (or rewound) meanwhile
            return None
        next_tokens = seq.token_ids[s.start + 1 : s.start + n + 1]
        if len(next_tokens) < n or PENDING in next_tokens:
            return None
        if self.tree is not None:  # its last row ranks a tree's first level: the module's own distribution
            sampling = RowSampling(temperature=1.0)
        else:
            sampling = RowSampling.from_params(seq.request.params, seed=child_seed(seq.seed, DRAFT_SEED_SALT),
                                               counter=len(seq.output_token_ids))
        rows = [s.chunk.first_token + i for i in kept]  # the target step's token rows: h_p
        return ScheduledChunk(SequenceChunk(next_tokens, s.start, ctx.page_table(seq), [n - 1], hidden_src=rows), sampling)

    # ------------------------------------------------------------------ before each target step
    def propose(self, ctx: DraftContext, asked) -> Drafts:
        ready = [(seq, k) for seq, k in asked if id(seq) in self._ready and self._reserve(ctx, seq, k)]
        ingest, first = self._ingest, self._ready
        self._ingest, self._ready = None, {}  # the steps below replace the module's tokens and streams
        if not ready:
            return Drafts([[] for _ in asked])
        if self.tree is not None:
            return self._propose_trees(ctx, asked, ready, ingest, first)
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

    # ------------------------------------------------------------------ draft trees
    def _propose_trees(self, ctx: DraftContext, asked, ready, ingest: InFlightStep, first) -> Drafts:
        """Draft trees (module docstring) for the `ready` sequences (their slots reserved), from
        their ingest rows `first`: tokens in topological order and their parents; no buffer."""
        width = self.tree_top_k if self.tree == "dynamic" else 1 + max(p[-1] for p in self.tree_paths)
        width = min(width, ingest.out.probs.shape[-1])
        trees = []
        for seq, k in ready:
            entry = first[id(seq)]
            tree = (_DynamicTree(k, self.tree_top_k, self.tree_depth) if self.tree == "dynamic"
                    else _StaticTree(self.tree_paths[:k], self.tree_parents[:k]))
            tree.seq, tree.pages, tree.root = seq, ctx.page_table(seq), len(seq.token_ids) - 2
            tree.stream_row[-1] = entry.first_token + len(entry.chunk.token_ids) - 1  # the root's: the ingest's last row
            trees.append(tree)
        logp, ids = _ranked(ingest, [(t.seq.request.replica, first[id(t.seq)].rows[-1]) for t in trees], width)
        for j, tree in enumerate(trees):
            tree.take(-1, logp[j], ids[j])
        for group in self._groups(ctx, trees):
            previous = ingest
            while True:  # one module step per level: the rows of its nodes that have children
                rounds, placed = [[] for _ in range(ctx.num_replicas)], []
                for tree in group:
                    nodes = tree.expand()
                    if nodes:
                        entry = ScheduledChunk(self._level_chunk(tree, nodes), RowSampling(temperature=1.0))
                        rounds[tree.seq.request.replica].append(entry)
                        placed.append((tree, nodes, entry))
                if not placed:
                    break
                previous = self.runner.dispatch(rounds, return_probs=True, stream=previous.stream)
                where = [(tree.seq.request.replica, row) for tree, _, entry in placed for row in entry.rows]
                logp, ids = _ranked(previous, where, width)
                j = 0
                for tree, nodes, entry in placed:
                    for i, node in enumerate(nodes):
                        tree.stream_row[node] = entry.first_token + i
                        tree.take(node, logp[j], ids[j])
                        j += 1
        tokens, parents = [[] for _ in asked], [[] for _ in asked]
        index = {id(seq): i for i, (seq, _) in enumerate(asked)}
        for tree in trees:
            i = index[id(tree.seq)]
            tokens[i], parents[i] = tree.result()
        return Drafts(tokens, parents=parents)

    def _level_chunk(self, tree: "_Tree", nodes: list[int]) -> SequenceChunk:
        """A tree level's chunk: `nodes`' rows at the tree's next free slots (after the root at
        tree.root and the rows written before), each seeing the prefix, the root, its ancestors'
        rows and itself, at RoPE position root + depth, reading its parent's stream row."""
        j0, masks = tree.rows_written, []
        for i, node in enumerate(nodes):
            tree.mask[node] = tree.mask[tree.parent[node]] | (1 << (j0 + i + 1))
            masks.append(tree.mask[node])
        tree.rows_written += len(nodes)
        return SequenceChunk([tree.token[v] for v in nodes], tree.root + 1 + j0, tree.pages, list(range(len(nodes))),
                             hidden_src=[tree.stream_row[tree.parent[v]] for v in nodes], tree_base=tree.root,
                             tree_masks=masks, tree_positions=[tree.root + tree.depth[v] for v in nodes])

    def _groups(self, ctx: DraftContext, trees: list["_Tree"]) -> list[list["_Tree"]]:
        """Trees whose levels share module steps: each step's chunks of a replica fit its largest
        bucket (at most max_tokens rows: a level of a tree has at most `width_bound` rows)."""
        most = self.runner.buckets.max_tokens
        groups, used = [], []  # per group: rows per replica
        for tree in trees:
            r, w = tree.seq.request.replica, tree.width_bound
            for group, rows in zip(groups, used):
                if rows[r] + w <= most:
                    group.append(tree)
                    rows[r] += w
                    break
            else:
                groups.append([tree])
                used.append([0] * ctx.num_replicas)
                used[-1][r] = w
        return groups


class _Tree:
    """One sequence's draft tree while it is drafted: its nodes (index -1: the root), each with
    its token, parent, depth, and once it has a module row, that row's stream row and tree mask."""

    def __init__(self):
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.stream_row: dict[int, int] = {}  # node -> its row of the stream of the step that computed it
        self.mask: dict[int, int] = {-1: 1}  # node -> its tree mask (bit 0: the root, bit j + 1: the tree's j-th row)
        self.rows_written = 0  # module rows written (at slots root + 1 ..)
        self.level = 0  # the level whose nodes expand next (expand: level + 1)
        self.seq = self.pages = self.root = None  # set by _propose_trees

    def node_depth(self, node: int) -> int:
        return 0 if node < 0 else self.depth[node]


class _StaticTree(_Tree):
    """A static tree cut to a sequence's first k paths: node i's token is rank paths[i][-1] of
    its parent's distribution."""

    def __init__(self, paths, parents):
        super().__init__()
        self.paths, self.parent = paths, list(parents)
        self.depth = [len(p) for p in paths]
        self.token = [-1] * len(paths)  # -1: not ranked yet (or no such rank: a vocabulary narrower than the tree)
        self.children = [[] for _ in paths]
        self.root_children = []
        for i, parent in enumerate(self.parent):
            (self.children[parent] if parent >= 0 else self.root_children).append(i)
        levels = {}
        for i, d in enumerate(self.depth):
            if self.children[i]:
                levels[d] = levels.get(d, 0) + 1
        self.width_bound = max(levels.values(), default=0)

    def take(self, node: int, logp: np.ndarray, ids: np.ndarray) -> None:
        for child in self.children[node] if node >= 0 else self.root_children:
            rank = self.paths[child][-1]
            self.token[child] = int(ids[rank]) if rank < len(ids) else -1

    def expand(self) -> list[int]:
        self.level += 1
        return [i for i, d in enumerate(self.depth) if d == self.level and self.children[i] and self.token[i] >= 0]

    def result(self) -> tuple[list[int], list[int]]:
        alive = set()
        for i in range(len(self.token)):  # (parents first) a node whose token or an ancestor's is missing is dropped
            if self.token[i] >= 0 and (self.parent[i] < 0 or self.parent[i] in alive):
                alive.add(i)
        return _subtree(sorted(alive), self.token, self.parent)


class _DynamicTree(_Tree):
    """EAGLE-2's candidates (module docstring): `frontier` the nodes to expand next."""

    def __init__(self, k: int, top_k: int, depth: int):
        super().__init__()
        self.k, self.top_k, self.max_depth = k, top_k, depth
        self.score: list[float] = []
        self.frontier: list[int] = []
        self.capacity = min(k + 1, MAX_TREE_TOKENS)  # its rows: the reserved slots, the mask's bits
        self.width_bound = min(top_k, self.capacity)

    def take(self, node: int, logp: np.ndarray, ids: np.ndarray) -> None:
        base = 0.0 if node < 0 else self.score[node]
        depth = self.node_depth(node) + 1
        for lp, token in zip(logp[: self.top_k], ids[: self.top_k]):
            if np.isfinite(lp):  # (no tokens outside the module's vocabulary)
                self.token.append(int(token))
                self.parent.append(node)
                self.depth.append(depth)
                self.score.append(base + float(lp))

    def _best(self, candidates, n: int) -> list[int]:
        return sorted(candidates, key=lambda c: (-self.score[c], self.depth[c], c))[:n]

    def expand(self) -> list[int]:
        self.level += 1  # its best top_k nodes expand
        if self.level >= self.max_depth:
            return []
        nodes = self._best([c for c in range(len(self.token)) if self.depth[c] == self.level], self.top_k)
        if self.level + 1 == self.max_depth:  # the last expansion: only nodes among the k best so far can have kept children
            best = set(self._best(range(len(self.token)), self.k))
            nodes = [c for c in nodes if c in best]
        nodes = nodes[: self.capacity - self.rows_written]  # (the rest of the tree's rows: the best first)
        if not nodes:
            self.max_depth = self.level  # it stops here
        return nodes

    def result(self) -> tuple[list[int], list[int]]:
        return _subtree(sorted(self._best(range(len(self.token)), self.k)), self.token, self.parent)


def _subtree(kept: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Nodes `kept` (ascending: parents first, every kept node's parent kept or the root) as
    (tokens, parents: each one's parent's index among them, -1 = the root)."""
    position = {c: i for i, c in enumerate(kept)}
    return [tokens[c] for c in kept], [position[parents[c]] if parents[c] >= 0 else -1 for c in kept]


def _parents_of(masks) -> list[int]:
    """A verification chunk's tree masks of its nodes (bit 0: the root, bit i + 1: node i) -> each
    node's parent (its index among the nodes; -1: the root): the highest other bit it sees."""
    return [(int(m) & ~(1 << (i + 1))).bit_length() - 2 for i, m in enumerate(masks)]


def _ranked(step: InFlightStep, where: list[tuple[int, int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The `width` most probable tokens of the step's rows `where` ((replica, logits row) each) and
    their log-probabilities, [len(where), width] each, on the host."""
    n = 1 << (len(where) - 1).bit_length()  # a few compiled sizes
    replica, row = np.zeros(n, np.int32), np.zeros(n, np.int32)
    replica[: len(where)], row[: len(where)] = zip(*where)
    logp, ids = jax.device_get(_top_rows(step.out.probs, replica, row, width))
    return logp[: len(where)], ids[: len(where)]


@functools.partial(jax.jit, static_argnames=("width",))
def _top_rows(probs, replica, row, width: int):
    top, ids = jax.lax.top_k(probs[replica, row].astype(jnp.float32), width)
    return jnp.log(top), ids

"""The draft-head proposer of speculative decoding (methods "eagle" and "medusa").

    LLM(target, speculative_config={"method": "eagle", "model": "./heads", "num_speculative_tokens": 3})

The target's step returns the final-normed hidden state of every logits row
(`StepFunction(return_hidden=True)`). For a sequence whose newest token y came from row h, the
heads (`jaxinfer.models.draft_heads`) turn h (and, EAGLE-style, y and each draft in turn) into k
distributions, one after another; each draft is sampled from its distribution with the
request's temperature / top-k / top-p / min-p (greedy: the argmax) under a seed of its own, and
the distributions go to the verification step as q (rejection sampling stays exact). No second
model, no cache of its own: one small jitted call per step. A sequence without a fresh hidden
row (it sat out the last step) drafts nothing.

With a confidence threshold, a sequence's draft ends before the first guess whose distribution
(the heads' logits at temperature 1) has a top probability below it: a small head is right
about as often as it is confident, and a guess it is unsure of costs a verification row for
little. The cut reads each guess's distribution, never the token drawn from it, so every draft
that is verified is still a draw from its q: the sampler stays exact.

Draft trees (`speculative_token_tree`, engine.spec_decode): the heads rank tokens instead of
sampling one. Each tree node v (the root: the newest token y, with the target's h) has a state
S(v) = head_state(depth(v), S(parent), h, embed(token(v))) (S(root's parent) = h), exactly the
chain's state at that depth, and its children are the top-ranked tokens of lm_head(S(v)):

- a static tree (paths of child ranks): level by level, node (r1 .. rd) is the rd-th ranked
  token of its parent's distribution; a sequence allowed k drafts takes the first k nodes
  (breadth-first, so still a tree);
- a dynamic tree (EAGLE-2): the root's `tree_top_k` best tokens form level 1; each further level
  expands the top_k children of every node of the level above and keeps the top_k of those by
  cumulative log-probability (the product of the heads' probabilities along the path, at
  temperature 1); after `tree_depth` levels, the k candidates of the highest cumulative
  log-probability (ties: the shallower first, so a node's ancestors always come with it) are
  the tree, parents first.

Tree drafts are a deterministic function of the context (no draw), so they are verified as
one-hot proposals (`jaxinfer.ops.sampling.verify_tree`): exact at any temperature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.seeds import DRAFT_SEED_SALT, child_seed
from jaxinfer.engine.spec_decode import MAX_SPECULATIVE_TOKENS, MAX_TREE_TOKENS, DraftContext, Drafts, tree_parents
from jaxinfer.models.draft_heads import head_state, num_heads_of
from jaxinfer.models.layers import embed_lookup, matmul, tied_logits
from jaxinfer.ops.sampling import SamplingTensors, sample


class DraftHeadProposer:
    on_device = True

    def __init__(self, heads: dict, lm_weight, tied: bool, embed, confidence_threshold: float = 0.0, *,
                 tree=None, tree_top_k: int | None = None, tree_depth: int | None = None):
        """tree: None (chains), "dynamic" (with tree_top_k and tree_depth) or a static tree's
        paths in breadth-first order (`spec_decode.parse_token_tree`)."""
        self.heads = heads  # draft_heads.init_heads' layout (medusa or eagle)
        self.tree, self.tree_top_k, self.tree_depth = tree, tree_top_k, tree_depth
        if tree is not None and tree != "dynamic":
            self.tree_parents = tree_parents(tree)
            self.tree_levels = _static_levels(tuple(tuple(p) for p in tree))
        self.confidence_threshold = confidence_threshold
        self.lm_weight = lm_weight  # the target's LM head [H, V] (or its tied embedding: layers.tied_logits)
        self.tied = tied
        self.embed = embed  # the target's embedding [V, H] (or quantized: layers.embed_lookup)
        # the longest chain (a tree: the most levels) it drafts; an eagle layer chains any length
        self.max_k = num_heads_of(heads) or (MAX_TREE_TOKENS if tree is not None else MAX_SPECULATIVE_TOKENS)

    def propose(self, ctx: DraftContext, asked) -> Drafts:
        # (i, sequence, its draft length: for a tree, its node budget)
        ready = [(i, seq, min(k, self.max_k) if self.tree is None else k) for i, (seq, k) in enumerate(asked)
                 if seq.spec.hidden_row is not None and seq.spec.hidden_step == ctx.num_processed]
        tokens = [[] for _ in asked]
        if not ready:
            return Drafts(tokens)
        if self.tree is not None:
            return self._propose_trees(ctx, asked, ready)
        K = max(k for _, _, k in ready)
        n = 1 << (len(ready) - 1).bit_length()  # a few compiled sizes
        replica, row, newest = (np.zeros(n, np.int32) for _ in range(3))
        fields = {name: np.zeros((K, n), dtype) for name, dtype in (  # [guess, sequence]
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("seed", np.uint32),
            ("counter", np.int32), ("min_p", np.float32))}
        fields["top_p"][:] = 1.0
        for j, (_, seq, _) in enumerate(ready):
            p = seq.request.params
            replica[j], row[j], newest[j] = seq.request.replica, seq.spec.hidden_row, seq.token_ids[-1]
            fields["temperature"][:, j], fields["top_k"][:, j], fields["top_p"][:, j] = p.temperature, p.top_k, p.top_p
            fields["min_p"][:, j], fields["seed"][:, j] = p.min_p, child_seed(seq.seed, DRAFT_SEED_SALT)
            fields["counter"][:, j] = len(seq.output_token_ids) + np.arange(K)  # the draft seed keeps these apart from the target's
        f = {name: value.reshape(-1) for name, value in fields.items()}  # row i * n + j: guess i of sequence j
        st = SamplingTensors(f["temperature"], f["top_k"], f["top_p"], f["seed"], f["counter"], np.full(n * K, -1, np.int32),
                             min_p=f["min_p"], return_probs=np.ones(1, bool))
        drafted, confidence, probs = _draft(self.heads, self.lm_weight, self.embed, ctx.last_hidden, replica, row,
                                            newest, st, K, self.tied)
        drafted, confident = np.asarray(drafted), np.asarray(confidence) >= self.confidence_threshold  # [K, n] each
        src = [[] for _ in asked]
        for j, (i, _, k) in enumerate(ready):
            k = int(np.cumprod(confident[:k, j]).sum())  # up to the first unconfident guess
            tokens[i] = drafted[:k, j].tolist()
            src[i] = [g * n + j for g in range(k)]
        buffer = jnp.broadcast_to(probs[None], (ctx.num_replicas,) + probs.shape)  # every replica reads its own rows
        return Drafts(tokens, buffer, src)

    def _propose_trees(self, ctx: DraftContext, asked, ready) -> Drafts:
        """Draft trees (module docstring) for the `ready` sequences: tokens in topological order
        and their parents; deterministic (no buffer)."""
        n = 1 << (len(ready) - 1).bit_length()  # a few compiled sizes
        replica, row, newest = (np.zeros(n, np.int32) for _ in range(3))
        for j, (_, seq, _) in enumerate(ready):
            replica[j], row[j], newest[j] = seq.request.replica, seq.spec.hidden_row, seq.token_ids[-1]
        tokens, parents = [[] for _ in asked], [[] for _ in asked]
        if self.tree == "dynamic":
            cand_tokens, scores, cand_parents = (np.asarray(a) for a in _draft_dynamic_tree(
                self.heads, self.lm_weight, self.embed, ctx.last_hidden, replica, row, newest, self.tied,
                self.tree_top_k, self.tree_depth))  # [n, M] each
            depth = _candidate_depths(self.tree_top_k, self.tree_depth)  # [M]
            for j, (i, _, k) in enumerate(ready):
                tokens[i], parents[i] = _best_subtree(cand_tokens[j], scores[j], cand_parents[j], depth, k)
            return Drafts(tokens, parents=parents)
        drafted = np.asarray(_draft_static_tree(self.heads, self.lm_weight, self.embed, ctx.last_hidden, replica, row,
                                                newest, self.tied, self.tree_levels))  # [n, N] breadth-first
        for j, (i, _, k) in enumerate(ready):
            tokens[i], parents[i] = drafted[j, :k].tolist(), self.tree_parents[:k]
        return Drafts(tokens, parents=parents)


@functools.partial(jax.jit, static_argnames=("num_guesses", "tied"))
def _draft(heads, lm_weight, embed, hidden, replica, row, newest, st: SamplingTensors, num_guesses: int, tied: bool):
    """hidden [replicas, R, H] -> (drafted tokens [K, n], each guess's confidence [K, n] (its
    distribution's top probability at temperature 1), the distributions drawn from [K * n, V])."""
    h = hidden[replica, row].astype(jnp.float32)  # [n, H]
    n = h.shape[0]
    lm_head = functools.partial(tied_logits, table=lm_weight) if tied else (lambda x: matmul(x, lm_weight))
    state, token, drafted, confidence, probs = h, newest, [], [], []
    for i in range(num_guesses):
        state = head_state(heads, i, state, h, embed_lookup(embed, token))
        rows = jax.tree.map(lambda a: a[i * n : (i + 1) * n] if a.shape[0] == num_guesses * n else a, st)
        logits = lm_head(state)  # [n, V]
        out = sample(logits, rows, 0)
        token = out.tokens
        drafted.append(token)
        confidence.append(jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)))
        probs.append(out.probs)
    return jnp.stack(drafted), jnp.stack(confidence), jnp.concatenate(probs)


def _static_levels(paths: tuple[tuple[int, ...], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Breadth-first paths -> per level d = 1, 2, ...: each node's (parent's index within level
    d - 1 (the root is level 0's only node), its rank among the parent's children)."""
    levels, index = [], {(): 0}
    for depth in range(1, max(len(p) for p in paths) + 1):
        level = [p for p in paths if len(p) == depth]
        levels.append(tuple((index[p[:-1]], p[-1]) for p in level))
        index = {p: i for i, p in enumerate(level)}
    return tuple(levels)


def _lm_head(lm_weight, tied: bool):
    return functools.partial(tied_logits, table=lm_weight) if tied else (lambda x: matmul(x, lm_weight))


@functools.partial(jax.jit, static_argnames=("tied", "levels"))
def _draft_static_tree(heads, lm_weight, embed, hidden, replica, row, newest, tied: bool, levels):
    """A static tree's tokens [n, N] (breadth-first), level by level: a level's nodes are the
    ranked guesses of their parents' distributions (`_static_levels`)."""
    h = hidden[replica, row].astype(jnp.float32)  # [n, H]
    n, H = h.shape
    lm_head = _lm_head(lm_weight, tied)
    state = head_state(heads, 0, h, h, embed_lookup(embed, newest))[:, None]  # [n, 1, H]: the root's
    out = []
    for depth, level in enumerate(levels, start=1):
        parent = np.array([p for p, _ in level])
        rank = np.array([r for _, r in level])
        m = state.shape[1]
        logits = lm_head(state.reshape(n * m, H)).reshape(n, m, -1)  # [n, m, V]
        _, top = jax.lax.top_k(logits, int(rank.max()) + 1)  # [n, m, K]
        token = top[:, parent, rank]  # [n, level]
        out.append(token)
        if depth < len(levels):  # the states of this level's nodes, whose children come next
            w = len(level)
            state = head_state(heads, depth, state[:, parent].reshape(n * w, H), jnp.repeat(h, w, axis=0),
                               embed_lookup(embed, token.reshape(-1))).reshape(n, w, H)
    return jnp.concatenate(out, axis=1).astype(jnp.int32)


def _candidate_depths(top_k: int, depth: int) -> np.ndarray:
    """Depth of each candidate of `_draft_dynamic_tree`: top_k at level 1, top_k^2 at each further level."""
    return np.concatenate([np.full(top_k, 1)] + [np.full(top_k * top_k, d) for d in range(2, depth + 1)])


@functools.partial(jax.jit, static_argnames=("tied", "top_k", "depth"))
def _draft_dynamic_tree(heads, lm_weight, embed, hidden, replica, row, newest, tied: bool, top_k: int, depth: int):
    """EAGLE-2's candidates (module docstring): (tokens, cumulative log-probabilities, parents:
    the candidate index of each one's parent, -1 = the root), each [n, M], M = K + (depth - 1) K^2;
    level 1 first, then each level's K^2 expansions of the level above's best K."""
    h = hidden[replica, row].astype(jnp.float32)  # [n, H]
    n, H = h.shape
    K = top_k
    lm_head = _lm_head(lm_weight, tied)
    root = head_state(heads, 0, h, h, embed_lookup(embed, newest))  # [n, H]
    score, token = jax.lax.top_k(jax.nn.log_softmax(lm_head(root), axis=-1), K)  # [n, K]
    tokens, scores, parents = [token], [score], [jnp.full((n, K), -1, jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (n, K))  # candidate ids of the level's best K
    state = head_state(heads, 1, jnp.repeat(root, K, axis=0), jnp.repeat(h, K, axis=0),
                       embed_lookup(embed, token.reshape(-1))).reshape(n, K, H)  # the frontier's states
    first = K  # candidate id of the next level's first
    for d in range(2, depth + 1):
        logp = jax.nn.log_softmax(lm_head(state.reshape(n * K, H)), axis=-1).reshape(n, K, -1)
        child_logp, child = jax.lax.top_k(logp, K)  # [n, K (parent), K (child)]
        child_score = (score[:, :, None] + child_logp).reshape(n, K * K)
        child = child.reshape(n, K * K).astype(jnp.int32)
        tokens.append(child)
        scores.append(child_score)
        parents.append(jnp.repeat(frontier, K, axis=1))
        if d < depth:  # the best K of this level expand next
            score, best = jax.lax.top_k(child_score, K)  # [n, K]
            parent_slot = best // K
            token = jnp.take_along_axis(child, best, axis=1)
            prev = jnp.take_along_axis(state, parent_slot[:, :, None], axis=1)  # [n, K, H]
            state = head_state(heads, d, prev.reshape(n * K, H), jnp.repeat(h, K, axis=0),
                               embed_lookup(embed, token.reshape(-1))).reshape(n, K, H)
            frontier = first + best.astype(jnp.int32)
        first += K * K
    return jnp.concatenate(tokens, axis=1), jnp.concatenate(scores, axis=1), jnp.concatenate(parents, axis=1)


def _best_subtree(tokens: np.ndarray, scores: np.ndarray, parents: np.ndarray, depth: np.ndarray,
                  k: int) -> tuple[list[int], list[int]]:
    """The k candidates of the highest cumulative log-probability (ties: shallower first, then
    the earlier), in candidate order (parents first), with each one's parent as its index among
    them (-1: the root). A candidate whose parent was not chosen is skipped (possible only
    through ties)."""
    order = np.lexsort((np.arange(len(scores)), depth, -scores))
    chosen = set()
    for c in order:
        if len(chosen) == k:
            break
        if parents[c] < 0 or parents[c] in chosen:
            chosen.add(int(c))
    kept = sorted(chosen)
    position = {c: i for i, c in enumerate(kept)}
    return [int(tokens[c]) for c in kept], [position[int(parents[c])] if parents[c] >= 0 else -1 for c in kept]

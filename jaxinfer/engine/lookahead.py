"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): speculative decoding with no draft model.

    LLM(model, speculative_config={"method": "lookahead", "lookahead_window": 4, "lookahead_ngram": 3,
                                   "lookahead_candidates": 4})

W = lookahead_window, N = lookahead_ngram, G = lookahead_candidates. Each sequence keeps

- a 2-D window of guessed tokens, N - 1 levels x W columns: level l, column i guesses the token
  at position root + 1 + i + l, where the root is the sequence's newest token (so a column is a
  diagonal of the paper's figure: its levels are consecutive positions);
- an n-gram pool: first token -> its most recent continuations (N - 1 tokens each), at most G
  per first token and `MAX_POOL_KEYS` first tokens, least recently used first out.

Every target step of the sequence is one verification chunk (spec_decode's draft trees) of

    root | verification branch (a trie of nodes) | lookahead branch (the window: extra rows)

- The verification branch: the pool's (at most G) continuations of the root token, merged into a
  trie (`trie`), verified as any draft tree (exact, greedy or sampled: `ops.sampling.verify_tree`).
- The lookahead branch: the window's tokens, level by level (level-major, so that any first rows
  of it are a closed set), as extra rows (`spec_decode.ExtraRows`) never accepted. Row (l, i)
  rotates at root + 1 + i + l and sees the root, level 0's columns 0..i and its own column's
  levels 1..l (`window_rows`): its context is one token per position from the root on, a proper
  sequence, as in the paper's mask (llama.cpp's `examples/lookahead` lays out the same rows,
  except that the root is level 0 of its first column: W - 1 + (N - 2) * W rows). One Jacobi
  iteration: the target's token at row (N - 2, i) is the next guess for column i, one position on.

After the step the proposer gets the tokens sampled at the extra rows (`observe`; under greedy
decoding the argmax, otherwise a sample from the row's distribution, as llama.cpp samples them).
With a full window each column's levels 0 .. N - 2 and its new token are an N-gram, added to the
pool under its first token; then level 0 goes and the new tokens become the last level (the
window slides one position, as the root does). In the first N - 2 steps the window is not full
yet: it starts as one level of tokens drawn from the sequence's own text and grows by a level a
step (the paper's warm-up), collecting nothing.

Differences from the paper's implementation, by choice:
- the pool is also fed the N-grams of the sequence's own text (prompt and output, as prompt lookup
  reads them), so that repeated text is verified from the first step;
- the window slides one position per step whatever the verification accepted (as llama.cpp's
  does), and the levels of the warm-up are not realigned as the root moves (their guesses are a
  position off per step until their level 0 is dropped): Jacobi iterations converge from any start;
- the window and pool are per sequence (a request's n completions each have their own).

The engine's side: the tree and window rows ask for slots like any draft (`draft_budget`: never
past the request's max_len, so never past max_model_len), at most 31 rows besides the root (the
32 positions of a tree mask; `SpeculativeConfig` checks (G + W) * (N - 1) <= 31); when a
sequence's budget is smaller, the trie is cut first (a prefix of it, parents first) and the
window to the columns that still fit. A sequence whose pool has nothing for its root still
computes its window rows. The draft-length back-off does not apply (`backs_off = False`): the
rows are the configured cost. Like draft trees, it is refused with hybrid models, MLA,
sliding-window or chunked attention, sequence parallelism and KV outliers
(`build.check_token_tree`), and constrained sequences (structured outputs) verify the pool's trie
pruned by their grammar but run no window.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from typing import Sequence

import numpy as np

from jaxinfer.engine.spec_decode import DraftContext, Drafts, ExtraRows

MAX_POOL_KEYS = 4096  # first tokens a sequence's pool remembers (least recently used out)


class NgramPool:
    """N-grams by first token: for each, its most recent continuations (N - 1 tokens), at most
    `per_key`; at most `max_keys` first tokens. Adding an n-gram again makes it the most recent."""

    def __init__(self, ngram: int, per_key: int, max_keys: int = MAX_POOL_KEYS):
        self.ngram, self.per_key, self.max_keys = ngram, per_key, max_keys
        self._pool: collections.OrderedDict[int, collections.OrderedDict[tuple[int, ...], None]] = collections.OrderedDict()

    def add(self, ngram: Sequence[int]) -> None:
        assert len(ngram) == self.ngram, ngram
        key, continuation = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        entries = self._pool.pop(key, None)
        if entries is None:
            entries = collections.OrderedDict()
            if len(self._pool) >= self.max_keys:
                self._pool.popitem(last=False)
        self._pool[key] = entries  # (the most recently used key)
        entries.pop(continuation, None)
        entries[continuation] = None
        if len(entries) > self.per_key:
            entries.popitem(last=False)

    def candidates(self, key: int, most: int) -> list[tuple[int, ...]]:
        """At most `most` continuations of `key`, the most recent first."""
        entries = self._pool.get(int(key))
        if not entries:
            return []
        self._pool.move_to_end(int(key))
        return list(reversed(entries))[:most]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._pool.values())


def trie(continuations: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Continuations of the root merged into a trie: (tokens, parents), parents first (each
    node's parent its index, -1 the root), nodes in the order the continuations first reach them."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    for continuation in continuations:
        parent = -1
        for token in continuation:
            node = index.get((parent, token))
            if node is None:
                node = index[parent, token] = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
            parent = node
    return tokens, parents


def window_rows(num_levels: int, num_columns: int, num_nodes: int) -> tuple[list[int], list[int]]:
    """(masks, offsets) of the window's rows, level-major (row (l, i) the l * num_columns + i-th),
    after the root and num_nodes tree nodes: mask bits count the chunk's rows from the root
    (bit 0 the root, bit 1 + num_nodes + j the window's row j). Row (l, i) sees the root, level
    0's columns 0..i and its column's levels 1..l (itself the last), and rotates at root + 1 + i + l."""
    def bit(level: int, column: int) -> int:
        return 1 << (1 + num_nodes + level * num_columns + column)

    masks, offsets = [], []
    for level in range(num_levels):
        for column in range(num_columns):
            mask = 1
            for c in range(column + 1):
                mask |= bit(0, c)
            for l in range(1, level + 1):
                mask |= bit(l, column)
            masks.append(mask)
            offsets.append(1 + column + level)
    return masks, offsets


@dataclasses.dataclass
class LookaheadState:
    """One sequence's window, pool and bookkeeping."""

    levels: list[list[int]]  # [levels <= N - 1][W]: level l, column i guesses the token at root + 1 + i + l
    pool: NgramPool
    num_read: int = 0  # tokens of the sequence whose n-grams the pool has taken
    sent: tuple[int, int] = (0, 0)  # (levels, columns) of the window rows of its last proposal


class LookaheadProposer:
    """Method "lookahead" (module docstring): per sequence a Jacobi window and an n-gram pool."""

    on_device = False
    backs_off = False  # (core: the draft-length back-off does not apply)

    def __init__(self, window: int = 4, ngram: int = 3, candidates: int = 4):
        if ngram < 2 or window < 1 or candidates < 1:
            raise ValueError(f"lookahead: window={window}, ngram={ngram}, candidates={candidates}: need window >= 1, "
                             f"ngram >= 2, candidates >= 1")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> LookaheadState
        self.num_candidates = 0  # n-grams verified (trie branches)
        self.num_window_rows = 0  # window rows computed
        self.num_ngrams_collected = 0  # n-grams the window gave the pools

    def state(self, seq) -> LookaheadState:
        """The sequence's state, made on first use: level 0 of its window drawn from its own tokens."""
        state = self._states.get(seq)
        if state is None:
            rng = np.random.default_rng(seq.seed)
            text = np.asarray(seq.token_ids, np.int64)
            state = LookaheadState([rng.choice(text, self.window).tolist()], NgramPool(self.ngram, self.candidates))
            self._states[seq] = state
        return state

    def propose(self, ctx: DraftContext, asked) -> Drafts:
        tokens, parents, extra = [], [], []
        for seq, k in asked:
            state = self.state(seq)
            self._read_text(state, seq.token_ids)
            nodes, node_parents = trie(state.pool.candidates(seq.token_ids[-1], self.candidates))
            nodes, node_parents = nodes[:k], node_parents[:k]  # (a prefix of a trie is a trie)
            self.num_candidates += len(set(range(len(nodes))) - set(node_parents))  # (the trie's leaves)
            levels = len(state.levels)
            columns = min(self.window, (k - len(nodes)) // levels)
            state.sent = (levels, columns)
            tokens.append(nodes)
            parents.append(node_parents)
            if columns:
                masks, offsets = window_rows(levels, columns, len(nodes))
                extra.append(ExtraRows([state.levels[l][i] for l in range(levels) for i in range(columns)], masks, offsets))
                self.num_window_rows += levels * columns
            else:
                extra.append(None)
        return Drafts(tokens, parents=parents, extra=extra)

    def observe(self, seq, tokens: Sequence[int]) -> None:
        """The target's tokens at the window rows of the sequence's last proposal (the first
        `len(tokens)` of them: the scheduler may have cut the last ones). One Jacobi step: the last
        level's tokens are the window's next level; a full window gives the pool one N-gram per
        column and drops its level 0. A column whose last-level row was not computed keeps its
        last level's guess."""
        state = self._states.get(seq)
        if state is None:
            return
        levels, columns = state.sent
        state.sent = (0, 0)
        if not levels or not columns:
            return
        first = (levels - 1) * columns  # the last level's first row
        new = list(state.levels[-1])
        computed = [i for i in range(columns) if first + i < len(tokens)]
        for i in computed:
            new[i] = int(tokens[first + i])
        state.levels = update_window(state.levels, new, computed, state.pool, self.ngram)
        if len(state.levels) == self.ngram - 1 and levels == self.ngram - 1:
            self.num_ngrams_collected += len(computed)

    def _read_text(self, state: LookaheadState, token_ids: Sequence[int]) -> None:
        """The pool takes the N-grams of the sequence's tokens it has not read yet."""
        n = self.ngram
        for end in range(max(state.num_read, n), len(token_ids) + 1):
            state.pool.add(token_ids[end - n : end])
        state.num_read = max(state.num_read, len(token_ids))


def update_window(levels: list[list[int]], new: list[int], columns: Sequence[int], pool: NgramPool,
                  ngram: int) -> list[list[int]]:
    """The window after one Jacobi step: `new` [W] is its next level (the target's tokens at the
    last level's rows, for the `columns` computed). A full window (ngram - 1 levels) gives `pool`
    each computed column's N-gram (levels 0 .. ngram - 2, then its new token) and loses level 0;
    a window still warming up grows by the level."""
    if len(levels) < ngram - 1:
        return levels + [new]
    for i in columns:
        pool.add([level[i] for level in levels] + [new[i]])
    return levels[1:] + [new]

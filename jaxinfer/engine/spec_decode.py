"""Speculative decoding: its configuration and the proposers that draft tokens.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

Each engine step, every decoding sequence that speculates gets up to k drafted tokens from the
proposer; its step then computes its newest token and the drafts together (k + 1 query rows of
the same ragged step), and the target's distributions at those rows decide, on the device, how
many drafts to keep (`jaxinfer.ops.sampling.verify_drafts`: the longest matching prefix under
greedy decoding, the standard rejection sampler otherwise), plus one more token sampled from the
target. The rest is rolled back: the sequence's length rewinds and pages past it are released
(`BlockManager.truncate`).

Proposers implement `propose(ctx, asked) -> Drafts`, where `ctx` is a `DraftContext` (what a
proposer may read and do in the engine core: page tables, reserving slots with their page
copies, the last step's hidden states), `asked` is a list of (sequence, k) and each draft is a
list of at most k token ids (plus, for a model that samples its drafts, the distributions they
came from). The engine builds the proposer of a `SpeculativeConfig` (`jaxinfer.engine.build`).
Here:

- `NgramProposer` (method "ngram", prompt lookup): the last n tokens (n from prompt_lookup_max
  down to prompt_lookup_min) are searched for earlier in the prompt and output; what followed
  their latest earlier occurrence is the draft. No model; a deterministic proposal (its
  distribution q is one-hot), so rejection sampling accepts a drafted token with the target's
  probability of it.
- `draft_model.DraftModelProposer` (method "draft_model"): another model, or the target itself
  quantized or truncated to its first layers, drafts autoregressively in its own paged cache.
- `draft_head.DraftHeadProposer` (methods "eagle" and "medusa"): draft heads trained on the
  target's own text (`scripts/train_draft_head.py`) read the target's last hidden state.
- `mtp.MTPProposer` (method "mtp"): DeepSeek-V3's multi-token-prediction layer, shipped in its
  checkpoint, reads the target's hidden state of every token and drafts from its own cache.
- `eagle3.Eagle3Proposer` (method "eagle3"): a published EAGLE-3 head (`model`: its folder) reads
  three of the target's layers' streams of every token and drafts from its own cache, as MTP does.
- `lookahead.LookaheadProposer` (method "lookahead", Fu et al. 2024): no draft model; Jacobi
  iterations over a window of guessed tokens, computed in the verification chunk as extra rows
  (`Drafts.extra`), fill a pool of n-grams; those starting with the newest token are verified as
  a tree (keys lookahead_window, lookahead_ngram, lookahead_candidates; see that module).

Draft trees (methods "eagle", "medusa" and "eagle3"; lookahead builds its own): instead of one
chain, the proposer drafts a tree of guesses (several candidates per position), all verified in
ONE target step.

    speculative_config={"method": "medusa", "model": "./heads", "num_speculative_tokens": 6,
                        "speculative_token_tree": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]}
    speculative_config={"method": "eagle", "model": "./heads", "num_speculative_tokens": 16,
                        "speculative_token_tree": "dynamic", "tree_top_k": 4, "tree_depth": 5}

- A static tree is vLLM's `speculative_token_tree`: a list of paths (or its string), each a tuple
  of child ranks: (0, 1) = the second-ranked guess after the top-ranked first guess. Every proper
  prefix of a path must be a path too. num_speculative_tokens is the number of nodes (vLLM's
  meaning; it may be left out).
- A dynamic tree ("dynamic", as EAGLE-2 builds it): level by level, the `tree_top_k` most probable
  children of each of the `tree_top_k` best nodes of the level above (by cumulative draft
  log-probability) are candidates, for `tree_depth` levels; the num_speculative_tokens candidates
  of the highest cumulative probability are verified (the best nodes of a tree always include
  their ancestors: a child's probability is at most its parent's).

At most MAX_TREE_TOKENS nodes (with the newest token, the 32 positions of a tree mask). A tree's
drafts come as tokens in topological order (parents first) plus, per node, its parent's index
(`Drafts.parents`, -1: the newest token, the root). The verification chunk holds the root and
the nodes at slots start .. start + N, each attending to its ancestors and itself (tree masks,
`SequenceChunk.tree_masks`), RoPE at start + depth. Each row's candidate children are verified
on the device (`jaxinfer.ops.sampling.verify_tree`: each child a deterministic proposal, so the
output keeps the target's distribution exactly); the host walks from the root along the accepted
children, moves the accepted nodes' K/V to the positions after the root (`ModelRunner.move_kv_rows`)
and rewinds the rest. The draft length back-off (`SpecState.k`) is then a node budget: a tree is
cut to its first k nodes (a prefix of a topological order is still a tree).
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

METHODS = ("ngram", "draft_model", "eagle", "medusa", "mtp", "eagle3", "lookahead")
MAX_SPECULATIVE_TOKENS = 7  # k + 1 verification rows fit the spec_block bucket of 8
MAX_TREE_TOKENS = 31  # nodes of a draft tree: with its root, the 32 positions a tree mask covers
TREE_METHODS = ("eagle", "medusa", "eagle3")  # proposers that draft trees


class SpecConfigError(ValueError):
    """A speculative_config the engine cannot use; the message names the key at fault."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys: method, num_speculative_tokens, prompt_lookup_max,
    prompt_lookup_min (method "ngram"), model, quantization (method "draft_model": a model path,
    None for the target itself; the draft's weight quantization), and jaxinfer's num_layers (a
    draft of the first num_layers layers of `model`: self-speculation) and
    draft_confidence_threshold (methods "eagle" / "medusa": a draft stops at the first guess whose
    distribution's top probability is below it; 0 drafts all k); disable_by_batch_size (vLLM's:
    no sequence drafts in a step that starts with at least this many running in its replica,
    where verification rows cost more than they save)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None
    num_layers: int | None = None
    draft_confidence_threshold: float = 0.0
    disable_by_batch_size: int | None = None
    # draft trees (module docstring): a static tree (paths of child ranks) or "dynamic"
    speculative_token_tree: Any = None
    tree_top_k: int | None = None  # dynamic trees: children expanded per node, nodes kept per level (default 4)
    tree_depth: int | None = None  # dynamic trees: levels drafted (default 4)
    # method "lookahead" (jaxinfer.engine.lookahead): W columns and N - 1 levels of the Jacobi window,
    # n-grams of N tokens, at most G of them verified per step (defaults 4, 3, 4)
    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_candidates: int | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise SpecConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = d.get("method", "ngram" if "prompt_lookup_max" in d else None)
        if method not in METHODS:
            raise SpecConfigError(f"speculative_config['method']={method!r}: expected one of {METHODS}")
        d = {**d, "method": method}
        if d.get("speculative_token_tree") is not None:
            d["speculative_token_tree"] = parse_token_tree(d["speculative_token_tree"])
            if "num_speculative_tokens" not in d and d["speculative_token_tree"] != "dynamic":
                d["num_speculative_tokens"] = len(d["speculative_token_tree"])  # (vLLM's: the tree's nodes)
        if d.get("speculative_token_tree") == "dynamic":
            d.setdefault("tree_top_k", 4)
            d.setdefault("tree_depth", 4)
        if method == "lookahead":
            d.setdefault("lookahead_window", 4)
            d.setdefault("lookahead_ngram", 3)
            d.setdefault("lookahead_candidates", 4)
            try:  # (derived; a bad key is named by check)
                rows = lookahead_rows(d["lookahead_window"], d["lookahead_ngram"], d["lookahead_candidates"])
            except TypeError:
                rows = 0
            d.setdefault("num_speculative_tokens", rows)
        config = SpeculativeConfig(**d)
        config.check()
        return config

    def check(self) -> None:
        self._check_lookahead()  # (first: its num_speculative_tokens is derived from its keys)
        k = self.num_speculative_tokens
        most = MAX_TREE_TOKENS if self.is_tree else MAX_SPECULATIVE_TOKENS
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= most:
            raise SpecConfigError(f"speculative_config['num_speculative_tokens']={k!r}: must be an integer in "
                                  f"[1, {most}]" + (" (tree nodes)" if self.is_tree else ""))
        self._check_tree()
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise SpecConfigError(f"speculative_config['num_layers']={self.num_layers!r}: must be a positive integer")
        if self.method == "ngram" and (self.model or self.quantization or self.num_layers):
            raise SpecConfigError("speculative_config: model / quantization / num_layers need method 'draft_model' "
                                  "(or 'eagle' / 'medusa': model)")
        if self.method == "mtp" and (self.model or self.quantization or self.num_layers):
            raise SpecConfigError("speculative_config: method 'mtp' drafts with the target checkpoint's own "
                                  "multi-token-prediction layer and takes no model / quantization / num_layers")
        if self.method == "eagle3" and (not self.model or self.quantization or self.num_layers):
            raise SpecConfigError("speculative_config: method 'eagle3' needs 'model' (a folder of an EAGLE-3 head in the "
                                  "published format) and takes no quantization / num_layers")
        if self.method in ("eagle", "medusa") and (not self.model or self.quantization or self.num_layers):
            raise SpecConfigError(f"speculative_config: method {self.method!r} needs 'model' (a folder of heads from "
                                  "scripts/train_draft_head.py) and takes no quantization / num_layers")
        tau = self.draft_confidence_threshold
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < 1:
            raise SpecConfigError(f"speculative_config['draft_confidence_threshold']={tau!r}: must be a number in [0, 1)")
        if tau and self.method not in ("eagle", "medusa"):
            raise SpecConfigError(f"speculative_config['draft_confidence_threshold'] applies to methods 'eagle' and "
                                  f"'medusa', not {self.method!r}")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 2):
            raise SpecConfigError(f"speculative_config['disable_by_batch_size']={n!r}: must be an integer >= 2")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise SpecConfigError(
                f"speculative_config: prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with 1 <= min <= max"
            )

    def _check_lookahead(self) -> None:
        keys = ("lookahead_window", "lookahead_ngram", "lookahead_candidates")
        if self.method != "lookahead":
            for key in keys:
                if getattr(self, key) is not None:
                    raise SpecConfigError(f"speculative_config['{key}'] applies to method 'lookahead', not {self.method!r}")
            return
        if self.speculative_token_tree is not None:
            raise SpecConfigError("speculative_config['speculative_token_tree'] with method 'lookahead': its trees are "
                                  "the tries of its n-gram pool's candidates (lookahead_candidates)")
        if self.model or self.quantization or self.num_layers:
            raise SpecConfigError("speculative_config: method 'lookahead' drafts with no model (its n-grams come from "
                                  "the target's own Jacobi iterations) and takes no model / quantization / num_layers")
        for key, least in zip(keys, (1, 2, 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= MAX_TREE_TOKENS:
                raise SpecConfigError(f"speculative_config['{key}']={value!r}: must be an integer in [{least}, {MAX_TREE_TOKENS}]")
        W, N, G = self.lookahead_window, self.lookahead_ngram, self.lookahead_candidates
        rows = lookahead_rows(W, N, G)
        if rows > MAX_TREE_TOKENS:
            raise SpecConfigError(f"speculative_config: lookahead_window={W}, lookahead_ngram={N}, lookahead_candidates={G} "
                                  f"make 1 + (G + W) * (N - 1) = {1 + rows} rows per verification; at most "
                                  f"{MAX_TREE_TOKENS + 1} (the 32 positions of a tree mask)")
        if self.num_speculative_tokens != rows:
            raise SpecConfigError(f"speculative_config['num_speculative_tokens']={self.num_speculative_tokens!r}: method "
                                  f"'lookahead' drafts (G + W) * (N - 1) = {rows} rows (leave it out)")

    def _check_tree(self) -> None:
        tree = self.speculative_token_tree
        if tree is None:
            for key in ("tree_top_k", "tree_depth"):
                if getattr(self, key) is not None:
                    raise SpecConfigError(f"speculative_config['{key}'] applies to speculative_token_tree='dynamic'")
            return
        if self.method not in TREE_METHODS:
            raise SpecConfigError(f"speculative_config['speculative_token_tree'] with method {self.method!r}: only methods "
                                  f"{TREE_METHODS} draft trees (the others propose one chain)")
        if self.draft_confidence_threshold:
            raise SpecConfigError("speculative_config['draft_confidence_threshold'] cuts a chain; it does not apply to a "
                                  "speculative_token_tree")
        if tree == "dynamic":
            for key in ("tree_top_k", "tree_depth"):
                value = getattr(self, key)
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TREE_TOKENS:
                    raise SpecConfigError(f"speculative_config['{key}']={value!r}: must be an integer in [1, {MAX_TREE_TOKENS}]")
            return
        for key in ("tree_top_k", "tree_depth"):
            if getattr(self, key) is not None:
                raise SpecConfigError(f"speculative_config['{key}'] applies to speculative_token_tree='dynamic', "
                                      f"not to a static tree")
        if self.num_speculative_tokens != len(tree):
            raise SpecConfigError(f"speculative_config['num_speculative_tokens']={self.num_speculative_tokens} but "
                                  f"speculative_token_tree has {len(tree)} nodes (they must agree)")

    @property
    def is_tree(self) -> bool:
        """Whether the proposer drafts trees (static or dynamic; lookahead's trie of n-grams)."""
        return self.speculative_token_tree is not None or self.method == "lookahead"

    @property
    def tree_paths(self) -> tuple[tuple[int, ...], ...] | None:
        """A static tree's paths in breadth-first order; None for a dynamic tree or a chain."""
        tree = self.speculative_token_tree
        return None if tree is None or tree == "dynamic" else tree

    @property
    def max_tree_depth(self) -> int:
        """How many levels the tree drafts (a chain: num_speculative_tokens)."""
        if self.speculative_token_tree == "dynamic":
            return self.tree_depth
        if self.method == "lookahead":  # an n-gram's continuation
            return self.lookahead_ngram - 1
        paths = self.tree_paths
        return max(len(p) for p in paths) if paths else self.num_speculative_tokens

    @property
    def spec_block(self) -> int:
        """Rows of the longest verification chunk (the newest token + k drafts, or a tree's root
        and nodes), as a power of two."""
        return 1 << (self.num_speculative_tokens).bit_length()


def lookahead_rows(window: int, ngram: int, candidates: int) -> int:
    """Rows a lookahead verification chunk holds beside its root: at most `candidates` n-grams'
    continuations (ngram - 1 tokens each, a trie) and the window's (ngram - 1) x `window` tokens."""
    return (candidates + window) * (ngram - 1)


def parse_token_tree(value) -> tuple[tuple[int, ...], ...] | str:
    """speculative_token_tree -> "dynamic", or its paths sorted breadth-first (by depth, then
    rank: vLLM's order, which puts every parent before its children); SpecConfigError names
    what is wrong. Takes a list of paths (tuples or lists of child ranks) or its string (vLLM's CLI)."""
    key = "speculative_config['speculative_token_tree']"
    if value == "dynamic":
        return value
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as error:
            raise SpecConfigError(f"{key}={value!r}: expected 'dynamic' or a list of paths such as "
                                  f"[(0,), (1,), (0, 0)]") from error
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecConfigError(f"{key}={value!r}: expected 'dynamic' or a non-empty list of paths of child ranks")
    paths = []
    for path in value:
        if (not isinstance(path, (list, tuple)) or not path
                or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path)):
            raise SpecConfigError(f"{key}: path {path!r} is not a non-empty tuple of child ranks (integers >= 0)")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise SpecConfigError(f"{key}: a path appears twice")
    if len(paths) > MAX_TREE_TOKENS:
        raise SpecConfigError(f"{key}: {len(paths)} nodes; a tree holds at most {MAX_TREE_TOKENS} (with the newest "
                              f"token, the 32 positions of a tree mask)")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise SpecConfigError(f"{key}: path {path} has no parent {path[:-1]} in the tree")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def tree_parents(paths: Sequence[tuple[int, ...]]) -> list[int]:
    """Breadth-first paths -> each node's parent (its index among the paths; -1: the root)."""
    index = {p: i for i, p in enumerate(paths)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in paths]


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """Per row of a verification chunk (0: the root, i: node i - 1 of `parents`), its children's
    rows, in the order they come (rank order)."""
    children = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i + 1)
    return children


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Per row (0: the root, depth 0), its depth; parents come before their children."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def tree_masks(parents: Sequence[int]) -> list[int]:
    """Per row (0: the root), its tree mask: bit j set = it sees row j (its ancestors and itself)."""
    masks = [1]
    for i, parent in enumerate(parents):
        masks.append(masks[parent + 1] | (1 << (i + 1)))
    return masks


def accepted_path(parents: Sequence[int], accepted_child: Sequence[int]) -> list[int]:
    """The accepted nodes' rows (1-based: row 0 is the root), from the root down: each row's
    accepted child (its index among the row's children, -1: none; `verify_tree`) leads on."""
    children = tree_children(parents)
    path, row = [], 0
    while 0 <= accepted_child[row] < len(children[row]):
        row = children[row][accepted_child[row]]
        path.append(row)
    return path


class DraftContext(Protocol):
    """What a proposer may read and do in the engine core (`jaxinfer.engine.core` implements it)."""

    num_replicas: int
    num_processed: int  # steps read back so far
    last_hidden: Any  # [replicas, R, H] hidden states of the last step read (None unless the step returns them)

    def page_table(self, seq) -> list[int]:
        """The sequence's pages (ids within its replica's pool)."""

    def holds(self, seq, num_tokens: int) -> bool:
        """Whether the sequence still holds the K/V of its first num_tokens tokens (not preempted
        or rewound since)."""

    def reserve(self, seq, num_tokens: int) -> list[tuple[int, tuple[int, int]]] | None:
        """Slots for the sequence to hold num_tokens tokens; returns the (replica, (src, dst))
        page copies done in the target's pool for copy-on-write (a draft model's pool must
        mirror them), or None when out of pages."""


@dataclasses.dataclass
class Drafts:
    """What a proposer returns for the sequences it was asked about, in order."""

    tokens: list[list[int]]  # at most k drafted tokens each
    buffer: Any = None  # [replicas, N, V] device array of the drafts' distributions; None: deterministic drafts
    src: list[list[int]] | None = None  # per sequence, per draft: its row of buffer
    # draft trees: per sequence, per draft its parent's index among the drafts (-1: the newest
    # token), parents first; None (or an empty list for a sequence): chains
    parents: list[list[int]] | None = None
    # extra rows beside a tree (method "lookahead"'s window): per sequence an `ExtraRows` or None
    extra: list["ExtraRows | None"] | None = None


@dataclasses.dataclass
class ExtraRows:
    """Rows a verification chunk computes after its tree's nodes that are never accepted (lookahead's
    window): the target's token at each is handed back (`observe(seq, tokens)` of the proposer).
    Each row sees what its mask says; bits count the chunk's rows from the root (bit 0: the root,
    1 .. n: the tree's n nodes, n + 1 + j: extra row j), so an extra row may see only rows before it."""

    tokens: list[int]
    masks: list[int]  # per extra row, its mask over the chunk's rows (for the tree it came with)
    offsets: list[int]  # per extra row, its RoPE position minus the root's


class NgramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    on_device = False

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1):
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, ctx: DraftContext, asked) -> Drafts:
        return Drafts([self.draft(seq.token_ids, k) for seq, k in asked])

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens for what follows `tokens`; [] when no n-gram of the suffix recurs."""
        ids = np.asarray(tokens, np.int64)
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram but the suffix itself
            hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
            if len(hits):
                start = hits[-1] + n  # the latest occurrence, and what followed it
                return ids[start : start + k].tolist()
        return []


def replica_speculates(config: SpeculativeConfig, num_running: int) -> bool:
    """Whether a replica's sequences may draft this step: not while it runs `disable_by_batch_size` or more."""
    return config.disable_by_batch_size is None or num_running < config.disable_by_batch_size


def draft_budget(seq, max_model_len: int) -> int:
    """How many tokens to draft for a running sequence now (0: it decodes plainly this step)."""
    request, p = seq.request, seq.request.params
    if seq.spec is None or not seq.spec.tick():  # tick: a pause counts down every step
        return 0
    if seq.is_prefill or seq.pending or seq.hold or not request.forked:
        return 0
    num_out = len(seq.output_token_ids)
    if num_out < p.min_tokens:  # min_tokens bans EOS for some positions; the drafts would not know
        return 0
    left = min((p.max_tokens or max_model_len) - num_out, request.max_len - len(seq.token_ids))
    if left <= 1:
        return 0
    return min(seq.spec.k, left - 1)

"""On-device sampling, vectorized over logits rows with per-row parameters.

Each row carries its own temperature (0 = greedy), top-k (0 = off), top-p (1 = off), seed and
counter. The random draw for a row depends only on (seed, counter), so a seeded request samples
the same tokens whatever else shares the batch. Sampling is Gumbel-max over the filtered,
temperature-scaled logits; batches that need no filtering skip the filter, and all-greedy batches
skip the random draw (`lax.cond` picks one branch at run time, no recompile).

Optional per-row processing, in vLLM's order (each feature is a static switch: a `None` field in
`SamplingTensors` changes the pytree structure, so it selects a separate compiled variant and a
batch without it traces exactly the code it traced before the feature existed):

- penalties (`history_ids` set; then all four penalty fields must be set): built on the device from
  each row's token history (prompt ids, then output ids, -1 padded to a static H). Repetition
  penalty acts on tokens seen in the prompt or the output (positive logits divided by it, others
  multiplied); presence subtracts once per token present in the output; frequency subtracts its
  value times the token's output count. Applied to the raw logits, so greedy rows take the argmax
  of the penalized logits.
- `banned_ids` [R, MAX_BANNED_IDS]: logits set to -inf (the engine's min_tokens bans EOS/stop ids
  this way). One fixed width, so that no request's stop list picks a shape.
- `allowed_tokens` [R, ceil(V / 32)] int32 bitmask (structured outputs): tokens whose bit is clear
  get -inf, after penalties and bans and before temperature, min-p, top-k and top-p, so every
  sampler setting works on the allowed tokens alone.
- `min_p` (random rows only; argmax-invariant): after temperature, tokens whose probability is
  below min_p times the row's largest probability are dropped, before top-k/top-p.

Penalties, bans and the allowed-token mask change which token is chosen, never the reported logprobs.

Every width here is fixed by the engine's configuration (rows R and tokens from its buckets, H from
max_model_len, the top-logprobs count from max_logprobs, the bitmask from the vocabulary,
MAX_BANNED_IDS): no value a request sends picks a shape, so none compiles a new variant.

Speculative decoding (`draft_token` set: a static switch like the others): a row that verifies
a drafted token d (draft_token >= 0) was proposed with probability q (`draft_probs`, the draft's
distribution after the same temperature / min-p / top-k / top-p processing, or one-hot at d for
a deterministic proposer such as n-gram lookup). With p the row's processed target distribution
(one-hot at the argmax for greedy rows), d is accepted with probability min(1, p(d) / q(d)), and
the row's sampled token is drawn from normalize(max(0, p - q)): the replacement used when d is
rejected (when the row has no draft, that is p itself: the bonus token after a fully accepted
draft, or an ordinary row). This is the standard rejection sampler; the output distribution is
exactly the target's. The acceptance draw and the sample use independent keys derived from the
row's (seed, counter), and rows without a draft sample exactly as without speculation.

Draft trees (`tree_children` set, another static switch): a row is a node of a draft tree and
carries its children's tokens [R, C] in rank order (-1 padding), each a deterministic proposal
(q one-hot). Multi-draft rejection sampling (SpecInfer's, with one-hot drafts): with p' = the
row's processed target distribution p, each child in turn is accepted with probability p'(t); a
rejected child's token gets p'(t) = 0 and p' is renormalised; if none is accepted, the row's
token is drawn from the final p'. Per child that is u_j * mass_j < p(t_j), mass_j being the mass
p keeps after the earlier children's (distinct) tokens are removed, so the whole row is a few
[R, C] operations. The emitted token (the accepted child's, or the draw) is distributed exactly
as p; greedy rows accept the child equal to the argmax. `verify_tree` returns, per row, the
accepted child's index (-1: none) and the draw; the host walks from the root along accepted
children (engine.core).

Vocabulary-split logits (`Vocab(V, axis)`, the LM head of lm_head_parallel="vocab"): every function
here also runs inside shard_map on a device's block of V / n columns (padding columns past V
masked to -inf). The processors touch only their own ids; each reduction over the vocabulary is a
local one plus one small collective (argmax: each device's best (value, id) all-gathered, ties to
the lowest id as jnp.argmax's; softmax and log-softmax: each device's (max, sum of exp)
all-gathered; sums: psum of [R]; the top-k / top-p thresholds: the same keys as the bisection,
found 4 bits a round, 8 psums of [R, 15] each); top logprobs merge each device's top K (an
all-gather of [R, n K]). The collectives of one program are chained in trace order (`Vocab.chain`)
so every device runs them in the same order. Each device takes its columns of the noise the
whole row draws, so the split sampler picks the same tokens as the whole one for the same seeds,
and its logprobs agree to rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Columns of `SamplingTensors.banned_ids`: a request with min_tokens holds back at most this many
# token ids (its stop_token_ids and EOS); the engine's input checks refuse more.
MAX_BANNED_IDS = 32
# Columns of `SamplingTensors.tree_children`: a draft tree node's children (a tree of at most 31
# nodes under its root gives a node at most 31); one fixed width, so no tree picks a shape.
MAX_TREE_CHILDREN = 32


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Where a logits row's columns lie in the vocabulary. `axis` None: the row is the whole
    vocabulary (every reduction is the plain one). Otherwise the row is this device's contiguous
    block of `width` columns of a vocabulary split over the mesh axis `axis` (inside shard_map;
    the LM head's "vocab" layout), columns from `size` on being padding (logits -inf, never
    sampled); reductions over the vocabulary are a local one plus a small collective."""

    size: int  # V, the real vocabulary
    axis: str | None = None
    # the output of the last collective traced (`_collective`): each collective waits for the one
    # before it, so every device runs them in one order. XLA:CPU runs independent thunks in any
    # order on each device; two collectives that do not depend on each other then deadlock when
    # some devices wait in one and the rest in the other with no thread left (seen with 4 CPU
    # devices on 2 cores). One chain per traced program: make a Vocab per trace.
    chain: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def _collective(self, fn, x):
        """fn(x), a collective, ordered after the previous one of this trace."""
        if self.chain:
            x, _ = jax.lax.optimization_barrier((x, self.chain[0]))
        y = fn(x)
        self.chain[:] = [jax.tree.leaves(y)[0]]
        return y

    def psum(self, x: jax.Array) -> jax.Array:
        return self._collective(lambda a: jax.lax.psum(a, self.axis), x)

    def cond(self, pred, true_fn, false_fn, *operands):
        """jax.lax.cond, whose branches' collectives follow this trace's previous one and precede its next."""
        if self.axis is None:
            return jax.lax.cond(pred, true_fn, false_fn, *operands)
        start = list(self.chain)

        def branch(fn):
            def run(*args):
                self.chain[:] = start
                return fn(*args)
            return run

        out = jax.lax.cond(pred, branch(true_fn), branch(false_fn), *operands)
        self.chain[:] = [jax.tree.leaves(out)[0]] if jax.tree.leaves(out) else start
        return out

    def offset(self, width: int) -> jax.Array | int:
        """The global id of this device's first column."""
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * width

    def ids(self, width: int) -> jax.Array:
        """The global ids [width] of this device's columns."""
        return self.offset(width) + jnp.arange(width)

    def pad(self, logits: jax.Array) -> jax.Array:
        """The padding columns (global id >= size) set to -inf."""
        width = logits.shape[-1]
        if self.axis is None and width == self.size:
            return logits
        return jnp.where(self.ids(width) < self.size, logits, -jnp.inf)

    def max(self, x: jax.Array) -> jax.Array:
        m = x.max(axis=-1, keepdims=True)
        return m if self.axis is None else self._collective(lambda a: jax.lax.pmax(a, self.axis), m)

    def min(self, x: jax.Array) -> jax.Array:
        m = x.min(axis=-1, keepdims=True)
        return m if self.axis is None else self._collective(lambda a: jax.lax.pmin(a, self.axis), m)

    def sum(self, x: jax.Array) -> jax.Array:
        t = x.sum(axis=-1, keepdims=True)
        return t if self.axis is None else self.psum(t)

    def _gather_pairs(self, values: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """float32 values and int32 ids of one shape, every device's, in ONE all-gather (the
        values' bits travel as int32): ([n, ...], [n, ...]), device by device."""
        packed = jnp.stack([jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32), ids.astype(jnp.int32)], -1)
        packed = self._collective(lambda a: jax.lax.all_gather(a, self.axis), packed)
        return jax.lax.bitcast_convert_type(packed[..., 0], jnp.float32), packed[..., 1]

    def argmax(self, x: jax.Array) -> jax.Array:
        """[R] int32 global ids of each row's largest value, the first one on ties (jnp.argmax's):
        each device's best (value, id) all-gathered, one collective."""
        if self.axis is None:
            return jnp.argmax(x, axis=-1).astype(jnp.int32)
        values, ids = self._gather_pairs(x.max(axis=-1), jnp.argmax(x, axis=-1) + self.offset(x.shape[-1]))  # [n, R]
        first = jnp.argmax(values == values.max(axis=0), axis=0)  # the first device holding the best: the lowest id
        return jnp.take_along_axis(ids, first[None], axis=0)[0]

    def _max_and_sum_exp(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(global max M [R, 1], global sum of exp(x - M) [R, 1], this device's exp(x - M)) with
        one all-gather of each device's (max, sum of exp(x - its max))."""
        m = x.max(axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # a device whose columns are all -inf holds no mass
        e = jnp.exp(x - m_safe)
        maxima = self._collective(lambda a: jax.lax.all_gather(a, self.axis),
                                  jnp.concatenate([m, e.sum(axis=-1, keepdims=True)], -1))  # [n, R, 2]
        M = maxima[..., 0].max(axis=0)  # [R]
        M_safe = jnp.where(jnp.isfinite(M), M, 0.0)
        S = (maxima[..., 1] * jnp.exp(maxima[..., 0] - M_safe)).sum(axis=0)
        return M[:, None], S[:, None], e * jnp.exp(m_safe - M_safe[:, None])

    def take(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x [R, width] at global ids [R, n] (in the vocabulary) -> [R, n]."""
        if self.axis is None:
            return jnp.take_along_axis(x, ids, axis=-1)
        width = x.shape[-1]
        local = ids - self.offset(width)
        inside = (local >= 0) & (local < width)
        picked = jnp.take_along_axis(x, jnp.clip(local, 0, width - 1), axis=-1)
        return self.psum(jnp.where(inside, picked, jnp.zeros((), x.dtype)))

    def local_ids(self, ids: jax.Array, width: int) -> jax.Array:
        """Global ids (-1 padding) -> this device's columns, `width` (out of bounds: a scatter drops
        it) for ids elsewhere or padding."""
        local = ids - self.offset(width)
        return jnp.where((ids >= 0) & (local >= 0) & (local < width), local, width)

    def softmax(self, x: jax.Array) -> jax.Array:
        if self.axis is None:
            return jax.nn.softmax(x, axis=-1)
        _, total, e = self._max_and_sum_exp(x)
        return e / total

    def log_softmax(self, x: jax.Array) -> jax.Array:
        if self.axis is None:
            return jax.nn.log_softmax(x, axis=-1)
        top, total, _ = self._max_and_sum_exp(x)
        return x - top - jnp.log(total)

    def gumbel(self, keys: jax.Array, width: int) -> jax.Array:
        """Each row's Gumbel noise over its columns [R, width]: the columns' entries of the noise
        the whole row draws (jax.random.gumbel(key, (size,))), so the split draw picks the same
        tokens as the whole one."""
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (self.size,), jnp.float32))(keys)
        if self.axis is None and width == self.size:
            return noise
        noise = jnp.pad(noise, ((0, 0), (0, max(0, self.offset_bound(width) - self.size))))
        return jax.lax.dynamic_slice_in_dim(noise, self.offset(width), width, axis=-1)

    def offset_bound(self, width: int) -> int:
        """The padded vocabulary: width x the number of devices along `axis`."""
        return width * (1 if self.axis is None else jax.lax.axis_size(self.axis))

    def top_k(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """Each row's k largest values and their global ids (lax.top_k's order: ties by lower id):
        each device's own top k, all-gathered (k per device), then the top k of those."""
        if self.axis is None:
            values, ids = jax.lax.top_k(x, k)
            return values, ids.astype(jnp.int32)
        width = x.shape[-1]
        kk = min(k, width)
        values, ids = jax.lax.top_k(x, kk)
        if kk < k:
            values = jnp.pad(values, ((0, 0), (0, k - kk)), constant_values=-jnp.inf)
            ids = jnp.pad(ids, ((0, 0), (0, k - kk)), constant_values=width - 1)
        ids = ids.astype(jnp.int32) + self.offset(width)
        values, ids = (jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1) for a in self._gather_pairs(values, ids))
        # [R, devices * k], device by device: ids ascending on ties
        best, where = jax.lax.top_k(values, k)
        return best, jnp.take_along_axis(ids, where, axis=-1)

    def gather_all(self, x: jax.Array) -> jax.Array:
        """[R, width] -> the whole rows [R, size]."""
        if self.axis is None:
            return x
        return self._collective(lambda a: jax.lax.all_gather(a, self.axis, axis=1, tiled=True), x)[:, : self.size]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    temperature: jax.Array  # [R] float32, 0 = greedy
    top_k: jax.Array  # [R] int32, 0 = off
    top_p: jax.Array  # [R] float32, 1 = off
    seed: jax.Array  # [R] uint32
    counter: jax.Array  # [R] int32, tokens sampled so far by the row's request (folded into the key)
    target_ids: jax.Array  # [R] int32, token whose logprob to report; -1 = the sampled token
    # Optional features; None = off for the whole batch (and not compiled in).
    min_p: jax.Array | None = None  # [R] float32, 0 = off
    banned_ids: jax.Array | None = None  # [R, MAX_BANNED_IDS] int32, -1 = padding
    history_ids: jax.Array | None = None  # [R, H] int32: prompt ids then output ids, -1 = padding
    num_prompt_history: jax.Array | None = None  # [R] int32: the first this-many history ids are prompt
    repetition_penalty: jax.Array | None = None  # [R] float32, 1 = off
    presence_penalty: jax.Array | None = None  # [R] float32, 0 = off
    frequency_penalty: jax.Array | None = None  # [R] float32, 0 = off
    # [1] bool: does any row want logprobs? False skips log-softmax and top-k at run time
    # (a lax.cond, not a new variant). None = always compute them.
    want_logprobs: jax.Array | None = None
    # speculative decoding (see the module docstring); None = no row verifies a draft
    draft_token: jax.Array | None = None  # [R] int32: the drafted token this row verifies, -1 = none
    draft_probs: jax.Array | None = None  # [R, V] float32: its proposal distribution; None = one-hot at draft_token
    # [1] bool: also return each row's processed distribution (a draft model's q); None = don't
    return_probs: jax.Array | None = None
    # [R, ceil(V / 32)] int32 structured outputs: bit t % 32 of word t // 32 set = token t allowed
    # (-1: every token); None = no row is constrained
    allowed_tokens: jax.Array | None = None
    # [R, MAX_TREE_CHILDREN] int32 draft trees: the row's children's tokens in rank order, -1 = padding;
    # None = no row verifies a tree
    tree_children: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # [R] int32: the sampled token (for a row verifying a draft: its replacement if rejected)
    logprobs: jax.Array  # [R] float32, logprob of the target (or emitted) token
    top_ids: jax.Array  # [R, K] int32
    top_logprobs: jax.Array  # [R, K] float32
    accepted: jax.Array | None = None  # [R] bool: the row's drafted token was accepted (speculative steps only)
    probs: jax.Array | None = None  # [R, V] float32: the distribution each row sampled from (SamplingTensors.return_probs)
    hidden: jax.Array | None = None  # [R, H] float32: each row's final-normed hidden state (StepFunction(return_hidden=True))
    accepted_child: jax.Array | None = None  # [R] int32: draft trees: the accepted child's column of tree_children, -1 = none


def filter_top_k_top_p_by_sorting(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The definition of `filter_top_k_top_p`, by sorting each row (the reference it is tested
    against; a full-vocabulary sort costs ~49 s of TPU compile at a 128k vocabulary)."""
    V = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)  # [R]
    in_top_k = sorted_desc >= jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # ties with the k-th kept (vLLM)
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))  # the smallest prefix reaching top_p
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)  # [R, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-inf lowest; -0.0 and +0.0 one key, as they compare equal)."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, vocab: Vocab | None = None) -> jax.Array:
    """Masks (to -inf) logits outside each row's top-k, then outside its top-p nucleus (the
    smallest set of the largest logits whose probability reaches top_p). [R, V].

    No sort: each threshold is found by bisection over the logits' order keys (`order_keys`), 32
    halvings of a [R, V] count each. The top-k threshold is the largest key t with at least k
    logits >= t (the k-th largest logit); the top-p one the smallest key t whose larger logits
    hold less than top_p of the top-k probability mass (in sorted order: the last position whose
    mass before it is under top_p). Ties with a threshold are kept, as in the sorted definition
    (`filter_top_k_top_p_by_sorting`). With a split `vocab` the same thresholds are found by
    `_radix_search` instead: 8 rounds of a [R, 15] psum each rather than 32 of [R] (each
    collective's latency is what counts there)."""
    if vocab is not None and vocab.axis is not None:
        return _filter_top_k_top_p_split(logits, top_k, top_p, vocab)
    vocab = Vocab(logits.shape[-1]) if vocab is None else vocab
    V = vocab.size
    keys = order_keys(logits)  # [R, V]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)[:, None]  # [R, 1]
    lowest, highest = vocab.min(keys), vocab.max(keys)

    def kth_largest(_, bounds):  # the largest t with count(keys >= t) >= k lies in [lo, hi]
        lo, hi = bounds
        mid = lo + (hi - lo) - (hi - lo) // 2  # the upper middle: lo + ceil((hi - lo) / 2), no overflow
        enough = vocab.sum((keys >= mid).astype(jnp.int32)) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    k_threshold, _ = jax.lax.fori_loop(0, 32, kth_largest, (lowest, highest))
    in_top_k = keys >= k_threshold
    probs = vocab.softmax(jnp.where(in_top_k, logits, -jnp.inf))

    def nucleus_edge(_, bounds):  # the smallest t with mass(keys > t) < top_p lies in [lo, hi]
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        small = vocab.sum(jnp.where(keys > mid, probs, 0.0)) < top_p[:, None]
        return jnp.where(small, lo, mid + 1), jnp.where(small, mid, hi)

    p_threshold, _ = jax.lax.fori_loop(0, 32, nucleus_edge, (k_threshold, highest))
    p_threshold = jnp.where(top_p[:, None] >= 1.0, k_threshold, p_threshold)  # top_p 1 keeps all, whatever the rounding
    return jnp.where(keys >= p_threshold, logits, -jnp.inf)


RADIX_BITS = 4  # bits of the threshold `_radix_search` settles per round (2^4 - 1 counts per collective)


def _radix_search(pred, R: int, with_zero: bool = False):
    """The largest uint32 t [R, 1] with pred(t) true, for a pred true from 0 up to some t and
    false above: bit groups from the top, each round testing the 2^RADIX_BITS - 1 nonzero values
    of the next group at once (`pred` maps [R, n] candidates to [R, n] bools, one collective).
    `with_zero`: also (whether pred(0) holds [R, 1]), tested in the first round."""
    n = 1 << RADIX_BITS
    t = jnp.zeros((R, 1), jnp.uint32)
    found = None
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        digits = jnp.arange(0 if with_zero and found is None else 1, n, dtype=jnp.uint32)
        ok = pred(t | (digits[None, :] << shift))  # [R, len(digits)]
        if with_zero and found is None:
            found, ok = ok[:, :1], ok[:, 1:]
        t = t | (ok.sum(axis=-1, keepdims=True).astype(jnp.uint32) << shift)  # monotone: the largest true digit
    return (t, found) if with_zero else t


def _filter_top_k_top_p(keys, logits, top_k, top_p, vocab: Vocab):
    """`filter_top_k_top_p`'s thresholds over split columns, by `_radix_search`."""
    R, V = keys.shape[0], vocab.size
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)[:, None]  # [R, 1]

    def counts(candidates):  # [R, n] -> count(keys >= candidate) over the whole vocabulary
        local = (keys[:, None, :] >= candidates[:, :, None]).sum(axis=-1, dtype=jnp.int32)  # (a fused compare-and-count)
        return vocab.psum(local)

    k_threshold = _radix_search(lambda c: counts(c) >= k, R)  # the k-th largest key
    probs = vocab.softmax(jnp.where(keys >= k_threshold, logits, -jnp.inf))

    def heavy(candidates):  # [R, n] -> mass(keys > candidate) >= top_p: false from the nucleus edge on
        local = jnp.where(keys[:, None, :] > candidates[:, :, None], probs[:, None, :], 0.0).sum(axis=-1)
        return vocab.psum(local) >= top_p[:, None]

    last_heavy, any_heavy = _radix_search(heavy, R, with_zero=True)
    # the smallest t >= k_threshold whose larger logits hold less than top_p: one past the last heavy t
    p_threshold = jnp.where(any_heavy, jnp.maximum(last_heavy + jnp.uint32(1), k_threshold), k_threshold)
    return jnp.where((top_p[:, None] >= 1.0) | ~any_heavy, k_threshold, p_threshold)


def _filter_top_k_top_p_split(logits, top_k, top_p, vocab: Vocab):
    keys = order_keys(logits)
    threshold = _filter_top_k_top_p(keys, logits, top_k, top_p, vocab)
    return jnp.where(keys >= threshold, logits, -jnp.inf)


def history_counts(history_ids: jax.Array, num_prompt: jax.Array, V: int,
                   vocab: Vocab | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-row token counts from a -1 padded history [R, H] whose first num_prompt[r] ids are prompt.

    Returns (output_counts [R, V] int32, seen [R, V] bool: in the prompt or the output); with a
    split `vocab`, V is this device's width and the counts are of its columns.
    """
    R, H = history_ids.shape
    valid = history_ids >= 0
    is_output = valid & (jnp.arange(H)[None, :] >= num_prompt[:, None])
    if vocab is None or vocab.axis is None:
        ids = jnp.where(valid, history_ids, V)  # padding scatters out of bounds and is dropped
    else:
        ids = vocab.local_ids(history_ids, V)  # (other devices' ids too)
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, H))
    output_counts = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    all_counts = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(1, mode="drop")
    return output_counts, all_counts > 0


# apply_penalties works through its rows this many at a time: its scatter then compiles once at
# this size whatever the row count (on a TPU, 10-15 s for 32-512 rows at a 128k vocabulary, ~1.5 s
# for 16; a fused [R, V] pass costs the same either way)
PENALTY_ROW_BLOCK = 16


def apply_penalties(logits: jax.Array, history_ids: jax.Array, num_prompt_history: jax.Array,
                    repetition_penalty: jax.Array, presence_penalty: jax.Array, frequency_penalty: jax.Array,
                    vocab: Vocab | None = None) -> jax.Array:
    """vLLM's repetition (prompt + output), frequency and presence (output only) penalties. [R, V]
    (with a split `vocab`: this device's columns, nothing exchanged)."""
    R = logits.shape[0]
    block = PENALTY_ROW_BLOCK if R % PENALTY_ROW_BLOCK == 0 else R

    def penalize(rows):
        logits, history_ids, num_prompt, rep, presence, frequency = rows
        output_counts, seen = history_counts(history_ids, num_prompt, logits.shape[-1], vocab)
        rep = jnp.where(seen, rep[:, None], 1.0)
        logits = jnp.where(logits > 0, logits / rep, logits * rep)
        logits = logits - frequency[:, None] * output_counts.astype(logits.dtype)
        return logits - presence[:, None] * (output_counts > 0).astype(logits.dtype)

    rows = (logits, history_ids, num_prompt_history, repetition_penalty, presence_penalty, frequency_penalty)
    blocks = jax.tree.map(lambda a: a.reshape(R // block, block, *a.shape[1:]), rows)
    return jax.lax.map(penalize, blocks).reshape(logits.shape)


def ban_tokens(logits: jax.Array, banned_ids: jax.Array, vocab: Vocab | None = None) -> jax.Array:
    """Sets each row's banned ids [R, B] (-1 = padding; ids past V are dropped) to -inf. [R, V]."""
    R, V = logits.shape
    if vocab is None or vocab.axis is None:
        ids = jnp.where(banned_ids >= 0, banned_ids, V)  # padding scatters out of bounds and is dropped
    else:
        ids = vocab.local_ids(banned_ids, V)
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], banned_ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def keep_allowed(logits: jax.Array, allowed_tokens: jax.Array, vocab: Vocab | None = None) -> jax.Array:
    """Sets the tokens whose bit is clear in each row's bitmask [R, W] to -inf. [R, V]."""
    return jnp.where(allowed_mask(allowed_tokens, logits.shape[-1], vocab), logits, -jnp.inf)


# The logits processors in the order `sample` applies them: (the SamplingTensors fields each one
# reads, its function of (logits, *fields)). A processor runs when its first field is set; the
# engine's step runs each as a program of its own (runtime/step.py), so that the variants add up
# instead of multiplying.
LOGITS_PROCESSORS = (
    (("history_ids", "num_prompt_history", "repetition_penalty", "presence_penalty", "frequency_penalty"), apply_penalties),
    (("banned_ids",), ban_tokens),
    (("allowed_tokens",), keep_allowed),
)


def process_logits(logits: jax.Array, st: SamplingTensors, vocab: Vocab | None = None) -> jax.Array:
    """logits [R, V] after the processors `st` switches on (penalties, bans, the allowed-token mask)."""
    for fields, processor in LOGITS_PROCESSORS:
        if getattr(st, fields[0]) is not None:
            assert all(getattr(st, f) is not None for f in fields), f"{processor.__name__} needs all of {fields}"
            logits = processor(logits, *(getattr(st, f) for f in fields), vocab=vocab)
    return logits


def without_processors(st: SamplingTensors) -> SamplingTensors:
    """`st` with every logits processor switched off (what the sampler reads after they ran)."""
    return dataclasses.replace(st, **{f: None for fields, _ in LOGITS_PROCESSORS for f in fields})


def filter_min_p(scaled: jax.Array, min_p: jax.Array, vocab: Vocab | None = None) -> jax.Array:
    """Masks tokens whose probability is below min_p x the row's top probability (on scaled logits)."""
    top = jnp.max(scaled, axis=-1, keepdims=True) if vocab is None else vocab.max(scaled)
    drop = jnp.exp(scaled - top) < min_p[:, None]
    return jnp.where(drop, -jnp.inf, scaled)


def allowed_mask(bitmask: jax.Array, V: int, vocab: Vocab | None = None) -> jax.Array:
    """int32 [R, W] bitmask (bit t % 32 of word t // 32: token t) -> bool [R, V]; tokens past
    32 W are not allowed. With a split `vocab`: the bits of this device's V columns."""
    if vocab is not None and vocab.axis is not None:
        ids = vocab.ids(V)  # [V] global
        words = jnp.take(bitmask, jnp.clip(ids // 32, 0, bitmask.shape[1] - 1), axis=1)  # [R, V]
        return (((words >> (ids % 32)) & 1) == 1) & (ids < 32 * bitmask.shape[1])[None]
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    bits = bits.reshape(bitmask.shape[0], -1)[:, :V]
    if bits.shape[1] < V:
        bits = jnp.pad(bits, ((0, 0), (0, V - bits.shape[1])))
    return bits.astype(bool)


def sample(logits: jax.Array, st: SamplingTensors, num_top_logprobs: int, raw_logits: jax.Array | None = None,
           vocab: Vocab | None = None) -> SampleOutput:
    """logits [R, V] float32 -> one token per row, with log-probabilities (of `raw_logits`, by
    default `logits` before the processors: logprobs are of the raw logits, whatever the processing).

    `vocab`: with a split one (`Vocab(V, axis)`, inside shard_map), logits are this device's
    columns [R, V / n] and every reduction over the vocabulary is local plus a collective of
    [R]-sized (top-logprobs: [R, n * K]) values: tokens, logprobs and top-logprobs come out the
    same on every device and equal to the whole-vocabulary sampler's (same seeds, same tokens)."""
    R, W = logits.shape
    vocab = Vocab(W) if vocab is None else vocab
    V = vocab.size
    raw_logits = logits if raw_logits is None else raw_logits
    logits, raw_logits = vocab.pad(logits), vocab.pad(raw_logits)
    logits = process_logits(logits, st, vocab)
    greedy = vocab.argmax(logits)
    is_random = st.temperature > 0

    def draw():
        scaled = logits / jnp.where(is_random, st.temperature, 1.0)[:, None]
        if st.min_p is not None:
            scaled = filter_min_p(scaled, st.min_p, vocab)
        needs_filter = jnp.any(((st.top_k > 0) & (st.top_k < V)) | (st.top_p < 1.0))
        scaled = vocab.cond(needs_filter, lambda x, k, p: filter_top_k_top_p(x, k, p, vocab), lambda x, *_: x,
                              scaled, st.top_k, st.top_p)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seed, st.counter)
        drawn = vocab.argmax(scaled + vocab.gumbel(keys, W))
        return jnp.where(is_random, drawn, greedy)

    tokens = vocab.cond(jnp.any(is_random), draw, lambda: greedy)
    accepted = child = None
    if st.draft_token is not None:
        tokens, accepted = verify_drafts(logits, st, tokens, vocab)
    if st.tree_children is not None:
        tokens, child = verify_tree(logits, st, tokens, vocab)
    emitted = tokens if accepted is None else jnp.where(accepted, st.draft_token, tokens)
    if child is not None:
        child_token = jnp.take_along_axis(st.tree_children, jnp.maximum(child, 0)[:, None], axis=-1)[:, 0]
        emitted = jnp.where(child >= 0, child_token, emitted)
    target = jnp.where(st.target_ids >= 0, st.target_ids, emitted)

    def with_logprobs():
        logprobs = vocab.log_softmax(raw_logits)
        token_logprobs = vocab.take(logprobs, target[:, None])[:, 0]
        if num_top_logprobs > 0:
            top_logprobs, top_ids = vocab.top_k(logprobs, num_top_logprobs)
        else:
            top_logprobs, top_ids = jnp.zeros((R, 0), jnp.float32), jnp.zeros((R, 0), jnp.int32)
        return token_logprobs, top_ids.astype(jnp.int32), top_logprobs

    def without_logprobs():
        K = num_top_logprobs
        return jnp.zeros(R, jnp.float32), jnp.zeros((R, K), jnp.int32), jnp.zeros((R, K), jnp.float32)

    if st.want_logprobs is None:
        token_logprobs, top_ids, top_logprobs = with_logprobs()
    else:
        token_logprobs, top_ids, top_logprobs = vocab.cond(jnp.any(st.want_logprobs), with_logprobs, without_logprobs)
    probs = vocab.gather_all(processed_probs(logits, st, vocab)) if st.return_probs is not None else None
    return SampleOutput(tokens, token_logprobs, top_ids, top_logprobs, accepted, probs, accepted_child=child)


def processed_probs(logits: jax.Array, st: SamplingTensors, vocab: Vocab | None = None) -> jax.Array:
    """The distribution each row samples from [R, V]: temperature, min-p, top-k and top-p applied
    (as `sample` draws), one-hot at the argmax for greedy rows. Penalties and bans are the caller's.
    (With a split `vocab`: this device's columns of it.)"""
    W = logits.shape[-1]
    vocab = Vocab(W) if vocab is None else vocab
    V = vocab.size
    is_random = st.temperature > 0
    scaled = logits / jnp.where(is_random, st.temperature, 1.0)[:, None]
    if st.min_p is not None:
        scaled = filter_min_p(scaled, st.min_p, vocab)
    needs_filter = jnp.any(((st.top_k > 0) & (st.top_k < V)) | (st.top_p < 1.0))  # the sort is skipped otherwise
    scaled = vocab.cond(needs_filter, lambda x, k, p: filter_top_k_top_p(x, k, p, vocab), lambda x, *_: x,
                          scaled, st.top_k, st.top_p)
    if vocab.axis is None:
        greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    else:
        greedy = (vocab.ids(W)[None] == vocab.argmax(logits)[:, None]).astype(jnp.float32)
    return jnp.where(is_random[:, None], vocab.softmax(scaled), greedy)


def verify_drafts(logits: jax.Array, st: SamplingTensors, plain_tokens: jax.Array,
                  vocab: Vocab | None = None) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of drafted tokens (module docstring). logits [R, V] after penalties and
    bans; plain_tokens [R]: what `sample` drew for each row without a draft (kept for those rows).
    Returns (tokens [R]: the replacement drawn from normalize(max(0, p - q)), accepted [R] bool)."""
    vocab = Vocab(logits.shape[-1]) if vocab is None else vocab
    has_draft = st.draft_token >= 0
    greedy = vocab.argmax(logits)

    def all_greedy():  # p is one-hot at the argmax: accept a draft equal to it, else replace it by it
        return jnp.where(has_draft, greedy, plain_tokens), has_draft & (st.draft_token == greedy)

    any_random = jnp.any(has_draft & (st.temperature > 0))
    return vocab.cond(any_random, lambda: _rejection_sample(logits, st, plain_tokens, vocab), all_greedy)


def _draft_q(st: SamplingTensors, draft: jax.Array, W: int, vocab: Vocab) -> jax.Array:
    """The proposal distribution q of each row over this device's columns [R, W]."""
    if st.draft_probs is None:
        return (vocab.ids(W)[None] == draft[:, None]).astype(jnp.float32)
    q = st.draft_probs.astype(jnp.float32)  # [R, V] whole rows
    if vocab.axis is None and q.shape[-1] == W:
        return q
    q = jnp.pad(q, ((0, 0), (0, max(0, vocab.offset_bound(W) - q.shape[-1]))))
    return jax.lax.dynamic_slice_in_dim(q, vocab.offset(W), W, axis=-1)


def _rejection_sample(logits: jax.Array, st: SamplingTensors, plain_tokens: jax.Array,
                      vocab: Vocab) -> tuple[jax.Array, jax.Array]:
    R, W = logits.shape
    has_draft = st.draft_token >= 0
    draft = jnp.maximum(st.draft_token, 0)
    p = processed_probs(logits, st, vocab)  # [R, V]
    q = jnp.where(has_draft[:, None], _draft_q(st, draft, W, vocab), 0.0)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seed, st.counter)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (), jnp.float32))(keys)
    p_d, q_d = vocab.take(p, draft[:, None])[:, 0], vocab.take(q, draft[:, None])[:, 0]
    accepted = has_draft & (u * q_d < p_d)  # u < p(d) / q(d), q(d) > 0
    residual = jnp.maximum(p - q, 0.0)
    total = vocab.sum(residual)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)  # p == q: nothing to correct
    drawn = vocab.argmax(jnp.log(residual) + vocab.gumbel(keys, W))  # the plain draw's noise
    replacement = jnp.where(st.temperature > 0, drawn, vocab.argmax(residual))
    return jnp.where(has_draft, replacement, plain_tokens), accepted


def verify_tree(logits: jax.Array, st: SamplingTensors, plain_tokens: jax.Array,
                vocab: Vocab | None = None) -> tuple[jax.Array, jax.Array]:
    """Multi-draft rejection sampling of draft trees' children (module docstring). logits [R, V]
    after penalties and bans; plain_tokens [R]: what the rows drew so far (kept for rows without
    children: leaves sample their bonus token as plain rows do). Returns (tokens [R]: the draw from
    p without the children's tokens, used when none is accepted; accepted child [R] int32, -1 = none)."""
    vocab = Vocab(logits.shape[-1]) if vocab is None else vocab
    children = st.tree_children  # [R, C]
    valid = children >= 0
    has_children = valid.any(axis=-1)
    greedy = vocab.argmax(logits)

    def all_greedy():  # p one-hot at the argmax: the first child equal to it, else the argmax
        match = valid & (children == greedy[:, None])
        child = jnp.where(match.any(axis=-1), jnp.argmax(match, axis=-1), -1).astype(jnp.int32)
        return jnp.where(has_children, greedy, plain_tokens), child

    any_random = jnp.any(has_children & (st.temperature > 0))
    return vocab.cond(any_random, lambda: _tree_rejection_sample(logits, st, plain_tokens, vocab), all_greedy)


def _tree_rejection_sample(logits: jax.Array, st: SamplingTensors, plain_tokens: jax.Array,
                           vocab: Vocab) -> tuple[jax.Array, jax.Array]:
    R, W = logits.shape
    children = st.tree_children  # [R, C]
    C = children.shape[1]
    valid = children >= 0
    has_children = valid.any(axis=-1)
    p = processed_probs(logits, st, vocab)  # [R, V] (greedy rows: one-hot at the argmax)
    p_child = vocab.take(p, jnp.maximum(children, 0))  # [R, C]
    # a child repeating an earlier sibling's token was rejected with it (its p' is 0 by then)
    earlier = jnp.tril(jnp.ones((C, C), bool), k=-1)[None]  # [1, C (this child), C (an earlier one)]
    repeat = (valid[:, :, None] & (children[:, :, None] == children[:, None, :]) & earlier).any(axis=-1)
    p_child = jnp.where(valid & ~repeat, p_child, 0.0)
    mass = vocab.sum(p) - (jnp.cumsum(p_child, axis=-1) - p_child)  # [R, C]: p' unnormalised, before child j
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seed, st.counter)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (C,), jnp.float32))(keys)  # [R, C]
    accept = valid & (u * mass < p_child)  # u < p'(t): p(t) / mass
    child = jnp.where(accept.any(axis=-1), jnp.argmax(accept, axis=-1), -1).astype(jnp.int32)
    # no child accepted: draw from p without every child's token, renormalised
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, C))
    if vocab.axis is None:
        columns = jnp.where(valid, children, W)
    else:
        columns = vocab.local_ids(children, W)
    residual = p.at[rows, columns].set(0.0, mode="drop")
    total = vocab.sum(residual)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p)  # (rounding left nothing: p)
    drawn = vocab.argmax(jnp.log(residual) + vocab.gumbel(keys, W))
    replacement = jnp.where(st.temperature > 0, drawn, vocab.argmax(residual))
    return jnp.where(has_children, replacement, plain_tokens), child

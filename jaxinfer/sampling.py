"""On-device sampling, vectorized over logits rows with per-row parameters.

Each row carries its own temperature (0 = greedy), top-k (0 = off), top-p (1 = off), seed and
counter. The random draw for a row depends only on (seed, counter), so a seeded request samples
the same tokens whatever else shares the batch. Sampling is Gumbel-max over the filtered,
temperature-scaled logits; batches that need no filtering skip the sort, and all-greedy batches
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
- `banned_ids` [R, B]: logits set to -inf (the engine's min_tokens bans EOS/stop ids this way).
- `min_p` (random rows only; argmax-invariant): after temperature, tokens whose probability is
  below min_p times the row's largest probability are dropped, before top-k/top-p.

Penalties and bans change which token is chosen, never the reported logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
    banned_ids: jax.Array | None = None  # [R, B] int32, -1 = padding
    history_ids: jax.Array | None = None  # [R, H] int32: prompt ids then output ids, -1 = padding
    num_prompt_history: jax.Array | None = None  # [R] int32: the first this-many history ids are prompt
    repetition_penalty: jax.Array | None = None  # [R] float32, 1 = off
    presence_penalty: jax.Array | None = None  # [R] float32, 0 = off
    frequency_penalty: jax.Array | None = None  # [R] float32, 0 = off
    # [1] bool: does any row want logprobs? False skips log-softmax and top-k at run time
    # (a lax.cond, not a new variant). None = always compute them.
    want_logprobs: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    tokens: jax.Array  # [R] int32
    logprobs: jax.Array  # [R] float32, logprob of the target (or sampled) token
    top_ids: jax.Array  # [R, K] int32
    top_logprobs: jax.Array  # [R, K] float32


def filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) logits outside each row's top-k, then outside its top-p nucleus. [R, V]."""
    V = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)  # [R]
    idx = jnp.arange(V)[None, :]
    in_top_k = idx < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < top_p[:, None])  # the smallest prefix reaching top_p
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)  # [R, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def history_counts(history_ids: jax.Array, num_prompt: jax.Array, V: int) -> tuple[jax.Array, jax.Array]:
    """Per-row token counts from a -1 padded history [R, H] whose first num_prompt[r] ids are prompt.

    Returns (output_counts [R, V] int32, seen [R, V] bool: in the prompt or the output).
    """
    R, H = history_ids.shape
    valid = history_ids >= 0
    is_output = valid & (jnp.arange(H)[None, :] >= num_prompt[:, None])
    ids = jnp.where(valid, history_ids, V)  # padding scatters out of bounds and is dropped
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, H))
    output_counts = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    all_counts = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(1, mode="drop")
    return output_counts, all_counts > 0


def apply_penalties(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """vLLM's repetition (prompt + output), frequency and presence (output only) penalties. [R, V]."""
    output_counts, seen = history_counts(st.history_ids, st.num_prompt_history, logits.shape[-1])
    rep = jnp.where(seen, st.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - st.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - st.presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype)


def ban_tokens(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    """Sets each row's banned ids [R, B] (-1 = padding) to -inf. [R, V]."""
    R, V = logits.shape
    ids = jnp.where(banned_ids >= 0, banned_ids, V)  # padding scatters out of bounds and is dropped
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], banned_ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def filter_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks tokens whose probability is below min_p x the row's top probability (on scaled logits)."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    drop = jnp.exp(scaled - top) < min_p[:, None]
    return jnp.where(drop, -jnp.inf, scaled)


def sample(logits: jax.Array, st: SamplingTensors, num_top_logprobs: int) -> SampleOutput:
    """logits [R, V] float32 -> one token per row, with log-probabilities."""
    R, V = logits.shape
    raw_logits = logits  # logprobs are of the raw logits, whatever the processing
    penalty_fields = (st.num_prompt_history, st.repetition_penalty, st.presence_penalty, st.frequency_penalty)
    if st.history_ids is not None:
        assert all(f is not None for f in penalty_fields), "penalties need all their SamplingTensors fields"
        logits = apply_penalties(logits, st)
    if st.banned_ids is not None:
        logits = ban_tokens(logits, st.banned_ids)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = st.temperature > 0

    def draw():
        scaled = logits / jnp.where(is_random, st.temperature, 1.0)[:, None]
        if st.min_p is not None:
            scaled = filter_min_p(scaled, st.min_p)
        needs_filter = jnp.any(((st.top_k > 0) & (st.top_k < V)) | (st.top_p < 1.0))
        scaled = jax.lax.cond(needs_filter, filter_top_k_top_p, lambda x, *_: x, scaled, st.top_k, st.top_p)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seed, st.counter)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_random, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(is_random), draw, lambda: greedy)
    target = jnp.where(st.target_ids >= 0, st.target_ids, tokens)

    def with_logprobs():
        logprobs = jax.nn.log_softmax(raw_logits, axis=-1)
        token_logprobs = jnp.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
        if num_top_logprobs > 0:
            top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
        else:
            top_logprobs, top_ids = jnp.zeros((R, 0), jnp.float32), jnp.zeros((R, 0), jnp.int32)
        return token_logprobs, top_ids.astype(jnp.int32), top_logprobs

    def without_logprobs():
        K = num_top_logprobs
        return jnp.zeros(R, jnp.float32), jnp.zeros((R, K), jnp.int32), jnp.zeros((R, K), jnp.float32)

    if st.want_logprobs is None:
        token_logprobs, top_ids, top_logprobs = with_logprobs()
    else:
        token_logprobs, top_ids, top_logprobs = jax.lax.cond(jnp.any(st.want_logprobs), with_logprobs, without_logprobs)
    return SampleOutput(tokens, token_logprobs, top_ids, top_logprobs)

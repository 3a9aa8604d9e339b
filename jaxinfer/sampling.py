"""On-device sampling, vectorized over logits rows with per-row parameters.

Each row carries its own temperature (0 = greedy), top-k (0 = off), top-p (1 = off), seed and
counter. The random draw for a row depends only on (seed, counter), so a seeded request samples
the same tokens whatever else shares the batch. Sampling is Gumbel-max over the filtered,
temperature-scaled logits; batches that need no filtering skip the sort, and all-greedy batches
skip the random draw (`lax.cond` picks one branch at run time, no recompile).

Reported log-probabilities are those of the model's raw distribution (log-softmax of the logits,
before temperature and filtering), as vLLM reports them.
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


def sample(logits: jax.Array, st: SamplingTensors, num_top_logprobs: int) -> SampleOutput:
    """logits [R, V] float32 -> one token per row, with log-probabilities."""
    V = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = st.temperature > 0

    def draw():
        scaled = logits / jnp.where(is_random, st.temperature, 1.0)[:, None]
        needs_filter = jnp.any(((st.top_k > 0) & (st.top_k < V)) | (st.top_p < 1.0))
        scaled = jax.lax.cond(needs_filter, filter_top_k_top_p, lambda x, *_: x, scaled, st.top_k, st.top_p)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(st.seed, st.counter)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_random, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(is_random), draw, lambda: greedy)
    target = jnp.where(st.target_ids >= 0, st.target_ids, tokens)
    token_logprobs = jnp.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
    if num_top_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(tokens, token_logprobs, top_ids.astype(jnp.int32), top_logprobs)

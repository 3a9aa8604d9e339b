"""The rejection sampler of speculative decoding (`jaxinfer.ops.sampling.verify_drafts`): whatever
the draft proposes, the emitted token (the draft if accepted, else the replacement) is
distributed exactly as the target's processed distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer.ops.sampling import SamplingTensors, processed_probs, sample

V = 6
N = 20000  # independent rows, one seed each


def tensors(n, temperature, top_k=0, top_p=1.0, draft_token=None, draft_probs=None) -> SamplingTensors:
    return SamplingTensors(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32) + 7, counter=jnp.zeros(n, jnp.int32),
        target_ids=jnp.full(n, -1, jnp.int32), min_p=jnp.zeros(n, jnp.float32),
        draft_token=draft_token, draft_probs=draft_probs,
    )


LOGITS = np.log(np.array([0.30, 0.25, 0.2, 0.15, 0.07, 0.03]))  # the target
DRAFT = np.array([0.05, 0.1, 0.5, 0.05, 0.2, 0.1])  # a deliberately bad draft


def emitted(out, st):
    return np.where(np.asarray(out.accepted), np.asarray(st.draft_token), np.asarray(out.tokens))


def chi_square_p(counts, probs):
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return stats.chisquare(counts[keep], probs[keep] * counts.sum()).pvalue


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8)])
def test_a_sampled_draft_leaves_the_target_distribution_unchanged(temperature, top_k, top_p):
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (N, 1))
    st = tensors(N, temperature, top_k, top_p)
    target = np.asarray(processed_probs(logits, st))[0]
    draft_probs = jnp.asarray(np.tile(DRAFT, (N, 1)), jnp.float32)
    proposals = np.random.default_rng(0).choice(V, size=N, p=DRAFT)  # drawn from q, independently of the target's keys
    st = tensors(N, temperature, top_k, top_p, jnp.asarray(proposals, jnp.int32), draft_probs)
    out = sample(logits, st, 0)
    counts = np.bincount(emitted(out, st), minlength=V)
    assert chi_square_p(counts, target) > 1e-3
    accept_rate = np.asarray(out.accepted).mean()
    assert abs(accept_rate - np.minimum(target, DRAFT).sum()) < 0.02  # the textbook acceptance rate


def test_a_deterministic_proposal_is_accepted_with_the_targets_probability():
    """n-gram lookup proposes a fixed token (q one-hot): accepted with probability p(d); on
    rejection the replacement is p without d, renormalised."""
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (N, 1))
    st = tensors(N, 1.0, draft_token=jnp.full(N, 2, jnp.int32))
    out = sample(logits, st, 0)
    target = np.exp(LOGITS) / np.exp(LOGITS).sum()
    assert abs(np.asarray(out.accepted).mean() - target[2]) < 0.02
    assert chi_square_p(np.bincount(emitted(out, st), minlength=V), target) > 1e-3


def test_greedy_rows_accept_exactly_the_argmax():
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (4, 1))
    st = tensors(4, 0.0, draft_token=jnp.array([0, 1, -1, 3], jnp.int32))
    out = sample(logits, st, 0)
    assert np.asarray(out.accepted).tolist() == [True, False, False, False]
    assert emitted(out, st).tolist() == [0, 0, 0, 0]  # the argmax, drafted or not


def test_rows_without_a_draft_sample_as_without_speculation():
    logits = jax.random.normal(jax.random.key(0), (64, 50))
    plain = sample(logits, tensors(64, 0.9, top_p=0.9), 0)
    mixed = sample(logits, tensors(64, 0.9, top_p=0.9, draft_token=jnp.where(jnp.arange(64) % 2 == 0, 3, -1)), 0)
    np.testing.assert_array_equal(np.asarray(mixed.tokens)[1::2], np.asarray(plain.tokens)[1::2])

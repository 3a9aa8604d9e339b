"""On-device sampling against numpy references on fixed logits."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import SamplingTensors, filter_top_k_top_p, sample


def tensors(R, temperature=0.0, top_k=0, top_p=1.0, seed=0, counter=0, target=-1):
    full = lambda v, dt: np.broadcast_to(np.asarray(v, dt), (R,)).copy()
    return SamplingTensors(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                           full(seed, np.uint32), full(counter, np.int32), full(target, np.int32))


def numpy_allowed(logits, top_k, top_p):
    """Tokens top-k then top-p keep: the k largest, then the smallest prefix of them reaching mass p."""
    order = np.argsort(-logits, kind="stable")
    k = top_k if 0 < top_k < len(logits) else len(logits)
    kept = order[:k]
    p = np.exp(logits[kept] - logits[kept].max())
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12) + 1)
    return set(kept[: min(n, k)].tolist())


def test_top_k_top_p_filter_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32) * 3
    top_k = np.array([0, 1, 5, 50, 10, 3], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 0.9, 0.3, 0.99], np.float32)
    filtered = np.asarray(filter_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for r in range(6):
        assert set(np.flatnonzero(np.isfinite(filtered[r])).tolist()) == numpy_allowed(logits[r], top_k[r], top_p[r])


def test_greedy_and_logprobs():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    out = sample(jnp.asarray(logits), tensors(4), num_top_logprobs=5)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(out.logprobs), logsm.max(-1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-logsm, -1)[:, :5], atol=1e-5)
    # a target id reports that token's logprob instead
    tgt = sample(jnp.asarray(logits), tensors(4, target=7), num_top_logprobs=0)
    np.testing.assert_allclose(np.asarray(tgt.logprobs), logsm[:, 7], atol=1e-5)


def test_seeded_rows_do_not_depend_on_their_neighbours():
    rng = np.random.default_rng(2)
    row = rng.standard_normal(40).astype(np.float32)
    alone = sample(jnp.asarray(row[None]), tensors(1, temperature=1.0, seed=42, counter=3), 0).tokens
    batch = np.stack([rng.standard_normal(40), row, rng.standard_normal(40)]).astype(np.float32)
    st = tensors(3, temperature=1.0, seed=42, counter=3)
    st.seed[0], st.seed[2], st.temperature[2] = 1, 2, 0.0
    mixed = sample(jnp.asarray(batch), st, 0).tokens
    assert int(alone[0]) == int(mixed[1])


def test_temperature_sampling_follows_the_softmax():
    logits = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    n = 4000
    st = tensors(n, temperature=0.5, seed=7)
    st.counter[:] = np.arange(n)
    tokens = np.asarray(jax.jit(lambda l, s: sample(l, s, 0).tokens)(jnp.asarray(np.tile(logits, (n, 1))), st))
    want = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    freq = np.bincount(tokens, minlength=4) / n
    assert np.abs(freq - want).max() < 0.03

"""On-device sampling against numpy references on fixed logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk, sampling_tensors
from jaxinfer.ops.sampling import MAX_BANNED_IDS, SamplingTensors, filter_min_p, filter_top_k_top_p, filter_top_k_top_p_by_sorting, process_logits, sample


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


def test_the_filter_without_a_sort_keeps_what_the_sorted_definition_keeps():
    """Bisection over order keys (no sort: the TPU compiles it in seconds, a 128k sort in ~49 s)
    against the sorted definition, on rows with ties (+0.0 and -0.0 among them), -inf, top_k
    past the vocabulary, top_p 1 and tiny."""
    rng = np.random.default_rng(0)
    bisected, by_sorting = jax.jit(filter_top_k_top_p), jax.jit(filter_top_k_top_p_by_sorting)
    for trial in range(60):
        V = [2, 37, 300][trial % 3]
        logits = (rng.standard_normal((8, V)) * rng.choice([0.1, 1, 3, 30])).astype(np.float32)
        if trial % 4 == 0:
            logits = np.round(logits)  # ties, signed zeros
        if trial % 5 == 0:
            logits[:, : V // 3] = -np.inf
        top_k = jnp.asarray(rng.integers(-1, V + 2, 8).astype(np.int32))
        top_p = jnp.asarray(rng.choice([1.0, 0.999, 0.9, 0.5, 0.1, 1e-6], 8).astype(np.float32))
        kept = np.isfinite(np.asarray(bisected(jnp.asarray(logits), top_k, top_p)))
        want = np.isfinite(np.asarray(by_sorting(jnp.asarray(logits), top_k, top_p)))
        np.testing.assert_array_equal(kept, want, err_msg=f"trial {trial}")


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


def test_logprobs_are_skipped_at_run_time_when_no_row_wants_them():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((4, 30)).astype(np.float32))
    logsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    run = jax.jit(lambda lg, st: sample(lg, st, num_top_logprobs=3))
    wanted = run(logits, dataclasses.replace(tensors(4), want_logprobs=np.array([True])))
    skipped = run(logits, dataclasses.replace(tensors(4), want_logprobs=np.array([False])))
    assert run._cache_size() == 1  # one compiled variant serves both
    np.testing.assert_array_equal(np.asarray(wanted.tokens), np.asarray(skipped.tokens))
    np.testing.assert_allclose(np.asarray(wanted.logprobs), logsm.max(-1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(wanted.top_logprobs), -np.sort(-logsm, -1)[:, :3], atol=1e-5)
    assert not np.any(np.asarray(skipped.logprobs)) and not np.any(np.asarray(skipped.top_logprobs))


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


# ---------------------------------------------------------------- min_p, penalties, banned ids


def numpy_penalize(logits, history, num_prompt, rep, pres, freq):
    """vLLM's definition: repetition on prompt + output tokens (positive / rep, else * rep), then
    frequency (x output count) and presence (once if in the output) subtracted."""
    out = logits.astype(np.float64).copy()
    output = history[num_prompt:]
    seen = set(history)
    for v in range(len(out)):
        if v in seen:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        count = output.count(v)
        out[v] -= freq * count + pres * (count > 0)
    return out


def with_penalties(st, histories, num_prompt, rep, pres, freq, H=16):
    R = len(histories)
    hist = np.full((R, H), -1, np.int32)
    for r, h in enumerate(histories):
        hist[r, : len(h)] = h
    f32 = lambda v: np.asarray(v, np.float32)
    return dataclasses.replace(st, history_ids=hist, num_prompt_history=np.asarray(num_prompt, np.int32),
                               repetition_penalty=f32(rep), presence_penalty=f32(pres), frequency_penalty=f32(freq))


# prompt ids then output ids; repeats in both parts, ids shared between prompt and output
HISTORIES = [[1, 2, 2, 3, 3, 3, 0], [5, 1, 1, 5, 7], [], [4, 4, 9, 9, 9, 2, 1]]
NUM_PROMPT = [3, 2, 0, 7]  # row 3: all prompt, no output


def test_min_p_keeps_exactly_the_right_set():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 40)).astype(np.float32) * 3
    temperature = np.array([1.0, 0.5, 2.0, 1.0, 0.7], np.float32)
    min_p = np.array([0.0, 0.1, 0.3, 0.9, 1.0], np.float32)
    scaled = logits / temperature[:, None]
    kept = np.asarray(filter_min_p(jnp.asarray(scaled), jnp.asarray(min_p)))
    for r in range(5):
        p = np.exp(scaled[r].astype(np.float64) - scaled[r].max())
        p /= p.sum()
        want = set(np.flatnonzero(p >= min_p[r] * p.max()).tolist())
        assert set(np.flatnonzero(np.isfinite(kept[r])).tolist()) == want
    # and sampling with it only ever draws from that set
    n = 600
    st = dataclasses.replace(tensors(n, temperature=2.0, seed=11), min_p=np.full(n, 0.3, np.float32))
    st.counter[:] = np.arange(n)
    tokens = np.asarray(jax.jit(lambda l, s: sample(l, s, 0).tokens)(jnp.asarray(np.tile(logits[2], (n, 1))), st))
    assert set(tokens.tolist()) == set(np.flatnonzero(np.isfinite(kept[2])).tolist())  # all reached, none else


def test_penalties_match_vllm_definition():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((4, 12)).astype(np.float32) * 2
    logits[0, 3], logits[1, 1], logits[1, 5] = -1.5, 2.0, 0.0  # both signs (and zero) on penalized ids
    cases = [  # (repetition, presence, frequency) per row
        ([1.3, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4),
        ([1.0] * 4, [0.7, 0.7, 0.7, 0.7], [0.0] * 4),
        ([1.0] * 4, [0.0] * 4, [0.4, 0.4, 0.4, 0.4]),
        ([1.5, 0.8, 2.0, 1.2], [0.5, -0.3, 1.0, 0.2], [0.25, 0.1, -0.5, 1.0]),
    ]
    for rep, pres, freq in cases:
        st = with_penalties(tensors(4), HISTORIES, NUM_PROMPT, rep, pres, freq)
        got = np.asarray(process_logits(jnp.asarray(logits), st))
        for r in range(4):
            want = numpy_penalize(logits[r], HISTORIES[r], NUM_PROMPT[r], rep[r], pres[r], freq[r])
            np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
    # 32 rows (the last case's four, eight times): penalized in blocks of PENALTY_ROW_BLOCK, each row as alone
    st = with_penalties(tensors(32), HISTORIES * 8, NUM_PROMPT * 8, rep * 8, pres * 8, freq * 8)
    got = np.asarray(process_logits(jnp.asarray(np.tile(logits, (8, 1))), st))
    for r in range(32):
        want = numpy_penalize(logits[r % 4], HISTORIES[r % 4], NUM_PROMPT[r % 4], rep[r % 4], pres[r % 4], freq[r % 4])
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)


def test_greedy_under_penalties_and_raw_logprobs():
    logits = np.array([[3.0, 2.9, 1.0, 0.5, -1.0, 0.0]] * 3, np.float32)
    histories = [[0], [0, 1, 1], [5]]  # row 0: 0 in prompt; row 1: 0 prompt, 1 output twice; row 2: untouched
    st = with_penalties(tensors(3), histories, [1, 1, 1], [2.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0])
    out = sample(jnp.asarray(logits), st, num_top_logprobs=2)
    want = [int(np.argmax(numpy_penalize(logits[r], histories[r], 1, 2.0 if r == 0 else 1.0, 0.0,
                                         1.0 if r == 1 else 0.0))) for r in range(3)]
    assert want == [1, 0, 0]
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # raw distribution, not the penalized one
    np.testing.assert_allclose(np.asarray(out.logprobs), logsm[np.arange(3), want], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-logsm, -1)[:, :2], atol=1e-5)


def test_banned_ids_are_never_sampled():
    row = np.array([4.0, 3.9, 3.8, 0.0, -1.0, -2.0], np.float32)
    n = 500
    banned = np.full((n, 8), -1, np.int32)
    banned[:, :2] = [0, 2]
    banned[1::2, 2] = 1  # odd rows also ban 1
    st = dataclasses.replace(tensors(n, temperature=1.5, seed=3), banned_ids=banned)
    st.counter[:] = np.arange(n)
    st.temperature[::5] = 0.0  # some greedy rows too
    tokens = np.asarray(jax.jit(lambda l, s: sample(l, s, 0).tokens)(jnp.asarray(np.tile(row, (n, 1))), st))
    assert not np.isin(tokens, [0, 2]).any() and not np.isin(tokens[1::2], [1]).any()
    assert (tokens[::10] == 1).all() and (tokens[5::10] == 3).all()  # greedy: best token left
    assert np.isin(tokens, [3, 4, 5]).any()  # the random rows do spread
    # bans apply after penalties too (a penalty can't resurrect a banned token)
    st2 = with_penalties(dataclasses.replace(tensors(1), banned_ids=np.array([[1, -1]], np.int32)),
                         [[0]], [1], [100.0], [0.0], [0.0])
    assert int(sample(jnp.asarray(row[None]), st2, 0).tokens[0]) == 2


def test_rows_without_the_features_are_unaffected():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 50)).astype(np.float32) * 2
    plain = tensors(4, temperature=0.8, seed=9, counter=2, top_k=10)
    plain.seed[:] = [9, 10, 11, 12]
    plain.temperature[3] = 0.0
    base = np.asarray(sample(jnp.asarray(logits), plain, 0).tokens)
    # rows 0 and 2 get penalties, min_p and bans; rows 1 and 3 keep the neutral values
    st = with_penalties(plain, [[int(base[0])] * 3, [int(base[1])], [1, 2, 3], [int(base[3])]], [0, 1, 0, 0],
                        [3.0, 1.0, 1.5, 1.0], [2.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.5, 0.0])
    banned = np.full((4, 8), -1, np.int32)
    banned[0, 0], banned[2, :3] = base[0], [4, 5, 6]
    st = dataclasses.replace(st, min_p=np.array([0.2, 0.0, 0.1, 0.0], np.float32), banned_ids=banned)
    got = np.asarray(jax.jit(lambda l, s: sample(l, s, 0).tokens)(jnp.asarray(logits), st))
    assert got[0] != base[0]
    assert got[1] == base[1] and got[3] == base[3]


def test_runner_turns_the_switches_on_only_when_needed():
    build = lambda *samplings: sampling_tensors(  # noqa: E731
        4, [ScheduledChunk(None, s) for s in samplings], [[i] for i in range(len(samplings))], max_history=32)
    st = build(RowSampling(temperature=1.0, min_p=0.1), RowSampling())
    assert st.banned_ids is None and st.history_ids is None
    np.testing.assert_allclose(st.min_p, [0.1, 0, 0, 0])
    st = build(RowSampling(banned_ids=[7, 8]), RowSampling(presence_penalty=0.5, history=[1, 2, 3], num_prompt_history=2),
               RowSampling(history=[9]))
    assert st.banned_ids.shape == (4, MAX_BANNED_IDS) and st.banned_ids[0, :3].tolist() == [7, 8, -1]
    assert (st.banned_ids[1:] == -1).all()
    assert st.history_ids.shape == (4, 32)  # the longest sequence
    assert st.history_ids[1, :4].tolist() == [1, 2, 3, -1] and st.num_prompt_history[1] == 2
    assert (st.history_ids[[0, 2, 3]] == -1).all()  # rows without penalties carry no history
    np.testing.assert_allclose(st.presence_penalty, [0, 0.5, 0, 0])
    np.testing.assert_allclose(st.repetition_penalty, 1.0)
    # one width whatever a request holds back: no stop list picks a compiled shape
    assert build(RowSampling(banned_ids=list(range(MAX_BANNED_IDS)))).banned_ids.shape == (4, MAX_BANNED_IDS)
    with pytest.raises(ValueError, match="banned ids"):  # the input checks refuse such a request before
        build(RowSampling(banned_ids=list(range(MAX_BANNED_IDS + 1))))

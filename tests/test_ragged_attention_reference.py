"""The jnp ragged paged attention implementations against a per-sequence numpy loop.

Both plain-jnp versions are checked: `reference` (the truth kernels are held to) and `split_kv`
(the work-list version the XLA CPU path runs), the latter with each of its contractions.
"""

import functools

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import reference, split_kv

IMPLS = {"reference": reference.ragged_paged_attention, "split_kv": split_kv.ragged_paged_attention,
         "split_kv-reduce": functools.partial(split_kv.ragged_paged_attention, contraction="reduce")}

pytestmark = pytest.mark.parametrize("ragged_paged_attention", list(IMPLS.values()), ids=list(IMPLS))


def numpy_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, sliding_window=None, soft_cap=None,
                    sinks=None, attention_chunk=None):
    """The obvious per-sequence loop: gather each sequence's keys, causal softmax, weighted sum
    (with sinks: the softmax over the scores and head h's sink logit, the sink's weight dropped;
    with attention_chunk C: only the keys of the query's own chunk of C positions)."""
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    out = np.zeros((T, Hq, D), np.float64)
    for s in range(num_seqs):
        q0, q1 = cu_q_lens[s], cu_q_lens[s + 1]
        q_len, kv_len = q1 - q0, kv_lens[s]
        if q_len == 0:
            continue
        k = k_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)
        v = v_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)
        for i in range(q_len):
            pos = kv_len - q_len + i
            visible = np.arange(kv_len) <= pos
            if sliding_window is not None:
                visible &= np.arange(kv_len) > pos - sliding_window
            if attention_chunk is not None:
                visible &= np.arange(kv_len) // attention_chunk == pos // attention_chunk
            for h in range(Hq):
                scores = k[:, h // G] @ q[q0 + i, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                scores = np.where(visible, scores, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(scores.max(), sink)
                p = np.exp(scores - top)
                out[q0 + i, h] = (p / (p.sum() + np.exp(sink - top))) @ v[:, h // G]
    return out


def make_case(rng, q_lens, kv_lens, *, Hq, Hkv, D, page_size, num_pages=None, pad_seqs=0, pad_tokens=0, dtype=np.float32):
    """Random pages; each sequence gets distinct random pages (page 0 stays scratch)."""
    S = len(q_lens)
    pages_needed = [max(1, -(-kv // page_size)) for kv in kv_lens]
    pages_per_seq = max(pages_needed) + 1
    num_pages = num_pages or sum(pages_needed) + 2
    perm = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((S + pad_seqs, pages_per_seq), np.int32)
    used = 0
    for s, n in enumerate(pages_needed):
        page_indices[s, :n] = perm[used : used + n]
        used += n
    T = sum(q_lens) + pad_tokens
    q = rng.standard_normal((T, Hq, D)).astype(dtype)
    k_pages = rng.standard_normal((num_pages, page_size, Hkv, D)).astype(dtype)
    v_pages = rng.standard_normal((num_pages, page_size, Hkv, D)).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([cu, np.full(pad_seqs, cu[-1], np.int32)])
    kv = np.array(list(kv_lens) + [0] * pad_seqs, np.int32)
    return q, k_pages, v_pages, kv, page_indices, cu, np.array([S], np.int32)


def check(ragged_paged_attention, case, *, sm_scale=0.125, tol=2e-5, **kw):
    q, k_pages, v_pages, kv_lens, page_indices, cu, num_seqs = case
    got = np.asarray(
        ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(kv_lens),
            jnp.asarray(page_indices), jnp.asarray(cu), jnp.asarray(num_seqs), sm_scale=sm_scale,
            **{k: jnp.asarray(v) if k == "sinks" else v for k, v in kw.items()},
        ),
        np.float64,
    )
    kw.pop("num_queries_per_block", None)
    kw.pop("num_kv_pages_per_block", None)
    kw.pop("items_per_step", None)
    if "sinks" in kw:
        kw["sinks"] = np.asarray(kw["sinks"])
    want = numpy_attention(q, k_pages, v_pages, kv_lens, page_indices, cu, int(num_seqs[0]), sm_scale, **kw)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_mixed_prefill_and_decode(ragged_paged_attention, page_size, Hq, Hkv):
    rng = np.random.default_rng(0)
    # a fresh prefill, a decode, a chunk continuing a prefill, a one-token prompt, a zero-length slot
    case = make_case(rng, [20, 1, 8, 1, 0], [20, 37, 50, 1, 0], Hq=Hq, Hkv=Hkv, D=64, page_size=page_size, pad_seqs=2, pad_tokens=5)
    check(ragged_paged_attention, case, num_queries_per_block=8)
    check(ragged_paged_attention, case, num_queries_per_block=1, num_kv_pages_per_block=1)


def test_lengths_at_and_across_page_boundaries(ragged_paged_attention):
    rng = np.random.default_rng(1)
    case = make_case(rng, [16, 1, 17, 15, 1], [16, 17, 33, 32, 16], Hq=4, Hkv=2, D=128, page_size=16)
    check(ragged_paged_attention, case, num_queries_per_block=4)


def test_sliding_window_and_soft_cap(ragged_paged_attention):
    rng = np.random.default_rng(2)
    case = make_case(rng, [30, 1, 5], [30, 40, 25], Hq=4, Hkv=2, D=32, page_size=4)
    check(ragged_paged_attention, case, sliding_window=7, num_queries_per_block=8)
    check(ragged_paged_attention, case, soft_cap=5.0, sm_scale=1.0, num_queries_per_block=2)


def test_chunked_local_attention(ragged_paged_attention):
    # Llama 4: a query sees only its own chunk; chunks of 8 (a power of two: a bit mask) and 6 (a
    # division), the prefill's query blocks straddling chunk starts, with and without a window
    rng = np.random.default_rng(12)
    case = make_case(rng, [30, 1, 5], [30, 40, 25], Hq=4, Hkv=2, D=32, page_size=4)
    check(ragged_paged_attention, case, attention_chunk=8, num_queries_per_block=8)
    check(ragged_paged_attention, case, attention_chunk=6, sliding_window=4, num_queries_per_block=4)


def test_attention_sinks_take_their_share_of_the_softmax(ragged_paged_attention):
    rng = np.random.default_rng(5)
    case = make_case(rng, [12, 1, 3], [12, 30, 20], Hq=4, Hkv=2, D=32, page_size=4)
    sinks = np.array([-1.0, 0.5, 2.0, 4.0], np.float32)  # from a small share to most of it
    check(ragged_paged_attention, case, sinks=sinks, sliding_window=6, num_queries_per_block=4)


def test_padding_rows_are_zero(ragged_paged_attention):
    rng = np.random.default_rng(3)
    case = make_case(rng, [3, 1], [3, 9], Hq=2, Hkv=1, D=16, page_size=4, pad_seqs=3, pad_tokens=6)
    q, k, v, kv, pi, cu, n = case
    out = np.asarray(ragged_paged_attention(*map(jnp.asarray, case), sm_scale=0.25))
    assert np.all(out[4:] == 0)


def test_bfloat16_inputs(ragged_paged_attention):
    rng = np.random.default_rng(4)
    case = make_case(rng, [12, 1, 3], [12, 30, 9], Hq=8, Hkv=2, D=64, page_size=8)
    case16 = tuple(jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 else jnp.asarray(x) for x in case)
    out = np.asarray(ragged_paged_attention(*case16, sm_scale=0.125), np.float64)
    q, k, v, *rest = (np.asarray(jnp.asarray(x, jnp.float32)) if x.dtype == jnp.bfloat16 else np.asarray(x) for x in case16)
    want = numpy_attention(q, k, v, *rest[:3], int(rest[3][0]), 0.125)
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_kv_pages_are_dequantized_with_their_scales(ragged_paged_attention, kv_dtype):
    rng = np.random.default_rng(5)
    q, k, v, *rest = make_case(rng, [9, 1, 4], [9, 21, 13], Hq=4, Hkv=2, D=32, page_size=4)
    k_scale, v_scale = 0.05, 0.02
    if kv_dtype == jnp.int8:
        k_q = np.clip(np.round(k / k_scale), -127, 127).astype(np.int8)
        v_q = np.clip(np.round(v / v_scale), -127, 127).astype(np.int8)
    else:
        k_q = jnp.asarray(k / k_scale, jnp.float8_e4m3fn)
        v_q = jnp.asarray(v / v_scale, jnp.float8_e4m3fn)
    out = np.asarray(
        ragged_paged_attention(jnp.asarray(q), jnp.asarray(k_q), jnp.asarray(v_q), *map(jnp.asarray, rest),
                               sm_scale=0.125, k_scale=k_scale, v_scale=v_scale, num_queries_per_block=4),
        np.float64,
    )
    # the truth: float attention over exactly the values the quantized pages stand for
    k_deq = np.asarray(jnp.asarray(k_q, jnp.float32)) * k_scale
    v_deq = np.asarray(jnp.asarray(v_q, jnp.float32)) * v_scale
    want = numpy_attention(q, k_deq, v_deq, *rest[:3], int(rest[3][0]), 0.125)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_quantized_kv_pages_need_a_scale(ragged_paged_attention):
    q, k, v, *rest = make_case(np.random.default_rng(6), [2], [2], Hq=2, Hkv=1, D=16, page_size=4)
    args = [jnp.asarray(q), jnp.asarray(k, jnp.int8), jnp.asarray(v, jnp.int8), *map(jnp.asarray, rest)]
    with pytest.raises(ValueError, match="k_scale"):
        ragged_paged_attention(*args, sm_scale=0.25)


@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 30)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 2, 8]),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    bq=st.sampled_from([1, 3, 8]),
)
def test_random_ragged_batches(ragged_paged_attention, seqs, page_size, heads, bq):
    q_lens = [q for q, _ in seqs]
    kv_lens = [q + ctx if q else 0 for q, ctx in seqs]
    hypothesis.assume(sum(q_lens) > 0)
    case = make_case(np.random.default_rng(sum(kv_lens)), q_lens, kv_lens, Hq=heads[0], Hkv=heads[1], D=16, page_size=page_size, pad_seqs=1, pad_tokens=2)
    check(ragged_paged_attention, case, num_queries_per_block=bq, num_kv_pages_per_block=2)


"""The work-list (split-KV) attention: partials of one query block merged across loop steps."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import split_kv
from test_ragged_attention_reference import check, make_case


@pytest.mark.parametrize("contraction", ["dot", "reduce"])
@pytest.mark.parametrize("items_per_step", [1, 3])
def test_work_items_spread_over_many_loop_steps(items_per_step, contraction):
    rng = np.random.default_rng(5)
    case = make_case(rng, [9, 1, 1, 4], [40, 23, 1, 13], Hq=4, Hkv=2, D=32, page_size=4, pad_seqs=2, pad_tokens=3)
    attn = functools.partial(split_kv.ragged_paged_attention, contraction=contraction)
    check(attn, case, num_queries_per_block=4, num_kv_pages_per_block=2, items_per_step=items_per_step)
    check(attn, case, sliding_window=6, num_queries_per_block=1, num_kv_pages_per_block=1, items_per_step=items_per_step)


def test_an_unknown_contraction_is_refused_by_name():
    rng = np.random.default_rng(5)
    case = make_case(rng, [1], [8], Hq=4, Hkv=2, D=32, page_size=4, pad_seqs=0, pad_tokens=0)
    with pytest.raises(ValueError, match="contraction='einsum'"):
        split_kv.ragged_paged_attention(*case, contraction="einsum")


# ---- partial attention: kv_end (see only the cache prefix) and return_lse (merge statistics)

SM_SCALE = 0.125


def numpy_partial_attention(case, *, kv_start=None, kv_end=None, sm_scale=SM_SCALE, sliding_window=None, soft_cap=None):
    """Per-sequence numpy loop over the keys at positions in [kv_start[s], kv_end[s]) that the usual
    causal / window / kv_lens rules let a query see. Returns (out [T, Hq, D], lse [T, Hq]) in float64:
    out 0 and lse -inf for rows that see no key (padding rows included)."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = case
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    out = np.zeros((T, Hq, D), np.float64)
    lse = np.full((T, Hq), -np.inf)
    for s in range(int(num_seqs[0])):
        q0, q1, kv_len = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
        k = k_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)  # [kv_len, Hkv, D]
        v = v_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)
        kv_pos = np.arange(kv_len)
        for i in range(q1 - q0):
            pos = kv_len - (q1 - q0) + i
            visible = kv_pos <= pos
            if sliding_window is not None:
                visible &= kv_pos > pos - sliding_window
            if kv_start is not None:
                visible &= kv_pos >= kv_start[s]
            if kv_end is not None:
                visible &= kv_pos < kv_end[s]
            if not visible.any():
                continue
            for h in range(Hq):
                scores = k[visible, h // G] @ q[q0 + i, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                lse[q0 + i, h] = np.logaddexp.reduce(scores)
                out[q0 + i, h] = np.exp(scores - lse[q0 + i, h]) @ v[visible, h // G]
    return out, lse


def numpy_merge(out_a, lse_a, out_b, lse_b):
    """Two partials over disjoint key sets -> the partial over their union (rows empty on both stay empty)."""
    lse = np.logaddexp(lse_a, lse_b)
    safe = np.where(lse == -np.inf, 0.0, lse)
    w_a, w_b = np.exp(lse_a - safe), np.exp(lse_b - safe)  # exp(-inf) = 0 for an empty side
    return w_a[..., None] * out_a + w_b[..., None] * out_b, lse


def run_split_kv(case, **kw):
    """split_kv on a numpy case; returns numpy arrays (a tuple when return_lse=True)."""
    kw.setdefault("sm_scale", SM_SCALE)
    if kw.get("kv_end") is not None:
        kw["kv_end"] = jnp.asarray(kw["kv_end"], jnp.int32)
    result = split_kv.ragged_paged_attention(*map(jnp.asarray, case), **kw)
    return tuple(np.asarray(x) for x in result) if isinstance(result, tuple) else np.asarray(result)


def assert_partial_close(got, want, tol=1e-5):
    """(out, lse) pairs agree: outputs within tol, lse within tol and -inf in exactly the same places."""
    (out, lse), (out_want, lse_want) = got, want
    np.testing.assert_allclose(out, out_want, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    np.testing.assert_allclose(lse, lse_want, atol=tol, rtol=tol)


# a prefill, two decodes, a chunk continuing a prefill, an empty slot; 2 padding slots, 3 padding rows
Q_LENS, KV_LENS = [9, 1, 1, 5, 0], [9, 23, 14, 19, 0]


@pytest.fixture(scope="module")
def gqa_case():
    return make_case(np.random.default_rng(7), Q_LENS, KV_LENS, Hq=4, Hkv=2, D=16, page_size=4, pad_seqs=2, pad_tokens=3)


def test_lse_is_the_logsumexp_of_the_visible_scores(gqa_case):
    got = run_split_kv(gqa_case, return_lse=True, num_queries_per_block=4, num_kv_pages_per_block=2, items_per_step=4)
    assert got[1].dtype == np.float32
    assert_partial_close(got, numpy_partial_attention(gqa_case))


def test_lse_uses_soft_capped_scores(gqa_case):
    got = run_split_kv(gqa_case, sm_scale=1.0, soft_cap=3.0, return_lse=True, num_queries_per_block=2)
    assert_partial_close(got, numpy_partial_attention(gqa_case, sm_scale=1.0, soft_cap=3.0))


def test_padding_rows_have_zero_output_and_lse_minus_inf(gqa_case):
    out, lse = run_split_kv(gqa_case, return_lse=True)
    real_rows = sum(Q_LENS)
    assert np.all(out[real_rows:] == 0) and np.all(lse[real_rows:] == -np.inf)
    assert np.all(np.isfinite(lse[:real_rows]))


def test_return_lse_leaves_the_output_bit_for_bit_unchanged(gqa_case):
    plain = run_split_kv(gqa_case, num_queries_per_block=4, num_kv_pages_per_block=2)
    out, _ = run_split_kv(gqa_case, return_lse=True, num_queries_per_block=4, num_kv_pages_per_block=2)
    np.testing.assert_array_equal(out, plain)


def test_kv_end_equal_to_kv_lens_changes_nothing(gqa_case):
    plain = run_split_kv(gqa_case, num_queries_per_block=4, num_kv_pages_per_block=2)
    limited = run_split_kv(gqa_case, kv_end=gqa_case[3], num_queries_per_block=4, num_kv_pages_per_block=2)
    np.testing.assert_array_equal(limited, plain)


# kv_end per sequence: mid-prefill, 0 (sees nothing), kv_lens - q_lens (earlier steps only),
# inside a page, past kv_lens (clamped to kv_lens); padding slots get arbitrary values
KV_END = [4, 0, 13, 6, 3, 99, 5]


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_kv_end_hides_cache_positions_at_and_past_it(gqa_case, sliding_window):
    want = numpy_partial_attention(gqa_case, kv_end=KV_END, sliding_window=sliding_window)
    got = run_split_kv(gqa_case, kv_end=KV_END, sliding_window=sliding_window, return_lse=True,
                       num_queries_per_block=2, num_kv_pages_per_block=1, items_per_step=3)
    assert_partial_close(got, want)


def test_rows_that_see_no_key_before_kv_end_are_zero_with_lse_minus_inf(gqa_case):
    out, lse = run_split_kv(gqa_case, kv_end=KV_END, sliding_window=5, return_lse=True)
    decode_row = Q_LENS[0]  # sequence 1 (a decode) has kv_end 0
    assert np.all(out[decode_row] == 0) and np.all(lse[decode_row] == -np.inf)
    # sequence 0's query at position 8 with a window of 5 sees positions 4..8, all at or past kv_end = 4
    assert np.all(out[8] == 0) and np.all(lse[8] == -np.inf)


def test_kv_blocks_past_kv_end_are_never_read():
    """Pages wholly at or past kv_end are filled with NaN: had any work item read them, the NaN
    would reach the output (0 * NaN is NaN), so a finite, correct result shows they were skipped."""
    page_size = 4
    case = make_case(np.random.default_rng(8), [6, 1, 3], [6, 17, 11], Hq=2, Hkv=1, D=16, page_size=page_size)
    kv_end = np.array([0, 8, 8], np.int32)  # page boundaries
    clean = numpy_partial_attention(case, kv_end=kv_end)
    q, k_pages, v_pages, kv_lens, page_indices, cu, n = (x.copy() for x in case)
    for s, kv_len in enumerate(kv_lens):
        hidden_pages = page_indices[s, kv_end[s] // page_size : -(-kv_len // page_size)]
        k_pages[hidden_pages] = np.nan
        v_pages[hidden_pages] = np.nan
    poisoned = (q, k_pages, v_pages, kv_lens, page_indices, cu, n)
    got = run_split_kv(poisoned, kv_end=kv_end, return_lse=True, num_queries_per_block=2, num_kv_pages_per_block=1)
    assert not np.isnan(got[0]).any()
    assert_partial_close(got, clean)


def test_partial_before_kv_end_merged_with_the_rest_is_the_full_attention(gqa_case):
    """The use case: attend to what earlier steps cached (kv_end = kv_lens - q_lens) with split_kv,
    to this step's own keys separately, and merge the two partials by their lse."""
    q_lens = np.diff(gqa_case[5])
    kv_end = gqa_case[3] - q_lens  # [S]
    kw = dict(sliding_window=6, num_queries_per_block=4, num_kv_pages_per_block=2)
    earlier = run_split_kv(gqa_case, kv_end=kv_end, return_lse=True, **kw)
    own = numpy_partial_attention(gqa_case, kv_start=kv_end, sliding_window=6)
    merged_out, merged_lse = numpy_merge(*earlier, *own)
    full_out, full_lse = run_split_kv(gqa_case, return_lse=True, **kw)
    np.testing.assert_allclose(merged_out, full_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(merged_lse, full_lse, atol=1e-5, rtol=1e-5)

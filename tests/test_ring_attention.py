"""Ring attention (sequence parallelism) against a numpy loop over the whole packed batch.

The batch: sequences packed back to back in T rows, padding rows at the end, each row with a
sequence id, a position in its sequence and a real-token flag. A query sees the keys of its own
sequence at positions <= its own (and inside the sliding window). On a mesh of n devices each
device holds T / n contiguous rows, so sequences straddle the device boundaries.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from pallas_kernels.ragged_paged_attention import split_kv
from sharding.ring_attention import attention_partial, merge_partials, ring_attention
from test_ragged_attention_reference import make_case

SM_SCALE = 0.25
HQ, HKV, D = 4, 2, 16  # GQA: 2 query heads per KV head


def packed_batch(rng, seq_lens, first_pos, num_padding):
    """A packed ragged batch: q [T, HQ, D], k / v [T, HKV, D] and per-row (seq, pos, valid) [T].
    Sequence s has seq_lens[s] rows at positions first_pos[s], first_pos[s] + 1, ...; the padding
    rows at the end carry sequence id 0 and position 0 (valid=False must be what hides them)."""
    seq = np.concatenate([np.full(n, s) for s, n in enumerate(seq_lens)] + [np.zeros(num_padding)]).astype(np.int32)
    pos = np.concatenate([p + np.arange(n) for n, p in zip(seq_lens, first_pos)] + [np.zeros(num_padding)]).astype(np.int32)
    valid = np.arange(len(seq)) < sum(seq_lens)
    T = len(seq)
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((T, HKV, D)).astype(np.float32)
    return q, k, v, seq, pos, valid


def numpy_attention(q, k, v, q_meta, k_meta, sm_scale=SM_SCALE, sliding_window=None, soft_cap=None):
    """The obvious loop: for each real query row and head, softmax over the visible key rows.
    q_meta / k_meta = (seq, pos, valid) of the query / key rows. Returns (out, lse) in float64;
    out 0 and lse -inf for rows that see no key."""
    (q_seq, q_pos, q_valid), (k_seq, k_pos, k_valid) = q_meta, k_meta
    G = q.shape[1] // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:2], -np.inf)
    for i in range(q.shape[0]):
        visible = k_valid & q_valid[i] & (k_seq == q_seq[i]) & (k_pos <= q_pos[i])
        if sliding_window is not None:
            visible &= k_pos > q_pos[i] - sliding_window
        if not visible.any():
            continue
        for h in range(q.shape[1]):
            scores = k[visible, h // G].astype(np.float64) @ q[i, h] * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            lse[i, h] = np.logaddexp.reduce(scores)
            out[i, h] = np.exp(scores - lse[i, h]) @ v[visible, h // G]
    return out, lse


def assert_partial_close(got, want, tol=1e-5):
    """(out, lse) pairs agree: outputs within tol, lse within tol and -inf in exactly the same places."""
    (out, lse), (out_want, lse_want) = (tuple(np.asarray(x) for x in got), want)
    np.testing.assert_allclose(out, out_want, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_want))
    np.testing.assert_allclose(lse, lse_want, atol=tol, rtol=tol)


# T = 32 rows: 4 sequences (one continuing at position 3, one a single token) and 6 padding rows.
# With 8 devices (4 rows each) the sequence boundaries 7, 19, 20 and 26 fall inside blocks.
SEQ_LENS, FIRST_POS, NUM_PADDING = [7, 12, 1, 6], [0, 3, 0, 0], 6


@pytest.fixture(scope="module")
def batch():
    return packed_batch(np.random.default_rng(0), SEQ_LENS, FIRST_POS, NUM_PADDING)


attention_partial_jit = jax.jit(attention_partial, static_argnames=("sm_scale", "sliding_window", "soft_cap"))


# ---- attention_partial and merge_partials on one device


@pytest.mark.parametrize(
    "sliding_window,soft_cap", [(None, None), (5, None), (None, 2.0)], ids=["causal", "window", "soft_cap"]
)
def test_attention_partial_over_all_rows_is_packed_causal_attention(batch, sliding_window, soft_cap):
    q, k, v, *meta = batch
    got = attention_partial_jit(q, k, v, *meta, *meta, sm_scale=SM_SCALE, sliding_window=sliding_window, soft_cap=soft_cap)
    want = numpy_attention(q, k, v, meta, meta, sliding_window=sliding_window, soft_cap=soft_cap)
    assert_partial_close(got, want)


def test_padding_rows_come_out_zero_with_lse_minus_inf(batch):
    q, k, v, *meta = batch
    out, lse = attention_partial_jit(q, k, v, *meta, *meta, sm_scale=SM_SCALE)
    real = sum(SEQ_LENS)
    assert np.all(np.asarray(out)[real:] == 0) and np.all(np.asarray(lse)[real:] == -np.inf)


def test_merging_partials_over_two_disjoint_key_sets_is_attention_over_their_union(batch):
    q, k, v, seq, pos, valid = batch
    meta = (seq, pos, valid)
    half = np.arange(len(seq)) < 16  # keys of rows 0..15 vs rows 16..31
    first = attention_partial_jit(q, k, v, *meta, seq, pos, valid & half, sm_scale=SM_SCALE)
    second = attention_partial_jit(q, k, v, *meta, seq, pos, valid & ~half, sm_scale=SM_SCALE)
    # the cases the merge must survive: rows before 16 see nothing in the second half, the
    # sequence starting at row 20 nothing in the first half, padding rows nothing at all
    lse_1, lse_2 = np.asarray(first[1]), np.asarray(second[1])
    assert np.isneginf(lse_2[:16]).all() and np.isneginf(lse_1[20:]).all()
    assert (np.isfinite(lse_1) & np.isfinite(lse_2)).any()
    merged = jax.jit(merge_partials)(*first, *second)
    assert_partial_close(merged, numpy_attention(q, k, v, meta, meta))


def test_merge_is_exact_for_any_split_of_the_keys(batch):
    q, k, v, seq, pos, valid = batch
    meta = (seq, pos, valid)
    in_a = np.random.default_rng(1).random(len(seq)) < 0.5  # an interleaved split
    part_a = attention_partial_jit(q, k, v, *meta, seq, pos, valid & in_a, sm_scale=SM_SCALE, sliding_window=5)
    part_b = attention_partial_jit(q, k, v, *meta, seq, pos, valid & ~in_a, sm_scale=SM_SCALE, sliding_window=5)
    merged = jax.jit(merge_partials)(*part_a, *part_b)
    assert_partial_close(merged, numpy_attention(q, k, v, meta, meta, sliding_window=5))


# ---- ring attention on a "sequence" mesh


def sequence_mesh(n):
    return jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def run_ring(batch, n, **kw):
    """ring_attention under shard_map on n devices; returns the global (out [T, Hq, D], lse [T, Hq])."""
    q, k, v, seq, pos, valid = batch

    def per_device(q, k, v, q_seq, q_pos, q_valid, seq_all, pos_all, valid_all):
        out, lse, _ = ring_attention(
            q, k, v, q_seq, q_pos, q_valid, seq_all, pos_all, valid_all,
            axis_name="sequence", axis_size=n, sm_scale=SM_SCALE, **kw,
        )
        return out, lse

    sharded = jax.shard_map(
        per_device, mesh=sequence_mesh(n),
        in_specs=(P("sequence"),) * 6 + (P(),) * 3, out_specs=(P("sequence"), P("sequence")), check_vma=False,
    )
    return jax.jit(sharded)(q, k, v, seq, pos, valid, seq, pos, valid)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("sliding_window", [None, 5], ids=["causal", "window"])
def test_ring_attention_equals_attention_over_the_whole_batch(batch, n, sliding_window):
    q, k, v, *meta = batch
    got = run_ring(batch, n, sliding_window=sliding_window)
    assert_partial_close(got, numpy_attention(q, k, v, meta, meta, sliding_window=sliding_window))


def test_ring_attention_applies_the_soft_cap(batch):
    q, k, v, *meta = batch
    got = run_ring(batch, 4, soft_cap=2.0)
    assert_partial_close(got, numpy_attention(q, k, v, meta, meta, soft_cap=2.0))


@pytest.mark.parametrize("n", [4, 8])
def test_on_block_sees_every_block_once_on_every_device_with_its_origin(batch, n):
    q, k, v, seq, pos, valid = batch
    T, block_rows = len(seq), len(seq) // n

    def write_block(carry, k_blk, v_blk, origin):
        """What a caller's KV-cache write would do: put the block at its global rows."""
        k_seen, v_seen, visits = carry  # [T, Hkv, D], [T, Hkv, D], [n]
        rows = origin * block_rows + jnp.arange(block_rows)
        return k_seen.at[rows].set(k_blk), v_seen.at[rows].set(v_blk), visits.at[origin].add(1)

    def per_device(q, k, v, q_seq, q_pos, q_valid, seq_all, pos_all, valid_all):
        empty = (jnp.zeros((T, HKV, D), jnp.float32), jnp.zeros((T, HKV, D), jnp.float32), jnp.zeros(n, jnp.int32))
        _, _, (k_seen, v_seen, visits) = ring_attention(
            q, k, v, q_seq, q_pos, q_valid, seq_all, pos_all, valid_all,
            axis_name="sequence", axis_size=n, sm_scale=SM_SCALE, carry=empty, on_block=write_block,
        )
        return k_seen[None], v_seen[None], visits[None]  # stacked over devices

    sharded = jax.shard_map(
        per_device, mesh=sequence_mesh(n),
        in_specs=(P("sequence"),) * 6 + (P(),) * 3, out_specs=P("sequence"), check_vma=False,
    )
    k_seen, v_seen, visits = jax.jit(sharded)(q, k, v, seq, pos, valid, seq, pos, valid)
    np.testing.assert_array_equal(np.asarray(visits), np.ones((n, n), np.int32))
    for device in range(n):
        np.testing.assert_array_equal(np.asarray(k_seen)[device], k)
        np.testing.assert_array_equal(np.asarray(v_seen)[device], v)


def test_the_ring_passes_k_and_v_on_after_every_hop_but_the_last(batch):
    n = 4
    q, k, v, seq, pos, valid = batch
    ring = functools.partial(ring_attention, axis_name="sequence", axis_size=n, sm_scale=SM_SCALE)
    sharded = jax.shard_map(
        ring, mesh=sequence_mesh(n),
        in_specs=(P("sequence"),) * 6 + (P(),) * 3, out_specs=(P("sequence"), P("sequence"), P()), check_vma=False,
    )
    program = jax.jit(sharded).lower(q, k, v, seq, pos, valid, seq, pos, valid).as_text()
    assert program.count("stablehlo.collective_permute") == 2 * (n - 1)


# ---- with a paged cache: earlier steps' keys from split_kv, this step's keys attended densely


def test_cache_prefix_partial_merged_with_the_steps_own_keys_is_the_full_attention():
    """A chunked-prefill step: split_kv attends to what earlier steps cached (kv_end = kv_lens -
    q_lens), attention_partial to this step's own keys, merge_partials joins them."""
    q_lens, kv_lens = [5, 1, 6], [12, 9, 6]
    case = make_case(np.random.default_rng(2), q_lens, kv_lens, Hq=HQ, Hkv=HKV, D=D, page_size=4, pad_tokens=2)
    q, k_pages, v_pages, kv_lens, page_indices, cu, num_seqs = case
    kw = dict(sm_scale=SM_SCALE, sliding_window=8, num_queries_per_block=2, num_kv_pages_per_block=1)
    args = [jnp.asarray(x) for x in case]
    full, _ = split_kv.ragged_paged_attention(*args, return_lse=True, **kw)
    kv_end = jnp.asarray(kv_lens - np.array(q_lens), jnp.int32)
    cached = split_kv.ragged_paged_attention(*args, kv_end=kv_end, return_lse=True, **kw)

    # this step's rows: their metadata, and their keys / values read back from the pages
    T = q.shape[0]
    seq = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    valid = np.arange(T) < sum(q_lens)
    k_new = np.zeros((T, HKV, D), np.float32)
    v_new = np.zeros((T, HKV, D), np.float32)
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(cu[s], cu[s + 1])
        seq[rows], pos[rows] = s, np.arange(kv_len - q_len, kv_len)
        k_new[rows] = k_pages[page_indices[s]].reshape(-1, HKV, D)[kv_len - q_len : kv_len]
        v_new[rows] = v_pages[page_indices[s]].reshape(-1, HKV, D)[kv_len - q_len : kv_len]
    meta = (seq, pos, valid)
    own = attention_partial_jit(q, k_new, v_new, *meta, *meta, sm_scale=SM_SCALE, sliding_window=8)

    out, _ = merge_partials(*cached, *own)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), atol=1e-5, rtol=1e-5)

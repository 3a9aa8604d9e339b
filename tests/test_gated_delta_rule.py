"""The gated delta rule's jnp forms (pallas_kernels.gated_delta_rule.reference) against
transformers' own (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule: what Qwen3-Next
and Qwen3.5 run without the FLA kernels), float32: the chunked form at another chunk size than
transformers' 64, the recurrent form, both from a non-zero initial state, with key heads shared
by two value heads each; and the ragged batch's per-sequence forms (jaxinfer.ops.linear_attention)
against one sequence at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pallas_kernels.gated_delta_rule import reference as delta_rule

T, HK, HV, DK, DV = 37, 2, 4, 16, 8


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(T, HK, DK)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(T, HV, DV)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(T, HV)))).astype(np.float32)  # log decays <= 0
    beta = (1 / (1 + np.exp(-rng.normal(size=(T, HV))))).astype(np.float32)
    state = (0.1 * rng.normal(size=(HV, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_each_form_equals_transformers(form):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = inputs()
    torch_form = hf.torch_chunk_gated_delta_rule if form == "chunked" else hf.torch_recurrent_gated_delta_rule
    t = lambda a: torch.tensor(a)[None]  # noqa: E731
    want, want_state = torch_form(t(q), t(k), t(v), t(g), t(beta), initial_state=t(state), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    qq, kk = delta_rule.prepare_qk(q, k, HV)
    if form == "chunked":
        out, final = delta_rule.chunked(qq, kk, v, g, beta, state, chunk_size=16)
    else:
        out, final = delta_rule.recurrent(qq, kk, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), want[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(np.asarray(final), want_state[0].numpy(), atol=2e-6)


def test_a_ragged_step_continues_each_sequence_from_its_slot():
    """Three sequences in one step (a decode, a chunk from zeros, a chunk continuing a saved
    state) equal each run alone; the states land in their slots, the others untouched."""
    import jax.numpy as jnp

    from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch
    from jaxinfer.ops.linear_attention import ragged_delta_rule

    q, k, v, g, beta, state = inputs(1)
    qq, kk = (np.asarray(a) for a in delta_rule.prepare_qk(q, k, HV))
    table = np.zeros((5, HV, DK, DV), np.float32)
    table[2], table[4] = state, 2 * state  # slot 2: the decode's, slot 4: the continued chunk's
    chunks = [SequenceChunk([0], 6, [[1, 2]], [0], state_slot=2), SequenceChunk([0] * 9, 0, [[3, 4, 5]], [8], state_slot=3),
              SequenceChunk([0] * 12, 7, [[6, 7, 8, 9, 10]], [11], state_slot=4)]
    _, batch, _ = pack_batch(chunks, Buckets((32,), max_num_seqs=4, pages_per_seq=5), page_size=4)
    rows = [(0, 1), (1, 10), (10, 22)]
    out, new, _ = ragged_delta_rule(*(jnp.asarray(a[:32]) for a in (qq, kk, v, g, beta)), jnp.asarray(table), batch, chunks=True)
    for (first, end), start in zip(rows, (table[2], np.zeros_like(state), table[4])):
        want, want_state = delta_rule.recurrent(qq[first:end], kk[first:end], v[first:end], g[first:end], beta[first:end], start)
        np.testing.assert_allclose(np.asarray(out)[first:end], np.asarray(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(new)[4], np.asarray(want_state), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(new)[1], table[1])  # a slot no sequence holds


def test_a_verifying_chunk_keeps_its_inputs_and_the_commit_advances_its_slot_by_the_tokens_kept():
    """Speculative decoding's short path (spec_block 4): a decode, a chunk of 4 verifying drafts,
    a short prefill chunk of 3 and a long one of 9 in one step each equal their sequence run alone;
    the verifying chunk's slot (its convolution's inputs and its recurrent state) stays as it was,
    and `commit_drafts` with 2 tokens kept gives the state after exactly those 2."""
    import jax.numpy as jnp

    from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch
    from jaxinfer.ops.linear_attention import ragged_causal_conv, ragged_delta_rule
    from jaxinfer.ops.linear_state import DraftInputs, LinearState, commit_drafts

    B, K, C = 4, 4, 6
    q, k, v, g, beta, state = inputs(2)
    qq, kk = (np.asarray(a) for a in delta_rule.prepare_qk(q, k, HV))
    table = np.zeros((5, HV, DK, DV), np.float32)
    table[1], table[2], table[3] = state, 2 * state, -state
    chunks = [SequenceChunk([0], 6, [[1, 2]], [0], state_slot=1),
              SequenceChunk([0] * 4, 5, [[3, 4, 5]], [0, 1, 2, 3], state_slot=2, verifies=True),
              SequenceChunk([0] * 3, 7, [[6, 7, 8]], [2], state_slot=3),
              SequenceChunk([0] * 9, 0, [[9, 10, 11]], [8], state_slot=4)]
    _, batch, _ = pack_batch(chunks, Buckets((32,), max_num_seqs=4, pages_per_seq=5, spec_block=B), page_size=4)
    rows = [(0, 1), (1, 5), (5, 8), (8, 17)]
    zeros = lambda *shape: jnp.zeros((5, B, *shape), jnp.float32)  # noqa: E731
    drafts = (zeros(HV, DK), zeros(HV, DV), zeros(HV), zeros(HV))
    out, new, drafts = ragged_delta_rule(*(jnp.asarray(a[:32]) for a in (qq, kk, v, g, beta)), jnp.asarray(table), batch,
                                         chunks=True, spec_block=B, drafts=drafts)
    for (first, end), slot in zip(rows, (1, 2, 3, None)):
        start = table[slot] if slot else np.zeros_like(state)
        want, want_state = delta_rule.recurrent(qq[first:end], kk[first:end], v[first:end], g[first:end], beta[first:end], start)
        np.testing.assert_allclose(np.asarray(out)[first:end], np.asarray(want), atol=2e-5)
        if slot != 2:
            np.testing.assert_allclose(np.asarray(new)[slot or 4], np.asarray(want_state), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(new)[2], table[2])  # the verifying chunk advanced nothing

    x = np.random.default_rng(3).normal(size=(32, C)).astype(np.float32)  # the convolution's inputs
    saved = np.random.default_rng(4).normal(size=(5, K - 1, C)).astype(np.float32)
    conv_out, conv_saved, conv_drafts = ragged_causal_conv(jnp.asarray(x), jnp.asarray(saved), jnp.ones((K, C)), batch,
                                                           jnp.zeros((5, B, C)))
    np.testing.assert_array_equal(np.asarray(conv_saved)[2], saved[2])
    np.testing.assert_array_equal(np.asarray(conv_drafts)[2], x[1:5])
    window = np.concatenate([saved[2], x[1:5]])  # the verifying chunk's outputs read its saved inputs, then its own
    np.testing.assert_allclose(np.asarray(conv_out)[1:5], [window[i : i + K].sum(0) for i in range(4)], atol=1e-5)

    states = LinearState(conv=conv_saved[None], recurrent=new[None], drafts=DraftInputs(conv_drafts[None], *(d[None] for d in drafts)))
    committed = commit_drafts(states, jnp.array([2, 0]), jnp.array([2, 0]))  # (slot 0: padding, nothing kept)
    _, want_state = delta_rule.recurrent(qq[1:3], kk[1:3], v[1:3], g[1:3], beta[1:3], table[2])
    np.testing.assert_allclose(np.asarray(committed.recurrent[0, 2]), np.asarray(want_state), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(committed.conv[0, 2]), window[2:5])  # the last K - 1 inputs up to the 2 kept
    np.testing.assert_array_equal(np.asarray(committed.recurrent[0, 0]), np.asarray(new)[0])

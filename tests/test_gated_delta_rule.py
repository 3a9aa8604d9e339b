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
    out, new = ragged_delta_rule(*(jnp.asarray(a[:32]) for a in (qq, kk, v, g, beta)), jnp.asarray(table), batch, chunks=True)
    for (first, end), start in zip(rows, (table[2], np.zeros_like(state), table[4])):
        want, want_state = delta_rule.recurrent(qq[first:end], kk[first:end], v[first:end], g[first:end], beta[first:end], start)
        np.testing.assert_allclose(np.asarray(out)[first:end], np.asarray(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(new)[4], np.asarray(want_state), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(new)[1], table[1])  # a slot no sequence holds

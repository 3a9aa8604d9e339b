"""Gated DeltaNet over a ragged batch: each sequence's tokens continue its own recurrent state.

A step holds decodes (one token each) and at most MAX_PREFILL_CHUNKS multi-token chunks
(jaxinfer.ops.batch). Both pieces of a Gated DeltaNet layer run per sequence:

- `ragged_causal_conv`: the depthwise causal convolution over the q | k | v channels, each
  token's window reaching back into its sequence's saved inputs (the state's `conv` rows) where
  the chunk does not; the last K - 1 inputs of each sequence become its new saved inputs. Every
  row at once, vectorised; with a Pallas kernel table, only the decodes' and short chunks' rows,
  each multi-token chunk through its `causal_conv` (pallas_kernels.causal_conv);
- `ragged_delta_rule`: the gated delta rule (pallas_kernels.gated_delta_rule.reference), the
  one-token step for every decode, vectorised over the sequences, and the chunked form for each
  multi-token chunk (its tokens gathered and padded to the step's T with tokens that change
  nothing), each from its sequence's state, the final states written back to their slots.

A sequence whose chunk starts at position 0 starts from zeros, whatever its slot holds. States
are per replica: `slots` index this replica's part of the table (jaxinfer.ops.linear_state).

With speculative decoding (a step's `spec_block` > 0) short chunks, of 2 to spec_block tokens,
run the one-token step spec_block times, vectorised over the sequences, beside the decodes: a
step may hold one verification chunk per sequence, far more than MAX_PREFILL_CHUNKS. A chunk
that verifies drafts (`batch.verifies`) leaves its slot as it was and keeps its inputs instead
(`drafts`: linear_state.DraftInputs), for `linear_state.commit_drafts` to advance the slot by the
tokens the host keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS, RaggedBatch
from pallas_kernels.causal_conv import reference as conv_reference
from pallas_kernels.gated_delta_rule import reference as delta_rule

CHUNK_SIZE = 64  # the chunked form's chunk (transformers' and FLA's)


def sequence_layout(batch: RaggedBatch, T: int):
    """Per token: (its sequence [T], its offset in its chunk [T]); per sequence: (its chunk's
    first row [S], length [S], whether it starts at position 0 [S])."""
    cu, kv_lens = jnp.asarray(batch.cu_q_lens), jnp.asarray(batch.kv_lens)
    first, q_lens = cu[:-1], cu[1:] - cu[:-1]
    seq = jnp.minimum(jnp.searchsorted(cu[1:], jnp.arange(T), side="right"), kv_lens.shape[0] - 1)
    return seq, jnp.arange(T) - first[seq], first, q_lens, kv_lens - q_lens == 0


def ragged_causal_conv(x: jax.Array, saved: jax.Array, weight: jax.Array, batch: RaggedBatch, drafts: jax.Array | None = None,
                       *, chunks: bool = True, spec_block: int = 0, kernels=None):
    """x [T, C] (one layer's conv inputs), saved [N, K - 1, C] (each slot's last inputs), weight
    [K, C] -> (out [T, C] = sum_j weight[j] * x[t - (K - 1) + j] per sequence (before the
    activation), saved with each sequence's last K - 1 inputs written to its slot, drafts).
    drafts [N, B, C] (speculative decoding): a verifying chunk's inputs go there instead.
    `kernels`: the kernel table whose `causal_conv` runs each chunk of more than max(1,
    spec_block) tokens (`chunks`: the step may hold some), as `ragged_delta_rule` picks them;
    None, or a table whose entry is the reference (which the vectorised rows compute already),
    computes every row vectorised."""
    T, C = x.shape
    K = weight.shape[0]
    seq, offset, first, q_lens, fresh = sequence_layout(batch, T)
    slots = jnp.asarray(batch.state_slots)  # [S]
    before = jnp.where(fresh[:, None, None], 0, saved[slots]).astype(x.dtype)  # [S, K - 1, C]: inputs before each chunk

    def tap(s, o):  # the input at offset o of sequence s's chunk (o < 0: saved before it)
        return jnp.where((o >= 0)[..., None], x[jnp.clip(first[s] + o, 0, T - 1)], before[s, jnp.clip(o + K - 1, 0, K - 2)])

    # each sequence's last K - 1 inputs: chunk offsets q_len - (K - 1) .. q_len - 1
    o = q_lens[:, None] - (K - 1) + jnp.arange(K - 1)[None, :]  # [S, K - 1]
    last = tap(jnp.arange(slots.shape[0])[:, None], o)  # [S, K - 1, C]
    in_use = jnp.arange(slots.shape[0]) < batch.num_seqs[0]
    conv = None if kernels is None else kernels.causal_conv
    if chunks and conv is not None and conv is not conv_reference.causal_conv:
        out, last = _conv_by_chunks(x, before, weight, tap, first, q_lens, in_use, last, spec_block, conv)
    else:
        out = sum(tap(seq, offset - (K - 1) + j).astype(jnp.float32) * weight[j].astype(jnp.float32) for j in range(K))
    verifies = in_use & batch.verifies if drafts is not None else jnp.zeros_like(in_use)
    saved = saved.at[jnp.where(in_use & ~verifies, slots, saved.shape[0])].set(last.astype(saved.dtype), mode="drop")
    if drafts is not None:  # a verifying chunk's inputs, in its slot's row (past its length: zeros)
        offsets = jnp.arange(drafts.shape[1])[None, :]  # [1, B]
        rows = jnp.where((offsets < q_lens[:, None])[..., None], x[jnp.clip(first[:, None] + offsets, 0, T - 1)], 0)
        drafts = drafts.at[jnp.where(verifies, slots, drafts.shape[0])].set(rows.astype(drafts.dtype), mode="drop")
    return out.astype(x.dtype), saved, drafts


def _conv_by_chunks(x, before, weight, tap, first, q_lens, in_use, last, spec_block: int, conv):
    """`ragged_causal_conv`'s rows with a kernel: the decodes' and short chunks' (up to B =
    max(1, spec_block) tokens) B rows per sequence vectorised (`tap(s, o)`: the input at offset o
    of sequence s's chunk), each longer chunk (at most MAX_PREFILL_CHUNKS) gathered into T rows
    through `conv`, its `last` (the K - 1 inputs ending at its length) replacing the sequence's
    row of last [S, K - 1, C] (the same values). -> (out [T, C] in x's dtype, last)."""
    T, C = x.shape
    K, S, B = weight.shape[0], q_lens.shape[0], max(1, spec_block)
    offsets = jnp.arange(B)[None, :]  # [1, B]
    few = sum(tap(jnp.arange(S)[:, None], offsets - (K - 1) + j).astype(jnp.float32) * weight[j].astype(jnp.float32)
              for j in range(K))  # [S, B, C]
    short = (in_use & (q_lens <= B))[:, None] & (offsets < q_lens[:, None])
    out = jnp.zeros((T, C), x.dtype).at[jnp.where(short, first[:, None] + offsets, T)].set(few.astype(x.dtype), mode="drop")

    long = in_use & (q_lens > B)
    (which,) = jnp.nonzero(long, size=MAX_PREFILL_CHUNKS, fill_value=0)
    present = jnp.arange(MAX_PREFILL_CHUNKS) < jnp.sum(long)

    def one_chunk(args):
        s, present = args
        rows = first[s] + jnp.arange(T)  # past the chunk's length: padding (valid_len)
        o, chunk_last = jax.lax.cond(present, lambda: conv(x[jnp.clip(rows, 0, T - 1)], before[s], weight, valid_len=q_lens[s]),
                                     lambda: (jnp.zeros((T, C), x.dtype), before[s]))
        return o, chunk_last, jnp.where(present & (jnp.arange(T) < q_lens[s]), rows, T)

    outs, lasts, targets = jax.lax.map(one_chunk, (which, present))
    out = out.at[targets.reshape(-1)].set(outs.reshape(-1, C), mode="drop")
    return out, last.at[jnp.where(present, which, S)].set(lasts.astype(last.dtype), mode="drop")


def ragged_delta_rule(q, k, v, g, beta, recurrent: jax.Array, batch: RaggedBatch, *, chunks: bool, spec_block: int = 0,
                      drafts: tuple | None = None, kernels=None):
    """The gated delta rule of every sequence of the step: q, k [T, Hv, Dk] (prepared:
    `delta_rule.prepare_qk`), v [T, Hv, Dv], g and beta [T, Hv], recurrent [N, Hv, Dk, Dv] (the
    slots' states) -> (out [T, Hv, Dv] float32, recurrent with each sequence's final state in its
    slot, drafts). `chunks`: the step may hold multi-token chunks (not a decode bucket);
    `spec_block` > 0: chunks of up to that many tokens run the short path (module docstring), and
    `drafts` (the slots' k, v, g, beta rows [N, B, ...] of linear_state.DraftInputs) keep a
    verifying chunk's inputs in place of its final state. `kernels`: the kernel table whose
    `gated_delta_rule` runs the multi-token chunks (jaxinfer.ops.kernels; None: the reference)."""
    T = q.shape[0]
    N = recurrent.shape[0]
    _, _, first, q_lens, fresh = sequence_layout(batch, T)
    slots, S = jnp.asarray(batch.state_slots), q_lens.shape[0]
    in_use = jnp.arange(S) < batch.num_seqs[0]
    start = jnp.where(fresh[:, None, None, None], 0.0, recurrent[slots])  # [S, Hv, Dk, Dv]

    # decodes: one step each, vectorised over the sequences (their one token at row `first`)
    row = jnp.clip(first, 0, T - 1)
    out_1, state_1 = delta_rule.step(q[row], k[row], v[row], g[row], beta[row], start)
    decode = in_use & (q_lens == 1)
    out = jnp.zeros(v.shape, jnp.float32).at[jnp.where(decode, row, T)].set(out_1, mode="drop")
    recurrent = recurrent.at[jnp.where(decode, slots, N)].set(state_1, mode="drop")
    if not chunks:
        return out, recurrent, drafts
    if spec_block:
        out, recurrent, drafts = _short_chunks(q, k, v, g, beta, out, recurrent, start, batch, spec_block, drafts)

    # multi-token chunks: each gathered into T rows (past its length: g = beta = 0, k = 0, no change)
    long = in_use & (q_lens > max(1, spec_block))
    (which,) = jnp.nonzero(long, size=MAX_PREFILL_CHUNKS, fill_value=0)
    present = jnp.arange(MAX_PREFILL_CHUNKS) < jnp.sum(long)
    chunked = delta_rule.chunked if kernels is None else kernels.gated_delta_rule

    def one_chunk(args):
        s, present = args
        rows = first[s] + jnp.arange(T)
        valid = present & (jnp.arange(T) < q_lens[s])
        take = jnp.clip(rows, 0, T - 1)
        mask = valid[:, None]
        o, final = jax.lax.cond(present, lambda: chunked(
            q[take], jnp.where(mask[..., None], k[take], 0.0), v[take], jnp.where(mask, g[take], 0.0),
            jnp.where(mask, beta[take], 0.0), start[s], chunk_size=CHUNK_SIZE),
            lambda: (jnp.zeros(v.shape, jnp.float32), start[s]))
        return o, final, jnp.where(valid, rows, T)

    outs, finals, targets = jax.lax.map(one_chunk, (which, present))
    out = out.at[targets.reshape(-1)].set(outs.reshape(-1, *outs.shape[2:]), mode="drop")
    recurrent = recurrent.at[jnp.where(present, slots[which], N)].set(finals, mode="drop")
    return out, recurrent, drafts


def _short_chunks(q, k, v, g, beta, out, recurrent, start, batch: RaggedBatch, B: int, drafts):
    """Chunks of 2..B tokens (verifications, short prefills): B one-token steps, vectorised over
    the sequences, from their states `start` [S, Hv, Dk, Dv]; each row's output into `out`, the
    final state into the slot (a verifying chunk: its inputs into `drafts` instead)."""
    T, N = q.shape[0], recurrent.shape[0]
    _, _, first, q_lens, _ = sequence_layout(batch, T)
    slots = jnp.asarray(batch.state_slots)
    in_use = jnp.arange(slots.shape[0]) < batch.num_seqs[0]
    short = in_use & (q_lens > 1) & (q_lens <= B)
    rows = jnp.clip(first[:, None] + jnp.arange(B)[None, :], 0, T - 1)  # [S, B]
    state = start
    for j in range(B):
        o, advanced = delta_rule.step(q[rows[:, j]], k[rows[:, j]], v[rows[:, j]], g[rows[:, j]], beta[rows[:, j]], state)
        valid = short & (j < q_lens)
        out = out.at[jnp.where(valid, rows[:, j], T)].set(o, mode="drop")
        state = jnp.where(valid[:, None, None, None], advanced, state)
    verifies = short & batch.verifies if drafts is not None else jnp.zeros_like(short)
    recurrent = recurrent.at[jnp.where(short & ~verifies, slots, N)].set(state, mode="drop")
    if drafts is not None:
        kept = (jnp.arange(B)[None, :] < q_lens[:, None])  # [S, B]: rows past a chunk's length are zeros
        target = jnp.where(verifies, slots, N)
        drafts = tuple(d.at[target].set(jnp.where(kept.reshape(kept.shape + (1,) * (a.ndim - 1)), a[rows], 0.0), mode="drop")
                       for d, a in zip(drafts, (k, v, g, beta)))
    return out, recurrent, drafts


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of each head's x [..., Dv] (weight [Dv], no offset) times silu(gate), in float32
    (transformers' Qwen3NextRMSNormGated); returned in gate's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight.astype(jnp.float32) * xf.astype(gate.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(gate.dtype)

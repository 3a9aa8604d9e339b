"""The recurrent states of Gated DeltaNet (linear attention) layers, one per sequence slot, beside the pages.

A hybrid model (Qwen3-Next, Qwen3.5: `ModelConfig.has_linear_layers`) keeps no K/V for its linear
layers. Each running sequence owns a *state slot* instead (handed out by the block manager, one per
sequence, freed when it finishes or is preempted), and the cache holds, per linear layer and slot:

    conv       [L_lin, N, K - 1, C]      the last K - 1 inputs of the causal convolution (C = the q | k | v
                                         channels), in the activation dtype
    recurrent  [L_lin, N, Hv, Dk, Dv]    the delta rule's state, float32

N = replicas x (max_num_seqs + 1 + num_prefix_states): each replica's slots one after the other
(split over the replica axes like pages), slot 0 of each replica the scratch slot padding
sequences read and write, then the sequences' slots, then the prefix cache's saved states
(jaxinfer.engine.block_manager). A chunk that starts at position 0 starts from zeros whatever its
slot holds; any other continues from its slot (a prefill in chunks, a decode). Bytes per sequence
are fixed, whatever its length: `LinearState.bytes_per_slot`.

Speculative decoding (`drafts`, `DraftInputs`): a chunk that verifies drafted tokens does not
advance its slot, since some of its tokens may be rejected. Each linear layer keeps instead, per
slot, what the chunk's B = spec_block tokens fed it: the convolution's inputs and the delta
rule's k, v, g and beta. Once the host knows how many tokens were kept,
`commit_drafts` advances each slot by exactly those (a few rank-one updates per layer; no
model weights, no recompute of the target, no state per position).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from pallas_kernels.gated_delta_rule.reference import update


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftInputs:
    """What a verification chunk's B tokens fed each linear layer, per slot (B = spec_block)."""

    conv: jax.Array  # [L_lin, N, B, C] the convolution's inputs, in the activation dtype
    k: jax.Array  # [L_lin, N, B, Hv, Dk] float32 (prepared: l2-normed, repeated to the value heads)
    v: jax.Array  # [L_lin, N, B, Hv, Dv] float32
    g: jax.Array  # [L_lin, N, B, Hv] float32 (log decay)
    beta: jax.Array  # [L_lin, N, B, Hv] float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearState:
    conv: jax.Array  # [L_lin, N, K - 1, C]
    recurrent: jax.Array  # [L_lin, N, Hv, Dk, Dv] float32
    drafts: DraftInputs | None = None  # with speculative decoding: verification chunks' inputs

    @staticmethod
    def shapes(config: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv's shape, recurrent's shape) for num_slots slots."""
        c = config
        channels = 2 * c.linear_key_heads * c.linear_key_head_dim + c.linear_value_heads * c.linear_value_head_dim
        return ((c.num_linear_layers, num_slots, c.linear_conv_kernel - 1, channels),
                (c.num_linear_layers, num_slots, c.linear_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))

    @staticmethod
    def draft_shapes(config: ModelConfig, num_slots: int, spec_block: int) -> DraftInputs:
        """The shapes of `DraftInputs` (a DraftInputs of shape tuples)."""
        (L, N, _, C), (_, _, Hv, Dk, Dv) = LinearState.shapes(config, num_slots)
        return DraftInputs(conv=(L, N, spec_block, C), k=(L, N, spec_block, Hv, Dk), v=(L, N, spec_block, Hv, Dv),
                           g=(L, N, spec_block, Hv), beta=(L, N, spec_block, Hv))

    @staticmethod
    def create(config: ModelConfig, num_slots: int, dtype, sharding=None, spec_block: int = 0) -> "LinearState":
        """Zeroed states for num_slots slots (with `spec_block` > 0 the drafts' inputs too);
        `sharding` (a LinearState of jax Shardings) places each device's part directly."""
        conv, recurrent = LinearState.shapes(config, num_slots)
        drafts = LinearState.draft_shapes(config, num_slots, spec_block) if spec_block else None

        def make():
            inputs = None
            if drafts is not None:
                inputs = DraftInputs(jnp.zeros(drafts.conv, dtype), *(jnp.zeros(getattr(drafts, f), jnp.float32)
                                                                      for f in ("k", "v", "g", "beta")))
            return LinearState(jnp.zeros(conv, dtype), jnp.zeros(recurrent, jnp.float32), inputs)

        return jax.jit(make, out_shardings=sharding)()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype) -> int:
        """One sequence's state bytes, every linear layer."""
        conv, recurrent = LinearState.shapes(config, 1)
        count = lambda shape: int(jnp.prod(jnp.array(shape)))  # noqa: E731
        return count(conv) * jnp.dtype(dtype).itemsize + count(recurrent) * 4

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]


def commit_drafts(state: LinearState, slots: jax.Array, kept: jax.Array) -> LinearState:
    """Advances each slot by the first `kept` tokens of its last verification chunk (`drafts`):
    slots, kept [n] int32 (kept 0: unchanged). The convolution keeps the last K - 1 of its saved
    inputs followed by the kept ones; the recurrent state takes one delta-rule update per token,
    the tokens past `kept` masked to change nothing (g = beta = 0)."""
    d = state.drafts
    K1, B = state.conv.shape[2], d.conv.shape[2]
    inputs = jnp.concatenate([state.conv[:, slots], d.conv[:, slots]], axis=2)  # [L, n, K - 1 + B, C]
    window = kept[:, None] + jnp.arange(K1)[None, :]  # [n, K - 1]: the last K - 1 inputs after `kept` more
    conv = jnp.take_along_axis(inputs, window[None, :, :, None], axis=2)
    recurrent = state.recurrent[:, slots]  # [L, n, Hv, Dk, Dv]
    for j in range(B):  # (B: a few tokens)
        keep = (j < kept)[None, :, None]  # [1, n, 1]
        recurrent = update(d.k[:, slots, j], d.v[:, slots, j], jnp.where(keep, d.g[:, slots, j], 0.0),
                           jnp.where(keep, d.beta[:, slots, j], 0.0), recurrent)
    return dataclasses.replace(state, conv=state.conv.at[:, slots].set(conv.astype(state.conv.dtype)),
                               recurrent=state.recurrent.at[:, slots].set(recurrent))

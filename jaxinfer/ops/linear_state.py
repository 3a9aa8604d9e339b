"""The recurrent states of Gated DeltaNet (linear attention) layers, one per sequence slot, beside the pages.

A hybrid model (Qwen3-Next, Qwen3.5: `ModelConfig.has_linear_layers`) keeps no K/V for its linear
layers. Each running sequence owns a *state slot* instead (handed out by the block manager, one per
sequence, freed when it finishes or is preempted), and the cache holds, per linear layer and slot:

    conv       [L_lin, N, K - 1, C]      the last K - 1 inputs of the causal convolution (C = the q | k | v
                                         channels), in the activation dtype
    recurrent  [L_lin, N, Hv, Dk, Dv]    the delta rule's state, float32

N = replicas x (max_num_seqs + 1): each replica's slots one after the other (split over the
replica axes like pages), slot 0 of each replica the scratch slot padding sequences read and
write. A chunk that starts at position 0 starts from zeros whatever its slot holds; any other
continues from its slot (a prefill in chunks, a decode). Bytes per sequence are fixed, whatever
its length: `LinearState.bytes_per_slot`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearState:
    conv: jax.Array  # [L_lin, N, K - 1, C]
    recurrent: jax.Array  # [L_lin, N, Hv, Dk, Dv] float32

    @staticmethod
    def shapes(config: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv's shape, recurrent's shape) for num_slots slots."""
        c = config
        channels = 2 * c.linear_key_heads * c.linear_key_head_dim + c.linear_value_heads * c.linear_value_head_dim
        return ((c.num_linear_layers, num_slots, c.linear_conv_kernel - 1, channels),
                (c.num_linear_layers, num_slots, c.linear_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))

    @staticmethod
    def create(config: ModelConfig, num_slots: int, dtype, sharding=None) -> "LinearState":
        """Zeroed states for num_slots slots; `sharding` (a jax Sharding, applied to both) places
        each device's part directly."""
        conv, recurrent = LinearState.shapes(config, num_slots)
        make = jax.jit(lambda: LinearState(jnp.zeros(conv, dtype), jnp.zeros(recurrent, jnp.float32)), out_shardings=sharding)
        return make()

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype) -> int:
        """One sequence's state bytes, every linear layer."""
        conv, recurrent = LinearState.shapes(config, 1)
        count = lambda shape: int(jnp.prod(jnp.array(shape)))  # noqa: E731
        return count(conv) * jnp.dtype(dtype).itemsize + count(recurrent) * 4

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

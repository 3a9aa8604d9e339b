"""Rows laid out in blocks of one group each: how the grouped Pallas kernels (the LoRA SGMV of
`lora_sgmv`, the experts' `grouped_matmul`) give every block of rows one matrix to read.

Each row has a slot in [0, num_slots); slot 0 means "no group" (a token with no adapter, an empty
row of an expert-parallel buffer). `group_by_slot` sorts the rows by slot and starts each slot's
group on a block boundary, so every block of `block` rows belongs to one slot (its matrices are
fetched once for the whole block) and slot 0's rows are left out:

    slot       = [2, 0, 1, 2, 2, 1]         block = 2, N = 3 slots: cdiv(6 + 2 x 1, 2) = 4 blocks
    rows       = [2, 5, 0, 3, 4, 6, 6, 6]   row of the input in each grouped row (T = 6: padding)
    block_slot = [1, 2, 2, 0]               slot of each block (0: unused, computes nothing)
    position   = [2, -, 0, 3, 4, 1]         each row's grouped row (slot-0 rows: any, masked on the way back)

The grouped layout has a static number of rows: every group wastes at most block - 1 rows, so
cdiv(T + (N - 1) (block - 1), block) blocks always suffice; the blocks in use come first, those
past the last group have slot 0. Everything here is a handful of [T]- and [N]-sized integer ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Grouping:
    rows: jax.Array  # [num_blocks * block] int32: the token in each grouped row (T: a padding row)
    block_slot: jax.Array  # [num_blocks] int32: each block's slot (0: no token of an adapter)
    position: jax.Array  # [T] int32: each token's grouped row (meaningless for slot 0)

    @property
    def num_blocks(self) -> int:
        return self.block_slot.shape[0]


def num_blocks(num_tokens: int, num_slots: int, block: int) -> int:
    return -(-(num_tokens + (num_slots - 1) * (block - 1)) // block)


def group_by_slot(slot: jax.Array, num_slots: int, block: int) -> Grouping:
    """slot [T] int32 -> the grouped layout (module docstring). Every slot must lie in
    [0, num_slots) (the engine's slots do; values are not checked inside a trace, and one out of
    range would misplace the other tokens)."""
    T = slot.shape[0]
    nb = num_blocks(T, num_slots, block)
    counts = jnp.zeros(num_slots, jnp.int32).at[slot].add(1)  # [N] rows per slot
    padded = (counts + block - 1) // block * block
    padded = padded.at[0].set(0)  # slot 0's tokens get no rows
    group_end = jnp.cumsum(padded)  # [N] row after slot s's group
    group_start = group_end - padded
    order = jnp.argsort(slot, stable=True)  # [T] tokens by slot
    sorted_slot = slot[order]
    rank = jnp.arange(T, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_slot]  # index within its slot
    position = jnp.zeros(T, jnp.int32).at[order].set(group_start[sorted_slot] + rank)
    # slot-0 tokens scatter out of bounds (dropped): their rows stay padding
    rows = jnp.full(nb * block, T, jnp.int32).at[jnp.where(slot > 0, position, nb * block)].set(
        jnp.arange(T, dtype=jnp.int32), mode="drop")
    block_start = jnp.arange(nb, dtype=jnp.int32) * block
    owner = jnp.searchsorted(group_end, block_start, side="right").astype(jnp.int32)  # first group ending after it
    block_slot = jnp.where(owner < num_slots, owner, 0)
    return Grouping(rows, block_slot, position)


def gather_rows(x: jax.Array, grouping: Grouping) -> jax.Array:
    """x [T, K] -> [num_blocks * block, K] in the grouped layout (padding rows: zeros)."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[grouping.rows]


def scatter_back(y: jax.Array, slot: jax.Array, grouping: Grouping) -> jax.Array:
    """y [num_blocks * block, O] grouped -> [T, O] in token order; slot-0 tokens get zeros."""
    return jnp.where((slot > 0)[:, None], y[grouping.position], 0.0).astype(y.dtype)


def used_blocks(grouping: Grouping) -> jax.Array:
    """int32 [1]: how many blocks hold rows (they come first)."""
    return jnp.sum(grouping.block_slot > 0, dtype=jnp.int32).reshape(1)

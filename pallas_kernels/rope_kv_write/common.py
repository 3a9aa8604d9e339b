"""What the TPU and GPU RoPE + KV write kernels share: the wrapper's checks and sizes, the four
outputs a `pallas_call` declares (and which of them the pools alias), and the cost estimate.

Outputs, in this order: q_rot [rows, Hq, D] in q's dtype, k_rot [rows, Hkv, D] in k's dtype, and
the two pools as they came in. `rows` is T for the GPU kernel and T padded to whole token blocks
for the TPU kernel, which slices the padding off q_rot and k_rot afterwards.

The rotation itself is not shared: the TPU kernel rotates whole rows with a lane roll and a
pre-signed sin (no slice at a lane offset of D/2), the GPU kernel the two half rows it loads
separately (Triton cannot slice a tensor in registers). Both compute the reference's rotate-half
RoPE in float32; see their module docstrings.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.experimental import pallas as pl

from pallas_kernels import cost
from pallas_kernels.rope_kv_write.reference import check_inputs, check_pools

Q_ROT, K_ROT, K_POOL, V_POOL = range(4)  # output indices


class Sizes(NamedTuple):
    tokens: int  # T
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D


def check_and_size(q, k, v, cos, sin, k_pages, v_pages, write_page, write_offset) -> Sizes:
    """`reference.check_inputs`, then the sizes the kernels are built for."""
    check_inputs(q, k, v, cos, sin, write_page, write_offset)
    check_pools(k, k_pages, v_pages)
    T, Hq, D = q.shape
    return Sizes(T, Hq, k.shape[1], D)


def check_block_tokens(block_tokens: int, multiple: int = 1) -> None:
    """ValueError unless block_tokens is positive and a multiple of `multiple`."""
    if block_tokens < 1 or block_tokens % multiple:
        what = "positive" if multiple == 1 else f"a positive multiple of {multiple}"
        raise ValueError(f"block_tokens must be {what}; got {block_tokens}")


def out_shape(rows: int, q, k, k_pages, v_pages) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(q_rot, k_rot, k_pages, v_pages) as the `pallas_call` returns them, q_rot and k_rot `rows` long."""
    _, Hq, D = q.shape
    return (
        jax.ShapeDtypeStruct((rows, Hq, D), q.dtype),
        jax.ShapeDtypeStruct((rows, k.shape[1], D), k.dtype),
        jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
    )


def pool_aliases(k_pages_operand: int) -> dict[int, int]:
    """input_output_aliases for a call whose operand `k_pages_operand` is k_pages and the next one
    v_pages: the pools are updated in place (when the caller donates them)."""
    return {k_pages_operand: K_POOL, k_pages_operand + 1: V_POOL}


def cost_estimate(rows: int, q, k, k_pages) -> pl.CostEstimate:
    """`cost.rope_kv_write` for `rows` tokens of these arrays."""
    _, Hq, D = q.shape
    return cost.rope_kv_write(rows, Hq, k.shape[1], D, itemsize=q.dtype.itemsize, pool_itemsize=k_pages.dtype.itemsize)

"""The chunked gated delta rule for one sequence: Pallas kernel for TPU (Mosaic).

Same inputs and result as `reference.chunked` (q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv],
state [Hv, Dk, Dv] -> out [T, Hv, Dv] float32 and the final state); the math of a chunk is
`common.chunk_step`.

How it runs:
- Grid (Hv, chunks): value heads "parallel" (a megacore chip's two TensorCores split them),
  chunks "arbitrary", in order. Step (h, c) reads chunk c of head h (q, k [C, Dk], v [C, Dv], the
  chunk's cumulative decays and rates as [1, C] rows) and writes its outputs [C, Dv]. The state
  [Dk, Dv] float32 lives in a VMEM scratch: read from the input at c = 0, carried from chunk to
  chunk, written to the final-state output (its block resident for the head) after the last.
- The wrapper pads T to a multiple of C with tokens that change nothing (g = 0, beta = 0, k = 0)
  and sums g within each chunk (G); G and beta go in as [Hv, chunks, 1, C] (a whole-dims block
  per step). The kernel turns the rows into columns [C, 1] by a masked lane sum of their
  broadcast square: no transpose, no matmul.
- Layout: with Dk and Dv multiples of 128 (Qwen3.5 and Qwen3-Next: 128) q, k, v and the output
  are read as [T, Hv * D] and a step's block is the lane-aligned column block of head h
  ([C, 128]): no transpose. (On a TPU's tiled HBM layout [T, Hv, D] -> [T, Hv * D] is still a
  relayout, which XLA does, or fuses into the ops that produce q, k, v; a block of one head out of
  [T, Hv, D] would cut the (8, 128) tiles, which Mosaic refuses.) Other head sizes (tiny test
  models) are transposed to [Hv, T, D], whose blocks [C, D] span the last dimension whole.

VMEM per step (C = 64, Dk = Dv = 128, float32): q, k, v, out blocks 32 KiB each, double
buffered; the state in, out and scratch 64 KiB each (in and out double buffered); the chunk's
[C, C] and [C, D] temporaries a few hundred KiB: under 1 MiB, far inside every chip's limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.gated_delta_rule import common
from pallas_kernels.tpu_chip import compiler_params

LANES = 128


def _as_column(row):
    """[1, C] -> [C, 1]: the diagonal of the row broadcast to [C, C], summed over the lanes."""
    C = row.shape[1]
    square = jnp.broadcast_to(row, (C, C))
    diagonal = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) == jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    return jnp.sum(jnp.where(diagonal, square, 0.0), axis=1, keepdims=True)


def _kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, state_ref, out_ref, final_ref, S_ref):
    # q_ref, k_ref [C, Dk]; v_ref, out_ref [C, Dv]; G_ref, beta_ref [1, C]; state_ref, final_ref, S_ref [Dk, Dv]
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        S_ref[...] = state_ref[...].astype(jnp.float32)

    G_row = G_ref[...]  # [1, C]
    C = G_row.shape[1]
    last = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1) == C - 1
    G_last = jnp.sum(jnp.where(last, G_row, 0.0), axis=1, keepdims=True)  # [1, 1]
    f32 = lambda ref: ref[...].astype(jnp.float32)  # noqa: E731
    out, S = common.chunk_step(f32(q_ref), f32(k_ref), f32(v_ref), _as_column(G_row), G_row, G_last,
                               _as_column(beta_ref[...]), S_ref[...])
    out_ref[...] = out
    S_ref[...] = S

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        final_ref[...] = S


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"))
def chunked(q, k, v, g, beta, state, chunk_size: int = 64, *, interpret: bool = False):
    """(out [T, Hv, Dv] float32, the final state [Hv, Dk, Dv] float32): `reference.chunked`.
    chunk_size: a power of two, at least 8 (one sublane tile)."""
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    if C < 8 or C & (C - 1):
        raise ValueError(f"chunk_size={C}: the TPU kernel takes a power of two >= 8")
    if interpret:
        patch_interpret_mode()
    q, k, v, g, beta = common.pad_tokens(C, q, k, v, g, beta)
    Tp = q.shape[0]
    n = Tp // C
    G, beta = common.chunk_gates(g, beta, C)
    gate_rows = lambda a: a.T.reshape(H, n, 1, C)  # noqa: E731  [T, H] -> [H, chunks, 1, C]
    in_lanes = Dk % LANES == 0 and Dv % LANES == 0
    if in_lanes:  # [T, H * D], head h's chunk c: the column block (c, h)
        tokens = lambda a: a.reshape(Tp, -1)  # noqa: E731
        block = lambda D: pl.BlockSpec((C, D), lambda h, c: (c, h))  # noqa: E731
        out_shape = jax.ShapeDtypeStruct((Tp, H * Dv), jnp.float32)
    else:  # [H, T, D]
        tokens = lambda a: a.swapaxes(0, 1)  # noqa: E731
        block = lambda D: pl.BlockSpec((None, C, D), lambda h, c: (h, c, 0))  # noqa: E731
        out_shape = jax.ShapeDtypeStruct((H, Tp, Dv), jnp.float32)
    gates = pl.BlockSpec((None, None, 1, C), lambda h, c: (h, c, 0, 0))
    whole_state = pl.BlockSpec((None, Dk, Dv), lambda h, c: (h, 0, 0))
    out, final = pl.pallas_call(
        _kernel,
        grid=(H, n),
        in_specs=[block(Dk), block(Dk), block(Dv), gates, gates, whole_state],
        out_specs=[block(Dv), whole_state],
        out_shape=[out_shape, jax.ShapeDtypeStruct((H, Dk, Dv), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((Dk, Dv), jnp.float32)],
        compiler_params=compiler_params("parallel", "arbitrary"),
        cost_estimate=common.cost(Tp, H, Dk, Dv, C),
        interpret=interpret,
        name="gated_delta_rule_chunked",
    )(tokens(q), tokens(k), tokens(v), gate_rows(G), gate_rows(beta), state)
    out = out.reshape(Tp, H, Dv) if in_lanes else out.swapaxes(0, 1)
    return out[:T], final

"""The chunked gated delta rule for one sequence: Pallas kernel for GPU (Triton lowering).

Same inputs and result as `reference.chunked` (q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv],
state [Hv, Dk, Dv] -> out [T, Hv, Dv] float32 and the final state); the math of a chunk is
`common.chunk_step`.

Verification status: checked in Pallas interpret mode on the CPU and compiled for an H100 by the
CUDA plugin (jaxinfer.aot.kernel_check); never run on a GPU: expect to tune block_v and num_warps.

How it runs:
- Grid (Hv, Dv / block_v): one program per value head and block of value columns, all parallel.
  The state's columns never mix (new_v = u - w S, out = q S + ..., S += k^T new_v, column by
  column), so a program owns S[:, its columns] ([Dk, block_v] float32, in registers) and walks the
  head's chunks in order with a `lax.fori_loop`: each iteration loads chunk c's q, k [C, Dk], its
  v columns [C, block_v] and gates, computes the chunk's matrices (recomputed by each of a head's
  Dv / block_v programs: cheaper than a pass through HBM) and writes its outputs.
- The arrays stay in the model's layout: q, k, v and the output as [T, Hv * D] (head h's columns
  h * D ... ), read whole (no BlockSpec) at offsets; the gates as [T, Hv] columns ([C, 1] per
  chunk) and, transposed by the wrapper, [Hv, T] rows ([1, C]). T is padded to a multiple of C with
  tokens that change nothing (g = 0, beta = 0, k = 0) and g summed within each chunk (G).
- Triton's blocks are powers of two of at least 16: Dk and Dv are padded with zero columns to one
  (their zero state rows and output columns stay zero and are cut off); C must be one.
- Every product is float32 ("ieee", not TF32: the UT inverse multiplies errors up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.gated_delta_rule import common
from pallas_kernels.ragged_paged_attention.gpu import triton_dim

# Untuned (no GPU at hand); chosen by what the H100 compile takes: 32 value columns per program (4
# programs per head of 128: 128 programs for Qwen3-Next's 32 heads, on 132 SMs) and 16 warps
# compile in ~6 s; 8 warps in ~13 s, 4 warps with 64 columns ~45 s (ptxas on a register-starved
# program: float32 tiles of [64, 128] are 16 registers a thread at 16 warps, 64 at 4).
DEFAULT_BLOCK_V = 32
DEFAULT_NUM_WARPS = 16


def _kernel(q_ref, k_ref, v_ref, G_ref, G_rows_ref, beta_ref, state_ref, out_ref, final_ref, *, Dk, Dv, block_v,
            chunk, num_chunks):
    # q_ref, k_ref [T, Hv * Dk]; v_ref, out_ref [T, Hv * Dv]; G_ref, beta_ref [T, Hv]; G_rows_ref [Hv, T];
    # state_ref, final_ref [Hv * Dk, Dv] (Dk, Dv: padded to powers of two)
    h, j = pl.program_id(0), pl.program_id(1)
    keys = pl.ds(h * Dk, Dk)  # head h's key columns of q and k, its state rows
    values = pl.ds(h * Dv + j * block_v, block_v)  # this program's value columns of v and the output
    state_columns = pl.ds(j * block_v, block_v)
    head = pl.ds(h, 1)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def one_chunk(c, S):  # S [Dk, block_v]
        rows = pl.ds(c * chunk, chunk)
        out, S = common.chunk_step(
            f32(q_ref[rows, keys]), f32(k_ref[rows, keys]), f32(v_ref[rows, values]),
            G_ref[rows, head],  # [C, 1]
            G_rows_ref[head, rows],  # [1, C]
            G_ref[pl.ds(c * chunk + chunk - 1, 1), head],  # [1, 1]: the chunk's whole decay
            beta_ref[rows, head], S)
        out_ref[rows, values] = out
        return S

    final_ref[keys, state_columns] = jax.lax.fori_loop(0, num_chunks, one_chunk, f32(state_ref[keys, state_columns]))


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_v", "num_warps", "num_stages", "interpret"))
def chunked(q, k, v, g, beta, state, chunk_size: int = 64, *, block_v: int = DEFAULT_BLOCK_V,
            num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = 1, interpret: bool = False):
    """(out [T, Hv, Dv] float32, the final state [Hv, Dk, Dv] float32): `reference.chunked`.
    chunk_size: a power of two >= 16; block_v: value columns per program (a power of two, capped
    at the padded Dv); num_warps / num_stages: to Triton."""
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size={C}: the Triton kernel takes a power of two >= 16")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v}: a power of two >= 16")
    if interpret:
        patch_interpret_mode()
    Dkp, Dvp = triton_dim(Dk), triton_dim(Dv)
    BV = min(block_v, Dvp)
    q, k, v, g, beta = common.pad_tokens(C, q, k, v, g, beta)
    Tp = q.shape[0]
    pad_last = lambda a, D: a if a.shape[-1] == D else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, D - a.shape[-1])])  # noqa: E731
    q, k, v = (pad_last(a, D).reshape(Tp, H * D) for a, D in ((q, Dkp), (k, Dkp), (v, Dvp)))
    state = pad_last(jnp.pad(state, ((0, 0), (0, Dkp - Dk), (0, 0))), Dvp).reshape(H * Dkp, Dvp)
    G, beta = common.chunk_gates(g, beta, C)
    kernel = functools.partial(_kernel, Dk=Dkp, Dv=Dvp, block_v=BV, chunk=C, num_chunks=Tp // C)
    out, final = pl.pallas_call(
        kernel,
        grid=(H, Dvp // BV),
        out_shape=[jax.ShapeDtypeStruct((Tp, H * Dvp), jnp.float32), jax.ShapeDtypeStruct((H * Dkp, Dvp), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=common.cost(Tp, H, Dkp, Dvp, C, programs_per_head=Dvp // BV),
        interpret=interpret,
        name="gated_delta_rule_chunked",
    )(q, k, v, G, G.T, beta, state)
    out = out.reshape(Tp, H, Dvp)[:T, :, :Dv]
    return out, final.reshape(H, Dkp, Dvp)[:, :Dk, :Dv]

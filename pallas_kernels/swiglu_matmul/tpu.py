"""SwiGLU matmul as a Pallas TPU (Mosaic) kernel: gate and up accumulate side by side in VMEM.

Same inputs and result as `reference.swiglu_matmul` (read its docstring for the semantics):

    out [M, N] = silu(x @ w_gate_up[:, :N]) * (x @ w_gate_up[:, N:])        (in x's dtype)

Grid and memory
---------------
grid = (Mp // bm, N // bn, K // bk), K innermost ("arbitrary": it is the reduction; the other two
are "parallel", split between the TensorCores of a megacore chip). Step (i, j, k) reads

* the x block [bm, bk] at (i, k);
* the gate block [bk, bn] of w_gate_up at block index (k, j), columns j*bn .. (j+1)*bn - 1;
* the up block [bk, bn] of the same array at block index (k, j + N // bn), the same columns + N.

w_gate_up is passed twice, as two operands with their own BlockSpecs, so the pipeline copies both
tiles HBM -> VMEM (double-buffered) straight from the one array: no [K, N] half is ever sliced out
in HBM. Two float32 [bm, bn] VMEM scratch accumulators hold g and u: zeroed at k == 0
(`pl.when`), and at the last K step silu(g) * u is computed in float32 and written to the output
block [bm, bn] at (i, j). Each weight byte is read once per row block of x (once in decode).

* M (the token count, 1..8 rows in decode) is padded in the wrapper to a multiple of bm, which is
  rounded up to the sublane tile (8 rows for f32, 16 for bf16). Padding x costs M x K, nothing.
* N is never padded (that would copy the weight), and a partial block is impossible here: an up
  block must start exactly at column N, so bn divides N. bn is the largest multiple of 128 (the
  lane width) dividing N that is <= block_n; when N is not a multiple of 128 there is none and
  the wrapper raises ValueError (the model then takes the unfused matmul + swiglu path).
* K is the reduction, so a partial block would add garbage: bk is the largest multiple of 128
  dividing K that is <= block_k, else all of K (a block equal to the full dim is always legal).

VMEM per step with the defaults (bm = 128, bn = 256, bk = 512) and b bytes per element:
2 x bm x bk x b (x) + 2 operands x 2 buffers x bk x bn x b (weight) + 2 x bm x bn x b (out)
+ 2 x bm x bn x 4 (accumulators): 1.6 MiB for bf16, 3.0 MiB for f32, well inside the 16 MiB
scoped-VMEM default of v4/v5e.

x is cast to the weight's dtype in the wrapper (as `layers.matmul` casts it); bf16 tiles go to the
MXU with f32 accumulation, f32 tiles at Precision.HIGHEST (full f32, not one bf16 pass).

Verified on the CPU with `interpret=True` only (no TPU here), and lowered to Mosaic for "tpu";
pass `interpret=True` or a `pltpu.InterpretParams()` to run it there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.swiglu_matmul import common
from pallas_kernels.swiglu_matmul.reference import check_inputs
from pallas_kernels.tpu_chip import compiler_params, mxu_columns

LANES = 128  # TPU vreg lane width: the minor dim of a block is a multiple of this, or the whole dim


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _largest_block(size: int, limit: int, multiple: int) -> int | None:
    """Largest multiple of `multiple` that divides `size` and is <= limit; None if there is none."""
    for b in range(limit - limit % multiple, 0, -multiple):
        if size % b == 0:
            return b
    return None


def _swiglu_kernel(x_ref, gate_ref, up_ref, out_ref, gate_acc_ref, up_acc_ref):
    """x_ref [bm, bk], gate_ref / up_ref [bk, bn] (two windows on w_gate_up), out_ref [bm, bn],
    gate_acc_ref / up_acc_ref [bm, bn] f32."""
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _init():
        gate_acc_ref[...] = jnp.zeros_like(gate_acc_ref)
        up_acc_ref[...] = jnp.zeros_like(up_acc_ref)

    x = x_ref[...]  # [bm, bk]
    gate_acc_ref[...] += common.dot(x, gate_ref[...])  # [bm, bn]
    up_acc_ref[...] += common.dot(x, up_ref[...])  # [bm, bn]

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _finalize():
        out_ref[...] = (jax.nn.silu(gate_acc_ref[...]) * up_acc_ref[...]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def swiglu_matmul(
    x: jax.Array,  # [M, K]
    w_gate_up: jax.Array,  # [K, 2N] = [gate | up]
    *,
    block_m: int = 128,
    block_n: int | None = None,  # default: twice the chip's MXU width (256 on v5e / v5p, 512 on v6e)
    block_k: int = 512,
    interpret=False,  # False on TPU; True or pltpu.InterpretParams() elsewhere
) -> jax.Array:  # [M, N] in x's dtype
    N = check_inputs(x, w_gate_up)
    block_n = block_n or 2 * mxu_columns()
    if block_m < 1 or block_n < LANES or block_k < 1:
        raise ValueError(f"block sizes must be positive and block_n at least {LANES}, got {block_m, block_n, block_k}")
    M, K = x.shape
    bn = _largest_block(N, block_n, LANES)
    if bn is None:
        raise ValueError(f"N = {N} (half of w_gate_up's {2 * N} columns) must be a multiple of {LANES} for the TPU kernel")
    bk = _largest_block(K, block_k, LANES) or K
    if interpret:
        patch_interpret_mode()

    out_dtype = x.dtype
    x = x.astype(w_gate_up.dtype)  # as layers.matmul: the dot runs in the weight's dtype
    sublanes = 8 * 4 // x.dtype.itemsize  # rows per vreg: 8 for f32, 16 for bf16
    bm = _round_up(min(block_m, M), sublanes)
    Mp = _round_up(M, bm)
    x = jnp.pad(x, ((0, Mp - M), (0, 0)))  # [Mp, K], zero rows
    n_blocks = N // bn  # up block j sits n_blocks blocks to the right of gate block j

    out = pl.pallas_call(
        _swiglu_kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(Mp // bm, n_blocks, K // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),  # x
                pl.BlockSpec((bk, bn), lambda i, j, k: (k, j)),  # gate columns of w_gate_up
                pl.BlockSpec((bk, bn), lambda i, j, k: (k, j + n_blocks)),  # up columns of w_gate_up
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32), pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        cost_estimate=common.cost_estimate(M, K, N, w_dtype=w_gate_up.dtype, out_dtype=out_dtype),
        name="swiglu_matmul",
    )(x, w_gate_up, w_gate_up)
    return out[:M]

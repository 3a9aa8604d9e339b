"""Residual add + RMSNorm: Pallas kernel for TPU (Mosaic).

Same inputs and result as `reference.add_rms_norm` (read its docstring for the semantics).

How it runs:
- Grid (row blocks,), "parallel" (the two TensorCores of a megacore chip split it). Step i takes
  rows [i * block_rows, (i + 1) * block_rows) of x and residual into VMEM, whole rows: the norm
  needs all H values of a row, and H is the full last dim, so any H is a legal block width.
- The weight is one [1, H] block whose index never changes, so the pipeline copies it once.
- The kernel adds, writes the sum, and normalises it in float32; both outputs go back to HBM
  through their own [block_rows, H] blocks. Each input byte is read once, each output written once.
- Without a residual the kernel reads only x and writes only `normed`; x is returned as the new
  residual, so no copy is written.
- T need not be a multiple of block_rows: the last block is partial. Rows are independent, so the
  rows past T that block holds only produce values that are never written back. When T is smaller
  than block_rows the block is T rows (a block equal to the full dim is always legal).

VMEM per grid step (B = block_rows, b = bytes per element of x):
    4 arrays (x, residual, normed, new_residual) x 2 pipeline buffers x B x H x b
  + about 3 float32 temporaries (the sum, the normalised rows, the weighted rows): 3 x B x H x 4
For H = 8192 that is 229 KiB per row in bf16 and 352 KiB in float32. `default_block_rows` takes
the largest power of two up to 256 that keeps this under 12 MiB, below the 16 MiB scoped-VMEM
default of v4/v5e (v6e has 32 MiB): 32 rows at H = 8192 (7.2 MiB bf16, 11 MiB f32), 256 rows at
H = 576 (4 MiB bf16). The op is memory bound; blocks of 32+ rows keep each DMA large.
Row blocks are a multiple of 8 sublanes (16 for bf16, whose rows pack two to a sublane), checked
unless interpreting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.fused_rms_norm import common
from pallas_kernels.fused_rms_norm.reference import check_inputs
from pallas_kernels.tpu_chip import compiler_params

VMEM_BUDGET_BYTES = 12 * 2**20
MAX_BLOCK_ROWS = 256


def _add_norm_kernel(x_ref, residual_ref, weight_ref, normed_ref, new_residual_ref, *, eps):
    # x_ref, residual_ref, normed_ref, new_residual_ref: [B, H]; weight_ref: [1, H]
    s = x_ref[...] + residual_ref[...]  # [B, H], rounded to x's dtype like the unfused model
    new_residual_ref[...] = s
    normed_ref[...] = common.normalize(s, weight_ref[...], hidden=s.shape[-1], eps=eps)


def _norm_kernel(x_ref, weight_ref, normed_ref, *, eps):
    normed_ref[...] = common.normalize(x_ref[...], weight_ref[...], hidden=x_ref.shape[-1], eps=eps)


def min_block_rows(dtype) -> int:
    """Rows in one (8, 128) 32-bit tile for this dtype: 8 for float32, 16 for bf16."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def default_block_rows(hidden: int, dtype) -> int:
    """Largest power-of-two row block (at most 256) whose VMEM use stays under VMEM_BUDGET_BYTES."""
    bytes_per_row = hidden * (4 * 2 * jnp.dtype(dtype).itemsize + 3 * 4)  # see the module docstring
    rows = MAX_BLOCK_ROWS
    while rows > min_block_rows(dtype) and rows * bytes_per_row > VMEM_BUDGET_BYTES:
        rows //= 2
    return rows


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "interpret"))
def add_rms_norm(
    x: jax.Array,  # [T, H]
    residual: jax.Array | None,  # [T, H], x's dtype
    weight: jax.Array,  # [H]
    *,
    eps: float,
    block_rows: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # normed [T, H], new_residual [T, H], both x's dtype
    check_inputs(x, residual, weight)
    T, H = x.shape
    if block_rows is None:
        block_rows = default_block_rows(H, x.dtype)
    row_multiple = 1 if interpret else min_block_rows(x.dtype)
    if block_rows <= 0 or block_rows % row_multiple:
        raise ValueError(f"block_rows must be a positive multiple of {row_multiple}; got {block_rows}")
    if interpret:
        patch_interpret_mode()
    block_rows = min(block_rows, T)  # a block as tall as the whole array is always legal

    return common.call(
        x, residual, weight.reshape(1, H),  # [1, H]: TPU blocks are at least 2-D
        norm_kernel=functools.partial(_norm_kernel, eps=eps),
        add_norm_kernel=functools.partial(_add_norm_kernel, eps=eps),
        rows=pl.BlockSpec((block_rows, H), lambda i: (i, 0)),  # [block_rows, H]
        whole_weight=pl.BlockSpec((1, H), lambda i: (0, 0)),  # [1, H], the same block every step
        pallas_call=functools.partial(
            pl.pallas_call,
            grid=(pl.cdiv(T, block_rows),),
            compiler_params=compiler_params("parallel"),
            interpret=interpret,
        ),
    )

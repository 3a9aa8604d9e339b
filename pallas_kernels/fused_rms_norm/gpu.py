"""Residual add + RMSNorm: Pallas kernel for GPU (Triton lowering).

Same inputs and result as `reference.add_rms_norm` (read its docstring for the semantics).

Verification status: checked only in Pallas interpret mode on the CPU. It uses the Triton
lowering because Mosaic GPU has no interpret mode in this JAX (0.10.2), and no GPU was available
to compile or time it; expect to tune block_rows and num_warps on hardware.

How it runs:
- Grid (row blocks,). A program owns rows [i * block_rows, (i + 1) * block_rows) and loads them
  whole as one [block_rows, H_pad] tile: the norm needs every value of a row.
- Triton tiles must have power-of-two sides, so H is padded to H_pad = next power of two (576 ->
  1024 for SmolLM2) and block_rows must be a power of two. The BlockSpecs ask for the padded
  block; every load and store is masked to columns < H and rows < T, and masked loads give 0, so
  the padding adds nothing to the sum of squares. The mean divides by the true H.
- Each program reads x and residual once, writes the sum, then normalises it in float32 and
  writes the result: one pass over HBM. Without a residual it reads x and writes only `normed`;
  x is returned as the new residual.

Registers and shared memory (per program; Triton keeps the tile in registers and uses shared
memory only for the row reduction): a [block_rows, H_pad] tile holds E = block_rows * H_pad values,
and about 3 float32 copies of it are live at once (the sum, the normalised rows, the weighted
rows), 12 * E bytes. The defaults aim at E = 4096 (block_rows = max(1, 4096 // H_pad), so one row
per program from H_pad = 4096 up) and give one warp per 512 values, at most 16 warps: H = 8192 is
one row per program, 8192 values over 512 threads = 16 per thread per tile, about 48 f32
registers for the tile copies, well inside the 255-register limit and the 256 KiB register file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.fused_rms_norm import common
from pallas_kernels.fused_rms_norm.reference import check_inputs

TILE_VALUES = 4096  # target values per program tile, block_rows * H_pad
VALUES_PER_WARP = 512
MAX_WARPS = 16


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _tile_masks(block_rows, hidden_pad, *, num_rows, hidden):
    """(in_tile [block_rows, H_pad], in_row [H_pad]): which tile entries are real data."""
    row = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [block_rows]
    in_row = jnp.arange(hidden_pad, dtype=jnp.int32) < hidden  # [H_pad]
    return (row < num_rows)[:, None] & in_row[None, :], in_row


def _add_norm_kernel(x_ref, residual_ref, weight_ref, normed_ref, new_residual_ref, *, num_rows, hidden, eps):
    # x_ref, residual_ref, normed_ref, new_residual_ref: [block_rows, H_pad]; weight_ref: [H_pad]
    in_tile, in_row = _tile_masks(*x_ref.shape, num_rows=num_rows, hidden=hidden)
    s = plt.load(x_ref, mask=in_tile, other=0) + plt.load(residual_ref, mask=in_tile, other=0)  # x's dtype
    plt.store(new_residual_ref, s, mask=in_tile)
    weight = plt.load(weight_ref, mask=in_row, other=0)  # [H_pad]
    plt.store(normed_ref, common.normalize(s, weight, hidden=hidden, eps=eps), mask=in_tile)


def _norm_kernel(x_ref, weight_ref, normed_ref, *, num_rows, hidden, eps):
    in_tile, in_row = _tile_masks(*x_ref.shape, num_rows=num_rows, hidden=hidden)
    s = plt.load(x_ref, mask=in_tile, other=0)
    weight = plt.load(weight_ref, mask=in_row, other=0)
    plt.store(normed_ref, common.normalize(s, weight, hidden=hidden, eps=eps), mask=in_tile)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def add_rms_norm(
    x: jax.Array,  # [T, H]
    residual: jax.Array | None,  # [T, H], x's dtype
    weight: jax.Array,  # [H]
    *,
    eps: float,
    block_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # normed [T, H], new_residual [T, H], both x's dtype
    check_inputs(x, residual, weight)
    T, H = x.shape
    H_pad = _next_power_of_two(H)
    if block_rows is None:
        block_rows = max(1, TILE_VALUES // H_pad)
    if not _is_power_of_two(block_rows):
        raise ValueError(f"block_rows must be a power of two; got {block_rows}")
    block_rows = min(block_rows, _next_power_of_two(T))  # no wasted rows when T is small
    if num_warps is None:
        num_warps = min(MAX_WARPS, max(1, block_rows * H_pad // VALUES_PER_WARP))
    if interpret:
        patch_interpret_mode()

    options = dict(num_rows=T, hidden=H, eps=eps)
    return common.call(
        x, residual, weight,
        norm_kernel=functools.partial(_norm_kernel, **options),
        add_norm_kernel=functools.partial(_add_norm_kernel, **options),
        rows=pl.BlockSpec((block_rows, H_pad), lambda i: (i, 0)),  # [block_rows, H_pad], masked to [.., H]
        whole_weight=pl.BlockSpec((H_pad,), lambda i: (0,)),  # [H_pad], masked to [H]
        pallas_call=functools.partial(
            pl.pallas_call,
            grid=(pl.cdiv(T, block_rows),),
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
        ),
    )

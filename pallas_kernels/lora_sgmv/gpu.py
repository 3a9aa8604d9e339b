"""The LoRA delta as two grouped Pallas GPU kernels (Triton lowering), after punica's SGMV: shrink
(x A) and expand ((x A) B), each reading one adapter's matrices per block of tokens.

Same inputs and result as `reference.lora_delta`, and the same grouped layout as the TPU kernels
(`common.group_by_slot`, `tpu.py`'s docstring): the tokens sorted by slot into blocks of 16 rows
(the smallest tile a tensor-core dot takes), one slot per block, slot 0's tokens left out.

Shrink: grid (nb,); program i loads its block's slot from `block_slot` (a plain int32 input: the
Triton lowering has no scalar prefetch) and walks K in a `fori_loop` of bk-column steps, adding
x's tile [16, bk] times A[slot]'s tile [bk, PRp] to a float32 accumulator in registers; PRp is
P R rounded up to a power of two (at least 16), the columns past P R masked to zero on load and
left out on store. A block of slot 0 runs no step and stores zeros.

Expand, once per module p: grid (nb, cdiv(O_p, bn)); program (i, j) multiplies xa_p's tile
[16, Rp] by B_p[slot]'s tile [Rp, bn] (Rp: R rounded up the same way, masked) and stores the
float32 product [16, bn] (columns past O_p masked). A block of slot 0 stores zeros.

All tiles are masked loads from whole arrays (no BlockSpec), so nothing needs to divide its block.
f32 stacks use Precision.HIGHEST (IEEE f32, not TF32).

Verified on the CPU in interpret mode, and compiled by the real Triton compiler for an H100
(`python -m jaxinfer.aot.kernel_check --target h100 --kernel lora_sgmv_shrink --kernel lora_sgmv_expand`);
not run on a GPU (none lent to this work).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.lora_sgmv import common
from pallas_kernels.lora_sgmv.reference import check_inputs
from pallas_kernels.triton_tiles import masked_tile

BLOCK = 16  # rows per block: the smallest tensor-core dot tile


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _store(ref, value, row_start, col_start, cols: int):
    """Stores value [n_rows, n_cols] at (row_start, col_start), columns past `cols` left out."""
    n_rows, n_cols = value.shape
    mask = jnp.broadcast_to((col_start + jnp.arange(n_cols) < cols)[None, :], value.shape)
    plt.store(ref.at[pl.ds(row_start, n_rows), pl.ds(col_start, n_cols)], value.astype(ref.dtype), mask=mask)


def _shrink_kernel(block_slot_ref, x_ref, a_ref, out_ref, *, bk: int, prp: int):
    """x_ref [rows, K] grouped, a_ref [N, K, PR], out_ref [rows, PR] (whole arrays)."""
    i = pl.program_id(0)
    slot = block_slot_ref[i]
    K, PR = a_ref.shape[1], a_ref.shape[2]
    row0 = i * BLOCK

    def k_step(step, acc):  # acc [BLOCK, prp] f32
        k0 = step * bk
        x = masked_tile(x_ref, x_ref.shape[0], K, row0, k0, BLOCK, bk)  # [BLOCK, bk]
        a = masked_tile(a_ref, K, PR, k0, 0, bk, prp, lead=slot)  # [bk, prp] of the block's adapter
        return acc + common.dot(x, a)

    @pl.when(slot != 0)
    def _product():
        acc = jax.lax.fori_loop(0, pl.cdiv(K, bk), k_step, jnp.zeros((BLOCK, prp), jnp.float32))
        _store(out_ref, acc, row0, 0, PR)

    @pl.when(slot == 0)
    def _nothing():
        _store(out_ref, jnp.zeros((BLOCK, prp), jnp.float32), row0, 0, PR)


def _expand_kernel(block_slot_ref, xa_ref, b_ref, out_ref, *, rp: int, bn: int):
    """xa_ref [rows, R] grouped, b_ref [N, R, O], out_ref [rows, O] f32 (whole arrays)."""
    i, j = pl.program_id(0), pl.program_id(1)
    slot = block_slot_ref[i]
    R, O = b_ref.shape[1], b_ref.shape[2]
    row0, col0 = i * BLOCK, j * bn

    @pl.when(slot != 0)
    def _product():
        xa = masked_tile(xa_ref, xa_ref.shape[0], R, row0, 0, BLOCK, rp)  # [BLOCK, rp]
        b = masked_tile(b_ref, R, O, 0, col0, rp, bn, lead=slot)  # [rp, bn] of the block's adapter
        _store(out_ref, common.dot(xa, b), row0, col0, O)

    @pl.when(slot == 0)
    def _nothing():
        _store(out_ref, jnp.zeros((BLOCK, bn), jnp.float32), row0, col0, O)


def sgmv_shrink(x, a, block_slot, *, block_k: int = 64, num_warps: int = 4, interpret=False) -> jax.Array:
    """x [nb * 16, K] grouped, a [N, K, PR], block_slot [nb] -> [nb * 16, PR] in a's dtype."""
    rows, K = x.shape
    nb, PR = block_slot.shape[0], a.shape[2]
    return pl.pallas_call(
        functools.partial(_shrink_kernel, bk=block_k, prp=_pow2_at_least_16(PR)),
        out_shape=jax.ShapeDtypeStruct((rows, PR), a.dtype),
        grid=(nb,),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret,
        cost_estimate=common.cost_estimate(rows, K, PR, matrices_read=nb, itemsize=a.dtype.itemsize,
                                           out_itemsize=a.dtype.itemsize),
        name="lora_sgmv_shrink",
    )(block_slot, x.astype(a.dtype), a)


def sgmv_expand(xa, b, block_slot, *, block_n: int = 128, num_warps: int = 4, interpret=False) -> jax.Array:
    """xa [nb * 16, R] grouped, b [N, R, O], block_slot [nb] -> float32 [nb * 16, O]."""
    rows, R = xa.shape
    nb, O = block_slot.shape[0], b.shape[2]
    return pl.pallas_call(
        functools.partial(_expand_kernel, rp=_pow2_at_least_16(R), bn=block_n),
        out_shape=jax.ShapeDtypeStruct((rows, O), jnp.float32),
        grid=(nb, pl.cdiv(O, block_n)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        cost_estimate=common.cost_estimate(rows, R, O, matrices_read=nb, itemsize=b.dtype.itemsize,
                                           out_itemsize=4),
        name="lora_sgmv_expand",
    )(block_slot, xa.astype(b.dtype), b)


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "interpret"))
def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array, *, block_k: int = 64, block_n: int = 128,
               interpret=False) -> jax.Array:
    """See the module docstring. block_k / block_n: the K step of the shrink, the O_p tile of the
    expand (powers of two >= 16)."""
    for name, b in (("block_k", block_k), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    _, R = check_inputs(x, a, bs, slot)
    if interpret:
        patch_interpret_mode()
    grouping = common.group_by_slot(slot.astype(jnp.int32), a.shape[0], BLOCK)
    xa = sgmv_shrink(common.gather_rows(x, grouping), a, grouping.block_slot, block_k=block_k, interpret=interpret)
    y = jnp.concatenate([
        sgmv_expand(xa[:, p * R : (p + 1) * R], b, grouping.block_slot, block_n=block_n, interpret=interpret)
        for p, b in enumerate(bs)
    ], axis=-1)
    return common.scatter_back(y, slot, grouping)

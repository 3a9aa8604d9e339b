"""The LoRA delta as two grouped Pallas TPU (Mosaic) kernels, after punica's SGMV: shrink (x A) and
expand ((x A) B), each reading one adapter's matrices per block of tokens.

Same inputs and result as `reference.lora_delta` (read its docstring for the semantics):

    lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T]) -> float32 [T, sum O_p]

Unlike the XLA path's dense form (`xla.py`), the work follows the adapters the tokens use, not the
table's size: tokens with no adapter (slot 0) cost nothing. B is read once per run of blocks of
one slot; A once per block (K is the shrink's inner grid axis; A is K x P R, small next to x's
block rows times K).

Layout
------
`common.group_by_slot` sorts the tokens by slot into blocks of `block` rows, one slot per block
(a slot's group starts on a block boundary); `block_slot` [nb] goes to the kernels as a scalar
prefetch (SMEM), so each BlockSpec's index map picks the block's adapter. The grouped x [nb * block,
K] is gathered in XLA (T x K values, as much as reading x once).

Shrink: grid (nb, K // bk), K innermost ("arbitrary": the reduction). Step (i, k) reads x's block
[block, bk] at (i, k) and A[block_slot[i]]'s block [bk, P R] at (k, 0), and adds their product to
a float32 [block, P R] VMEM accumulator, written out in the stacks' dtype at the last k. Blocks of
slot 0 skip the product (zeros out) and keep their K block index at 0, so the pipeline fetches
no new A block for them (only x's tile moves).

Expand, once per module p: grid (O_p // bn, nb), blocks innermost, so consecutive blocks of one
slot reuse the B block already in VMEM (the pipeline skips a copy whose block index is unchanged).
Step (j, i) reads xa_p's block [block, R] at (i, 0) and B_p[block_slot[i]]'s block [R, bn] at
(0, j) and writes the float32 product [block, bn] at (i, j).

Blocks: `block` is a sublane tile (8 rows for float32 stacks, 16 for bf16), so a decode batch
spread over many adapters wastes at most block - 1 rows per adapter. bk is the largest multiple of
128 dividing K up to block_k (2048), else all of K; bn the largest multiple of 128 dividing O_p
up to block_n (2048: few column steps, the [R, bn] B block is small), else all of O_p (a block
equal to the whole dimension is always legal). These sizes are not tuned on a chip (none here):
a long prefill in blocks of 16 rows takes many small grid steps, and larger blocks for large T
are the first thing to measure. P R and R are whole
dimensions of their blocks. VMEM per step (bf16, K = 14336 -> bk = 2048, P R = 48 in 128 lanes):
x 2 x 16 x 2048 x 2 + A 2 x 2048 x 128 x 2 + accumulator and output: under 1.3 MiB.

Verified on the CPU in interpret mode, and compiled by the real TPU compiler for v5e / v6e / v5p
(`python -m jaxinfer.aot.kernel_check --kernel lora_sgmv_shrink --kernel lora_sgmv_expand`);
not run on a TPU (none here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.lora_sgmv import common
from pallas_kernels.lora_sgmv.reference import check_inputs
from pallas_kernels.tpu_chip import compiler_params

LANES = 128


def _largest_block(size: int, limit: int) -> int:
    """The largest multiple of 128 dividing `size` up to `limit`; else the whole size."""
    for b in range(limit - limit % LANES, 0, -LANES):
        if size % b == 0:
            return b
    return size


def _shrink_kernel(block_slot_ref, x_ref, a_ref, out_ref, acc_ref):
    """x_ref [block, bk], a_ref [bk, P R] (the block's adapter), out_ref [block, P R], acc_ref f32."""
    i, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(block_slot_ref[i] != 0)
    def _accumulate():
        acc_ref[...] += common.dot(x_ref[...], a_ref[...])

    @pl.when(k == pl.num_programs(1) - 1)
    def _finalize():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _expand_kernel(block_slot_ref, xa_ref, b_ref, out_ref):
    """xa_ref [block, R], b_ref [R, bn] (the block's adapter), out_ref [block, bn] f32."""
    used = block_slot_ref[pl.program_id(1)] != 0

    @pl.when(used)
    def _product():
        out_ref[...] = common.dot(xa_ref[...], b_ref[...])

    @pl.when(jnp.logical_not(used))
    def _nothing():
        out_ref[...] = jnp.zeros_like(out_ref)


def sgmv_shrink(x: jax.Array, a: jax.Array, block_slot: jax.Array, *, block: int, block_k: int = 2048,
                interpret=False) -> jax.Array:
    """x [nb * block, K] grouped, a [N, K, PR], block_slot [nb] -> [nb * block, PR] in a's dtype."""
    rows, K = x.shape
    nb, PR = block_slot.shape[0], a.shape[2]
    bk = _largest_block(K, block_k)

    def k_of(i, k, slots):  # slot-0 blocks stay on block 0: nothing new to fetch
        return jnp.where(slots[i] != 0, k, 0)

    return pl.pallas_call(
        _shrink_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, PR), a.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nb, K // bk),
            in_specs=[
                pl.BlockSpec((block, bk), lambda i, k, slots: (i, k_of(i, k, slots))),
                pl.BlockSpec((None, bk, PR), lambda i, k, slots: (slots[i], k_of(i, k, slots), 0)),
            ],
            out_specs=pl.BlockSpec((block, PR), lambda i, k, slots: (i, 0)),
            scratch_shapes=[pltpu.VMEM((block, PR), jnp.float32)],
        ),
        compiler_params=compiler_params("parallel", "arbitrary"),
        interpret=interpret,
        cost_estimate=common.cost_estimate(rows, K, PR, matrices_read=nb, itemsize=a.dtype.itemsize,  # A: once per block
                                           out_itemsize=a.dtype.itemsize),
        name="lora_sgmv_shrink",
    )(block_slot, x.astype(a.dtype), a)


def sgmv_expand(xa: jax.Array, b: jax.Array, block_slot: jax.Array, *, block: int, block_n: int = 2048,
                interpret=False) -> jax.Array:
    """xa [nb * block, R] grouped, b [N, R, O], block_slot [nb] -> float32 [nb * block, O]."""
    rows, R = xa.shape
    nb, O = block_slot.shape[0], b.shape[2]
    bn = _largest_block(O, block_n)
    return pl.pallas_call(
        _expand_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, O), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(O // bn, nb),
            in_specs=[
                pl.BlockSpec((block, R), lambda j, i, slots: (i, 0)),
                pl.BlockSpec((None, R, bn), lambda j, i, slots: (slots[i], 0, j)),
            ],
            out_specs=pl.BlockSpec((block, bn), lambda j, i, slots: (i, j)),
        ),
        compiler_params=compiler_params("parallel", "parallel"),
        interpret=interpret,
        cost_estimate=common.cost_estimate(rows, R, O, matrices_read=min(nb, b.shape[0] - 1), itemsize=b.dtype.itemsize,
                                           out_itemsize=4),  # B: once per run of one slot's blocks
        name="lora_sgmv_expand",
    )(block_slot, xa.astype(b.dtype), b)


@functools.partial(jax.jit, static_argnames=("block", "block_k", "block_n", "interpret"))
def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array, *, block: int | None = None, block_k: int = 2048,
               block_n: int = 2048, interpret=False) -> jax.Array:
    """See the module docstring. block: tokens per block (default: the stacks' sublane tile);
    block_k / block_n: the largest K / O_p block tried (a multiple of 128 dividing the dimension;
    with none up to the limit, the whole dimension)."""
    _, R = check_inputs(x, a, bs, slot)
    block = block or 8 * 4 // a.dtype.itemsize
    if interpret:
        patch_interpret_mode()
    grouping = common.group_by_slot(slot.astype(jnp.int32), a.shape[0], block)
    xa = sgmv_shrink(common.gather_rows(x, grouping), a, grouping.block_slot, block=block, block_k=block_k, interpret=interpret)
    y = jnp.concatenate([
        sgmv_expand(xa[:, p * R : (p + 1) * R], b, grouping.block_slot, block=block, block_n=block_n, interpret=interpret)
        for p, b in enumerate(bs)
    ], axis=-1)
    return common.scatter_back(y, slot, grouping)

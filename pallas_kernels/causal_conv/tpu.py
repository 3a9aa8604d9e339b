"""The causal depthwise convolution of one sequence's chunk: Pallas kernel for TPU (Mosaic).

Same inputs and result as `reference.causal_conv` (x [T, C], before [K - 1, C], weight [K, C],
valid_len -> out [T, C] in x's dtype, last [K - 1, C]).

How it runs:
- Grid (C / block_c, Tp / block_t): channel blocks "parallel" (a megacore chip's two TensorCores
  split them), token blocks "arbitrary", in order. Step (c, i) reads x's block [block_t, block_c]
  and writes out's.
- The window: a float32 VMEM scratch `ext` [P + block_t, block_c] (P = K - 1 rounded up to a
  sublane tile of 8) holds, in rows P - (K - 1) .. P - 1, the K - 1 inputs before the block, then
  the block itself from row P (an aligned store). Tap j of output row t is ext row
  P - (K - 1) + j + t: each tap is a static, sublane-shifted view of the scratch, multiplied by its
  weight row and summed in float32. Before the next block, the scratch's last P rows move to its
  first P (an aligned copy): the K - 1 inputs carried across token blocks never leave VMEM. At
  i = 0 the first P rows come from `before` (padded with zero rows above it by the wrapper).
- `last` (the K - 1 inputs ending at valid_len, a scalar prefetched into SMEM) is taken at the one
  step whose window holds them (the block of row valid_len - 1): the scratch rolled by a dynamic
  number of sublanes so they come first, its first P rows written to a float32 output block
  resident for the channel block (cut to K - 1 rows and cast by the wrapper: exact).
- The wrapper pads T to a multiple of block_t and C to one of 128 lanes (padding rows and channels
  are cut off the outputs), and places the weights as float32 rows.

VMEM per step (block_t = block_c = 512, bf16): x and out blocks 512 KiB each, double buffered; the
scratch and the float32 accumulator about 1 MiB each: a few MiB, inside every chip's scoped VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.causal_conv import reference
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.tpu_chip import compiler_params

LANES, SUBLANES = 128, 8
DEFAULT_BLOCK_T = 512
DEFAULT_BLOCK_C = 512


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _kernel(valid_ref, x_ref, before_ref, w_ref, out_ref, last_ref, ext_ref, *, taps: int):
    # valid_ref [1] int32 (SMEM); x_ref, out_ref [Bt, Bc]; before_ref, last_ref [P, Bc]; w_ref [Kp, Bc] float32;
    # ext_ref [P + Bt, Bc] float32: rows P - (K - 1) .. P - 1 the K - 1 inputs before the block, then the block
    K = taps
    P = before_ref.shape[0]
    Bt = x_ref.shape[0]
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        ext_ref[0:P, :] = before_ref[...].astype(jnp.float32)

    @pl.when(i > 0)
    def _():
        ext_ref[0:P, :] = ext_ref[Bt : Bt + P, :]  # the previous block's last P rows

    ext_ref[P:, :] = x_ref[...].astype(jnp.float32)
    first = P - (K - 1)  # ext row of x_ext[i * Bt]: the first tap of the block's first output
    acc = sum(ext_ref[first + j : first + j + Bt, :] * w_ref[j : j + 1, :] for j in range(K))  # [Bt, Bc]
    out_ref[...] = acc.astype(out_ref.dtype)

    end = valid_ref[0]  # last = x_ext[end : end + K - 1]: in the window of the block of row end - 1

    @pl.when(i == jnp.maximum(end - 1, 0) // Bt)
    def _():
        start = first + end - i * Bt  # its ext row
        rows = ext_ref.shape[0]
        last_ref[...] = pltpu.roll(ext_ref[...], (rows - start) % rows, 0)[:P]


@functools.partial(jax.jit, static_argnames=("block_t", "block_c", "interpret"))
def causal_conv(x, before, weight, valid_len=None, *, block_t: int = DEFAULT_BLOCK_T, block_c: int = DEFAULT_BLOCK_C,
                interpret: bool = False):
    """(out [T, C] in x's dtype, last [K - 1, C] in x's dtype): `reference.causal_conv`.
    block_t: token rows per step (a multiple of 16, capped at T rounded up to 16); block_c:
    channels per step (a multiple of 128; the largest one dividing C's 128-lane blocks is taken)."""
    T, C = x.shape
    K = weight.shape[0]
    if block_t % 16 or block_t <= 0:
        raise ValueError(f"block_t={block_t}: the TPU kernel takes a multiple of 16 (a bf16 sublane tile)")
    if block_c % LANES or block_c <= 0:
        raise ValueError(f"block_c={block_c}: the TPU kernel takes a multiple of {LANES} lanes")
    if interpret:
        patch_interpret_mode()
    P = _round_up(K - 1, SUBLANES)
    Bt = max(min(block_t, _round_up(T, 16)), _round_up(P, 16))
    lane_blocks = _round_up(C, LANES) // LANES
    Bc = LANES * max(d for d in range(1, block_c // LANES + 1) if lane_blocks % d == 0)
    Tp, Cp = _round_up(T, Bt), lane_blocks * LANES
    x_p = jnp.pad(x, ((0, Tp - T), (0, Cp - C))) if (Tp, Cp) != (T, C) else x
    before_p = jnp.pad(before.astype(x.dtype), ((P - (K - 1), 0), (0, Cp - C)))  # [P, Cp]: K - 1 rows at the bottom
    w_p = jnp.pad(weight.astype(jnp.float32), ((0, _round_up(K, SUBLANES) - K), (0, Cp - C)))  # [Kp, Cp]
    end = jnp.full((1,), T if valid_len is None else jnp.clip(valid_len, 0, T), jnp.int32)
    out, last = pl.pallas_call(
        functools.partial(_kernel, taps=K),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(Cp // Bc, Tp // Bt),
            in_specs=[pl.BlockSpec((Bt, Bc), lambda c, i, end: (i, c)),
                      pl.BlockSpec((P, Bc), lambda c, i, end: (0, c)),
                      pl.BlockSpec((w_p.shape[0], Bc), lambda c, i, end: (0, c))],
            out_specs=[pl.BlockSpec((Bt, Bc), lambda c, i, end: (i, c)),
                       pl.BlockSpec((P, Bc), lambda c, i, end: (0, c))],
            scratch_shapes=[pltpu.VMEM((P + Bt, Bc), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((Tp, Cp), x.dtype), jax.ShapeDtypeStruct((P, Cp), jnp.float32)],
        compiler_params=compiler_params("parallel", "arbitrary"),
        cost_estimate=reference.cost(Tp, Cp, K, jnp.dtype(x.dtype).itemsize),
        interpret=interpret,
        name="causal_conv",
    )(end, x_p, before_p, w_p)
    return out[:T, :C], last[: K - 1, :C].astype(x.dtype)

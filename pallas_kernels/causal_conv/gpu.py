"""The causal depthwise convolution of one sequence's chunk: Pallas kernel for GPU (Triton lowering).

Same inputs and result as `reference.causal_conv` (x [T, C], before [K - 1, C], weight [K, C],
valid_len -> out [T, C] in x's dtype, last [K - 1, C]).

Verification status: checked in Pallas interpret mode on the CPU and compiled for an H100 by the
CUDA plugin (jaxinfer.aot.kernel_check); never run on a GPU: expect to tune the blocks and warps.

How it runs:
- Grid (C / block_c,): a program per block of channels, its K weight rows loaded once (float32),
  walking the token blocks in order with a `lax.fori_loop`.
- Block i's outputs (rows t = i * block_t ...) sum K taps, tap j the inputs at rows t - (K - 1) + j:
  each tap is a load of [block_t, block_c] at a row offset (element indices, so the offset may be
  negative), masked to the rows in x; the rows before the chunk (negative) come from `before` by a
  second masked load (all masked off past the first block). The taps overlap: after the first they
  are mostly cache hits, and x is read from memory about once.
- `last`: one more such load, of the K - 1 rows ending at valid_len, after the loop.
- The arrays are read whole (no BlockSpec) in place: rows past T and channels past C are masked,
  so nothing is padded. Triton's blocks are powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.causal_conv import reference
from pallas_kernels.compat import patch_interpret_mode

# Untuned (no GPU at hand): 64 channels of bf16 are a 128-byte row per load; 160 programs at
# Qwen3.5-27B's 10240 channels (128 at the 35B's 8192) on an H100's 132 SMs.
DEFAULT_BLOCK_T = 32
DEFAULT_BLOCK_C = 64
DEFAULT_NUM_WARPS = 4


def _kernel(end_ref, x_ref, before_ref, w_ref, out_ref, last_ref, *, block_t: int, block_c: int):
    # end_ref [1] int32 (valid_len); x_ref, out_ref [T, C]; before_ref, last_ref [K - 1, C]; w_ref [K, C]
    T, C = x_ref.shape
    K = w_ref.shape[0]
    cols = pl.program_id(0) * block_c + jnp.arange(block_c)  # [Bc]
    in_c = cols < C
    col_ids = jnp.minimum(cols, C - 1)[None, :]
    channels = pl.ds(pl.program_id(0) * block_c, block_c)

    def inputs(rows):
        """x_ext[rows + K - 1] (x's rows; negative ones: before's), float32 [len(rows), Bc]."""
        n = rows.shape[0]
        at = lambda r: (jnp.broadcast_to(r[:, None], (n, block_c)), jnp.broadcast_to(col_ids, (n, block_c)))  # noqa: E731
        in_x = ((rows >= 0) & (rows < T))[:, None] & in_c[None, :]
        from_x = plt.load(x_ref.at[at(jnp.clip(rows, 0, T - 1))], mask=in_x, other=0)
        in_before = (rows < 0)[:, None] & in_c[None, :]
        from_before = plt.load(before_ref.at[at(jnp.clip(rows + K - 1, 0, K - 2))], mask=in_before, other=0)
        return jnp.where(in_before, from_before.astype(jnp.float32), from_x.astype(jnp.float32))

    taps = [plt.load(w_ref.at[pl.ds(j, 1), channels], mask=in_c[None, :], other=0).astype(jnp.float32) for j in range(K)]

    def block(i, carry):
        rows = i * block_t + jnp.arange(block_t)  # the block's output rows
        acc = sum(inputs(rows - (K - 1) + j) * taps[j] for j in range(K))  # [Bt, Bc]
        plt.store(out_ref.at[pl.ds(i * block_t, block_t), channels], acc.astype(out_ref.dtype),
                  mask=(rows < T)[:, None] & in_c[None, :])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(T, block_t), block, 0)
    n = pl.next_power_of_2(K - 1)
    offsets = jnp.arange(n)
    last = inputs(end_ref[0] - (K - 1) + offsets)  # [n, Bc]: the K - 1 inputs before position valid_len
    plt.store(last_ref.at[pl.ds(0, n), channels], last.astype(last_ref.dtype), mask=(offsets < K - 1)[:, None] & in_c[None, :])


@functools.partial(jax.jit, static_argnames=("block_t", "block_c", "num_warps", "num_stages", "interpret"))
def causal_conv(x, before, weight, valid_len=None, *, block_t: int = DEFAULT_BLOCK_T, block_c: int = DEFAULT_BLOCK_C,
                num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = 2, interpret: bool = False):
    """(out [T, C] in x's dtype, last [K - 1, C] in x's dtype): `reference.causal_conv`.
    block_t / block_c: rows and channels of a tile (powers of two; block_c capped at C's next
    power of two); num_warps / num_stages: to Triton."""
    T, C = x.shape
    K = weight.shape[0]
    for name, size in (("block_t", block_t), ("block_c", block_c)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name}={size}: the Triton kernel takes a power of two")
    if interpret:
        patch_interpret_mode()
    Bc = min(block_c, pl.next_power_of_2(C))
    end = jnp.full((1,), T if valid_len is None else jnp.clip(valid_len, 0, T), jnp.int32)
    return pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, block_c=Bc),
        grid=(pl.cdiv(C, Bc),),
        out_shape=[jax.ShapeDtypeStruct((T, C), x.dtype), jax.ShapeDtypeStruct((K - 1, C), x.dtype)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=reference.cost(T, C, K, jnp.dtype(x.dtype).itemsize),
        interpret=interpret,
        name="causal_conv",
    )(end, x, before.astype(x.dtype), weight)

"""2:4 sparse matmul as a Pallas GPU kernel (Triton lowering): the compressed weight is expanded
tile by tile in registers / shared memory.

Same arguments and result as `reference.sparse24_matmul`:

    y [M, N] = x [M, K] @ densify(values [4, K/8, N], mask uint8 [K/8, N]) [K, N]   (in x's dtype)

Only the compressed bytes are loaded from HBM (bfloat16: four kept values and one mask byte per
8 rows of a column, 9 bytes for 16 dense ones).

Grid and memory
---------------
grid = (cdiv(M, bm), cdiv(N, bn)); each program owns one [bm, bn] output tile and walks K/8 in
steps of bk8 mask rows (8 * bk8 rows of W) in a `fori_loop`, its float32 accumulator a loop carry.
Per step it loads the mask tile [bk8, bn] (uint8), the four value planes' tiles [bk8, bn] and x's
eight planes' tiles [bm, bk8] (the wrapper's split, reference.x_planes), expands W_{4e+p} with
selects (tpu.expanded_planes, the same code) and runs eight tensor-core dots of depth bk8. The
arrays are passed whole and every tile is a masked load (`other=0`): nothing is padded, and no
dimension needs to divide its block. Triton's tiles are powers of two >= 16.

Decode (M = 1..8) takes bm = 16 (the smallest dot tile, rows past M masked off) and bn = 64 so a
short N still spreads over several programs (as quantized_matmul/gpu.py), 3 pipeline stages;
larger M takes 64 x 128 tiles and 256 rows of W per step in 2 stages (3 ask an H100 for 232 KiB
of shared memory, past its 227: measured by the compiler). Values are cast to x's
dtype before the dot. Verified on the CPU with `interpret=True`; compiled for an H100 by the CUDA
plugin with no GPU (tests, jaxinfer.aot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import cost
from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.sparse24_matmul.reference import check_matmul_inputs, x_planes
from pallas_kernels.sparse24_matmul.tpu import expanded_planes
from pallas_kernels.triton_tiles import masked_tile

SMALL_M = 16


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """f32 accumulation; f32 inputs at HIGHEST (the Triton lowering turns the default into tf32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _kernel(x_ref, values_ref, mask_ref, out_ref, *, bm: int, bn: int, bk8: int):
    """x_ref [8, M, K/8], values_ref [4, K/8, N], mask_ref uint8 [K/8, N], out_ref [M, N] (whole arrays)."""
    _, M, K8 = x_ref.shape
    N = mask_ref.shape[-1]
    m0, n0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    dtype = x_ref.dtype

    def k_step(step, acc):                                             # acc [bm, bn] f32
        r0 = step * bk8
        mask = masked_tile(mask_ref, K8, N, r0, n0, bk8, bn).astype(jnp.int32)             # [bk8, bn]
        values = [masked_tile(values_ref, K8, N, r0, n0, bk8, bn, lead=q) for q in range(4)]
        tiles = expanded_planes(mask, values, dtype)
        for j in range(8):
            acc = acc + _dot(masked_tile(x_ref, M, K8, m0, r0, bm, bk8, lead=j), tiles[j])
        return acc

    acc = jax.lax.fori_loop(0, pl.cdiv(K8, bk8), k_step, jnp.zeros((bm, bn), jnp.float32))
    rows, cols = m0 + jnp.arange(bm), n0 + jnp.arange(bn)
    plt.store(out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
              mask=(rows < M)[:, None] & (cols < N)[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def sparse24_matmul(
    x: jax.Array,       # [M, K] f32 or bf16
    values: jax.Array,  # [4, K/8, N]
    mask: jax.Array,    # uint8 [K/8, N]
    *,
    block_m: int | None = None,  # None: 16 for M <= 16 (decode), else 64
    block_n: int | None = None,  # None: 64 for M <= 16, else 128
    block_k: int | None = None,  # rows of W per loop step (8 per mask row); None: 512 (decode) / 256
    num_warps: int = 4,
    num_stages: int | None = None,  # None: 3 (decode), 2 (larger M: 3 stages of 64 x 256 tiles pass an H100's 227 KiB)
    interpret: bool = False,
) -> jax.Array:                  # [M, N] in x's dtype
    K = check_matmul_inputs(x, values, mask)
    M = x.shape[0]
    N = mask.shape[1]
    small_m = M <= SMALL_M
    bm = block_m or (SMALL_M if small_m else 64)
    bn = block_n or (64 if small_m else 128)
    bk = block_k or (512 if small_m else 256)
    num_stages = num_stages or (3 if small_m else 2)
    if bk % 8:
        raise ValueError(f"block_k must be a multiple of 8 (rows per mask byte), got {bk}")
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k / 8", bk // 8)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    if interpret:
        patch_interpret_mode()

    weight_bytes = values.size * values.dtype.itemsize + mask.size
    return pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, bk8=bk // 8),
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.matmul(M, K, N, x_itemsize=x.dtype.itemsize, out_itemsize=x.dtype.itemsize,
                                  weight_bytes=weight_bytes),
        name="sparse24_matmul",
    )(x_planes(x), values, mask)

"""SwiGLU matmul as a Pallas GPU kernel (Triton lowering): gate and up accumulate side by side in registers.

Same inputs and result as `reference.swiglu_matmul` (read its docstring for the semantics):

    out [M, N] = silu(x @ w_gate_up[:, :N]) * (x @ w_gate_up[:, N:])        (in x's dtype)

Why Triton and not Mosaic GPU: Pallas' Mosaic GPU backend has no interpret mode in this JAX
(0.10.2) and there is no GPU on the machines this was written on, so a Mosaic GPU kernel could not
have been run at all. The Triton lowering runs under `interpret=True` on the CPU, which is how this
file is tested; it has been lowered to Triton IR but not run on a GPU.

Grid and memory
---------------
grid = (cdiv(M, bm), cdiv(N, bn)); program (i, j) owns output tile [bm, bn] at rows m0 = i * bm,
columns n0 = j * bn, and walks all of K in a `fori_loop` with two float32 [bm, bn] accumulators
as loop carries (registers). Each step loads

* the x tile [bm, bk] at (m0, k0);
* the gate tile [bk, bn] of w_gate_up at (k0, n0);
* the up tile [bk, bn] of the same array at (k0, N + n0),

and adds x @ gate and x @ up to the accumulators. After the loop, silu(g) * u is computed in
float32 and stored once (masked), so the [M, 2N] projection never reaches memory. There is no K
grid axis: Triton programs run concurrently and have no scratch that outlives one program, so a
reduction split over programs would need atomics or a second pass.

The arrays are passed whole (no BlockSpec) and every tile is a masked load (`other=0`), so no
dimension needs to divide its block and nothing is padded: rows past M, K columns past K (K = 576
with bk = 128 ends in a half tile) and columns past the end of each half are read as 0. The up
tile's columns N + n0 + c are masked to < 2N, which is the same as n0 + c < N: a tile never reads
across from gate into up or past the array. Triton wants power-of-two tiles of at least 16 per
dot dimension, so bm, bn, bk are powers of two >= 16.

Decode (M = 1..8) is memory-bound: the whole [K, 2N] weight is read once per call. The small-M
path takes bm = 16 (the smallest dot tile) with the rows past M masked off, and a narrower bn (64)
so a short N still spreads over more programs. Registers per program: two [bm, bn] f32
accumulators (2 x 64 x 128 values at the large-M defaults, 64 per thread at 4 warps) plus the
tiles of one step; since each step loads two weight tiles, bk defaults to 64 (half of a
single-accumulator matmul's 128) to keep the [bk, bn] tiles in flight per stage the same.

x is cast to the weight's dtype in the wrapper (as `layers.matmul` casts it); bf16 tiles feed the
tensor cores with f32 accumulation, f32 tiles use Precision.HIGHEST (IEEE f32: the Triton lowering
treats the default precision as TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.swiglu_matmul import common
from pallas_kernels.swiglu_matmul.reference import check_inputs
from pallas_kernels.triton_tiles import masked_tile

SMALL_M = 16  # the smallest tile a tensor-core dot takes; decode batches are padded (masked) up to it


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _swiglu_kernel(x_ref, w_ref, out_ref, *, bm: int, bn: int, bk: int):
    """x_ref [M, K], w_ref [K, 2N] = [gate | up], out_ref [M, N] (whole arrays)."""
    M, K = x_ref.shape
    N = out_ref.shape[1]
    m0 = pl.program_id(0) * bm
    n0 = pl.program_id(1) * bn

    def k_step(step, accs):  # accs: gate, up [bm, bn] f32
        gate_acc, up_acc = accs
        k0 = step * bk
        x = masked_tile(x_ref, M, K, m0, k0, bm, bk)  # [bm, bk]
        gate = masked_tile(w_ref, K, N, k0, n0, bk, bn)  # [bk, bn], columns n0.. of the gate half
        up = masked_tile(w_ref, K, 2 * N, k0, N + n0, bk, bn)  # [bk, bn], the same columns of the up half
        return gate_acc + common.dot(x, gate), up_acc + common.dot(x, up)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    gate_acc, up_acc = jax.lax.fori_loop(0, pl.cdiv(K, bk), k_step, (zeros, zeros))
    rows = m0 + jnp.arange(bm)
    cols = n0 + jnp.arange(bn)
    out_mask = (rows < M)[:, None] & (cols < N)[None, :]
    out = jax.nn.silu(gate_acc) * up_acc  # [bm, bn] f32
    plt.store(out_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out.astype(out_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret")
)
def swiglu_matmul(
    x: jax.Array,  # [M, K]
    w_gate_up: jax.Array,  # [K, 2N] = [gate | up]
    *,
    block_m: int | None = None,  # None: 16 for M <= 16 (decode), else 64
    block_n: int | None = None,  # None: 64 for M <= 16, else 128
    block_k: int | None = None,  # None: 64
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, N] in x's dtype
    N = check_inputs(x, w_gate_up)
    M, K = x.shape
    small_m = M <= SMALL_M
    bm = block_m or (SMALL_M if small_m else 64)
    bn = block_n or (64 if small_m else 128)
    bk = block_k or 64
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if not _is_power_of_two(b) or b < 16:
            raise ValueError(f"{name} must be a power of two >= 16 (Triton tiles), got {b}")
    if interpret:
        patch_interpret_mode()

    return pl.pallas_call(
        functools.partial(_swiglu_kernel, bm=bm, bn=bn, bk=bk),
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=common.cost_estimate(M, K, N, w_dtype=w_gate_up.dtype, out_dtype=x.dtype),
        name="swiglu_matmul",
    )(x.astype(w_gate_up.dtype), w_gate_up)  # as layers.matmul: the dot runs in the weight's dtype

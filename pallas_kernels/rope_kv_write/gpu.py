"""RoPE + KV write as a Pallas GPU kernel (Triton lowering): one program per token.

Same arguments and result as `reference.rope_kv_write` (read its docstring for the semantics).

Verification status: run only in Pallas interpret mode on the CPU and lowered for "cuda" (no GPU
here). Triton lowering rather than Mosaic GPU: the latter has no interpret mode in this JAX.

How it runs
-----------
grid = (cdiv(T, bt),); program p handles tokens p*bt .. p*bt + bt - 1 in a loop. Every array is
passed whole (no BlockSpec), and each load and store is a masked tile of power-of-two sides:

* heads are padded to H_pad = next power of two (masked), and each row is handled as its two
  halves [H_pad, D/2]: Triton cannot slice a tensor in registers, so the rotate-half pairs
  (x1, x2) are loaded separately and
      out1 = x1 * cos1 - x2 * sin1,    out2 = x2 * cos2 + x1 * sin2        (float32)
* q_rot and k_rot are stored at row t; the rotated key halves and the value halves are stored
  at `pool[write_page[t], write_offset[t]]`. The pools are aliased to the outputs
  (`input_output_aliases`), so with a donated pool the call writes only those rows.

Tokens at or past T (the last program's tail) do nothing. Each program touches a few KiB; the
kernel is bound by the bytes of q, k, v read and written once.

D/2 must be a power of two (head_dim 64, 128, 256: every supported family's real models): a half
row is one power-of-two tile. `supports(head_dim)` says whether a shape fits; the model runs the
reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.rope_kv_write.reference import check_inputs, check_pools


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def supports(head_dim: int) -> bool:
    """True when half a head row is a power of two, the tile this kernel loads."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def _kernel(q_ref, k_ref, v_ref, cos_ref, sin_ref, k_pool_in, v_pool_in, page_ref, offset_ref,
            q_out, k_out, k_pool, v_pool, *, num_tokens: int, block_tokens: int, half: int):
    """q_ref [T, Hq, D], k_ref / v_ref [T, Hkv, D], cos_ref / sin_ref [T, D], pools [N, page_size, Hkv, D]
    (the *_in ones are the same buffers as the outputs), page_ref / offset_ref [T]."""
    del k_pool_in, v_pool_in
    half_pad = half  # a power of two (see `supports`)
    col_ok = jnp.arange(half) < half  # [half]: all true; the row masks below need a column mask to broadcast

    def halves(ref, *index, heads):
        """(first, second) halves [H_pad, half_pad] of rows ref[*index, :heads, :], 0 where masked."""
        rows = jnp.arange(_next_power_of_two(heads))
        mask = (rows < heads)[:, None] & col_ok[None, :]
        lo = plt.load(ref.at[(*index, pl.ds(0, rows.shape[0]), pl.ds(0, half_pad))], mask=mask, other=0)
        hi = plt.load(ref.at[(*index, pl.ds(0, rows.shape[0]), pl.ds(half, half_pad))], mask=mask, other=0)
        return lo, hi, mask

    def store(ref, index, lo, hi, mask):
        H_pad = lo.shape[0]
        plt.store(ref.at[(*index, pl.ds(0, H_pad), pl.ds(0, half_pad))], lo.astype(ref.dtype), mask=mask)
        plt.store(ref.at[(*index, pl.ds(0, H_pad), pl.ds(half, half_pad))], hi.astype(ref.dtype), mask=mask)

    first = pl.program_id(0) * block_tokens  # read here: the interpreter knows program_id only outside loops

    def token(i, carry):
        t = first + i

        @pl.when(t < num_tokens)
        def _():
            cos1 = plt.load(cos_ref.at[t, pl.ds(0, half_pad)], mask=col_ok, other=0).astype(jnp.float32)[None, :]
            cos2 = plt.load(cos_ref.at[t, pl.ds(half, half_pad)], mask=col_ok, other=0).astype(jnp.float32)[None, :]
            sin1 = plt.load(sin_ref.at[t, pl.ds(0, half_pad)], mask=col_ok, other=0).astype(jnp.float32)[None, :]
            sin2 = plt.load(sin_ref.at[t, pl.ds(half, half_pad)], mask=col_ok, other=0).astype(jnp.float32)[None, :]

            def rotate(x1, x2):
                x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
                return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2

            q1, q2, q_mask = halves(q_ref, t, heads=q_ref.shape[1])
            store(q_out, (t,), *rotate(q1, q2), q_mask)
            k1, k2, kv_mask = halves(k_ref, t, heads=k_ref.shape[1])
            k1, k2 = rotate(k1, k2)
            store(k_out, (t,), k1.astype(k_out.dtype), k2.astype(k_out.dtype), kv_mask)  # rounded like k_rot
            page, offset = page_ref[t], offset_ref[t]
            store(k_pool, (page, offset), k1.astype(k_out.dtype), k2.astype(k_out.dtype), kv_mask)
            v1, v2, _ = halves(v_ref, t, heads=v_ref.shape[1])
            store(v_pool, (page, offset), v1, v2, kv_mask)

        return carry

    jax.lax.fori_loop(0, block_tokens, token, 0)


@functools.partial(jax.jit, static_argnames=("block_tokens", "num_warps", "interpret"))
def rope_kv_write(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    cos: jax.Array,  # [T, D]
    sin: jax.Array,  # [T, D]
    k_pages: jax.Array,  # [N, page_size, Hkv, D]; updated in place when the caller donates it
    v_pages: jax.Array,
    write_page: jax.Array,  # [T] int32
    write_offset: jax.Array,  # [T] int32
    *,
    block_tokens: int = 4,
    num_warps: int = 4,
    interpret: bool = False,
):
    check_inputs(q, k, v, cos, sin, write_page, write_offset)
    check_pools(k, k_pages, v_pages)
    T, Hq, D = q.shape
    if not supports(D):
        raise ValueError(f"head_dim {D}: the GPU kernel needs head_dim / 2 to be a power of two")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive; got {block_tokens}")
    if interpret:
        patch_interpret_mode()
    q_rot, k_rot, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, num_tokens=T, block_tokens=block_tokens, half=D // 2),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        grid=(pl.cdiv(T, block_tokens),),
        input_output_aliases={5: 2, 6: 3},  # k_pages, v_pages: updated in place when the caller donates them
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        cost_estimate=cost.rope_kv_write(T, Hq, k.shape[1], D, itemsize=q.dtype.itemsize, pool_itemsize=k_pages.dtype.itemsize),
        name="rope_kv_write",
    )(q, k, v, cos, sin, k_pages, v_pages, write_page.astype(jnp.int32), write_offset.astype(jnp.int32))
    return q_rot, k_rot, k_pages, v_pages

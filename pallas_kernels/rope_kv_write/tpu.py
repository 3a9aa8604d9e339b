"""RoPE + KV write as a Pallas TPU (Mosaic) kernel: rotate in VMEM, DMA each key/value row to its page.

Same arguments and result as `reference.rope_kv_write` (read its docstring for the semantics).

Grid and memory
---------------
grid = (Tp // bt,) over blocks of bt tokens (T is padded in the wrapper to Tp, a multiple of bt).
Step i gets, through the Pallas pipeline (HBM -> VMEM, double-buffered):

* q [bt, Hq, D], k [bt, Hkv, D], v [bt, Hkv, D], cos [bt, D] and sin_signed [bt, D] blocks;
* write_page / write_offset [Tp] by scalar prefetch (they sit in SMEM before the grid starts).

It rotates q and k in float32 and writes them to the q_rot / k_rot output blocks. The page pools
never enter VMEM: they are passed with `memory_space=pl.ANY` (left in HBM) and aliased to the
outputs (`input_output_aliases`), so the call updates them in place when the caller donates them.
For each real token t of the block, two DMAs copy its rotated key row (from the k_rot output
block) and its value row (from the v input block), [Hkv, D] each, to `pool[write_page[t],
write_offset[t]]`. All copies of a block are started before any is waited on, so they overlap;
every one is waited on before the step ends (its source buffers are reused by the next step).
Padding tokens past T are skipped; padding tokens the caller sends to the scratch page are
written there like any other (several of them may land on one slot: that page is garbage).

Rotation without lane shuffles: rotate_half(x) * sin = roll(x, D/2) * sin_signed, where
roll(x, D/2) = concat(x[D/2:], x[:D/2]) (the same for either direction: the shift is half the
axis) and sin_signed = concat(-sin[:D/2], sin[D/2:]) is built once in the wrapper. `pltpu.roll`
is a native lane rotation; no slice at a lane offset of D/2 is needed.

VMEM per step, b bytes per element, double-buffered inputs and outputs (heads padded to whole
sublane tiles when fewer than 8, or 16 in bf16):
    2 x bt x (2 Hq + 3 Hkv) x D x b  +  2 x 2 x bt x D x 4  (cos, sin)
bt = 128, Hq = 32, Hkv = 8, D = 128 in bf16: 4.5 MiB + 0.5 MiB. `block_tokens` is a multiple of
8 (a sublane tile of cos / sin), checked unless interpreting.

Verified on the CPU with `interpret=True` and in the TPU simulator (`pltpu.InterpretParams`,
race detection on), and compiled by the real TPU compiler (libtpu, no TPU needed:
`jaxinfer.aot.kernel_check`) for v5e, v6e and v5p at every supported family's shapes, SmolLM2's
9 / 4 heads of 64 included: Mosaic takes the roll over [bt, heads, D] whatever the head count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels.rope_kv_write import common
from pallas_kernels.tpu_chip import compiler_params

SUBLANES = 8


def _rotate(x, cos, sin_signed):
    """x [bt, H, D], cos / sin_signed [bt, D] float32 -> rope(x) in float32."""
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + pltpu.roll(x, shift=half, axis=2) * sin_signed[:, None, :]


def _kernel(page_ref, offset_ref,  # scalar prefetch: [Tp] int32 each
            q_ref, k_ref, v_ref, cos_ref, sin_ref,  # [bt, Hq, D], [bt, Hkv, D] x 2, [bt, D] x 2
            k_pool_in, v_pool_in,  # aliased to k_pool, v_pool (unused here: the DMAs write the outputs)
            q_out, k_out, k_pool, v_pool,  # [bt, Hq, D], [bt, Hkv, D], pools in HBM
            sems, *, num_tokens: int):
    del k_pool_in, v_pool_in
    bt = q_ref.shape[0]
    first = pl.program_id(0) * bt
    cos, sin = cos_ref[...], sin_ref[...]
    q_out[...] = _rotate(q_ref[...], cos, sin).astype(q_out.dtype)
    k_out[...] = _rotate(k_ref[...], cos, sin).astype(k_out.dtype)

    def copies(i):
        t = first + i
        page, offset = page_ref[t], offset_ref[t]
        return (
            pltpu.make_async_copy(k_out.at[i], k_pool.at[page, offset], sems.at[0]),
            pltpu.make_async_copy(v_ref.at[i], v_pool.at[page, offset], sems.at[1]),
        )

    def for_each_real_token(action):
        def body(i, carry):
            @pl.when(first + i < num_tokens)
            def _():
                for copy in copies(i):
                    action(copy)
            return carry
        jax.lax.fori_loop(0, bt, body, 0)

    for_each_real_token(lambda copy: copy.start())
    for_each_real_token(lambda copy: copy.wait())


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
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
    block_tokens: int = 128,
    interpret=False,  # False on TPU; True or pltpu.InterpretParams() elsewhere
):
    T, Hq, Hkv, D = common.check_and_size(q, k, v, cos, sin, k_pages, v_pages, write_page, write_offset)
    common.check_block_tokens(block_tokens, 1 if interpret else SUBLANES)
    if k.dtype != k_pages.dtype or v.dtype != v_pages.dtype:
        raise ValueError(f"the TPU kernel copies rows as they are: k/v dtypes {k.dtype}/{v.dtype} must be the pools' "
                         f"{k_pages.dtype}/{v_pages.dtype}")
    if interpret:
        patch_interpret_mode()
    bt = min(block_tokens, -(-T // SUBLANES) * SUBLANES)
    Tp = -(-T // bt) * bt
    pad = lambda x: jnp.pad(x, [(0, Tp - T)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    half = D // 2
    cos = cos.astype(jnp.float32)
    sin_signed = jnp.concatenate([-sin[:, :half], sin[:, half:]], axis=1).astype(jnp.float32)

    rows = lambda *shape: pl.BlockSpec((bt, *shape), lambda i, *_: (i,) + (0,) * len(shape))  # noqa: E731
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    q_rot, k_rot, k_pages, v_pages = pl.pallas_call(
        functools.partial(_kernel, num_tokens=T),
        out_shape=common.out_shape(Tp, q, k, k_pages, v_pages),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Tp // bt,),
            in_specs=[rows(Hq, D), rows(Hkv, D), rows(Hkv, D), rows(D), rows(D), in_hbm, in_hbm],
            out_specs=(rows(Hq, D), rows(Hkv, D), in_hbm, in_hbm),
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        # operand indices count the two scalar-prefetch arrays: k_pages is operand 7, v_pages 8
        input_output_aliases=common.pool_aliases(7),
        compiler_params=compiler_params("arbitrary"),
        cost_estimate=common.cost_estimate(Tp, q, k, k_pages),
        interpret=interpret,
        name="rope_kv_write",
    )(pad(write_page.astype(jnp.int32)), pad(write_offset.astype(jnp.int32)),
      pad(q), pad(k), pad(v), pad(cos), pad(sin_signed), k_pages, v_pages)
    return q_rot[:T], k_rot[:T], k_pages, v_pages

"""Flash attention over packed variable-length segments: Pallas kernel for TPU (Mosaic).

Same inputs, options and result as `reference.flash_attention` (read its docstring for the
semantics). Used for prefill-only steps where every sequence starts at position 0, so keys and
values are the tokens of the queries themselves.

How it runs:
- The wrapper (`common.prepare_inputs`) pads rows to whole blocks, moves heads in front
  (q -> [Hkv, G, T, D], k/v -> [Hkv, T, D]), gives every row a segment id, and computes for each
  query block the range [kv_lo, kv_hi) of KV blocks it needs. Those two small int arrays are
  scalar-prefetched into SMEM.
- Grid (Hkv, query blocks, KV blocks). One step takes a [G, block_q, D] query tile (the G query
  heads of one KV head, so each K/V tile is loaded once for all of them) and a [block_k, D] K and V
  tile, all in VMEM through BlockSpecs. The last grid axis is the reduction ("arbitrary"); the
  other two are "parallel".
- VMEM scratch carries the online-softmax state across KV steps: running max m and sum l
  [G, block_q, 1] and the unnormalised output acc [G, block_q, D], all float32.
- `pl.when(kv_lo <= j < kv_hi)` skips KV blocks that are fully masked: past the causal diagonal,
  in another segment, before the sliding window. The K/V index maps clamp j into that range, so a
  skipped step asks for the block already in VMEM (or the next one needed) and moves no data.
- The G query heads form one [G * block_q, D] matrix, so each step is two MXU matmuls.
Blocks are (8, 128)-friendly: block_q a multiple of 8 (16 for bf16) and block_k a multiple of
128, checked unless interpreting (then multiples of 8 are enough); head_dim is the full last dim.

Known costs, left for later: the wrapper's head-major transposes are one extra pass over q, k, v
and the output; the grid visits every (query block, KV block) pair, so a skipped pair still costs
a (cheap) grid step. Many short segments in a long array would do better with a prefetched list
of the needed pairs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.tpu_chip import compiler_params
from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.reference import check_options


def _kernel(
    kv_lo_ref,  # SMEM [num_q_blocks]
    kv_hi_ref,  # SMEM [num_q_blocks]
    q_ref,  # [G, block_q, D]
    k_ref,  # [block_k, D]
    v_ref,  # [block_k, D]
    q_segment_ref,  # [block_q, 1] int32
    q_start_ref,  # [block_q, 1] int32: each query row's segment start
    kv_segment_ref,  # [1, block_k] int32
    o_ref,  # [G, block_q, D]
    m_ref,  # scratch [G, block_q, 1] f32
    l_ref,  # scratch [G, block_q, 1] f32
    acc_ref,  # scratch [G, block_q, D] f32
    *,
    sm_scale,
    causal,
    sliding_window,
    attention_chunk,
    soft_cap,
):
    G, block_q, D = q_ref.shape
    block_k = k_ref.shape[0]
    q_block, kv_block = pl.program_id(1), pl.program_id(2)

    @pl.when(kv_block == 0)
    def _start_query_block():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((kv_lo_ref[q_block] <= kv_block) & (kv_block < kv_hi_ref[q_block]))
    def _fold_kv_block():
        q = q_ref[...].reshape(G * block_q, D)  # all G heads in one matmul
        scores = common.attention_scores(q, k_ref[...], sm_scale=sm_scale, soft_cap=soft_cap)
        scores = scores.reshape(G, block_q, block_k)
        q_pos = q_block * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        k_pos = kv_block * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = common.visible_keys(
            q_pos, k_pos, q_segment_ref[...], kv_segment_ref[...], causal=causal, sliding_window=sliding_window,
            attention_chunk=attention_chunk, q_start=q_start_ref[...],
        )  # [block_q, block_k], the same for every head
        m_next, l_next, p, alpha = common.online_softmax_step(m_ref[...], l_ref[...], scores, visible[None])
        v = v_ref[...]
        pv = jnp.dot(
            p.reshape(G * block_q, block_k).astype(v.dtype), v,
            precision=common.dot_precision(v.dtype), preferred_element_type=jnp.float32,
        )
        acc_ref[...] = alpha * acc_ref[...] + pv.reshape(G, block_q, D)
        m_ref[...] = m_next
        l_ref[...] = l_next

    @pl.when(kv_block == pl.num_programs(2) - 1)
    def _finish_query_block():
        o_ref[...] = common.normalize(acc_ref[...], l_ref[...]).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "causal", "sliding_window", "soft_cap", "attention_chunk", "block_q", "block_k", "interpret"),
)
def flash_attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    cu_seq_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    attention_chunk: int | None = None,  # Llama 4's chunks (pallas_kernels.visible_span), counted from each segment's start
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    check_options(q, k, v, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk)
    # Hardware tiles are (8, 128) 32-bit words: block_q fills whole sublane tiles (16 rows for
    # bf16) and block_k whole lane rows. The interpreter has no tiles; multiples of 8 keep the tests
    # close to hardware shapes while staying small.
    row_multiple = 8 if interpret else 8 * (4 // q.dtype.itemsize)
    key_multiple = 8 if interpret else 128
    if block_q % row_multiple or block_k % key_multiple:
        raise ValueError(
            f"block_q must be a multiple of {row_multiple} and block_k of {key_multiple}; got {block_q}, {block_k}"
        )
    if interpret:
        patch_interpret_mode()
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    x = common.prepare_inputs(
        q, k, v, cu_seq_lens, num_seqs, block_q=block_q, block_k=block_k, causal=causal, sliding_window=sliding_window,
        attention_chunk=attention_chunk,
    )
    T_pad = x.k.shape[1]
    num_q_blocks, num_kv_blocks = T_pad // block_q, T_pad // block_k

    def needed_kv_block(q_block, kv_block, kv_lo, kv_hi):
        # Outside [lo, hi) the step is skipped: point at a block the query block loads anyway.
        return jnp.maximum(jnp.minimum(kv_block, kv_hi[q_block] - 1), kv_lo[q_block])

    def q_map(h, i, j, kv_lo, kv_hi):
        return (h, 0, i, 0)

    def kv_map(h, i, j, kv_lo, kv_hi):
        return (h, needed_kv_block(i, j, kv_lo, kv_hi), 0)

    def q_segment_map(h, i, j, kv_lo, kv_hi):
        return (i, 0)

    def kv_segment_map(h, i, j, kv_lo, kv_hi):
        return (0, needed_kv_block(i, j, kv_lo, kv_hi))

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, attention_chunk=attention_chunk,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Hkv, num_q_blocks, num_kv_blocks),
            in_specs=[
                pl.BlockSpec((None, G, block_q, D), q_map),
                pl.BlockSpec((None, block_k, D), kv_map),
                pl.BlockSpec((None, block_k, D), kv_map),
                pl.BlockSpec((block_q, 1), q_segment_map),
                pl.BlockSpec((block_q, 1), q_segment_map),  # q_start
                pl.BlockSpec((1, block_k), kv_segment_map),
            ],
            out_specs=pl.BlockSpec((None, G, block_q, D), q_map),
            scratch_shapes=[
                pltpu.VMEM((G, block_q, 1), jnp.float32),  # m
                pltpu.VMEM((G, block_q, 1), jnp.float32),  # l
                pltpu.VMEM((G, block_q, D), jnp.float32),  # acc
            ],
        ),
        compiler_params=compiler_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        cost_estimate=cost.flash_attention(T, Hq, Hkv, D, itemsize=q.dtype.itemsize, causal=causal),
        name="flash_attention_segments",
    )(x.kv_lo, x.kv_hi, x.q, x.k, x.v, x.q_segment[:, None], x.q_start[:, None], x.kv_segment[None, :])
    return common.restore_layout(out, T)

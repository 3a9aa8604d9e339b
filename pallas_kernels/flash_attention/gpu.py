"""Flash attention over packed variable-length segments: Pallas kernel for GPU (Triton lowering).

Same inputs, options and result as `reference.flash_attention` (read its docstring for the
semantics). Used for prefill-only steps where every sequence starts at position 0, so keys and
values are the tokens of the queries themselves.

Verification status: this kernel is checked only in Pallas interpret mode on the CPU. It uses the
Triton lowering because Mosaic GPU has no interpret mode in this JAX (0.10.2), and no GPU was
available to compile or time it; expect to tune block sizes, num_warps and num_stages on hardware.

How it runs:
- The wrapper (`common.prepare_inputs`) pads rows to whole blocks, moves heads in front
  (q -> [Hkv, G, T, D], k/v -> [Hkv, T, D]), gives every row a segment id, and computes for each
  query block the range [kv_lo, kv_hi) of KV blocks it needs.
- Grid (query blocks, KV heads). A program holds the [block_q, D] query tiles of the G query heads
  that share one KV head, and runs a `fori_loop` over KV blocks kv_lo .. kv_hi-1 only: the range
  starts at the first row's segment start (or window start) and stops at the causal diagonal.
  Each iteration loads one [block_k, D] K and V tile and uses it for all G heads.
- Online softmax in float32 lives in the loop carry: per head a running max m and sum l
  [block_q, 1] and the unnormalised output acc [block_q, D].
Triton needs power-of-two tiles: block_q, block_k and head_dim must be powers of two (G need not
be: the heads are a static Python loop).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.compat import patch_interpret_mode
from pallas_kernels import cost
from pallas_kernels.flash_attention import common
from pallas_kernels.flash_attention.reference import check_options


def _kernel(
    kv_lo_ref,  # [1] int32: first KV block this query block needs
    kv_hi_ref,  # [1] int32: one past the last
    q_ref,  # [G, block_q, D]
    k_ref,  # [T_pad, D] (the whole KV head)
    v_ref,  # [T_pad, D]
    q_segment_ref,  # [block_q] int32
    q_start_ref,  # [block_q] int32: each query row's segment start
    kv_segment_ref,  # [T_pad] int32
    o_ref,  # [G, block_q, D]
    *,
    block_k,
    sm_scale,
    causal,
    sliding_window,
    attention_chunk,
    soft_cap,
):
    G, block_q, D = q_ref.shape
    q_tiles = [q_ref[g] for g in range(G)]  # G x [block_q, D], loaded once
    q_pos = (pl.program_id(0) * block_q + jnp.arange(block_q, dtype=jnp.int32))[:, None]  # [block_q, 1]
    q_seg = q_segment_ref[...][:, None]  # [block_q, 1]
    q_start = q_start_ref[...][:, None]  # [block_q, 1]

    def fold_kv_block(kv_block, state):
        keys = pl.ds(kv_block * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]  # [block_k, D], shared by the G heads
        k_pos = (kv_block * block_k + jnp.arange(block_k, dtype=jnp.int32))[None, :]  # [1, block_k]
        visible = common.visible_keys(
            q_pos, k_pos, q_seg, kv_segment_ref[keys][None, :], causal=causal, sliding_window=sliding_window,
            attention_chunk=attention_chunk, q_start=q_start,
        )  # [block_q, block_k]
        new_state = []
        for q, (m, l, acc) in zip(q_tiles, state):
            scores = common.attention_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap)  # [block_q, block_k]
            m, l, p, alpha = common.online_softmax_step(m, l, scores, visible)
            acc = alpha * acc + jnp.dot(
                p.astype(v.dtype), v, precision=common.dot_precision(v.dtype), preferred_element_type=jnp.float32
            )
            new_state.append((m, l, acc))
        return tuple(new_state)

    empty = (
        jnp.full((block_q, 1), -jnp.inf, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, D), jnp.float32),
    )
    state = jax.lax.fori_loop(kv_lo_ref[0], kv_hi_ref[0], fold_kv_block, (empty,) * G)
    for g, (_, l, acc) in enumerate(state):
        o_ref[g] = common.normalize(acc, l).astype(o_ref.dtype)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _power_of_two_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "causal", "sliding_window", "soft_cap", "attention_chunk", "block_q", "block_k", "num_warps", "num_stages",
        "interpret",
    ),
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
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D], q.dtype
    check_options(q, k, v, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk)
    T, Hq, D = q.shape
    if not _is_power_of_two(D):  # Triton's blocks are powers of two: zero dims change no score (Phi-3's 96 -> 128)
        Dp = 1 << (D - 1).bit_length()
        pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, Dp - D)))  # noqa: E731
        out = flash_attention(pad(q), pad(k), pad(v), cu_seq_lens, num_seqs, sm_scale=sm_scale, causal=causal,
                              sliding_window=sliding_window, soft_cap=soft_cap, attention_chunk=attention_chunk,
                              block_q=block_q, block_k=block_k,
                              num_warps=num_warps, num_stages=num_stages, interpret=interpret)
        return out[..., :D]
    # default blocks: 64 x 64, smaller where a program's q rows (G heads x block_q) and its
    # double-buffered K/V tiles would outgrow ~192 KiB of shared memory (an H100 has 227; head_dim
    # 512 with G = 4 at 64 x 64 asked for 512 KiB: measured)
    G = Hq // k.shape[1]
    budget = 192 * 1024 // q.dtype.itemsize  # entries
    block_k = block_k or max(16, min(64, 64 * 256 // D))
    block_q = block_q or max(16, min(64, _power_of_two_floor((budget - 2 * num_stages * block_k * D) // (G * D))))
    if not all(map(_is_power_of_two, (block_q, block_k, D))):
        raise ValueError(f"block_q and block_k must be powers of two; got {block_q}, {block_k}")
    if interpret:
        patch_interpret_mode()
    Hkv = k.shape[1]
    x = common.prepare_inputs(
        q, k, v, cu_seq_lens, num_seqs, block_q=block_q, block_k=block_k, causal=causal, sliding_window=sliding_window,
        attention_chunk=attention_chunk,
    )
    T_pad = x.k.shape[1]

    kernel = functools.partial(
        _kernel, block_k=block_k, sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        attention_chunk=attention_chunk, soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.q.shape, q.dtype),
        grid=(T_pad // block_q, Hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (i,)),  # kv_lo
            pl.BlockSpec((1,), lambda i, h: (i,)),  # kv_hi
            pl.BlockSpec((None, G, block_q, D), lambda i, h: (h, 0, i, 0)),
            pl.BlockSpec((None, T_pad, D), lambda i, h: (h, 0, 0)),
            pl.BlockSpec((None, T_pad, D), lambda i, h: (h, 0, 0)),
            pl.BlockSpec((block_q,), lambda i, h: (i,)),
            pl.BlockSpec((block_q,), lambda i, h: (i,)),  # q_start
            pl.BlockSpec((T_pad,), lambda i, h: (0,)),
        ],
        out_specs=pl.BlockSpec((None, G, block_q, D), lambda i, h: (h, 0, i, 0)),
        compiler_params=plt.CompilerParams(
            num_warps=num_warps if num_warps is not None else (4 if D <= 64 else 8), num_stages=num_stages
        ),
        interpret=interpret,
        cost_estimate=cost.flash_attention(T, Hq, Hkv, D, itemsize=q.dtype.itemsize, causal=causal),
        name="flash_attention_segments",
    )(x.kv_lo, x.kv_hi, x.q, x.k, x.v, x.q_segment, x.q_start, x.kv_segment)
    return common.restore_layout(out, T)

"""RoPE on this step's queries and keys, and the rotated keys and the values written into the
paged KV pool, in plain jnp: the truth the kernels match.

    rope_kv_write(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cos [T, D], sin [T, D],
                  k_pages [N, page_size, Hkv, D], v_pages [N, page_size, Hkv, D],
                  write_page [T] int32, write_offset [T] int32)
      -> (q_rot [T, Hq, D], k_rot [T, Hkv, D], k_pages, v_pages)

RoPE is Hugging Face's rotate-half form, computed in float32 and cast back to the input's dtype:

    rope(x) = x * cos + rotate_half(x) * sin,    rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])

Token t's rotated key and its value land in slot `write_offset[t]` of page `write_page[t]` of the
pools (cast to the pools' dtype); nothing else in the pools changes. Slots of different tokens are
distinct, except that padding tokens may all be sent to one scratch page, whose content is then
unspecified. `k_rot` is returned for attention over this step's own keys (flash attention of a
fresh prefill).

This is what each decoder layer does between its QKV projection and attention. The kernels do it
in one pass: each token's q and k are read once, rotated in registers / VMEM, and the key and
value rows are stored straight into their pages (in place: callers donate the pools).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(q, k, v, cos, sin, write_page, write_offset) -> None:
    """ValueError naming the first argument whose shape does not fit the others (pools aside)."""
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"q and k must be [T, heads, D]; got q {q.shape}, k {k.shape}")
    T, _, D = q.shape
    Hkv = k.shape[1]
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE; got {D}")
    if k.shape != (T, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, Hkv, D] with q's T and D: q {q.shape}, k {k.shape}, v {v.shape}")
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos and sin must be [T, D] = {(T, D)}; got {cos.shape}, {sin.shape}")
    if write_page.shape != (T,) or write_offset.shape != (T,):
        raise ValueError(f"write_page and write_offset must be [T] = [{T}]; got {write_page.shape}, {write_offset.shape}")


def check_pools(k, k_pages, v_pages) -> None:
    """ValueError unless the separate pools are [pages, page_size, Hkv, D] like k's heads."""
    Hkv, D = k.shape[1:]
    if k_pages.ndim != 4 or k_pages.shape[2:] != (Hkv, D) or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must be [pages, page_size, Hkv, D] with Hkv={Hkv}, D={D}: "
            f"got {k_pages.shape}, {v_pages.shape}"
        )


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout) in float32. x [T, heads, D]; cos, sin [T, R] -> x's dtype.

    R < D (partial rotary embeddings, Phi-3): the first R dims of each head turn, the rest pass."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :R], cos, sin), x[..., R:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)


@jax.jit
def rope_kv_write(q, k, v, cos, sin, k_pages, v_pages, write_page, write_offset):
    check_inputs(q, k, v, cos, sin, write_page, write_offset)
    check_pools(k, k_pages, v_pages)
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pages = k_pages.at[write_page, write_offset].set(k_rot.astype(k_pages.dtype))
    v_pages = v_pages.at[write_page, write_offset].set(v.astype(v_pages.dtype))
    return q_rot, k_rot, k_pages, v_pages


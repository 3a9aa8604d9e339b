"""The LoRA delta of a batch whose tokens each pick an adapter slot, written the plainest way: the
truth the kernels and the dense XLA path are tested against.

    lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T] int32) -> float32 [T, sum O_p]

For token t with slot s = slot[t], module p's columns are (x[t] @ A_p[s]) @ B_p[s], where A_p[s] is
columns p R .. (p + 1) R of a[s] (the P modules reading the same input share one A stack, their
blocks side by side) and B_p[s] = bs[p][s]; the modules' results sit side by side. Slot 0 is "no
adapter": its A and B are zeros, and its tokens get exactly zeros. Scales are folded into B.

Precision: x is cast to the stacks' dtype, x A accumulates in float32 and is rounded to the
stacks' dtype before the second product (what every implementation does, so a bf16 table gives
the same rounding everywhere), which accumulates in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_inputs(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> tuple[int, int]:
    """Raises ValueError on shapes that do not fit together; returns (P modules, rank R)."""
    if x.ndim != 2 or a.ndim != 3 or x.shape[1] != a.shape[1]:
        raise ValueError(f"lora_delta: x {x.shape} and a {a.shape} must be [T, K] and [N, K, P R]")
    if not bs or any(b.ndim != 3 or b.shape[0] != a.shape[0] for b in bs):
        raise ValueError(f"lora_delta: bs {[b.shape for b in bs]} must be P arrays [N, R, O_p] over a's {a.shape[0]} slots")
    R = bs[0].shape[1]
    if any(b.shape[1] != R for b in bs) or a.shape[2] != len(bs) * R:
        raise ValueError(f"lora_delta: a's {a.shape[2]} columns must be {len(bs)} blocks of the B stacks' rank {R}")
    if slot.shape != (x.shape[0],) or not jnp.issubdtype(slot.dtype, jnp.integer):
        raise ValueError(f"lora_delta: slot {slot.shape} {slot.dtype} must be integers [T] for x's {x.shape[0]} tokens")
    return len(bs), R


def lora_delta(x: jax.Array, a: jax.Array, bs, slot: jax.Array) -> jax.Array:
    """Each token's own A and B gathered, two batched products (see the module docstring)."""
    _, R = check_inputs(x, a, bs, slot)
    hi = jax.lax.Precision.HIGHEST
    xa = jnp.einsum("tk,tkr->tr", x.astype(a.dtype), a[slot], precision=hi, preferred_element_type=jnp.float32)
    xa = xa.astype(a.dtype)  # [T, P R]
    return jnp.concatenate([
        jnp.einsum("tr,tro->to", xa[:, p * R : (p + 1) * R], b[slot], precision=hi, preferred_element_type=jnp.float32)
        for p, b in enumerate(bs)
    ], axis=-1)

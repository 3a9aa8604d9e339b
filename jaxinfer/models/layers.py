"""Building blocks of a Llama-family decoder, as pure functions of arrays.

Dtype policy: weights are stored in the parameter dtype and matmuls take their inputs in that
dtype, accumulating in float32 (`preferred_element_type`); everything else (norms, residual
stream, RoPE, softmax) runs in the compute dtype of the activations passed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.quantization import QuantizedWeight, int8_activation_matmul, rotate_rows
from jaxinfer.ops.sparsity import Sparse24Weight


def matmul(x: jax.Array, w: jax.Array | QuantizedWeight | Sparse24Weight, kernels: Kernels = Kernels()) -> jax.Array:
    """x [..., in] @ w [in, out] -> float32 [..., out].

    A plain weight takes x cast to its dtype with f32 accumulation. A QuantizedWeight (int8 /
    int4 / fp8, per column or group, maybe with offsets: jaxinfer.ops.quantization) goes through
    the kernel table's quantized matmul,
    which dequantizes inside the call; one with int8 activations (w8a8) multiplies integers.
    A Sparse24Weight (2:4 sparse, kept compressed: jaxinfer.ops.sparsity) goes through the
    table's 2:4 matmul, x cast to the values' dtype as for a plain weight.
    """
    if isinstance(w, Sparse24Weight):
        x2 = x.reshape(-1, x.shape[-1]).astype(w.dtype)
        y = kernels.sparse24_matmul(x2, w.values, w.mask)
        return y.astype(jnp.float32).reshape(*x.shape[:-1], y.shape[-1])
    if not isinstance(w, QuantizedWeight):
        return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if w.activations == "int8":
        return int8_activation_matmul(x2, w).reshape(*x.shape[:-1], w.qweight.shape[-1])
    if w.input_order is not None:  # act-order: the rows are stored sorted by group
        x2 = jnp.take(x2, w.input_order, axis=1)
    y = kernels.quantized_matmul(x2, w.qweight, w.scales, w.offsets, mode=w.mode, group_size=w.group_size)
    return y.astype(jnp.float32).reshape(*x.shape[:-1], y.shape[-1])


def embed_lookup(table: jax.Array | QuantizedWeight, token_ids: jax.Array) -> jax.Array:
    """Rows `token_ids` [T] of an embedding table [V, H], or the columns of a quantized one, which
    is stored [H, V] as the tied LM head reads it: [T, H] (the table's dtype; float32 if quantized)."""
    if isinstance(table, QuantizedWeight):
        columns = jax.tree.map(lambda a: a[..., token_ids], table)  # qweight [H (/2), T], scales [G, T]
        w = columns.dequantize()  # [H, T]
        if table.rotated:  # w8a8 stores R^T w: turn it back
            w = rotate_rows(w, axis=0, inverse=True)
        return w.T
    return table[token_ids]


def table_vocab(table: jax.Array | QuantizedWeight, head: bool = False) -> int:
    """How many vocabulary entries a (local shard of an) embedding table [V, H] holds (a quantized
    one is stored [H, V]); `head`: of an LM head [H, V]."""
    if isinstance(table, QuantizedWeight):
        return table.qweight.shape[-1]
    return table.shape[-1] if head else table.shape[0]


def vocab_parallel_lookup(table: jax.Array | QuantizedWeight, token_ids: jax.Array, axis: str) -> jax.Array:
    """`embed_lookup` of a table split on the vocabulary over the mesh axis `axis` (inside
    shard_map; each shard holds a contiguous block of ids): each shard looks up the ids in its
    block, zeros for the others, in the table's dtype (float32 if quantized); the caller sums
    the shards (psum over `axis`). [T, H]."""
    rows = table_vocab(table)
    local = token_ids - jax.lax.axis_index(axis) * rows
    inside = (local >= 0) & (local < rows)
    x = embed_lookup(table, jnp.where(inside, local, 0))
    return jnp.where(inside[:, None], x, jnp.zeros((), x.dtype))


def tied_logits(h: jax.Array, table: jax.Array | QuantizedWeight, kernels: Kernels = Kernels()) -> jax.Array:
    """h [R, H] @ the embedding table's transpose -> float32 [R, V]: the tied LM head."""
    if isinstance(table, QuantizedWeight):  # stored [H, V] already
        return matmul(h, table, kernels)
    return jnp.einsum("rh,vh->rv", h.astype(table.dtype), table, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, b: jax.Array | None = None, kernels: Kernels = Kernels()) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b [out]); f32 accumulation, result in x's dtype."""
    y = matmul(x, w, kernels)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, kernels: Kernels = Kernels()):
    """(rms_norm(x + residual), x + residual): the residual add fused with the next norm, one pass
    over [T, H] with the Pallas kernels (pallas_kernels.fused_rms_norm)."""
    return kernels.add_rms_norm(x, residual, weight, eps=eps)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (mean and variance), computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 as HF does, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I], in float32, returned in the input's dtype."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(gate_up.dtype)


def gate_up_swiglu(x, w_gate_up, b_gate_up=None, kernels: Kernels = Kernels()):
    """silu(gate(x)) * up(x): x [T, H] -> [T, I] in x's dtype. w_gate_up [H, 2I] = [gate | up].

    Gate and up are one matmul. A float weight without bias goes through the kernel table's
    SwiGLU matmul (with the Pallas kernels silu(gate) * up is applied to the accumulators, so the
    [T, 2I] projection never reaches memory); a quantized or biased one through `linear`, then
    `swiglu`.
    """
    if b_gate_up is None and not isinstance(w_gate_up, (QuantizedWeight, Sparse24Weight)):
        return kernels.swiglu_matmul(x, w_gate_up)
    return swiglu(linear(x, w_gate_up, b_gate_up, kernels))


def rms_norm_weight(weight: jax.Array, offset: float) -> jax.Array:
    """The factor an RMSNorm multiplies by: weight, or (offset + weight) in float32 (Gemma stores
    w - 1 and HF adds the 1 in float32, so a bfloat16 weight near -1 keeps its precision)."""
    return weight if not offset else weight.astype(jnp.float32) + offset


def gelu_tanh_glu(gate_up: jax.Array) -> jax.Array:
    """[..., 2I] = [gate | up] -> gelu_tanh(gate) * up [..., I] (GeGLU, Gemma), in float32."""
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.gelu(gate, approximate=True) * up).astype(gate_up.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)

"""The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as a Flax NNX module.

The module holds the weights; its `__call__` is a pure function of them, the paged KV cache and a
ragged batch, meant to run under `jax.jit` after `nnx.split` / `nnx.merge`.

All decoder layers live in one `DecoderLayers` module whose weights carry a leading
`[num_layers]` axis; the forward pass runs the layers in a `lax.fori_loop` (one compiled layer,
not N), carrying the residual stream and the whole KV cache, which is updated in place.

Parameter layout (flat names as in `param_shapes`; linear weights are [in, out]):

    embed [V, H]   final_norm [H]   lm_head [H, V] (absent with tied embeddings)
    layers.attn_norm [L, H]   layers.mlp_norm [L, H]
    layers.qkv_proj [L, H, (Hq + 2*Hkv)*D] = [q | k | v]      layers.o_proj [L, Hq*D, H]
    layers.gate_up_proj [L, H, 2*I] = [gate | up]             layers.down_proj [L, I, H]
    optional: layers.qkv_bias [L, (Hq + 2*Hkv)*D], layers.o_bias [L, H],
              layers.gate_up_bias [L, 2*I], layers.down_bias [L, H], layers.{q,k}_norm [L, D]

Q, K and V are one matmul, and gate and up another (`param_parts` says which columns hold which
HF projection; the checkpoint loaders fill them in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.attention import kv_write_locations, write_kv_and_attend
from jaxinfer.batch import RaggedBatch
from jaxinfer.config import ModelConfig
from jaxinfer.kernels import Kernels
from jaxinfer.kv_cache import SCRATCH_PAGE, KVCache
from jaxinfer.models.layers import add_rms_norm, linear, matmul, rms_norm, rope_cos_sin, swiglu_mlp


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat parameter name -> shape, for exactly the parameters this config has."""
    c = config
    L, H, I, V, D = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    q_dim, kv_dim = c.num_heads * D, c.num_kv_heads * D
    qkv_dim = q_dim + 2 * kv_dim
    shapes = {
        "embed": (V, H),
        "final_norm": (H,),
        "layers.attn_norm": (L, H),
        "layers.qkv_proj": (L, H, qkv_dim),
        "layers.o_proj": (L, q_dim, H),
        "layers.mlp_norm": (L, H),
        "layers.gate_up_proj": (L, H, 2 * I),
        "layers.down_proj": (L, I, H),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    if c.qkv_bias:
        shapes["layers.qkv_bias"] = (L, qkv_dim)
    if c.o_bias:
        shapes["layers.o_bias"] = (L, H)
    if c.mlp_bias:
        shapes.update({"layers.gate_up_bias": (L, 2 * I), "layers.down_bias": (L, H)})
    if c.qk_norm:
        shapes.update({"layers.q_norm": (L, D), "layers.k_norm": (L, D)})
    return shapes


def param_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused param -> its parts in order on the last axis, as (name, width); the loaders' map."""
    c = config
    qkv = (("q", c.num_heads * c.head_dim), ("k", c.num_kv_heads * c.head_dim), ("v", c.num_kv_heads * c.head_dim))
    gate_up = (("gate", c.intermediate_size), ("up", c.intermediate_size))
    parts = {"layers.qkv_proj": qkv, "layers.qkv_bias": qkv, "layers.gate_up_proj": gate_up, "layers.gate_up_bias": gate_up}
    return {name: p for name, p in parts.items() if name in param_shapes(config)}


def split_qkv(qkv: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[T, (Hq + 2*Hkv)*D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
    c = config
    T = qkv.shape[0]
    q_end = c.num_heads * c.head_dim
    k_end = q_end + c.num_kv_heads * c.head_dim
    q = qkv[:, :q_end].reshape(T, c.num_heads, c.head_dim)
    k = qkv[:, q_end:k_end].reshape(T, c.num_kv_heads, c.head_dim)
    v = qkv[:, k_end:].reshape(T, c.num_kv_heads, c.head_dim)
    return q, k, v


def _init(name: str, shape, dtype, key) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class DecoderLayers(nnx.Module):
    """The weights of all decoder layers, each stacked on a leading [num_layers] axis."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype, rngs: nnx.Rngs):
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(_init(name, shape, dtype, rngs.params())))

    def stacked(self) -> dict[str, jax.Array]:
        """name -> [L, ...] array (or a QuantizedWeight standing for a [L, K, N] one)."""
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, param_dtype=jnp.float32, compute_dtype=jnp.float32, kernels: Kernels = Kernels(), rngs: nnx.Rngs
    ):
        self.config = config
        self.compute_dtype = compute_dtype
        self.kernels = kernels  # static: XLA paths or Pallas kernels (jaxinfer.kernels)
        shapes = param_shapes(config)
        layer_shapes = {k.split(".", 1)[1]: v for k, v in shapes.items() if k.startswith("layers.")}
        self.embed = nnx.Param(_init("embed", shapes["embed"], param_dtype, rngs.params()))
        self.layers = DecoderLayers(layer_shapes, param_dtype, rngs)
        self.final_norm = nnx.Param(_init("final_norm", shapes["final_norm"], param_dtype, None))
        if "lm_head" in shapes:
            self.lm_head = nnx.Param(_init("lm_head", shapes["lm_head"], param_dtype, rngs.params()))

    def __call__(self, kv: KVCache, batch: RaggedBatch, *, query_block: int) -> tuple[jax.Array, KVCache]:
        """Returns (logits [R, V] float32 for the rows batch.logits_indices, the updated cache)."""
        c = self.config
        T = batch.token_ids.shape[0]
        S = batch.kv_lens.shape[0]
        page_size = kv.page_size

        x = self.embed[...][batch.token_ids].astype(self.compute_dtype)  # [T, H]
        write_page, write_offset = kv_write_locations(batch, page_size, SCRATCH_PAGE)  # [T] each
        seq_of_token = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)
        cos, sin = rope_cos_sin(c, batch.positions, batch.kv_lens[seq_of_token])  # [T, D] each
        stacked = self.layers.stacked()
        sm_scale = float(c.head_dim) ** -0.5
        kernels = self.kernels

        # Fold the layer axis into the page axis: layer i's page p is page i * P + p of one pool.
        L, num_pages = kv.k.shape[:2]
        pool_shape = (L * num_pages,) + kv.k.shape[2:]  # [L * P, page_size, Hkv, D]

        # The loop carries the residual stream as (hidden, residual): each norm takes in the add
        # that precedes it (add_rms_norm), so on accelerators the add and the norm are one pass.
        def layer(i, carry):
            hidden, residual, k_pages, v_pages = carry  # [T, H] each; the stream is hidden + residual
            w = {name: jax.tree.map(lambda a: a[i], p) for name, p in stacked.items()}  # layer i's weights
            h, residual = add_rms_norm(hidden, residual, w["attn_norm"], c.rms_norm_eps, kernels)
            q, k, v = split_qkv(linear(h, w["qkv_proj"], w.get("qkv_bias"), kernels), c)  # one matmul
            if c.qk_norm:
                q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
            attn, k_pages, v_pages = write_kv_and_attend(  # RoPE, KV write, attention
                q, k, v, cos, sin, k_pages, v_pages, i * num_pages, write_page, write_offset, batch,
                sm_scale=sm_scale, sliding_window=c.sliding_window, query_block=query_block, kernels=kernels,
            )
            attn_out = linear(attn.reshape(T, c.num_heads * c.head_dim), w["o_proj"], w.get("o_bias"), kernels)
            h, residual = add_rms_norm(attn_out, residual, w["mlp_norm"], c.rms_norm_eps, kernels)
            hidden = swiglu_mlp(h, w["gate_up_proj"], w["down_proj"], w.get("gate_up_bias"), w.get("down_bias"), kernels)
            return hidden, residual, k_pages, v_pages

        hidden, residual, k_pages, v_pages = jax.lax.fori_loop(
            0, c.num_layers, layer, (x, jnp.zeros_like(x), kv.k.reshape(pool_shape), kv.v.reshape(pool_shape))
        )
        rows = batch.logits_indices
        h, _ = add_rms_norm(hidden[rows], residual[rows], self.final_norm[...], c.rms_norm_eps, kernels)  # [R, H]
        if c.tie_word_embeddings:
            embed = self.embed[...]
            logits = jnp.einsum("rh,vh->rv", h.astype(embed.dtype), embed, preferred_element_type=jnp.float32)
        else:
            logits = matmul(h, self.lm_head.get_value(), kernels)
        return logits, KVCache(k=k_pages.reshape(kv.k.shape), v=v_pages.reshape(kv.v.shape))


def flat_to_nested(flat: dict[str, np.ndarray]) -> dict:
    """{"layers.q_proj": a} -> {"layers": {"q_proj": a}} (the shape of nnx's pure state dict)."""
    nested: dict = {}
    for name, value in flat.items():
        node = nested
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return nested


def nested_to_flat(nested: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(nested_to_flat(v, name + "."))
        else:
            flat[name] = v
    return flat

"""The decoder one layer at a time over calibration text, with the input of every matmul.

GPTQ and AWQ quantize a layer from the activations that reach its matmuls, and quantize layers in
order, each seeing the activations of the layers before it already quantized. The serving model
runs all layers in one jitted loop over a paged cache and keeps no intermediate; this is the same
decoder written layer by layer for whole sequences (dense causal attention), out of the model's
own pieces (`models.layers`, `split_qkv`, RoPE, the flash-attention reference):

    x = embed(ids)                                  # [T, H], per calibration sequence
    for layer i:
        taps = layer_inputs(w_i, x)                 # what reaches qkv_proj, o_proj, gate_up_proj, down_proj
        ... quantize layer i from taps ...
        x = layer_forward(w_i_quantized, x)         # the next layer's input

`tests/test_calibration.py` holds it to the serving model: the same logits. `layer_by_layer` is
that loop with a compression step per layer (pruning's driver; calibrate.py runs its own copy).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.obs import fast_jit
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import embed_lookup, linear, matmul, rms_norm, swiglu, tied_logits
from jaxinfer.models.rope import rope_cos_sin
from jaxinfer.models.llama import split_qkv
from pallas_kernels.flash_attention.reference import flash_attention
from pallas_kernels.rope_kv_write.reference import apply_rope

MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_supported(config: ModelConfig) -> None:
    if config.is_moe:
        raise ValueError(f"calibration (GPTQ / AWQ) supports dense models; {config.model_type} is a mixture of experts")


def layer_weights(flat: dict, i: int) -> dict:
    """Layer i's weights from flat stacked params ("layers.qkv_proj" [L, ...] -> "qkv_proj")."""
    return {name.split(".", 1)[1]: jax.tree.map(lambda a: a[i], w) for name, w in flat.items() if name.startswith("layers.")}


@functools.partial(fast_jit, static_argnums=0)  # (XLA's full optimization on the CPU: run for every layer and sequence)
def _layer(config: ModelConfig, w: dict, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """One decoder layer over one sequence: x [T, H] float32 -> (x after the layer, the four matmul inputs)."""
    c = config
    T = x.shape[0]
    h = rms_norm(x, w["attn_norm"], c.rms_norm_eps)
    q, k, v = split_qkv(linear(h, w["qkv_proj"], w.get("qkv_bias")), c.num_heads, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = rms_norm(q, w["q_norm"], c.rms_norm_eps), rms_norm(k, w["k_norm"], c.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn = flash_attention(q, k, v, jnp.array([0, T], jnp.int32), jnp.array([1], jnp.int32),
                           sm_scale=float(c.head_dim) ** -0.5, sliding_window=c.sliding_window)
    attn = attn.reshape(T, c.num_heads * c.head_dim)
    x = x + linear(attn, w["o_proj"], w.get("o_bias"))
    h2 = rms_norm(x, w["mlp_norm"], c.rms_norm_eps)
    act = swiglu(linear(h2, w["gate_up_proj"], w.get("gate_up_bias")))
    x = x + linear(act, w["down_proj"], w.get("down_bias"))
    return x, {"qkv_proj": h, "o_proj": attn, "gate_up_proj": h2, "down_proj": act}


@functools.lru_cache(maxsize=8)  # (computed op by op: once per length, not once per layer and sequence)
def rope_tables(config: ModelConfig, T: int):
    positions = jnp.arange(T)
    return rope_cos_sin(config, positions, jnp.full((T,), T))


def embed(flat: dict, token_ids) -> jax.Array:
    """[T, H] float32 embeddings of one sequence."""
    return embed_lookup(flat["embed"], jnp.asarray(token_ids, jnp.int32)).astype(jnp.float32)


def layer_forward(config: ModelConfig, w: dict, x: jax.Array):
    """(x after layer w, {matmul: its input}) for one sequence x [T, H]."""
    cos, sin = rope_tables(config, x.shape[0])
    return _layer(config, w, x, cos, sin)


def layer_by_layer(config: ModelConfig, flat: dict, sequences: list[list[int]], compress_layer: Callable[[int, dict, dict], dict],
                   log: Callable[[str], None] | None = None) -> list[dict]:
    """The decoder layer by layer over calibration `sequences`, each layer compressed from the
    inputs that reach its matmuls with the layers before it already compressed (as GPTQ, AWQ,
    Wanda and SparseGPT do): `compress_layer(i, w, inputs)` gets layer i's weights (name ->
    array) and {matmul: [its input [T, K] per sequence]} and returns the weights the compressed
    layer computes with (pruned / dequantized floats). No sequences: no forward (the inputs
    empty). Returns each layer's compressed weights."""
    flat = {name: jnp.asarray(a, jnp.float32) for name, a in flat.items()}
    xs = [embed(flat, ids) for ids in sequences]
    layers = []
    for i in range(config.num_layers):
        t0 = time.perf_counter()
        w = layer_weights(flat, i)
        taps = [layer_forward(config, w, x)[1] for x in xs]
        w = compress_layer(i, w, {name: [t[name] for t in taps] for name in MATMULS})
        xs = [layer_forward(config, w, x)[0] for x in xs]
        layers.append(w)
        if log:
            log(f"layer {i + 1}/{config.num_layers}: {time.perf_counter() - t0:.1f} s")
    return layers


def logits(config: ModelConfig, flat: dict, x: jax.Array) -> jax.Array:
    """The LM head over the last layer's output x [T, H]: [T, V] float32."""
    h = rms_norm(x, flat["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        return tied_logits(h, flat["embed"])
    return matmul(h, flat["lm_head"])


def log_softmax(config: ModelConfig, flat: dict, token_ids) -> np.ndarray:
    """The whole decoder over one sequence, layer by layer: log-softmax [T, V] (float64)."""
    x = embed(flat, token_ids)
    for i in range(config.num_layers):
        x, _ = layer_forward(config, layer_weights(flat, i), x)
    return np.asarray(jax.nn.log_softmax(logits(config, flat, x), axis=-1), np.float64)

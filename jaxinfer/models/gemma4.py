"""Gemma 4 (text): Gemma's sandwich norms over sliding and global layers of two shapes, with
per-layer input embeddings, K/V shared by the last layers, and a mixture of experts beside the MLP.

    x = embed(tokens) * sqrt(H)                               # rounded to the compute dtype first
    ple = (rms_norm(x @ W_ple / sqrt(H)) + embed_ple(tokens) * sqrt(P)) / sqrt(2)   # [T, L, P] (E2B, E4B)
    per layer l (a sliding window on "sliding_attention" layers; the global ones have head_dim 512,
    their own KV heads and, with attention_k_eq_v, values from the key projection):
        q, k, v = proj(norm(x))                               # q and k RMS-normed per head with a
                                                              # weight, v without one; scores unscaled
        h = attention(rope(q), rope(k), v)                    # sliding: RoPE base 10k over the head;
                                                              # global: base 1M over its first quarter
        x = x + norm(h)                                       # ("proportional" RoPE)
        m = mlp(norm(x))                                      # GeGLU; 2x wide on the KV-shared layers
        MoE models: m = norm(m) + norm(experts(norm(x)))      # routed on rms_norm(x) * scale / sqrt(H):
                                                              # softmax, top-k, renormalised, times a
                                                              # learned per-expert scale
        x = x + norm(m)
        x = x + norm(W_up(gelu_tanh(W_gate x) * ple[:, l]))   # per-layer input (E2B, E4B)
        x = x * layer_scalar[l]
    logits = soft_cap(lm_head(norm(x)))

The last `num_kv_shared_layers` layers compute no K/V: each attends over the pages of the last
earlier layer of its kind (`jaxinfer.kv_groups`). Norms multiply by w (not Gemma 2/3's 1 + w).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import Decoder, LayerRef, StepInputs
from jaxinfer.models.layers import linear, matmul
from jaxinfer.models.moe import route
from sharding.expert_parallel import moe_experts


def gelu_tanh_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' activation (GeGLU) on split gate / up: gelu_tanh(gate) * up."""
    return jax.nn.gelu(gate.astype(jnp.float32), approximate=True) * up.astype(jnp.float32)


class Gemma4ForCausalLM(Decoder):
    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        c = self.config
        h, residual = self.add_norm(hidden, residual, w["attn_norm"])
        attn, pool = self.attention(step, layer, kind, w, lw, h, pool)
        h, x = self.add_norm(self.norm(attn, w["post_attn_norm"]), residual, w["mlp_norm"])  # x: the stream
        mlp = self.dense_mlp(step, w, lw, h)
        if "router" in w:
            mlp = self.norm(mlp, w["post_dense_norm"]) + self.norm(self.experts(w, x), w["post_experts_norm"])
        x = x + self.norm(mlp, w["post_mlp_norm"])
        if step.per_layer_inputs is not None:
            gate = jax.nn.gelu(linear(x, w["ple_gate"], None, self.kernels).astype(jnp.float32), approximate=True)
            ple = (gate * step.per_layer_inputs[:, layer.index].astype(jnp.float32)).astype(x.dtype)  # [Tl, P]
            x = x + self.norm(linear(ple, w["ple_proj"], None, self.kernels), w["ple_norm"])
        if c.layer_scalar:
            x = (x * w["layer_scalar"].astype(x.dtype)).astype(x.dtype)
        return x, jnp.zeros_like(x), pool

    def experts(self, w: dict, x: jax.Array) -> jax.Array:
        """The mixture of experts of the stream x [Tl, H], summed over the tensor shards: [Tl, H]."""
        c, par = self.config, self.parallel
        scaled = self._l2_norm(x).astype(jnp.float32) * w["router_scale"].astype(jnp.float32) * c.hidden_size**-0.5
        weights, ids = route(matmul(scaled.astype(x.dtype), w["router"], self.kernels), c.num_experts_per_tok, normalize=True)
        weights = weights * w["expert_scale"].astype(jnp.float32)[ids]  # [Tl, k]
        h = self.norm(x, w["experts_norm"])
        out = moe_experts(h.astype(w["experts_gate_up"].dtype), ids, weights, w["experts_gate_up"], w["experts_down"],
                          expert_axis="expert" if par.ep > 1 else None, num_experts=c.num_experts, activation=gelu_tanh_gate)
        return self._tensor_sum(out)

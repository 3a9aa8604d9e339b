"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE (replaces a dense layer's MLP).

    router_logits = x @ W_router                                  # [T, E]
    weights, ids  = top-k of softmax(router_logits)               # [T, k] each, in float32
                    (renormalised to sum to 1 when config.norm_topk_prob; Mixtral always)
    out           = sum_j weights[:, j] * expert_{ids[:, j]}(x)   # SwiGLU experts
                  + sigmoid(x @ W_shared_gate) * shared_expert(x) # Qwen2-MoE only

MiniMax-M2 and GLM-4.5 score each expert with a sigmoid and pick the k largest after adding a
learned correction bias (the weights are the sigmoid scores, renormalised); GLM-4.5 (and
DeepSeek-V3) picks them from the best groups of experts only, scales their weights, and adds
ungated shared experts. Its first layers are dense (`config.first_dense_layers`). DeepSeek-V2
keeps the softmax and ranks the groups by their best expert.

Llama 4 weighs an expert's *input* instead of its output (`config.router_scales_inputs`):

    out = sum_j expert_{ids[:, j]}(weights[:, j] * x) + shared_expert(x)   # sigmoid weights, not renormalised

so each (token, choice) pair runs as a row of its own with weight 1.

GPT-OSS adds biases to the router and to every expert's gate/up and down projections, and its
experts clamp their SwiGLU (`clamped_swiglu`). The down projections' biases are added after the
grouped matmul, as sum_j weights[:, j] * b_down[ids[:, j]] (the same on every device: once).

The experts run as a grouped matmul over the tokens sorted by expert
(`sharding.expert_parallel.moe_experts`; experts kept quantized, GPT-OSS's mxfp4, through the
kernel table's `grouped_matmul`, which lays the rows out by expert itself); with expert parallelism each device holds E / ep experts
and the (token, expert) pairs travel to their expert's device and back with all_to_all, dropping
none. With tensor parallelism every expert's (and the shared expert's) width is split too, so
this returns a partial sum the decoder adds over the tensor axis with its other MLP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from jaxinfer.models.layers import gate_up_swiglu, matmul
from jaxinfer.ops.quantization import QuantizedWeight
from sharding.expert_parallel import moe_experts
from sharding.mesh import ParallelConfig


def route(router_logits: jax.Array, top_k: int, normalize: bool, scoring: str = "softmax",
          correction_bias: jax.Array | None = None, groups: int = 1, top_groups: int = 1,
          scale: float = 1.0, group_score: str = "top2") -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), as HF routes:
    scores = softmax over all experts (or an independent sigmoid per expert: MiniMax-M2, GLM-4.5)
    in float32; the k largest (after adding a correction bias [E], which picks experts but does not
    weigh them; with `groups` > 1 only from the `top_groups` groups of E / groups experts whose
    two best choices sum highest, or whose best is highest with group_score="max": DeepSeek-V2),
    their scores optionally renormalised over those k, times `scale`."""
    logits = router_logits.astype(jnp.float32)
    probs = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = probs if correction_bias is None else probs + correction_bias.astype(jnp.float32)
    if groups > 1:
        T, E = choice.shape
        by_group = choice.reshape(T, groups, E // groups)
        group_scores = jax.lax.top_k(by_group, 2)[0].sum(axis=-1) if group_score == "top2" else by_group.max(axis=-1)  # [T, groups]
        _, best = jax.lax.top_k(group_scores, top_groups)  # [T, top_groups]
        keep = jnp.zeros((T, groups), bool).at[jnp.arange(T)[:, None], best].set(True)
        choice = jnp.where(keep[:, :, None], by_group, -jnp.inf).reshape(T, E)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * scale, ids.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    """GPT-OSS's expert activation: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def _grouped_matmul(x: jax.Array, group_of_row: jax.Array, w: QuantizedWeight, kernels: Kernels) -> jax.Array:
    """x [N, K] rows, each times its expert's matrix of the quantized stack w [E, K, out] (E: none) -> float32 [N, out]."""
    return kernels.grouped_matmul(x, group_of_row, w.qweight, w.scales, w.offsets, mode=w.mode, group_size=w.group_size)


def moe_mlp(x: jax.Array, w: dict, config: ModelConfig, parallel: ParallelConfig, kernels: Kernels = Kernels()) -> jax.Array:
    """x [T, H] -> this tensor shard's partial MLP output [T, H] float32.

    w: one layer's weights: router [H, E], experts_gate_up [E_local, H, 2*Ie_local],
    experts_down [E_local, Ie_local, H] and, for Qwen2-MoE, shared_gate_up [H, 2*Is_local],
    shared_down [Is_local, H], shared_expert_gate [H, 1].
    """
    router_logits = matmul(x, w["router"], kernels)  # [T, E]
    if "router_bias" in w:
        router_logits = router_logits + w["router_bias"].astype(jnp.float32)
    weights, ids = route(router_logits, config.num_experts_per_tok, config.norm_topk_prob, config.router_scoring,
                         w.get("router_correction_bias"), config.router_groups, config.router_top_groups,
                         config.routed_scaling_factor, config.router_group_score)
    w_gate_up, w_down = w["experts_gate_up"], w["experts_down"]
    T, k = ids.shape
    routed_x, routed_ids, routed_weights = x, ids, weights
    if config.router_scales_inputs:  # one row per (token, choice): its input scaled, its output summed as is
        routed_x = (x[:, None, :].astype(jnp.float32) * weights[:, :, None]).astype(x.dtype).reshape(T * k, -1)  # [T*k, H]
        routed_ids, routed_weights = ids.reshape(T * k, 1), jnp.ones((T * k, 1), jnp.float32)
    mlp = {}
    if config.swiglu_limit is not None:
        mlp["activation"] = functools.partial(clamped_swiglu, limit=config.swiglu_limit, alpha=config.swiglu_alpha)
    if isinstance(w_gate_up, QuantizedWeight):  # experts kept as the checkpoint stores them (GPT-OSS's mxfp4)
        mlp["grouped_matmul"] = functools.partial(_grouped_matmul, kernels=kernels)
    else:
        routed_x = routed_x.astype(w_gate_up.dtype)
    out = moe_experts(
        routed_x, routed_ids, routed_weights, w_gate_up, w_down,
        expert_axis="expert" if parallel.ep > 1 else None, num_experts=config.num_experts,
        b_gate_up=w.get("experts_gate_up_bias"), **mlp,
    )
    if config.router_scales_inputs:
        out = out.reshape(T, k, -1).sum(axis=1)  # [T, H]
    if "experts_down_bias" in w:  # [E, H] on every device: added by tensor shard 0 only (the caller sums the shards)
        bias = jnp.einsum("tk,tkh->th", weights, w["experts_down_bias"][ids].astype(jnp.float32))
        out = out + (bias if parallel.tp == 1 else jnp.where(jax.lax.axis_index("tensor") == 0, bias, 0.0))
    if "shared_gate_up" in w:
        shared = matmul(gate_up_swiglu(x, w["shared_gate_up"], None, kernels), w["shared_down"], kernels)  # [T, H] partial
        if "shared_expert_gate" in w:  # Qwen2-MoE; GLM-4.5's shared experts are always fully on
            shared = jax.nn.sigmoid(matmul(x, w["shared_expert_gate"], kernels)) * shared  # gate [T, 1]: the same on every shard
        out = out + shared
    return out

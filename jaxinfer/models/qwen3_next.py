"""Qwen3-Next (qwen3_next), Qwen3.5 (qwen3_5_text) and Qwen3.5-MoE (qwen3_5_moe_text; the text
decoder of either's multimodal folder):
Gated DeltaNet (linear attention) layers between full-attention ones.

    per layer (Llama's pre-norm block; every norm scales by 1 + w):
        x = x + mixer(rms_norm(x))        # layer_types: "linear_attention" (three of four) or
                                          # "full_attention": q/k norms per head, partial RoPE,
                                          # the output times sigmoid(gate), the gate a second half
                                          # of each query head's projection
        x = x + mlp(rms_norm(x))          # Qwen3.5: SwiGLU; Qwen3-Next: experts and a gated shared one

A Gated DeltaNet layer, per token (Hk key heads of Dk, Hv value heads of Dv):

    qkv       = silu(causal_conv(h @ lin_qkv))                # K taps over the sequence, per channel
    q, k, v   = split(qkv);  q, k = l2norm(q), l2norm(k)       # each key head serves Hv / Hk value heads
    g         = -exp(A_log) * softplus(h @ lin_a + dt_bias)   # log decay per value head
    beta      = sigmoid(h @ lin_b)
    S         = exp(g) S + k (beta (v - S^T k))^T              # [Dk, Dv] per value head
    out       = lin_out(rms_norm(S^T q / sqrt(Dk)) * w * silu(h @ lin_z))

It keeps no K/V: each sequence carries its convolution's last K - 1 inputs and S per linear layer
in a state slot (jaxinfer.ops.linear_state, inside the cache beside the full-attention layers'
pages; `LayerRef.slot` is the layer's row there), and a step continues every sequence from its
slot: decodes one token at a time, prefill chunks in the chunked form (jaxinfer.ops.linear_attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import LayerRef, StepInputs
from jaxinfer.models.layers import matmul
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.ops.linear_attention import gated_rms_norm, ragged_causal_conv, ragged_delta_rule
from jaxinfer.ops.linear_state import DraftInputs, LinearState
from pallas_kernels.gated_delta_rule.reference import decay_and_rate, prepare_qk


class Qwen3NextForCausalLM(LlamaForCausalLM):
    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        if not kind.linear:
            return super().block(step, layer, kind, w, lw, hidden, residual, pool)
        h, residual = self.add_norm(hidden, residual, w["attn_norm"])
        out, pool = self.gated_deltanet(step, layer, w, h, pool)
        h, residual = self.add_norm(out, residual, w["mlp_norm"])
        return self.mlp(step, w, lw, h), residual, pool

    def gated_deltanet(self, step: StepInputs, layer: LayerRef, w: dict, h, pool):
        """A Gated DeltaNet over h [T, H], each sequence from its state slot: (out [T, H], pool)."""
        c, kernels, dtype, tp = self.config, self.kernels, h.dtype, self.parallel.tp
        if self.parallel.sp > 1:
            raise ValueError(f"{c.model_type}: Gated DeltaNet layers run without sequence parallelism")
        T = h.shape[0]
        Hk, Hv = c.linear_key_heads // tp, c.linear_value_heads // tp  # this shard's heads
        Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
        state, row = pool.state, layer.slot  # this layer's row of the states
        drafts = state.drafts  # (speculative decoding: verifying chunks keep their inputs there)
        mixed, conv, draft_conv = ragged_causal_conv(matmul(h, w["lin_qkv"], kernels).astype(dtype), state.conv[row],
                                                     w["lin_conv"], step.batch, drafts.conv[row] if drafts is not None else None,
                                                     chunks=step.query_block > 1, spec_block=step.spec_block, kernels=kernels)
        mixed = jax.nn.silu(mixed.astype(jnp.float32)).astype(dtype)  # [T, 2 Hk Dk + Hv Dv]
        q, k = prepare_qk(mixed[:, : Hk * Dk].reshape(T, Hk, Dk), mixed[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk), Hv)
        v = mixed[:, 2 * Hk * Dk :].reshape(T, Hv, Dv).astype(jnp.float32)
        g, beta = decay_and_rate(matmul(h, w["lin_a"], kernels), matmul(h, w["lin_b"], kernels), w["lin_a_log"],
                                 w["lin_dt_bias"])
        draft_rows = (drafts.k[row], drafts.v[row], drafts.g[row], drafts.beta[row]) if drafts is not None else None
        out, recurrent, draft_rows = ragged_delta_rule(q, k, v, g, beta, state.recurrent[row], step.batch,
                                                       chunks=step.query_block > 1, spec_block=step.spec_block, drafts=draft_rows,
                                                       kernels=kernels)
        z = matmul(h, w["lin_z"], kernels).astype(dtype).reshape(T, Hv, Dv)
        out = gated_rms_norm(out.astype(dtype), z, w["lin_norm"], c.rms_norm_eps).reshape(T, Hv * Dv)
        if drafts is not None:
            drafts = DraftInputs(*(a.at[row].set(b) for a, b in zip((drafts.conv, drafts.k, drafts.v, drafts.g, drafts.beta),
                                                                   (draft_conv, *draft_rows))))
        state = LinearState(conv=state.conv.at[row].set(conv), recurrent=state.recurrent.at[row].set(recurrent), drafts=drafts)
        return self._row_parallel(out, w["lin_out"]).astype(dtype), dataclasses.replace(pool, state=state)


"""The Llama family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2 and SmolLM3 (NoPE every
fourth layer), and the mixture-of-experts relatives Mixtral, Qwen2-MoE and Qwen3-MoE.

One pre-norm block per layer (the shared pieces are `jaxinfer.models.decoder`'s):

    h = attention(rms_norm(x))          # q/k RMSNorm per head for Qwen3; no RoPE on NoPE layers
    x = x + h
    x = x + mlp(rms_norm(x))            # SwiGLU, or a mixture of SwiGLU experts (models.moe)
"""

from __future__ import annotations

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import Decoder, LayerRef, StepInputs, split_qkv  # noqa: F401  (split_qkv: calibration reads it here)


class LlamaForCausalLM(Decoder):
    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        h, residual = self.add_norm(hidden, residual, w["attn_norm"])
        attn, pool = self.attention(step, layer, kind, w, lw, h, pool)
        h, residual = self.add_norm(attn, residual, w["mlp_norm"])
        return self.mlp(step, w, lw, h), residual, pool

"""Gemma 2 and Gemma 3 (text): sliding and global layers, norms on both sides of each branch.

    x = embed(tokens) * sqrt(H)                         # rounded to the compute dtype first
    per layer (sliding window on "sliding_attention" layers; Gemma 3: their own RoPE base):
        h = attention(norm(x))                          # scores * query_pre_attn_scalar ** -0.5,
                                                        # soft-capped (Gemma 2); q/k norms per head (Gemma 3)
        x = x + norm(h)
        x = x + norm(down(gelu_tanh(gate(norm(x))) * up(norm(x))))     # GeGLU
    logits = soft_cap(lm_head(norm(x)))                 # Gemma 2: cap 30

Every norm multiplies by (1 + w): Gemma stores w - 1 (`ModelConfig.norm_weight_offset`).
"""

from __future__ import annotations

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import Decoder, LayerRef, StepInputs


class GemmaForCausalLM(Decoder):
    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        h, residual = self.add_norm(hidden, residual, w["attn_norm"])
        attn, pool = self.attention(step, layer, kind, w, lw, h, pool)
        h, residual = self.add_norm(self.norm(attn, w["post_attn_norm"]), residual, w["mlp_norm"])
        return self.norm(self.mlp(step, w, lw, h), w["post_mlp_norm"]), residual, pool

"""OLMo 2 and OLMo 3: norms after each branch only, q/k RMSNorm over the whole projection.

    per layer (OLMo 3: three sliding-window layers, then a global one):
        x = x + norm(attention(x))          # q = norm(x W_q) over all heads at once, likewise k
        x = x + norm(mlp(x))                # SwiGLU
    logits = lm_head(norm(x))
"""

from __future__ import annotations

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import Decoder, LayerRef, StepInputs


class OlmoForCausalLM(Decoder):
    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        x = hidden + residual  # the stream: each branch reads it unnormalised
        attn, pool = self.attention(step, layer, kind, w, lw, x, pool)
        hidden, residual = self.norm(attn, w["post_attn_norm"]), x
        x = hidden + residual
        return self.norm(self.mlp(step, w, lw, x), w["post_mlp_norm"]), x, pool

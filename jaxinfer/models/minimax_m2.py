"""MiniMax-M2: a mixture-of-experts decoder, full attention in every layer.

    per layer:
        h = attention(rms_norm(x))        # q/k RMSNorm over the whole projection; RoPE on the
                                          # first rotary_dim dims of each head
        x = x + h
        x = x + moe(rms_norm(x))          # sigmoid score per expert; the k largest after adding a
                                          # learned correction bias (it picks, does not weigh);
                                          # the picked scores renormalised (models.moe)
    logits = lm_head(rms_norm(x))

The block is Llama's; what differs lives in the config (`qk_norm_scope`, `router_scoring`,
`router_correction_bias`, `rotary_dim`) and the shared sublayers. Tensors are named as Mixtral's.
"""

from __future__ import annotations

from jaxinfer.models.llama import LlamaForCausalLM


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    """Llama's pre-norm block over MiniMax-M2's sublayers (see the module docstring)."""

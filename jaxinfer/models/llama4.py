"""Llama 4 (Scout, Maverick; text): a mixture-of-experts decoder with three kinds of attention layer.

    per layer (every 4th a NoPE layer; the others RoPE layers with chunked local attention):
        h = attention(rms_norm(x))        # RoPE layers: RoPE, then q and k RMS-normalised per head
                                          # without a weight (L2 norm); a query sees only its own
                                          # chunk of attention_chunk_size (8192) positions.
                                          # NoPE layers: no position embedding, every earlier key,
                                          # q times 1 + 0.1 * log1p(floor((pos + 1) / 8192))
                                          # (attention temperature tuning, for long contexts)
        x = x + h
        x = x + mlp(rms_norm(x))          # MoE layers (all of Scout's, every other one of
                                          # Maverick's): the top-1 expert by router logit, run on
                                          # x * sigmoid(logit), plus an always-on shared expert;
                                          # the other layers a SwiGLU of intermediate_size_mlp
    logits = lm_head(rms_norm(x))

The block is Llama's; what differs lives in the config (`attention_chunk_size`, `qk_l2_norm`,
`attn_temperature_scale`, `router_scales_inputs`, `moe_layer_step`) and the shared sublayers.
Llama 4 turns adjacent dims (0, 1), (2, 3), ... with RoPE; `checkpoints_conv.views` reorders each
head's q and k rows into halves at load, which is what the kernels turn and changes no score.
"""

from __future__ import annotations

from jaxinfer.models.llama import LlamaForCausalLM


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama's pre-norm block over Llama 4's sublayers (see the module docstring)."""

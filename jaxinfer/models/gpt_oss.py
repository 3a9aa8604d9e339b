"""GPT-OSS (gpt-oss-20b / 120b): a mixture-of-experts decoder with attention sinks.

    per layer (sliding window of 128 on every other layer, starting with the first):
        h = attention(rms_norm(x))        # q/k/v/o biases; YaRN RoPE; each query head has a
                                          # learned sink logit that takes a share of the softmax
                                          # and contributes no value
        x = x + h
        x = x + moe(rms_norm(x))          # router with bias: softmax over the top-k logits;
                                          # experts with biases and a clamped SwiGLU (models.moe)
    logits = lm_head(rms_norm(x))

The block is Llama's; what differs lives in the config (`attention_sinks`, `router_bias`,
`expert_bias`, `swiglu_limit`) and the shared sublayers. The checkpoint stores all experts of a
layer as one tensor, gate and up interleaved, and in MXFP4 (`checkpoints_conv.views`).
"""

from __future__ import annotations

from jaxinfer.models.llama import LlamaForCausalLM


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's pre-norm block over GPT-OSS's sublayers (see the module docstring)."""

"""GLM-4.5 / 4.6 (glm4_moe): a decoder whose first layers are dense and the rest mixtures of experts.

    per layer:
        h = attention(rms_norm(x))        # q/k/v biases, optional q/k RMSNorm per head; RoPE on
                                          # half of each head
        x = x + h
        x = x + mlp(rms_norm(x))          # layers < first_dense_layers: a SwiGLU MLP; the others:
                                          # sigmoid scores + correction bias pick the k experts
                                          # from the best groups, weights renormalised and scaled,
                                          # plus ungated shared experts (models.moe)
    logits = lm_head(rms_norm(x))

The block is Llama's; the dense prefix is the layer loop's (`Decoder.run_layers`) and the MoE
stacks hold the MoE layers only (`param_layout.stack_slots`). The checkpoint's
multi-token-prediction layer is skipped at load (`checkpoints_conv.views`).
"""

from __future__ import annotations

from jaxinfer.models.llama import LlamaForCausalLM


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """Llama's pre-norm block over GLM-4.5's sublayers (see the module docstring)."""

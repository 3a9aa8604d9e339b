"""DeepSeek-V3's multi-token-prediction (MTP) module, run as a speculative proposer (jaxinfer.engine.mtp).

DeepSeek-V3 is trained with one layer after its last (the checkpoint's layer num_hidden_layers)
that predicts the token after next. At position p it reads the target's hidden state h_p (the
residual stream after the last layer, before the final norm) beside the *next* token t_{p+1}:

    x_p    = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])    # [2H] -> [H]; the embedding is zero at position 0
    x_p    = block(x_p)                                       # one MLA + MoE decoder layer at position p,
                                                              # over a latent cache of its own
    logits = lm_head(norm(x_p))                               # a guess at t_{p+2}

The module shares the target's embedding and LM head (its checkpoint copies of them are not
read); `norm` is its own (shared_head.norm). Here it is a one-layer `DeepseekForCausalLM`
(`ModelConfig.mtp_module`) whose first layer reads x_p instead of an embedding; the hidden
states come from the step's `input_hidden` (the target's stream, or the module's own stream
x_p when it guesses again from its own guess: jaxinfer.engine.mtp). The zeroed embedding at
position 0 follows vLLM's DeepSeek MTP layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.models.deepseek import DeepseekForCausalLM
from jaxinfer.models.layers import matmul, rms_norm


class DeepseekMTP(DeepseekForCausalLM):
    """The MTP module: a one-layer DeepSeek decoder whose input also reads a hidden state per token."""

    def step_input(self, token_ids: jax.Array, positions: jax.Array, input_hidden: jax.Array | None) -> jax.Array:
        """x [Tl, H] = eh_proj([enorm(embed(token)) | hnorm(input_hidden)]) (see the module docstring)."""
        if input_hidden is None:
            raise ValueError("the multi-token-prediction module reads a hidden state per token (batch.hidden_src)")
        eps, w = self.config.rms_norm_eps, self.layers.stacked()  # [1, ...] each: the module's one layer
        e = self._embed(token_ids)  # [Tl, H]
        e = jnp.where(positions[: e.shape[0], None] == 0, jnp.zeros_like(e), e)
        h = input_hidden.astype(e.dtype)  # [Tl, H]
        x = jnp.concatenate([rms_norm(e, w["mtp_enorm"][0], eps), rms_norm(h, w["mtp_hnorm"][0], eps)], axis=-1)
        return matmul(x, w["mtp_eh_proj"][0], self.kernels).astype(self.compute_dtype)

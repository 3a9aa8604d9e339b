"""DeepSeek-V2 / V2-Lite (deepseek_v2), DeepSeek-V3 / R1 and Kimi K2 (deepseek_v3): multi-head
latent attention (MLA) and DeepSeekMoE.

    per layer (Llama's pre-norm block):
        x = x + mla(rms_norm(x))
        x = x + mlp(rms_norm(x))          # the first first_k_dense_replace layers: a SwiGLU MLP; the
                                          # others: routed experts + shared experts (models.moe):
                                          # V3: sigmoid + correction bias, groups by their two best,
                                          # renormalised; V2: softmax, groups by their best; scaled
    logits = lm_head(rms_norm(x))

Multi-head latent attention, per token (Hq heads; r = kv_lora_rank, e.g. 512; rope = 64):

    q       = q_b(rms_norm(q_a(x)))  or  q_proj(x)         # [Hq, nope + rope]: q_nope | q_rope
    c, k_r  = kv_a(x)                                        # latent [r] and one shared RoPE key [rope]
    c       = rms_norm(c)
    K_h     = [c @ W_UK_h | k_r]     V_h = c @ W_UV_h        # kv_b: each head's key / value up-projection

Decode and prefill run it *absorbed*: q_nope @ W_UK_h^T is a query against the latent itself,

    score_h(t, s) = q_nope_h(t) . (c(s) @ W_UK_h) + q_rope_h(t) . k_r(s)
                  = [q_nope_h(t) @ W_UK_h^T | q_rope_h(t)] . [c(s) | k_r(s)]
    out_h(t)      = (sum_s p_h(t, s) c(s)) @ W_UV_h

so attention is multi-query attention with one KV head of r + rope dims: the row [c | k_r] (RoPE
on k_r) is all the paged cache holds per token and layer (`jaxinfer.ops.kv_cache`'s latent pool:
(r + rope) x dtype bytes), the values are that row's first r dims, and no token's K or V is ever
expanded per head. `Kernels.mla_attention` reads it (`pallas_kernels.mla_attention`: TPU and GPU
kernels that read each row once for all heads). DeepSeek-V3 interleaves its rope dims in pairs
(`rope_interleave`; V2 rotates them as complex numbers, the same pairs): they are taken as
[evens | odds], the same rotation in Llama's half layout.
The score scale is (nope + rope) ** -0.5 times YaRN's mscale squared (`ModelConfig.attention_scale`).

Not yet: the expanded form for long prefills (K_h and V_h made per head for flash attention;
absorbed is the only path), the checkpoint's multi-token-prediction layer (skipped at load).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import LayerRef, StepInputs
from jaxinfer.models.layers import matmul, rms_norm
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.ops.attention import write_latent_and_attend
from pallas_kernels.rope_kv_write import apply_rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with their default eps


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., 2n] rope dims as interleaved pairs -> [..., 2n] as [evens | odds] (Llama's half layout)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class DeepseekForCausalLM(LlamaForCausalLM):
    """Llama's pre-norm block with multi-head latent attention (see the module docstring)."""

    def attention(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, h, pool):
        """MLA of h [Tl, H] through the layer's paged latent cache: (out [Tl, H], pool)."""
        c, kernels = self.config, self.kernels
        if self.parallel.sp > 1:
            raise ValueError(f"sequence_parallel_size={self.parallel.sp}: multi-head latent attention ({c.model_type}) does "
                             "not run sequence-parallel yet; use tensor / expert / data parallelism")
        Tl, dtype = h.shape[0], h.dtype
        heads = c.num_heads // self.parallel.tp  # this device's query heads
        nope, rope, r, vd = c.qk_nope_head_dim, c.rotary_dim, c.kv_lora_rank, c.v_head_dim

        if c.q_lora_rank:
            q_a = rms_norm(matmul(h, w["q_a_proj"], kernels).astype(dtype), w["q_a_norm"], LATENT_NORM_EPS)
            q = matmul(q_a, w["q_b_proj"], kernels)
        else:
            q = matmul(h, w["q_proj"], kernels)
        q = q.astype(dtype).reshape(Tl, heads, nope + rope)  # [Tl, heads, nope | rope]
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        kv_a = matmul(h, w["kv_a_proj"], kernels).astype(dtype)  # [Tl, r + rope]
        latent = rms_norm(kv_a[:, :r], w["kv_a_norm"], LATENT_NORM_EPS)  # [Tl, r]
        k_rope = kv_a[:, r:]  # [Tl, rope]
        if c.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)

        kv_b = w["kv_b_proj"].reshape(r, heads, nope + vd)  # this device's heads: [r, heads, nope | v]
        w_uk, w_uv = kv_b[..., :nope], kv_b[..., nope:]
        q_latent = jnp.einsum("thn,rhn->thr", q_nope, w_uk.astype(dtype), preferred_element_type=jnp.float32)
        cos, sin = step.rope[kind.rope]  # [Tl, rope]
        q_row = jnp.concatenate([q_latent.astype(dtype), apply_rope(q_rope, cos, sin)], axis=-1)  # [Tl, heads, r + rope]
        row = jnp.concatenate([latent, apply_rope(k_rope[:, None, :], cos, sin)[:, 0]], axis=-1)  # [Tl, r + rope]

        attn, pool = write_latent_and_attend(  # [Tl, heads, r]: sum_s p_h(t, s) c(s)
            q_row, row, pool, layer.slot * step.num_pages, step.write_page[layer.group], step.write_offset[layer.group],
            layer.batch_view(step.batch), value_dim=r, sm_scale=c.sm_scale, query_block=step.query_block,
            spec_block=step.spec_block, kernels=kernels)
        out = jnp.einsum("thr,rhv->thv", attn, w_uv.astype(dtype), preferred_element_type=jnp.float32)
        return self._row_parallel(out.astype(dtype).reshape(Tl, heads * vd), w["o_proj"]), pool

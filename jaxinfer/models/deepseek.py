"""DeepSeek-V2 / V2-Lite (deepseek_v2), DeepSeek-V3 / R1 and Kimi K2 (deepseek_v3): multi-head
latent attention (MLA) and DeepSeekMoE; DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): the
same with DeepSeek sparse attention.

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

A fresh prefill (no sequence of the step has a cached prefix, decided on the device) runs
*expanded* in the buckets where that measured faster (`expanded_prefill`): each head's
K_h = [c @ W_UK_h | k_r] and V_h = c @ W_UV_h for the step's tokens, causal flash attention over
them (V padded to K's width), no pages read. It costs T x r x (nope + v) per head to expand and
then attends in nope + rope dims instead of r + rope (192 against 576 at DeepSeek-V3's shapes);
decodes and chunks over a prefix stay absorbed (expanding a cached context every step would cost
more than it saves). The latent rows are written either way.

DeepSeek sparse attention (`ModelConfig.index_topk`): an indexer per layer scores every earlier
token for each query and the query attends to its index_topk best only:

    q_i     = index_wq(rms_norm(q_a(x)))         # [Hi, Di]: the low-rank query's own heads
    k_i     = layer_norm(index_wk(x))            # [Di]: one key per token, kept in the row after [c | k_r]
    index(t, s) = sum_h weight_h(t) * relu(q_i_h(t) . k_i(s) / sqrt(Di)),   weight = index_weights(x) / sqrt(Hi)

(RoPE on the first rope dims of q_i and k_i: as pairs for GLM-5, halves for V3.2). It runs in
XLA on every platform (`attention.sparse_latent_attention`: a block of queries gathers its
sequences' rows, top-k, then the absorbed MLA score over the picked rows), never expanded; no
Pallas kernel and no quantized pool yet.

The checkpoint's multi-token-prediction layer is not part of this model: it drafts for it
(speculative method "mtp": models.deepseek_mtp, engine.mtp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import LayerKind
from jaxinfer.models.decoder import LayerRef, StepInputs
from jaxinfer.models.layers import layer_norm, matmul, rms_norm
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.ops.attention import (fresh_prefill, sparse_latent_attention, takes_flash_path, write_latent_and_attend,
                                    write_latent_rows)
from jaxinfer.ops.kernels import Kernels
from pallas_kernels.flash_attention.reference import flash_attention as flash_attention_reference
from pallas_kernels.rope_kv_write import apply_rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with their default eps
INDEX_KEY_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' DeepseekV32Indexer)
# Fresh-prefill buckets that run expanded. With a flash kernel (TPU, GPU): from FLASH_MIN_TOKENS
# tokens up, like the GQA families' flash path (measured on an H100 with scripts/bench_mla.py,
# DeepSeek-V3's 128 heads: expanded 0.19x to 0.22x of absorbed's time from 2 x 256 to 2 x 4096
# tokens; V2-Lite's 16 heads 0.77x at 2 x 256, 0.26x at 2 x 4096). On the CPU the flash attention is the jnp
# reference (dense [heads, T, T] scores), faster than absorbed up to 512 tokens and slower beyond
# (scripts/bench_mla.py, DeepSeek-V2-Lite's heads: 2 x 128 tokens 0.32x of absorbed's time, 2 x 256
# 0.58x, 2 x 512 1.04x; docs/benchmarks.md).
CPU_EXPANDED_MAX_TOKENS = 512


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., 2n] rope dims as interleaved pairs -> [..., 2n] as [evens | odds] (Llama's half layout)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def expanded_prefill(batch, num_tokens: int, query_block: int, kernels: Kernels):
    """(whether this step runs expanded: False, or a traced bool; the flash attention it uses)."""
    if kernels.flash_attention is not None:
        return takes_flash_path(batch, num_tokens, query_block=query_block, kernels=kernels), kernels.flash_attention
    if query_block == 1 or num_tokens > CPU_EXPANDED_MAX_TOKENS:
        return False, None
    return fresh_prefill(batch), flash_attention_reference


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

        batch, page_offset = layer.batch_view(step.batch), layer.slot * step.num_pages
        write_page, write_offset = step.write_page[layer.group], step.write_offset[layer.group]

        if c.index_topk:  # DeepSeek sparse attention: the indexer's key joins the row, each query reads its top-k rows
            if pool.quantized:
                raise ValueError(f"{c.model_type}: sparse attention reads a float latent pool; kv_cache_dtype int8 / fp8 "
                                 "is not supported with it")
            q_index, k_index, weights = self.indexer(w, h, q_a, cos, sin)
            pool = write_latent_rows(pool, jnp.concatenate([row, k_index], axis=-1), page_offset, write_page, write_offset)
            attn = sparse_latent_attention(q_row, q_index, weights, pool.kv, batch.page_table + page_offset, batch,
                                           value_dim=r, topk=c.index_topk, sm_scale=c.sm_scale)  # [Tl, heads, r]
            out = jnp.einsum("thr,rhv->thv", attn.astype(dtype), w_uv.astype(dtype), preferred_element_type=jnp.float32)
            return self._row_parallel(out.astype(dtype).reshape(Tl, heads * vd), w["o_proj"]), pool

        def absorbed(pool):
            attn, pool = write_latent_and_attend(  # [Tl, heads, r]: sum_s p_h(t, s) c(s)
                q_row, row, pool, page_offset, write_page, write_offset, batch, value_dim=r, sm_scale=c.sm_scale,
                query_block=step.query_block, spec_block=step.spec_block, kernels=kernels)
            return jnp.einsum("thr,rhv->thv", attn, w_uv.astype(dtype), preferred_element_type=jnp.float32), pool

        def expanded(pool):  # a fresh prefill: every head's K and V of this step's tokens, flash attention
            k_nope = jnp.einsum("tr,rhn->thn", latent, w_uk.astype(dtype), preferred_element_type=jnp.float32)
            k = jnp.concatenate([k_nope.astype(dtype), jnp.broadcast_to(row[:, None, r:], (Tl, heads, rope))], axis=-1)
            v = jnp.einsum("tr,rhv->thv", latent, w_uv.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
            q = jnp.concatenate([q_nope, q_row[..., r:]], axis=-1)  # [Tl, heads, nope + rope], RoPE applied
            width = max(nope + rope, vd)  # one head_dim for q, k and v: zero dims add nothing to a score
            q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1]))) for x in (q, k, v))
            out = flash(q, k, v, batch.cu_q_lens, batch.num_seqs, causal=True, sm_scale=c.sm_scale, sliding_window=None,
                        soft_cap=None, attention_chunk=None)
            return out[..., :vd].astype(jnp.float32), write_latent_rows(pool, row, page_offset, write_page, write_offset)

        runs_expanded, flash = expanded_prefill(batch, Tl, step.query_block, kernels)
        out, pool = absorbed(pool) if runs_expanded is False else jax.lax.cond(runs_expanded, expanded, absorbed, pool)
        return self._row_parallel(out.astype(dtype).reshape(Tl, heads * vd), w["o_proj"]), pool

    def indexer(self, w: dict, h, q_a, cos, sin):
        """DeepSeek sparse attention's indexer for h [Tl, H] (q_a: the normed low-rank query
        [Tl, q_rank]): (its queries [Tl, Hi, Di], each token's key [Tl, Di], both with RoPE on their
        first rope dims; each head's weight [Tl, Hi] float32, times Hi ** -0.5)."""
        c, kernels, dtype = self.config, self.kernels, h.dtype
        Hi, Di, rope = c.index_heads, c.index_head_dim, c.rotary_dim
        q = matmul(q_a, w["index_wq"], kernels).astype(dtype).reshape(h.shape[0], Hi, Di)
        k = layer_norm(matmul(h, w["index_wk"], kernels).astype(dtype), w["index_k_norm"], w["index_k_norm_bias"],
                       INDEX_KEY_NORM_EPS)  # [Tl, Di]
        q_rot, k_rot = q[..., :rope], k[:, None, :rope]
        if c.index_rope_interleave:  # GLM-5's pairs (the same permutation of q and k: their dot products stand)
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = jnp.concatenate([apply_rope(q_rot, cos, sin), q[..., rope:]], axis=-1)
        k = jnp.concatenate([apply_rope(k_rot, cos, sin)[:, 0], k[:, rope:]], axis=-1)
        weights = matmul(h, w["index_weights"], kernels) * Hi**-0.5  # [Tl, Hi]
        return q, k, weights

"""The Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2) and its
mixture-of-experts relatives (Mixtral, Qwen2-MoE, Qwen3-MoE) as one Flax NNX module.

The module holds the weights; its `__call__` is a pure function of them, the paged KV cache and a
ragged batch, meant to run under `jax.jit` after `nnx.split` / `nnx.merge`.

All decoder layers live in one `DecoderLayers` module whose weights carry a leading
`[num_layers]` axis; the forward pass runs the layers in a `lax.fori_loop` (one compiled layer,
not N), carrying the residual stream and the whole KV cache, which is updated in place. The
parameter layout is `jaxinfer.models.param_layout`'s. A MoE model differs only in its MLP
(`jaxinfer.models.moe`).

**Parallel.** The step runs the model inside `jax.shard_map` over the device mesh (see
jaxinfer.runtime.step), so `__call__` sees this device's shards and does its own collectives, each
only when its axis has more than one device (on one device the program is the plain one):

- tensor (Megatron): the fused QKV and gate/up columns, o and down rows, and the hidden dim of the
  embedding / LM head are split; one `psum` after o_proj and one after down_proj per layer, an
  all-gather of the embedded tokens and a `psum` of the logits per step;
- sequence: this replica's T tokens are split in `sp` contiguous blocks for everything but
  attention, which sees all of this step's K/V (all-gathered, or passed around a ring), see
  `jaxinfer.ops.attention.attend_sequence_parallel`; the logits rows are summed over the axis;
- expert (MoE): experts are split, tokens dispatched with all_to_all (`jaxinfer.models.moe`);
- data and expert also index replicas: each device sees only its replica's batch and KV pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.ops.attention import kv_write_locations, write_kv_and_attend
from jaxinfer.ops.batch import SCRATCH_PAGE, RaggedBatch
from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.models import moe
from jaxinfer.models.layers import (add_rms_norm, embed_lookup, gate_up_swiglu, linear, matmul, rms_norm, rope_cos_sin,
                                   swiglu, tied_logits)
from jaxinfer.models.lora import LoraSlots, LoraTable, lora_shapes
from jaxinfer.models.param_layout import param_shapes
from sharding.mesh import ParallelConfig, kv_heads_per_shard


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[T, (Hq + 2*Hkv)*D] = [q | k | v] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (this
    device's heads: the shard-major layout puts each shard's q, k and v side by side)."""
    T = qkv.shape[0]
    q_end = num_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    q = qkv[:, :q_end].reshape(T, num_heads, head_dim)
    k = qkv[:, q_end:k_end].reshape(T, num_kv_heads, head_dim)
    v = qkv[:, k_end:].reshape(T, num_kv_heads, head_dim)
    return q, k, v


def _init(name: str, shape, dtype, key) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class DecoderLayers(nnx.Module):
    """The weights of all decoder layers, each stacked on a leading [num_layers] axis."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype, rngs: nnx.Rngs):
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(_init(name, shape, dtype, rngs.params())))

    def stacked(self) -> dict[str, jax.Array]:
        """name -> [L, ...] array (or a QuantizedWeight standing for a [L, K, N] one)."""
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        kernels: Kernels = Kernels(),
        parallel: ParallelConfig = ParallelConfig(),
        lora: LoraTable | None = None,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.compute_dtype = compute_dtype
        self.kernels = kernels  # static: XLA paths or Pallas kernels (jaxinfer.ops.kernels)
        self.parallel = parallel  # static: the mesh's axis sizes (sharding.mesh.ParallelConfig)
        shapes = param_shapes(config, parallel.tp)  # global shapes; __call__ sees this device's shards
        layer_shapes = {k.split(".", 1)[1]: v for k, v in shapes.items() if k.startswith("layers.")}
        self.embed = nnx.Param(_init("embed", shapes["embed"], param_dtype, rngs.params()))
        self.layers = DecoderLayers(layer_shapes, param_dtype, rngs)
        self.final_norm = nnx.Param(_init("final_norm", shapes["final_norm"], param_dtype, None))
        if "lm_head" in shapes:
            self.lm_head = nnx.Param(_init("lm_head", shapes["lm_head"], param_dtype, rngs.params()))
        if lora is not None:
            self.lora = LoraSlots(lora_shapes(config, lora, parallel.tp), param_dtype)  # the adapter slot table (jaxinfer.models.lora)

    def __call__(self, kv: KVCache, batch: RaggedBatch, *, query_block: int, spec_block: int = 0,
                 return_hidden: bool = False):
        """One device's part of a step (see the module docstring).

        kv: this device's pages, [L, P, page_size, Hkv_local, D]; batch: its replica's batch (T
        tokens, S sequence slots). Returns (logits [R, V] float32 for the rows
        batch.logits_indices, the same on every device of the replica; the updated cache), and
        with return_hidden the rows' final-normed hidden states [R, H] too (draft heads read them).
        """
        c, par, kernels = self.config, self.parallel, self.kernels
        T = batch.token_ids.shape[0]
        S = batch.kv_lens.shape[0]
        num_heads = c.num_heads // par.tp  # this device's query heads
        num_kv_heads = kv_heads_per_shard(c.num_kv_heads, par.tp)
        Tl = T // par.sp  # this device's tokens: rows first_row : first_row + Tl of the step
        first_row = jax.lax.axis_index("sequence") * Tl if par.sp > 1 else 0
        page_size = kv.page_size

        x = self._embed(jax.lax.dynamic_slice_in_dim(batch.token_ids, first_row, Tl))  # [Tl, H]
        write_page, write_offset = kv_write_locations(batch, page_size, SCRATCH_PAGE)  # [T] each: every token's slot
        seq_of_token = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)
        cos, sin = rope_cos_sin(c, batch.positions, batch.kv_lens[seq_of_token])  # [T, D] each
        stacked = self.layers.stacked()
        sm_scale = float(c.head_dim) ** -0.5
        lora, slot = None, None  # LoRA: the slot table's stacks, and each of this device's tokens' slot
        if getattr(self, "lora", None) is not None and batch.lora_slots is not None:
            lora = self.lora.stacked()
            slot_of_token = jnp.where(jnp.arange(T) < batch.cu_q_lens[-1], batch.lora_slots[seq_of_token], 0)  # padding: none
            slot = jax.lax.dynamic_slice_in_dim(slot_of_token, first_row, Tl)  # [Tl]

        # Fold the layer axis into the page axis: layer i's page p is page i * P + p of one pool.
        L, num_pages = kv.num_layers, kv.num_pages

        # The loop carries the residual stream as (hidden, residual): each norm takes in the add
        # that precedes it (add_rms_norm), so on accelerators the add and the norm are one pass.
        def layer(i, carry):
            hidden, residual, pool = carry  # [Tl, H] each (the stream is hidden + residual); the pages
            w = {name: jax.tree.map(lambda a: a[i], p) for name, p in stacked.items()}  # layer i's weights
            lw = {name: a[i] for name, a in lora.items()} if lora is not None else None  # [N, ...] each
            h, residual = add_rms_norm(hidden, residual, w["attn_norm"], c.rms_norm_eps, kernels)
            qkv = linear(h, w["qkv_proj"], w.get("qkv_bias"), kernels)  # one matmul: [Tl, (Hq + 2*Hkv)*D] local
            if lw is not None:
                delta = kernels.lora_delta(h, lw["qkv_a"], [lw["q_b"], lw["k_b"], lw["v_b"]], slot)  # [Tl, q | k | v] local
                qkv = (qkv.astype(jnp.float32) + delta).astype(qkv.dtype)
            q, k, v = split_qkv(qkv, num_heads, num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
            attn, pool = write_kv_and_attend(  # RoPE, KV write, attention
                q, k, v, cos, sin, pool, i * num_pages, write_page, write_offset, batch,
                sm_scale=sm_scale, sliding_window=c.sliding_window, query_block=query_block, spec_block=spec_block,
                kernels=kernels, parallel=par,
            )
            attn = attn.reshape(Tl, num_heads * c.head_dim)
            attn_out = self._row_parallel(attn, w["o_proj"], w.get("o_bias"),
                                          kernels.lora_delta(attn, lw["o_a"], [lw["o_b"]], slot) if lw is not None else None)
            h, residual = add_rms_norm(attn_out, residual, w["mlp_norm"], c.rms_norm_eps, kernels)
            if c.is_moe:
                hidden = self._tensor_sum(moe.moe_mlp(h, w, c, par, kernels))
            elif lw is not None:
                gate_up = linear(h, w["gate_up_proj"], w.get("gate_up_bias"), kernels).astype(jnp.float32)
                act = swiglu((gate_up + kernels.lora_delta(h, lw["gate_up_a"], [lw["gate_b"], lw["up_b"]], slot)).astype(h.dtype))
                hidden = self._row_parallel(act, w["down_proj"], w.get("down_bias"),
                                            kernels.lora_delta(act, lw["down_a"], [lw["down_b"]], slot))
            else:
                hidden = self._row_parallel(gate_up_swiglu(h, w["gate_up_proj"], w.get("gate_up_bias"), kernels),
                                            w["down_proj"], w.get("down_bias"))
            return hidden, residual, pool

        hidden, residual, pool = jax.lax.fori_loop(0, c.num_layers, layer, (x, jnp.zeros_like(x), kv.fold_layers()))
        hidden, residual = self._logits_rows(hidden, residual, batch.logits_indices, first_row)  # [R, H] each
        h, _ = add_rms_norm(hidden, residual, self.final_norm[...], c.rms_norm_eps, kernels)
        kv = pool.unfold_layers(L)
        if return_hidden:  # the final-normed hidden state of each logits row [R, H] (what the LM head reads)
            return self._lm_head(h), kv, h
        return self._lm_head(h), kv

    # ------------------------------------------------------------------ the parallel pieces
    def _tensor_sum(self, partial: jax.Array, dtype=None) -> jax.Array:
        """Adds the tensor-parallel shards' partial sums (the Megatron all-reduce) in `dtype`, by
        default the compute dtype: bfloat16 on accelerators halves the bytes on the links, as vLLM
        and Megatron do."""
        partial = partial.astype(dtype or self.compute_dtype)
        return jax.lax.psum(partial, "tensor") if self.parallel.tp > 1 else partial

    def _row_parallel(self, x, w, b=None, delta=None):
        """x [T, K_local] @ w [K_local, H] (+ a LoRA `delta` [T, H] from the same K_local rows),
        summed over the tensor shards, + b; in x's dtype."""
        y = matmul(x, w, self.kernels)
        if delta is not None:
            y = y.astype(jnp.float32) + delta
        y = self._tensor_sum(y)
        if b is not None:
            y = y.astype(jnp.float32) + b.astype(jnp.float32)
        return y.astype(x.dtype)

    def _hidden_shard(self, h: jax.Array) -> jax.Array:
        """This tensor shard's columns of h [R, H] (the embedding's hidden dim is split)."""
        tp = self.parallel.tp
        if tp == 1:
            return h
        width = h.shape[-1] // tp
        return jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index("tensor") * width, width, axis=-1)

    def _embed(self, token_ids: jax.Array) -> jax.Array:
        """token_ids [T] -> [T, H] in the compute dtype; the table's hidden dim is split over tensor.
        A quantized table is stored [H / tp, V] (the tied LM head's orientation): a token's
        embedding is its column, dequantized."""
        x = embed_lookup(self.embed.get_value(), token_ids).astype(self.compute_dtype)  # [T, H / tp]
        return jax.lax.all_gather(x, "tensor", axis=1, tiled=True) if self.parallel.tp > 1 else x

    def _logits_rows(self, hidden, residual, rows, first_row):
        """The rows [R] of this replica's step that need logits, from the devices holding them."""
        if self.parallel.sp == 1:
            return hidden[rows], residual[rows]
        local = rows - first_row
        mine = ((local >= 0) & (local < hidden.shape[0]))[:, None]
        local = jnp.clip(local, 0, hidden.shape[0] - 1)
        pick = lambda a: jax.lax.psum(jnp.where(mine, a[local], 0).astype(jnp.float32), "sequence").astype(a.dtype)  # noqa: E731
        return pick(hidden), pick(residual)

    def _lm_head(self, h: jax.Array) -> jax.Array:
        """h [R, H] -> logits [R, V] float32 (the LM head, or the tied embedding)."""
        h = self._hidden_shard(h)
        if self.config.tie_word_embeddings:
            logits = tied_logits(h, self.embed.get_value(), self.kernels)
        else:
            logits = matmul(h, self.lm_head.get_value(), self.kernels)
        return self._tensor_sum(logits, jnp.float32)  # logits stay float32

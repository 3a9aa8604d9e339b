"""What every decoder-only model shares: its weights, the step around its layers, and the
attention and MLP sublayers the family files compose into their blocks.

A family file (llama.py, gemma.py, olmo.py) subclasses `Decoder` and writes one method, `block`:
one decoder layer, reading top to bottom like the architecture. Everything else is here:

- the weights: `embed [V, H]`, one `DecoderLayers` module whose weights carry a leading
  [num_layers] axis (the layout is `jaxinfer.models.param_layout`'s), `final_norm`, `lm_head`;
- `__call__`: embed this step's tokens, run the layers, the final norm and the LM head;
- the layer loop (`run_layers`): a `lax.fori_loop` over the layers' *period*, the shortest run of
  attention kinds that repeats (1 for Llama; 2 for Gemma 2, a sliding layer then a global one; 6
  for Gemma 3): the period's layers are unrolled, so each sees its kind (window, RoPE table) as
  a static fact and the kernels specialise on it, while the compiled program holds one period
  rather than every layer. Layers past the last whole period are unrolled after the loop; a MoE
  model's first dense layers (GLM-4.5) and Gemma 4's KV-shared last layers are runs of their own,
  each with its own period; the period counts a layer's KV group, which weight stacks it reads
  (`param_layout.stack_of`: the MoE or the dense MLP's, Gemma 4's global attention's) and whether
  it reads another layer's K/V, beside its attention kind;
- `attention(...)`: QKV projection, q/k(/v) norms, RoPE, the paged KV write, attention and o_proj,
  at the layer kind's head dim and KV heads, through its group's view of the pool (pages of
  page_size * f tokens, or a TPU pool's lane blocks: `jaxinfer.ops.kv_cache.page_factors`) (with
  `ModelConfig.kv_eviction`: over the kept tokens only, `jaxinfer.ops.kv_eviction`);
- `mlp(...)`: a gated MLP (SwiGLU or GeGLU) or a mixture of experts (`jaxinfer.models.moe`).

The residual stream travels as (hidden, residual), stream = hidden + residual: each norm takes
in the add that precedes it (`add_rms_norm`), so on accelerators the add and the norm are one pass.

**Parallel.** The step runs the model inside `jax.shard_map` over the device mesh (see
jaxinfer.runtime.step), so `__call__` sees this device's shards and does its own collectives, each
only when its axis has more than one device (on one device the program is the plain one):

- tensor (Megatron): the fused QKV and gate/up columns, o and down rows, and the hidden dim of the
  embedding / LM head are split; one `psum` after o_proj and one after down_proj per layer, an
  all-gather of the embedded tokens and a `psum` of the logits per step (with
  lm_head_parallel="vocab" the embedding / LM head are split on the vocabulary instead: a `psum`
  of the embedded tokens, each shard looking up its own ids, and no collective on the logits,
  which leave the model split on the vocabulary, [R, V / tp], for the sampler);
- sequence: this replica's T tokens are split in `sp` contiguous blocks for everything but
  attention, which sees all of this step's K/V (all-gathered, or passed around a ring), see
  `jaxinfer.ops.attention.attend_sequence_parallel`; the logits rows are summed over the axis;
- expert (MoE): experts are split, tokens dispatched with all_to_all (`jaxinfer.models.moe`);
- data and expert also index replicas: each device sees only its replica's batch and KV pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ConfigError, LayerKind, ModelConfig
from jaxinfer.kv_groups import kv_groups, layer_period
from jaxinfer.models import moe, pipeline
from jaxinfer.models.layers import (add_rms_norm, embed_lookup, gate_up_swiglu, gelu_tanh_glu, linear, matmul, rms_norm,
                                   rms_norm_weight, soft_cap, swiglu, table_vocab, tied_logits,
                                   vocab_parallel_lookup)
from jaxinfer.models.lora import LoraSlots, LoraTable, lora_shapes
from jaxinfer.models.param_layout import base_name, param_shapes, stack_of, stack_slots
from jaxinfer.models.rope import rope_tables
from jaxinfer.ops import kv_eviction
from jaxinfer.ops.attention import attend_written_kv, kv_write_locations, write_kv_and_attend
from jaxinfer.ops.batch import SCRATCH_PAGE, RaggedBatch
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache, page_factors
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


def lane_block_table(table: jax.Array, f: int) -> jax.Array:
    """A group's page table [S, pages] with pages of page_size * f tokens -> the same width of
    pages of page_size tokens, page i's f lane blocks (ids i * f + j) in its place: the table the
    TPU kernel reads for a group whose pages are lane blocks (jaxinfer.ops.kv_cache.page_factors)."""
    if f == 1:
        return table
    S, width = table.shape
    blocks = table[:, : -(-width // f), None] * f + jnp.arange(f, dtype=table.dtype)  # [S, ceil(width / f), f]
    return blocks.reshape(S, -1)[:, :width]


def _init(name: str, shape, dtype, key) -> jax.Array:
    if name.endswith(("norm", "scale", "scalar")):  # (Gemma 4's router and layer scales)
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


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What every layer of one step reads besides its weights (built once per step in __call__)."""

    batch: RaggedBatch  # its page_table [G, S, pages_per_seq]: a row per sequence and KV layer group
    write_page: jax.Array  # [G, T]: each token's page in each group (kv_write_locations)
    write_offset: jax.Array  # [G, T]: its offset in that page (a group's pages hold page_size * its factor tokens)
    rope: dict  # LayerKind.rope -> (cos, sin) [T, rotary_dim] each (jaxinfer.models.rope)
    lora_slot: jax.Array | None  # [Tl]: each of this device's tokens' adapter slot (None: no LoRA)
    query_block: int
    spec_block: int
    num_pages: int  # pages per slot: slot s's pages start at s * num_pages in the folded pool
    nope_query_scale: jax.Array | None = None  # [Tl]: NoPE layers' query scale per token (Llama 4), else None
    per_layer_inputs: jax.Array | None = None  # [Tl, L, P]: each layer's extra input per token (Gemma 4's PLE), else None
    # KV eviction "streaming": LayerKind.rope -> (cos, sin) at each token's position inside its cache
    # (ops.kv_eviction.cache_positions), what its sinks are scored with; else None
    cache_rope: dict | None = None


@dataclasses.dataclass(frozen=True)
class LayerRef:
    """Where a layer's K/V live (jaxinfer.kv_groups): its group's page-table row (static) and its
    slot in the pool (traced inside the layer loop); whether it reads another layer's K/V instead
    of writing its own (Gemma 4's KV-shared layers: the group and slot are that layer's)."""

    index: jax.Array | int  # the layer (its weights)
    group: int
    slot: jax.Array | int
    kv_shared: bool = False

    def batch_view(self, batch: RaggedBatch) -> RaggedBatch:
        """The batch as this layer's attention sees it: its group's page table [S, pages_per_seq]."""
        return dataclasses.replace(batch, page_table=batch.page_table[self.group])


def check_tree_support(config: ModelConfig, batch: RaggedBatch) -> None:
    """ValueError for a batch with tree masks (draft trees) on a model that cannot take them: M-RoPE
    (three positions per token), KV eviction (its own masks and positions), recurrent layers (their
    state runs through a chunk's tokens in order, not along the tree's branches)."""
    if batch.tree_rope is None or batch.tree_bits is None:
        raise ValueError("a batch with tree_base needs tree_bits and tree_rope too (ops.batch.pack_batch(with_tree=True))")
    if batch.rope_positions is not None or config.mrope_section is not None:
        raise ValueError("tree attention masks (draft trees) with M-RoPE positions are not supported")
    if config.kv_eviction is not None:
        raise ValueError("tree attention masks (draft trees) with KV eviction are not supported")
    if config.has_linear_layers:
        raise ValueError("tree attention masks (draft trees) with linear-attention (recurrent) layers are not supported")


class Decoder(nnx.Module):
    """A decoder-only language model; a family file supplies `block` (see the module docstring)."""

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
        if config.qk_norm and config.qk_norm_scope == "projection" and parallel.tp > config.num_kv_heads:
            raise ConfigError(f"{config.model_type}: q/k norms over the whole projection with tensor parallelism {parallel.tp} "
                              f"> {config.num_kv_heads} KV heads (replicated KV heads) are not supported")
        if config.attention_sinks and parallel.sp > 1 and parallel.sp_attention == "ring":
            raise ConfigError(f"{config.model_type}: attention sinks with ring attention are not supported "
                              "(sequence parallelism with sp_attention='allgather' is)")
        self.kv_groups = kv_groups(config)  # static: which page-table row and pool slot each layer uses
        factors = page_factors(self.kv_groups, tp=parallel.tp, combined=kernels.combines_kv)
        # static, per group: a separate pool is reshaped to pages of page_size * f tokens, a combined (TPU) one
        # read as f lane blocks of page_size tokens per page (jaxinfer.ops.kv_cache.page_factors)
        self.page_factors = tuple(1 if kernels.combines_kv else f for f in factors)
        self.lane_blocks = tuple(f if kernels.combines_kv else 1 for f in factors)
        if max(self.lane_blocks) > 1 and parallel.sp > 1:
            raise ConfigError(f"{config.model_type}: KV layer groups of several row widths on TPU pools with sequence "
                              "parallelism are not supported")
        if config.kv_eviction is not None and (kernels.combines_kv or parallel.sp > 1):
            raise ConfigError(f"kv_eviction={config.kv_eviction.method!r} runs the XLA attention over separate K and V pools, "
                              "without sequence parallelism (jaxinfer.ops.kv_eviction)")
        if config.kv_shared_layers and parallel.sp > 1:
            raise ConfigError(f"{config.model_type}: layers sharing K/V (num_kv_shared_layers={config.kv_shared_layers}) "
                              "with sequence parallelism are not supported")
        self.config = config
        self.compute_dtype = compute_dtype
        self.kernels = kernels  # static: XLA paths or Pallas kernels (jaxinfer.ops.kernels)
        self.parallel = parallel  # static: the mesh's axis sizes (sharding.mesh.ParallelConfig)
        shapes = param_shapes(config, parallel.tp)  # global shapes; __call__ sees this device's shards
        layer_shapes = {k.split(".", 1)[1]: v for k, v in shapes.items() if k.startswith("layers.")}
        if parallel.pp > 1:  # every stage's layers alike (one program runs them all)
            pipeline.check_pipeline(config, parallel, self.kv_groups, tuple(layer_shapes))
        self.embed = nnx.Param(_init("embed", shapes["embed"], param_dtype, rngs.params()))
        self.layers = DecoderLayers(layer_shapes, param_dtype, rngs)
        self.final_norm = nnx.Param(_init("final_norm", shapes["final_norm"], param_dtype, None))
        if "lm_head" in shapes:
            self.lm_head = nnx.Param(_init("lm_head", shapes["lm_head"], param_dtype, rngs.params()))
        for name in ("embed_per_layer", "per_layer_proj", "per_layer_proj_norm"):  # Gemma 4's per-layer inputs
            if name in shapes:
                setattr(self, name, nnx.Param(_init(name, shapes[name], param_dtype, rngs.params())))
        if lora is not None:
            self.lora = LoraSlots(lora_shapes(config, lora, parallel.tp), param_dtype)  # the adapter slot table (jaxinfer.models.lora)

    # ------------------------------------------------------------------ the step
    def __call__(self, kv: KVCache, batch: RaggedBatch, *, query_block: int, spec_block: int = 0,
                 return_hidden: bool = False, return_stream: bool | tuple[int, ...] = False,
                 input_hidden: jax.Array | None = None):
        """One device's part of a step (see the module docstring).

        kv: this device's pages, [slots, P, page_size, Hkv_local, D]; batch: its replica's batch (T
        tokens, S sequence slots). Returns (logits [R, V] float32 for the rows
        batch.logits_indices, the same on every device of the replica; the updated cache), then
        with return_hidden the rows' final-normed hidden states [R, H] (draft heads read them),
        with return_stream every token's residual stream (hidden + residual) at the input of the
        layers it names, side by side: True names layer num_layers, the stream after the last
        layer before the final norm, [T, H] (a multi-token-prediction module reads it); a tuple of
        layer indices in 0..num_layers gives [T, len * H] (EAGLE-3 reads three: models.eagle3).
        `input_hidden` [T, H']: a hidden state per token beside its id, for models whose input
        takes one (`step_input`).
        """
        c, par = self.config, self.parallel
        T = batch.token_ids.shape[0]
        S = batch.kv_lens.shape[0]
        Tl = T // par.sp  # this device's tokens: rows first_row : first_row + Tl of the step
        first_row = jax.lax.axis_index("sequence") * Tl if par.sp > 1 else 0

        token_ids = jax.lax.dynamic_slice_in_dim(batch.token_ids, first_row, Tl)
        if return_stream and (par.sp > 1 or par.pp > 1):
            raise ValueError("the residual stream of every token is returned without sequence or pipeline parallelism only")
        x = self.step_input(token_ids, batch.positions, input_hidden)  # [Tl, H]
        if batch.mm_embeds is not None:  # image tokens read their encoder rows instead of their ids' embeddings
            if par.sp > 1 or par.pp > 1:
                raise ValueError("image inputs with sequence or pipeline parallelism are not supported")
            x = jnp.where(batch.mm_mask[:, None], batch.mm_embeds.astype(x.dtype), x)
        if max(self.lane_blocks) > 1:  # a lane-block group's table names its pages' lane blocks (page_factors)
            batch = dataclasses.replace(batch, page_table=jnp.stack(
                [lane_block_table(table, f) for table, f in zip(batch.page_table, self.lane_blocks)]))
        groups = [LayerRef(0, g, 0).batch_view(batch) for g in range(batch.page_table.shape[0])]
        locations = [kv_write_locations(view, kv.page_size * f, SCRATCH_PAGE) for view, f in zip(groups, self.page_factors)]
        write_page = jnp.stack([page for page, _ in locations])  # [G, T]: every token's page and offset in each group
        write_offset = jnp.stack([offset for _, offset in locations])
        seq_of_token = jnp.minimum(jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T), side="right"), S - 1)
        logical_positions = batch.positions  # [T]: where RoPE (and position-dependent scales) put each token
        if batch.tree_base is not None:  # draft trees: a node rotates at its root's position + its depth (ops.batch)
            check_tree_support(c, batch)
            logical_positions = batch.tree_rope
        rope = rope_tables(c, logical_positions, batch.kv_lens[seq_of_token], batch.rope_positions)  # kind -> [T, dim] each
        slot = None  # LoRA: each of this device's tokens' adapter slot
        if getattr(self, "lora", None) is not None and batch.lora_slots is not None:
            slot_of_token = jnp.where(jnp.arange(T) < batch.cu_q_lens[-1], batch.lora_slots[seq_of_token], 0)  # padding: none
            slot = jax.lax.dynamic_slice_in_dim(slot_of_token, first_row, Tl)  # [Tl]
        query_scale = None
        if c.attn_temperature_scale is not None:  # Llama 4's attention temperature tuning, by each token's position
            positions = jax.lax.dynamic_slice_in_dim(logical_positions, first_row, Tl).astype(jnp.float32)
            query_scale = jnp.log1p(jnp.floor((positions + 1.0) / c.attn_temperature_floor)) * c.attn_temperature_scale + 1.0
        ple = self._per_layer_inputs(token_ids, x) if c.per_layer_input_size else None
        cache_rope = None
        if c.kv_eviction is not None and c.kv_eviction.method == "streaming":  # the sinks' query rotation
            cache_rope = rope_tables(c, kv_eviction.cache_positions(batch.positions, c.kv_eviction),
                                     batch.kv_lens[seq_of_token])
        step = StepInputs(batch, write_page, write_offset, rope, slot, query_block, spec_block, kv.num_pages, query_scale, ple,
                          cache_rope)

        num_slots = kv.num_slots
        # Fold the slot axis into the page axis: slot s's page p is page s * P + p of one pool.
        stream_layers = (c.num_layers,) if return_stream is True else tuple(return_stream or ())
        if any(not 0 <= i <= c.num_layers for i in stream_layers):
            raise ValueError(f"return_stream={return_stream!r}: layer indices must be in 0..{c.num_layers}")
        if par.pp > 1:  # this stage's layers over micro-batches, handed stage to stage (models.pipeline)
            run_stage = lambda step, carry: self.run_layers(step, carry, stage_layers=c.num_layers // par.pp)[0]  # noqa: E731
            stream, residual, pool = pipeline.run_pipeline(run_stage, step, x, kv.fold_slots(), par.pp, par.tp)
            captured = {}
        else:
            (stream, residual, pool), captured = self.run_layers(
                step, (x, jnp.zeros_like(x), kv.fold_slots()), capture=tuple(i for i in stream_layers if i < c.num_layers))
        captured[c.num_layers] = stream + residual
        hidden, rows_residual = self._logits_rows(stream, residual, batch.logits_indices, first_row)  # [R, H] each
        h, _ = add_rms_norm(hidden, rows_residual, self.norm_weight(self.final_norm[...]), c.rms_norm_eps, self.kernels)
        if par.pp > 1:  # the normed rows from the last stage, on every stage
            h = pipeline.from_last_stage(h, par.pp, par.tp)
        kv = pool.unfold_slots(num_slots)
        extras = (h,) if return_hidden else ()  # the final-normed hidden state of each logits row [R, H]
        if stream_layers:  # every token's stream at the input of those layers [T, len * H]
            extras += (jnp.concatenate([captured[i] for i in stream_layers], axis=-1),)
        return (self._lm_head(h), kv, *extras)

    def step_input(self, token_ids: jax.Array, positions: jax.Array, input_hidden: jax.Array | None) -> jax.Array:
        """What the first layer reads for this device's tokens [Tl]: their embeddings [Tl, H]
        (a multi-token-prediction module also reads `input_hidden`: models.deepseek_mtp)."""
        return self._embed(token_ids)

    def run_layers(self, step: StepInputs, carry, capture: tuple[int, ...] = (), stage_layers: int | None = None):
        """carry = (hidden, residual, pool) through every layer (the period loop of the module docstring);
        with `stage_layers` (pipeline parallelism) through this stage's layers only, 0 .. stage_layers - 1
        of its shards of the stacks (models.pipeline: every stage's alike);
        with `batch.mm_deepstack` [K, T, H] (Qwen3-VL's deepstack) layer j < K's output at the image
        tokens gains row j (added to hidden: the stream is hidden + residual). Returns (carry,
        {layer: stream [T, H] at its input} for the layers in `capture`): the runs of layers are
        cut at those layers, so the stream is read between two loops, not copied in every layer."""
        c, groups = self.config, self.kv_groups
        stacked = self.layers.stacked()
        # what a layer's code specialises on: its attention kind, its KV group, which stacks hold its
        # weights (a MoE layer's MLP reads the MoE stacks, a dense one the dense ones; Gemma 4's global
        # layers their own attention stacks), whether it reads another layer's K/V
        def stacks(i):  # (weight, stacked param) of layer i's weights
            return tuple((base_name(f"layers.{name}"), name) for name in stacked
                         if stack_of(c, base_name(f"layers.{name}"), i) == f"layers.{name}")

        statics = [(kind, group, stacks(i), c.is_kv_shared(i))
                   for i, (kind, group) in enumerate(zip(c.layer_kinds(), groups.group_of_layer))]
        slot_of_layer = jnp.asarray(groups.slot_of_layer, jnp.int32)
        slots = {name: jnp.asarray(stack_slots(c, f"layers.{name}"), jnp.int32) for name in stacked}  # [L] each
        lora = self.lora.stacked() if step.lora_slot is not None else None
        deepstack = step.batch.mm_deepstack  # [K, T, H] or None (Qwen3-VL's image steps)

        def layer(i, static, carry):  # layer i (traced in the loop), its static facts
            kind, group, names, shared = static
            w = {base: jax.tree.map(lambda a: a[slots[name][i]], stacked[name]) for base, name in names}  # layer i's weights
            lw = {name: a[i] for name, a in lora.items()} if lora is not None else None  # [N, ...] each
            carry = self.block(step, LayerRef(i, group, slot_of_layer[i], shared), kind, w, lw, *carry)
            if deepstack is not None:  # after layer i < K, the image tokens' stream gains deepstack row i
                hidden = carry[0]
                row = jax.lax.dynamic_index_in_dim(deepstack, jnp.minimum(i, deepstack.shape[0] - 1), keepdims=False)  # [T, H]
                add = (i < deepstack.shape[0]) & step.batch.mm_mask[:, None]  # [T, 1]
                carry = (jnp.where(add, hidden + row.astype(hidden.dtype), hidden), *carry[1:])
            return carry

        def run(start, end, carry):  # layers start..end-1: a loop over their period, the rest unrolled
            run_statics = statics[start:end]
            period = layer_period(tuple(run_statics))

            def one_period(p, carry):
                for j in range(period):
                    carry = layer(start + p * period + j, run_statics[j], carry)
                return carry

            whole = len(run_statics) // period
            if whole > 1:
                carry = jax.lax.fori_loop(0, whole, one_period, carry)
            elif whole:
                carry = one_period(0, carry)
            for i in range(start + whole * period, end):  # the layers past the last whole period
                carry = layer(i, statics[i], carry)
            return carry

        first = c.first_dense_layers if c.is_moe else 0  # GLM-4.5's dense layers before the MoE ones
        shared = c.num_layers - c.kv_shared_layers  # Gemma 4's KV-shared layers after the others
        cuts = sorted({0, first, shared, c.num_layers, *capture}) if stage_layers is None else [0, stage_layers]
        captured = {}
        for start, end in zip(cuts, cuts[1:]):
            if start in capture:
                captured[start] = carry[0] + carry[1]
            if end > start:
                carry = run(start, end, carry)
        return carry, captured

    def block(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, hidden, residual, pool):
        """One decoder layer (its K/V's place `layer`, static `kind`): (hidden, residual, pool) -> the same."""
        raise NotImplementedError

    # ------------------------------------------------------------------ sublayers the blocks compose
    def norm_weight(self, weight):
        return rms_norm_weight(weight, self.config.norm_weight_offset)

    def add_norm(self, x, residual, weight):
        """(rms_norm(x + residual) * weight, x + residual)."""
        return add_rms_norm(x, residual, self.norm_weight(weight), self.config.rms_norm_eps, self.kernels)

    def norm(self, x, weight):
        return rms_norm(x, self.norm_weight(weight), self.config.rms_norm_eps)

    def attention(self, step: StepInputs, layer: LayerRef, kind: LayerKind, w: dict, lw: dict | None, h, pool):
        """Self-attention of h [Tl, H] through the layer's paged cache: (out [Tl, H], pool)."""
        c, par, kernels = self.config, self.parallel, self.kernels
        Tl = h.shape[0]
        D = c.kind_head_dim(kind)  # Gemma 4's global layers have their own head dim and KV heads
        num_heads = c.num_heads // par.tp  # this device's query heads
        num_kv_heads = kv_heads_per_shard(c.kind_kv_heads(kind), par.tp)
        qkv = linear(h, w["qkv_proj"], w.get("qkv_bias"), kernels)  # one matmul: [Tl, (Hq + 2*Hkv)*D] local
        if lw is not None:
            delta = kernels.lora_delta(h, lw["qkv_a"], [lw["q_b"], lw["k_b"], lw["v_b"]], step.lora_slot)  # [Tl, q | k | v] local
            qkv = (qkv.astype(jnp.float32) + delta).astype(qkv.dtype)
        if kind.k_eq_v:  # [q | k]: the values are the keys' projection, normed on their own below
            q = qkv[:, : num_heads * D].reshape(Tl, num_heads, D)
            k = v = qkv[:, num_heads * D :].reshape(Tl, num_kv_heads, D)
        else:
            q, k, v = split_qkv(qkv, num_heads, num_kv_heads, D)
        if c.value_norm:  # Gemma 4: each value head RMS-normalised, without a weight
            v = self._l2_norm(v)
        if c.qk_norm and c.qk_norm_scope == "head":  # RMSNorm over each head's D dims (Qwen3, Gemma 3)
            q, k = self.norm(q, w["q_norm"]), self.norm(k, w["k_norm"])
        elif c.qk_norm:  # over the whole projection (OLMo 2): the sum of squares spans the tensor shards
            q, k = self._projection_norm(q, w["q_norm"]), self._projection_norm(k, w["k_norm"])
        if c.qk_l2_norm and kind.rope is not None:  # Llama 4: after RoPE there, the same before (a rotation keeps the norm)
            q, k = self._l2_norm(q), self._l2_norm(k)
        if step.nope_query_scale is not None and kind.rope is None:
            q = (q * step.nope_query_scale[:, None, None]).astype(q.dtype)
        cos, sin = step.rope[kind.rope]
        view = pool.group_view(self.page_factors[layer.group], num_kv_heads, D)  # [slots * P, page_size * f, Hkv, D]
        lanes = self.lane_blocks[layer.group]  # a TPU pool's: its pages are lane blocks of the pool's
        options = dict(sm_scale=c.sm_scale, sliding_window=kind.window, attention_chunk=kind.chunk, soft_cap=c.attn_logit_softcap,
                       sinks=w.get("sinks"), query_block=step.query_block, spec_block=step.spec_block, kernels=kernels,
                       lane_blocks=lanes)
        first_page = layer.slot * step.num_pages * lanes  # where the layer's (lane-block) pages start
        if c.kv_eviction is not None:  # StreamingLLM / H2O (ops.kv_eviction): the kept tokens only
            attn, view = kv_eviction.write_kv_and_attend(
                q, k, v, cos, sin, step.cache_rope[kind.rope] if step.cache_rope is not None else None, view, first_page,
                step.write_page[layer.group], step.write_offset[layer.group], layer.batch_view(step.batch),
                eviction=c.kv_eviction, sm_scale=c.sm_scale, query_block=step.query_block, soft_cap=c.attn_logit_softcap,
                kernels=kernels)
            pool = view.like(pool)
        elif layer.kv_shared:  # Gemma 4: another layer's K/V, already in the pages
            attn = attend_written_kv(q, cos, sin, view, first_page, layer.batch_view(step.batch),
                                     num_kv_heads=num_kv_heads, **options)
        else:
            attn, view = write_kv_and_attend(  # RoPE, KV write, attention
                q, k, v, cos, sin, view, first_page, step.write_page[layer.group],
                step.write_offset[layer.group], layer.batch_view(step.batch), parallel=par, pages_per_slot=step.num_pages,
                **options)
            pool = view.like(pool)
        attn = attn.reshape(Tl, num_heads * D)
        if c.attn_output_gate:  # Qwen3-Next / Qwen3.5: each query head's output times sigmoid(its gate)
            gate = matmul(h, w["attn_gate"], kernels)  # [Tl, Hq * D] (this shard's heads)
            attn = (attn.astype(jnp.float32) * jax.nn.sigmoid(gate)).astype(attn.dtype)
        delta = kernels.lora_delta(attn, lw["o_a"], [lw["o_b"]], step.lora_slot) if lw is not None else None
        return self._row_parallel(attn, w["o_proj"], w.get("o_bias"), delta), pool

    def _l2_norm(self, x):
        """x [T, heads, D] RMS-normalised over each head's D dims, without a weight (Llama 4's q/k norm)."""
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.rms_norm_eps)).astype(x.dtype)

    def _projection_norm(self, x, weight):
        """RMSNorm of x [T, heads, D] over all heads' dims together (weight [heads * D], this
        shard's part); with tensor parallelism the mean of squares is summed over the shards."""
        T, heads, D = x.shape
        xf = x.astype(jnp.float32).reshape(T, heads * D)
        sq = jnp.sum(xf * xf, axis=-1, keepdims=True)
        if self.parallel.tp > 1:
            sq = jax.lax.psum(sq, "tensor")
        xf = xf * jax.lax.rsqrt(sq / (heads * D * self.parallel.tp) + self.config.rms_norm_eps)
        return (self.norm_weight(weight).astype(jnp.float32) * xf).astype(x.dtype).reshape(T, heads, D)

    def mlp(self, step: StepInputs, w: dict, lw: dict | None, h):
        """The MLP of h [Tl, H]: gated (SwiGLU / GeGLU) or a mixture of experts. [Tl, H]."""
        if "router" in w:  # a MoE layer (GLM-4.5's first layers are dense)
            return self._tensor_sum(moe.moe_mlp(h, w, self.config, self.parallel, self.kernels))
        return self.dense_mlp(step, w, lw, h)

    def dense_mlp(self, step: StepInputs, w: dict, lw: dict | None, h):
        """The gated MLP (SwiGLU / GeGLU) of h [Tl, H]: [Tl, H]."""
        c, kernels = self.config, self.kernels
        act = gelu_tanh_glu if c.hidden_act == "gelu_tanh" else swiglu
        if lw is not None and "gate_up_a" in lw:  # (a MoE model's table has no MLP adapters, its dense layers none)
            gate_up = linear(h, w["gate_up_proj"], w.get("gate_up_bias"), kernels).astype(jnp.float32)
            a = act((gate_up + kernels.lora_delta(h, lw["gate_up_a"], [lw["gate_b"], lw["up_b"]], step.lora_slot)).astype(h.dtype))
            return self._row_parallel(a, w["down_proj"], w.get("down_bias"),
                                      kernels.lora_delta(a, lw["down_a"], [lw["down_b"]], step.lora_slot))
        if c.hidden_act == "silu":
            a = gate_up_swiglu(h, w["gate_up_proj"], w.get("gate_up_bias"), kernels)
        else:
            a = act(linear(h, w["gate_up_proj"], w.get("gate_up_bias"), kernels))
        return self._row_parallel(a, w["down_proj"], w.get("down_bias"))

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

    def _split_on_vocab(self, table, head: bool = False) -> bool:
        """Whether this shard of the embedding table (or of the LM head, `head`) holds a block of the
        vocabulary (lm_head_parallel="vocab") rather than a block of the hidden dim."""
        return self.parallel.tp > 1 and table_vocab(table, head=head) < self.config.vocab_size

    def _hidden_shard(self, h: jax.Array) -> jax.Array:
        """This tensor shard's columns of h [R, H] (the embedding's hidden dim is split; split on
        the vocabulary instead, lm_head_parallel="vocab": all of h)."""
        tp = self.parallel.tp
        if tp == 1 or self._split_on_vocab(self.embed.get_value()):
            return h
        width = h.shape[-1] // tp
        return jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index("tensor") * width, width, axis=-1)

    def _embed(self, token_ids: jax.Array) -> jax.Array:
        """token_ids [T] -> [T, H] in the compute dtype; the table's hidden dim is split over tensor.
        A quantized table is stored [H / tp, V] (the tied LM head's orientation): a token's
        embedding is its column, dequantized. Gemma scales it by sqrt(H), rounded to the compute
        dtype first as HF does. With the table split on the vocabulary instead (lm_head_parallel=
        "vocab": the local table holds V / tp ids), each shard looks up its own ids and the shards'
        rows are summed (a psum of [T, H] instead of an all-gather)."""
        table = self.embed.get_value()
        if self._split_on_vocab(table):
            x = jax.lax.psum(vocab_parallel_lookup(table, token_ids, "tensor").astype(self.compute_dtype), "tensor")
        else:
            x = embed_lookup(table, token_ids).astype(self.compute_dtype)  # [T, H / tp]
            if self.parallel.tp > 1:
                x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        if self.config.scale_embeddings:
            x = x * jnp.asarray(self.config.hidden_size**0.5, self.compute_dtype)
        return x

    def _per_layer_inputs(self, token_ids: jax.Array, x: jax.Array) -> jax.Array:
        """Gemma 4's per-layer inputs [Tl, L, P] of this device's tokens [Tl] (embedded as x [Tl, H]):
        (rms_norm(x @ per_layer_proj / sqrt(H)) + embed_per_layer[token] * sqrt(P)) / sqrt(2)."""
        c = self.config
        L, P, dtype = c.num_layers, c.per_layer_input_size, self.compute_dtype
        table = embed_lookup(self.embed_per_layer.get_value(), token_ids).astype(dtype)
        token = (table * jnp.asarray(P**0.5, dtype)).reshape(-1, L, P)
        context = (matmul(x, self.per_layer_proj.get_value(), self.kernels) * c.hidden_size**-0.5).astype(dtype)
        context = rms_norm(context.reshape(-1, L, P), self.per_layer_proj_norm.get_value(), c.rms_norm_eps)
        return ((context.astype(jnp.float32) + token.astype(jnp.float32)) * 2**-0.5).astype(dtype)

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
        """h [R, H] -> logits [R, V] float32 (the LM head, or the tied embedding; soft-capped for Gemma 2).
        With the head split on the vocabulary (lm_head_parallel="vocab"): this shard's block of
        the logits [R, V / tp], nothing exchanged (the sampler works on the blocks)."""
        h = self._hidden_shard(h)
        if self.config.tie_word_embeddings:
            table = self.embed.get_value()
            logits, split = tied_logits(h, table, self.kernels), self._split_on_vocab(table)
        else:
            head = self.lm_head.get_value()
            logits, split = matmul(h, head, self.kernels), self._split_on_vocab(head, head=True)
        if split:  # split on the vocabulary: no sum
            return soft_cap(logits.astype(jnp.float32), self.config.final_logit_softcap)
        return soft_cap(self._tensor_sum(logits, jnp.float32), self.config.final_logit_softcap)  # logits stay float32


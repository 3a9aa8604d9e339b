"""Building an engine from an `EngineConfig`: model, weights, mesh, KV pool, runner, proposer.

    engine = build_engine(EngineConfig(model="./model", tensor_parallel_size=2))

`place_weights` then `build_runner` are the one recipe for a model on the mesh, used for the
target and for every draft model: quantize (if asked) and place each parameter with its
sharding; allocate the KV pool (the engine's page geometry, every replica's pool on one page
axis) and wrap both in a `ModelRunner` over the engine's shape buckets.

On a TPU or GPU the pool's size comes from the devices' memory unless given (engine/memory.py):
`pages_from_device_memory` runs after every weight is placed (a draft model's too) and before any
pool exists, and compiles the largest bucket once over an abstract pool to measure its scratch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import jax
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.draft_head import DraftHeadProposer
from jaxinfer.engine.draft_model import DraftModelProposer
from jaxinfer.engine.eagle3 import Eagle3Proposer
from jaxinfer.engine.lookahead import LookaheadProposer
from jaxinfer.engine.mtp import MTPProposer
from jaxinfer.engine.lora import LoraManager
from jaxinfer.engine.memory import (PoolSummary, abstract_pool, bytes_per_device, device_capacity_bytes, kv_pool_pages,
                                    least_over_processes, measure_step_scratch)
from checkpoints_conv import read_checkpoint_config, read_hf_config
from jaxinfer.models.lora import LoraSlots, LoraTable, lora_shapes
from jaxinfer.models.param_layout import stack_slots
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.kv_tiers import GiB, DiskTier, HostTier, KVTiers, PageLayout, fingerprint
from jaxinfer.engine.model_runner import ModelRunner
from jaxinfer.engine.pooling import PoolerConfig
from jaxinfer.engine.spec_decode import NgramProposer, SpeculativeConfig
from jaxinfer.kv_groups import kv_groups
from jaxinfer.models.draft_heads import load_heads
from jaxinfer.models.eagle3 import load_eagle3
from jaxinfer.ops.kv_cache import KVCache, combined_pool, is_quantized
from jaxinfer.ops.linear_state import LinearState
from jaxinfer.ops.quantization import cast_scales, default_group_size, quantize_model
from jaxinfer.runtime.kernel_selfcheck import checked_kernels, step_shapes, with_kernels
from jaxinfer.runtime.loading import abstract_model, load_params, read_config, resolve_model
from jaxinfer.runtime.placement import kv_partition_spec, linear_state_spec, param_partition_specs, put_global
from jaxinfer.runtime.step import StepFunction
from jaxinfer.startup import PhaseClock
from jaxinfer.engine.multimodal import MAX_IMAGES_PER_PROMPT, ImageEncoder, PromptImages
from jaxinfer.tokenizer import cache_root, load_tokenizer
from jaxinfer.tree import flat_to_nested, nested_to_flat
from sharding.mesh import ParallelConfig, ShardingError, make_mesh

logger = logging.getLogger("jaxinfer")


def build_engine(config: EngineConfig, clock: PhaseClock | None = None) -> LLMEngine:
    """The engine of `config`, with `model_config`, `mesh` and `parallel` attributes. `clock`
    records the phases (config, weights, tokenizer, KV cache and engine, warmup)."""
    clock = clock or PhaseClock()
    source = resolve_model(config.model, revision=config.revision)
    model_config = config.with_kv_eviction(read_config(source))  # (KV eviction: the model attends over what it keeps)
    parallel = config.parallel(model_config)
    sized_by = config.pool_sized_by
    config = config.resolved(model_config)
    mesh = make_mesh(parallel)
    clock.mark("config")
    # The tokenizer (mostly importing transformers) loads in a thread while the weights load.
    tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-tokenizer")
    tokenizer_future = tokenizer_thread.submit(_timed, load_tokenizer, source)
    tokenizer_thread.shutdown(wait=False)
    weights = load_params(source, model_config, config.param_dtype, config.activation_dtype, kernels=config.kernels,
                          parallel=parallel, mesh=mesh, progress=config.progress,
                          keep_quantized=config.keeps_checkpoint_quantization, keep_w8a8=config.keeps_w8a8_checkpoint)
    placed = place_weights(model_config, config, mesh, weights, quantization=config.quantization)
    if config.enable_lora:
        placed = add_lora_table(placed, model_config, config, mesh)
    spec = config.speculative_config
    if spec is not None and spec.is_tree:
        check_token_tree(spec, model_config, config, parallel)
    return_hidden = spec is not None and spec.method in ("eagle", "medusa")
    return_stream = spec is not None and spec.method == "mtp"  # the MTP module reads every token's stream
    draft = None  # (config, weights) of a model drafting beside the target: a draft model's, the MTP module's, EAGLE-3's
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_weights(spec, model_config, config, mesh, placed)
    elif return_stream:
        draft = load_mtp_weights(source, model_config, config, mesh, placed)
    elif spec is not None and spec.method == "eagle3":  # the head reads three layers' streams of every token
        return_stream, draft = load_eagle3_weights(spec, model_config, config, mesh, placed)
    clock.mark("weights")
    config, placed = check_kernels_on_device(config, model_config, parallel, placed, clock)
    if draft is not None and config.xla_kernels:  # a draft model runs the same table: the same fallbacks
        draft_config, draft_weights = draft
        draft = (draft_config, dataclasses.replace(
            draft_weights, graphdef=with_kernels(draft_weights.graphdef, draft_weights.params, config.kernels)))
    tokenizer, tokenizer_seconds = tokenizer_future.result()
    clock.mark("tokenizer (what it took beyond the weights)")
    if config.num_pages is None:  # a TPU / GPU: the pool takes the memory the weights and the step leave
        capacity = device_capacity_bytes(mesh)
        pages, _ = pages_from_device_memory(config, model_config, mesh, placed, drafts=[draft] if draft else [],
                                            return_hidden=return_hidden, capacity_bytes=capacity)
        # every process of the mesh must hold the same pool (they schedule the same steps)
        config = dataclasses.replace(config, num_pages=least_over_processes(pages))
        sized_by += f" of {capacity / 2**30:.1f} GiB per device"
        clock.mark("KV cache size (the largest bucket compiled once)")
    groups = kv_groups(model_config)
    summary = PoolSummary(config.num_pages, config.page_size, config.max_model_len, parallel.num_replicas, sized_by,
                          groups.windows, config.kv_page_factors(model_config),
                          LinearState.bytes_per_slot(model_config, config.activation_dtype) if model_config.has_linear_layers else 0,
                          config.num_prefix_states or 0)
    logger.info("%s", summary)
    pooler = build_pooler(config, source, model_config) if config.runner == "pooling" else None
    runner = build_runner(model_config, config, mesh, placed, num_top_logprobs=config.max_logprobs,
                          return_hidden=return_hidden, return_stream=return_stream, pooling=pooler is not None)
    if spec is not None and spec.is_tree:  # draft trees: every batch carries tree masks; accepted nodes' K/V move
        runner.with_tree = True
        runner.max_tree_moves = config.max_num_seqs * runner.num_replicas * spec.max_tree_depth
    if draft is not None:
        draft_config, draft_weights = draft
        if return_stream:  # MTP / EAGLE-3: a module in lockstep with the target, reading its streams
            proposer_class = Eagle3Proposer if spec.method == "eagle3" else MTPProposer
            proposer = proposer_class(build_runner(draft_config, config, mesh, draft_weights, num_top_logprobs=1,
                                                   return_stream=True),
                                      tree=spec.speculative_token_tree, tree_top_k=spec.tree_top_k, tree_depth=spec.tree_depth)
        else:
            check_draft_groups(model_config, draft_config)
            proposer = DraftModelProposer(build_runner(draft_config, config, mesh, draft_weights, num_top_logprobs=1))
    else:
        proposer = make_proposer(spec, model_config, config, runner) if spec is not None else None
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    lora = (LoraManager(runner, model_config, max_loras=config.max_loras, max_rank=config.max_lora_rank, tp=parallel.tp)
            if config.enable_lora else None)
    kv_tiers = build_kv_tiers(config, model_config, source, runner) if config.kv_offloading_size else None
    images, image_encoder = build_images(config, source, tokenizer, parallel)
    if image_encoder is not None:  # the shapes of its image steps' extra inputs (warm-up compiles them)
        runner.image_inputs = (model_config.hidden_size, image_encoder.deepstack_rows, images.both_ways)
    engine = LLMEngine(config, runner, tokenizer, vocab_size=model_config.vocab_size, eos_token_ids=sorted(eos),
                       proposer=proposer, lora=lora, kv_tiers=kv_tiers, images=images, image_encoder=image_encoder,
                       pooler=pooler)
    engine.model_config, engine.mesh, engine.parallel, engine.source = model_config, mesh, parallel, source
    engine.tokenizer_seconds = tokenizer_seconds
    engine.kv_cache_summary = str(summary)  # the start-up line: pages, tokens, sequences at max_model_len
    clock.mark("KV cache and engine")
    return engine


def build_pooler(config: EngineConfig, source, model_config: ModelConfig) -> PoolerConfig:
    """runner="pooling": how the model pools (its folder's sentence-transformers config and
    classification head, engine.pooling), with config.pooler_config over it."""
    folder = source.path if source is not None and source.kind != "gguf" else None
    hf_config = read_hf_config(folder) if folder is not None else {}
    return PoolerConfig.from_folder(folder, hf_config, model_config.hidden_size, config.pooler_config)


def build_images(config: EngineConfig, source, tokenizer, parallel) -> tuple[PromptImages | None, ImageEncoder | None]:
    """A vision model's prompt processing and image encoder (jaxinfer.engine.multimodal); (None, None) for text models."""
    if source is None or source.kind == "gguf":
        return None, None
    limit = (config.limit_mm_per_prompt or {}).get("image", MAX_IMAGES_PER_PROMPT)
    images = PromptImages.for_model(source.path, tokenizer, max_images=limit, allowed_media_domains=config.allowed_media_domains)
    if images is None:
        return None, None
    if parallel.sp > 1 or parallel.pp > 1:
        raise ValueError("images with sequence_parallel_size > 1 or pipeline_parallel_size > 1 are not supported")
    cache_rows = config.encoder_cache_size or max(4096, 4 * config.max_num_batched_tokens)
    encoder = ImageEncoder(images.kind, images.folder, param_dtype=config.param_dtype, cache_rows=cache_rows)
    logger.info("images: %s vision tower loaded (encoder cache %d rows)", images.kind, cache_rows)
    return images, encoder


@dataclasses.dataclass
class PlacedWeights:
    graphdef: nnx.GraphDef
    params: nnx.State  # on the mesh, each parameter with its sharding
    param_specs: object  # their PartitionSpecs (runtime.placement.param_partition_specs)


def build_kv_tiers(config: EngineConfig, model_config: ModelConfig, source, runner: ModelRunner) -> KVTiers:
    """The KV tiers of config.kv_offloading_size / kv_offloading_dir (engine/kv_tiers.py), for the
    runner's page layout; the disk tier's files carry the fingerprint of this model and geometry."""
    layout = PageLayout.of_pool(runner.kv)
    host_bytes = int(config.kv_offloading_size * GiB)
    if host_bytes < layout.nbytes:
        raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB holds no KV page of {layout.nbytes} bytes")
    disk = None
    if config.kv_offloading_dir is not None:
        if jax.process_count() > 1:
            raise ValueError("kv_offloading_dir on several processes: each would need the same files; use the host tier "
                             "alone (kv_offloading_size)")
        disk_bytes = int(config.kv_offloading_disk_size * GiB) if config.kv_offloading_disk_size else None
        description = kv_tiers_description(config, model_config, source, layout)
        disk = DiskTier(config.kv_offloading_dir, layout, fingerprint(description), capacity_bytes=disk_bytes)
    logger.info("KV tiers: %.2f GiB of host memory (%d pages of %d bytes)%s", host_bytes / GiB, host_bytes // layout.nbytes,
                layout.nbytes, f", written through to {config.kv_offloading_dir}" if disk else "")
    return KVTiers(HostTier(host_bytes), disk)


def kv_tiers_description(config: EngineConfig, model_config: ModelConfig, source, layout: PageLayout) -> dict:
    """What a page file's fingerprint covers (engine/kv_tiers.py): the model (its config, and each
    file of its checkpoint by name, size and modification time, wherever the folder is: other
    weights, or the same ones written again, are another model), the settings that change its K/V (dtypes, quantization)
    and the page geometry."""
    path = source.path
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())[:4096]
    return {
        "model": {"kind": source.kind,
                  "files": [[str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns]
                            for p in files]},
        "model_config": dataclasses.asdict(model_config),
        "settings": {"dtype": str(config.param_dtype), "compute_dtype": str(config.activation_dtype),
                     "kv_dtype": str(config.kv_dtype), "quantization": config.quantization,
                     "quantization_group_size": config.quantization_group_size,
                     "quantization_symmetric": config.quantization_symmetric,
                     "keeps_checkpoint_quantization": config.keeps_checkpoint_quantization,
                     "keeps_w8a8_checkpoint": config.keeps_w8a8_checkpoint},
        "page_size": config.page_size,
        "arrays": layout.describe(),
    }


def place_weights(model_config: ModelConfig, config: EngineConfig, mesh, weights: tuple[nnx.GraphDef, nnx.State], *,
                  quantization: str | None) -> PlacedWeights:
    """`weights` (graphdef, params as loaded) quantized with `quantization` and placed on `mesh`."""
    graphdef, params = weights
    if quantization is not None:
        own = quantization == config.quantization  # the engine's setting (a draft may ask for another mode)
        group_size = config.quantization_group_size if own else default_group_size(quantization)
        _check_quantized_split(model_config, config.tensor_parallel_size, quantization, group_size)
        graphdef, params = quantize_model(graphdef, params, quantization, group_size,
                                          symmetric=config.quantization_symmetric if own else True)
    params = cast_scales(params, config.kernels.scale_dtype)  # the dtype the quantized matmul loads
    param_specs = param_partition_specs(params, model_config, lm_head_split(model_config, config))
    return PlacedWeights(graphdef, put_global(params, param_specs, mesh), param_specs)  # quantized weights: onto their shards


def check_kernels_on_device(config: EngineConfig, model_config: ModelConfig, parallel, placed: PlacedWeights,
                            clock: PhaseClock) -> tuple[EngineConfig, PlacedWeights]:
    """(config, weights) running only kernels that passed their check on the device at the
    model's shapes (`jaxinfer.runtime.kernel_selfcheck`), when config.check_kernels asks for it
    (None: when the Pallas kernels compile for this chip): a failing one's operation joins
    xla_kernels, and the model's table follows."""
    kernels = config.kernels
    if not (kernels.pallas and (config.check_kernels if config.check_kernels is not None else not kernels.interpret)):
        return config, placed
    shapes = step_shapes(model_config, placed.params, parallel=parallel, dtype=config.activation_dtype, kv_dtype=config.kv_dtype,
                         page_size=config.page_size, max_tokens=config.buckets(parallel).max_tokens,
                         spec_block=config.buckets(parallel).spec_block)
    checked = checked_kernels(kernels, shapes, cache=cache_root() / "kernel_checks.json")
    clock.mark("kernel check on the device")
    if checked == kernels:
        return config, placed
    placed = dataclasses.replace(placed, graphdef=with_kernels(placed.graphdef, placed.params, checked))
    return dataclasses.replace(config, xla_kernels=checked.xla), placed


def add_lora_table(placed: PlacedWeights, model_config: ModelConfig, config: EngineConfig, mesh) -> PlacedWeights:
    """The placed model with an empty LoRA slot table (`jaxinfer.models.lora`) of max_loras + 1
    slots at rank max_lora_rank, placed with its sharding beside the weights."""
    table = LoraTable(config.max_loras + 1, config.max_lora_rank)
    model = nnx.merge(placed.graphdef, placed.params)
    model.lora = LoraSlots(lora_shapes(model_config, table, config.parallel(model_config).tp), config.param_dtype)
    graphdef, params = nnx.split(model)
    param_specs = param_partition_specs(params, model_config, lm_head_split(model_config, config))
    return PlacedWeights(graphdef, put_global(params, param_specs, mesh), param_specs)


def build_runner(model_config: ModelConfig, config: EngineConfig, mesh, weights: PlacedWeights, *, num_top_logprobs: int,
                 return_hidden: bool = False, return_stream: bool = False, pooling: bool = False) -> ModelRunner:
    """A model's runner on `mesh`: its placed weights and a KV pool of the (resolved) config's page geometry."""
    parallel = config.parallel(model_config)
    h2o = model_config.kv_eviction is not None and model_config.kv_eviction.method == "h2o"  # (its scores beside the pages)
    context = parallel.sp > 1 and parallel.sp_attention == "context"  # the pages split over "sequence" too
    specs = kv_partition_spec(quantized=is_quantized(config.kv_dtype), combined=combined_pool(model_config, config.kernels),
                              outliers=config.kv_cache_outliers > 0, eviction=h2o, sequence=context)
    spec_block = draft_inputs_block(config, model_config, parallel)
    named = lambda spec: jax.sharding.NamedSharding(mesh, spec) if spec is not None else None  # noqa: E731
    state_sharding = jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec), linear_state_spec(spec_block > 0),
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    if context and (model_config.has_linear_layers or h2o or config.kv_cache_outliers):
        raise ValueError(f"sequence_parallel_attention='context' splits a pool of pages only: {model_config.model_type}'s "
                         f"recurrent states, KV eviction scores and kv_cache_outliers are not supported with it; use "
                         f"sequence_parallel_attention='allgather'")
    if context and config.num_pages % parallel.sp:
        raise ValueError(f"num_pages={config.num_pages} with sequence_parallel_attention='context': each replica's pages "
                         f"split over the sequence_parallel_size={parallel.sp} devices, so they must be a multiple of it")
    kv = KVCache.create(model_config, config.num_pages * parallel.num_replicas, config.page_size, config.kv_dtype,
                        tp=parallel.tp, sharding=jax.sharding.NamedSharding(mesh, specs.pages),
                        scale_sharding=jax.sharding.NamedSharding(mesh, specs.scales) if specs.scales else None,
                        kernels=config.kernels, state_slots=state_slots(config, parallel),
                        state_dtype=config.activation_dtype, state_sharding=state_sharding, spec_block=spec_block,
                        outliers=config.kv_cache_outliers, outlier_sharding=named(specs.k_outlier),
                        outlier_token_sharding=named(specs.outlier_token), eviction_sharding=named(specs.evict_score))
    if context:
        kv = dataclasses.replace(kv, sequence_sharded=True)
    groups = kv_groups(model_config)
    runner = ModelRunner(weights.graphdef, weights.params, kv, config.buckets(parallel, groups.num_groups),
                         num_top_logprobs=num_top_logprobs, mesh=mesh, param_specs=weights.param_specs,
                         return_hidden=return_hidden, return_stream=return_stream, kv_windows=groups.windows, pooling=pooling,
                         kv_page_factors=config.kv_page_factors(model_config))
    runner.with_rope_positions = model_config.mrope_section is not None
    return runner


def make_proposer(spec: SpeculativeConfig | dict, model_config: ModelConfig, config: EngineConfig, runner: ModelRunner):
    """The proposer of a speculative_config for the target model behind `runner`."""
    spec = SpeculativeConfig.from_dict(spec) if isinstance(spec, dict) else spec
    if spec.method == "draft_model":
        return DraftModelProposer(build_draft_runner(spec, model_config, config, runner))
    if spec.method == "mtp":
        raise ValueError("speculative_config: method 'mtp' reads the target's hidden states of every token, which this "
                         "LLM's step does not return; build the LLM with a speculative_config of method 'mtp'")
    if spec.method in ("eagle", "medusa"):
        if not runner.step_fn.return_hidden:
            raise ValueError(f"speculative_config: method {spec.method!r} reads the target's hidden states, which this "
                             f"LLM's step does not return; build the LLM with a speculative_config of method {spec.method!r}")
        heads = load_heads(spec.model, model_config.hidden_size, kind=spec.method)
        tied = model_config.tie_word_embeddings
        embed = runner.params["embed"].get_value()
        if spec.is_tree and not runner.with_tree:
            raise ValueError("speculative_config['speculative_token_tree']: this LLM's steps carry no tree masks; build "
                             "the LLM with a speculative_config that has a speculative_token_tree")
        proposer = DraftHeadProposer(heads, embed if tied else runner.params["lm_head"].get_value(), tied, embed,
                                     confidence_threshold=spec.draft_confidence_threshold, tree=spec.speculative_token_tree,
                                     tree_top_k=spec.tree_top_k, tree_depth=spec.tree_depth)
        if proposer.max_k < spec.max_tree_depth:
            raise ValueError(f"speculative_config: num_speculative_tokens={spec.num_speculative_tokens} but "
                             f"{spec.model} has {proposer.max_k} heads" if not spec.is_tree else
                             f"speculative_config['speculative_token_tree']: {spec.max_tree_depth} levels but {spec.model} "
                             f"has {proposer.max_k} heads")
        return proposer
    if spec.method == "lookahead":  # (no model: Jacobi window rows beside a trie of n-grams, tree masks)
        if not runner.with_tree:
            raise ValueError("speculative_config: method 'lookahead' verifies tries and computes its window with tree "
                             "masks, which this LLM's steps do not carry; build the LLM with a speculative_config of "
                             "method 'lookahead'")
        return LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_candidates)
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


def check_token_tree(spec: SpeculativeConfig, model_config: ModelConfig, config: EngineConfig, parallel) -> None:
    """What draft trees (verified with tree masks, accepted nodes' K/V moved) do not run with yet;
    the message names the setting."""
    refused = [(model_config.has_linear_layers, f"{model_config.model_type}'s Gated DeltaNet (linear attention) layers "
                                                f"(their recurrent states advance along one chain)"),
               (model_config.is_mla, f"{model_config.model_type}'s multi-head latent attention (MLA)"),
               (parallel.sp > 1, "sequence_parallel_size > 1"),
               (config.kv_cache_outliers > 0, f"kv_cache_outliers={config.kv_cache_outliers}"),
               # (a node's window or chunk would start from its slot, root + its row, not from its
               # position root + its depth: it would see other keys than once moved)
               (any(kind.window is not None or kind.chunk is not None
                    for kind in map(model_config.layer_kind, range(model_config.num_layers))),
                f"{model_config.model_type}'s sliding-window or chunked attention layers")]
    what = "speculative_config method 'lookahead'" if spec.method == "lookahead" else "speculative_config['speculative_token_tree']"
    for at_fault, setting in refused:
        if at_fault:
            raise ValueError(f"{what} with {setting} is not supported yet")


def build_draft_runner(spec: SpeculativeConfig, model_config: ModelConfig, config: EngineConfig,
                       target: ModelRunner) -> ModelRunner:
    """The draft model of method "draft_model" on the target's mesh, buckets and page geometry:
    another model, or the target (already loaded) truncated to its first `num_layers` layers
    and / or quantized."""
    mesh = target.step_fn.mesh
    draft_config, placed = load_draft_weights(spec, model_config, config, mesh, PlacedWeights(target.graphdef, target.params, None))
    check_draft_groups(model_config, draft_config)
    return build_runner(draft_config, config, mesh, placed, num_top_logprobs=1)


def check_draft_groups(model_config: ModelConfig, draft_config: ModelConfig) -> None:
    """A draft model reads its K/V at the target's page ids (draft_model.py): both must keep every
    position in one page-table row, i.e. full attention in every layer."""
    for role, c in (("target", model_config), ("draft", draft_config)):
        if kv_groups(c).windows != (None,):
            raise ValueError(f"speculative_config method 'draft_model': the {role} model ({c.model_type}) has sliding-window "
                             f"or chunked layers, whose pages are given back as the window moves; a draft model needs both models "
                             f"with full attention in every layer (ngram, eagle and medusa speculation work here)")
    if draft_config.has_linear_layers:
        raise ValueError(f"speculative_config method 'draft_model': the draft model ({draft_config.model_type}) has Gated "
                         f"DeltaNet layers, whose recurrent states a draft cannot roll back yet; draft with a full-attention "
                         f"model, or use ngram, eagle or medusa speculation")


def load_draft_weights(spec: SpeculativeConfig, model_config: ModelConfig, config: EngineConfig, mesh,
                       target: PlacedWeights) -> tuple[ModelConfig, PlacedWeights]:
    """(config, placed weights) of the draft model of method "draft_model" (build_draft_runner),
    loaded before any KV pool exists so that a pool sized from the devices' memory counts them."""
    parallel = config.parallel(model_config)
    draft_config, weights = model_config, (target.graphdef, target.params)
    if spec.model is not None:
        source = resolve_model(spec.model)
        draft_config = read_config(source)
        if draft_config.vocab_size != model_config.vocab_size:
            raise ValueError(
                f"speculative_config['model']={spec.model!r}: vocabulary of {draft_config.vocab_size} tokens, the "
                f"target's has {model_config.vocab_size}; a draft model must share the target's tokenizer"
            )
        weights = load_params(source, draft_config, config.param_dtype, config.activation_dtype, kernels=config.kernels,
                              parallel=parallel, mesh=mesh, progress=config.progress,
                              keep_quantized=config.keeps_checkpoint_quantization and spec.quantization is None)
    if spec.num_layers is not None:
        if spec.num_layers >= draft_config.num_layers:
            raise ValueError(f"speculative_config['num_layers']={spec.num_layers}: the model has only "
                             f"{draft_config.num_layers} layers")
        draft_config, weights = first_layers(draft_config, weights, spec.num_layers, config, parallel)
    return draft_config, place_weights(draft_config, config, mesh, weights, quantization=spec.quantization)


def draft_inputs_block(config: EngineConfig, model_config: ModelConfig, parallel: ParallelConfig) -> int:
    """Tokens of a verification chunk a hybrid model keeps the linear layers' inputs of, to advance
    its states by the accepted ones (jaxinfer.ops.linear_state.DraftInputs); 0: none kept."""
    return config.buckets(parallel).spec_block if model_config.has_linear_layers else 0


def state_slots(config: EngineConfig, parallel: ParallelConfig) -> int:
    """Recurrent-state slots of a hybrid model's cache (jaxinfer.ops.linear_state): each replica's
    max_num_seqs, its scratch slot and its prefix cache's saved states (a resolved config)."""
    return (config.max_num_seqs + 1 + (config.num_prefix_states or 0)) * parallel.num_replicas


MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # checkpoints whose multi-token-prediction layer jaxinfer runs


def load_mtp_weights(source, model_config: ModelConfig, config: EngineConfig, mesh,
                     target: PlacedWeights) -> tuple[ModelConfig, PlacedWeights]:
    """(config, placed weights) of the checkpoint's multi-token-prediction module (method "mtp":
    models.deepseek_mtp), which shares the target's placed embedding and LM head."""
    hf = read_checkpoint_config(source.path) if source.kind != "orbax" else {}
    num_mtp = int(hf.get("num_nextn_predict_layers") or 0)
    if model_config.model_type not in MTP_MODEL_TYPES or source.kind != "hf" or not num_mtp:
        raise ValueError(f"speculative_config: method 'mtp' drafts with the multi-token-prediction layer of a DeepSeek-V3-"
                         f"style safetensors checkpoint ({', '.join(MTP_MODEL_TYPES)} with num_nextn_predict_layers >= 1); "
                         f"{source.name} ({model_config.model_type}, {source.kind}) has none")
    parallel = config.parallel(model_config)
    mtp_config = dataclasses.replace(model_config, num_layers=1, first_dense_layers=0, mtp_module=True)
    graphdef, state = load_params(source, mtp_config, config.param_dtype, config.activation_dtype, kernels=config.kernels,
                                  parallel=parallel, mesh=mesh, progress=config.progress,
                                  keep_quantized=config.keeps_checkpoint_quantization, mtp_layer=0)
    module, shared = nnx.merge(graphdef, state), nnx.merge(target.graphdef, target.params)
    module.embed = shared.embed  # the target's, as placed (and quantized)
    if not model_config.tie_word_embeddings:
        module.lm_head = shared.lm_head
    return mtp_config, place_weights(mtp_config, config, mesh, nnx.split(module), quantization=config.quantization)


def load_eagle3_weights(spec: SpeculativeConfig, model_config: ModelConfig, config: EngineConfig, mesh,
                        target: PlacedWeights) -> tuple[tuple[int, ...], tuple[ModelConfig, PlacedWeights]]:
    """(the target layers whose input streams the head reads, (its config, placed weights)) of
    method "eagle3" (models.eagle3: a published head folder; the target's placed embedding unless
    the head has its own). Its weights are whole on every device: tensor and sequence parallelism
    are refused, and so are targets whose pages move with a window or carry recurrent states."""
    parallel = config.parallel(model_config)
    if parallel.tp > 1 or parallel.sp > 1 or parallel.pp > 1:
        raise ValueError("speculative_config method 'eagle3' runs without tensor, sequence or pipeline parallelism "
                         f"(tensor_parallel_size={parallel.tp}, sequence parallelism {parallel.sp}, pipeline {parallel.pp})")
    if any(kind.window or kind.chunk for kind in model_config.layer_kinds()) or model_config.has_linear_layers:
        raise ValueError(f"speculative_config method 'eagle3': the target ({model_config.model_type}) has sliding-window, "
                         "chunked or linear-attention layers; an EAGLE-3 head needs a target with full attention in every layer")
    if model_config.is_mla:
        raise ValueError(f"speculative_config method 'eagle3': the target ({model_config.model_type}) has latent attention "
                         "(MLA); its K/V pages are not the head's")
    embed = nnx.merge(target.graphdef, target.params).embed.get_value()  # the target's, as placed (maybe quantized)
    head, graphdef, state = load_eagle3(resolve_model(spec.model).path, model_config, embed, param_dtype=config.param_dtype,
                                        compute_dtype=config.activation_dtype, kernels=config.kernels)
    specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)  # every weight whole on every device
    return head.aux_layers, (head.config, PlacedWeights(graphdef, put_global(state, specs, mesh), specs))


def pages_from_device_memory(config: EngineConfig, model_config: ModelConfig, mesh, weights: PlacedWeights, *,
                             drafts: list[tuple[ModelConfig, PlacedWeights]] = (), return_hidden: bool = False,
                             capacity_bytes: int | None) -> tuple[int, int]:
    """(pages per replica, the step's scratch bytes per device) of the pool that fills each
    device up to config.gpu_memory_utilization of `capacity_bytes` beside the placed weights
    (the target's and the drafts') and the scratch of the target's largest bucket, compiled once
    over a pool of one sequence (engine/memory.py). The draft models' pools have as many pages
    as the target's, so a page costs all of theirs; their steps run apart from the target's and
    need less scratch. ValueError when one sequence of max_model_len does not fit."""
    if capacity_bytes is None:
        raise ValueError("the devices do not say how much memory they hold (memory_stats()['bytes_limit']): give "
                         "num_gpu_blocks_override (pages per replica) or kv_cache_memory_bytes")
    parallel = config.parallel(model_config)
    replicas = parallel.num_replicas
    models = [(model_config, weights), *drafts]

    def pool(model: ModelConfig, pages: int):  # pages per replica
        return abstract_pool(model, pages * replicas, config.page_size, config.kv_dtype, tp=parallel.tp,
                             kernels=config.kernels, mesh=mesh, state_slots=state_slots(config, parallel),
                             outliers=config.kv_cache_outliers,
                             state_dtype=config.activation_dtype, spec_block=draft_inputs_block(config, model, parallel))

    # (a hybrid model's recurrent states are a fixed cost beside the weights, whatever the pages)
    state_bytes = sum(bytes_per_device(pool(m, 1).state) for m, _ in models if m.has_linear_layers)
    weight_bytes = bytes_per_device([w.params for _, w in models]) + state_bytes
    page_bytes = sum(bytes_per_device(pool(m, 1).page_arrays()) for m, _ in models)
    groups = kv_groups(model_config)
    buckets = config.buckets(parallel, groups.num_groups)
    one_sequence = groups.pages_held(config.max_model_len, config.page_size, buckets.max_tokens,
                                     config.kv_page_factors(model_config)) + 1
    step = StepFunction(weights.graphdef, config.max_logprobs, max_rows=buckets.max_tokens, mesh=mesh,
                        param_specs=weights.param_specs, return_hidden=return_hidden)
    scratch = measure_step_scratch(step, weights.params, pool(model_config, one_sequence), buckets,
                                   with_lora=config.enable_lora,
                                   with_rope_positions=model_config.mrope_section is not None)
    pages = kv_pool_pages(capacity_bytes=capacity_bytes, utilization=config.gpu_memory_utilization,
                          weight_bytes=weight_bytes, scratch_bytes=scratch, page_bytes=page_bytes,
                          sequence_shards=parallel.sp if parallel.sp_attention == "context" else 1)  # (context parallelism)
    if pages < one_sequence:
        GiB = 2**30
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} of {capacity_bytes / GiB:.2f} GiB per device, less "
            f"{weight_bytes / GiB:.2f} GiB of weights and {scratch / GiB:.2f} GiB of step scratch, holds {pages} KV pages; "
            f"one sequence of max_model_len={config.max_model_len} needs {one_sequence}. Raise gpu_memory_utilization, "
            f"lower max_model_len, use more devices (tensor_parallel_size), smaller weights (quantization) or an int8 KV "
            f"cache, or give the pool's size: num_gpu_blocks_override / kv_cache_memory_bytes"
        )
    return pages, scratch


def first_layers(model_config: ModelConfig, weights, num_layers: int, config: EngineConfig, parallel: ParallelConfig):
    """(config, (graphdef, params)) of a model made of the first num_layers layers of another
    (the same embedding, final norm and LM head): self-speculation's draft."""
    truncated = dataclasses.replace(model_config, num_layers=num_layers,
                                    first_dense_layers=min(model_config.first_dense_layers, num_layers))
    flat = nested_to_flat(nnx.to_pure_dict(weights[1]))

    def keep(name, a):  # a stack's slots of layers 0 .. num_layers - 1 (a MoE stack holds only the MoE layers)
        return a[: sum(slot >= 0 for slot in stack_slots(model_config, name)[:num_layers])]

    flat = {name: jax.tree.map(lambda a, name=name: keep(name, a), value) if name.startswith("layers.") else value
            for name, value in flat.items() if not name.startswith("lora.")}  # the draft drafts with the base model
    graphdef, state = abstract_model(truncated, config.param_dtype, config.activation_dtype, config.kernels, parallel)
    nnx.replace_by_pure_dict(state, flat_to_nested(flat))
    return truncated, (graphdef, state)


def _check_quantized_split(config: ModelConfig, tp: int, mode: str, group_size: int | None) -> None:
    """Groups run along a weight's input dim: a row-parallel weight (o, down, LM head) split over
    tp shards needs each shard's rows to be whole groups."""
    if tp == 1 or group_size is None:
        return
    for what, rows in (("o_proj", config.num_heads * config.head_dim), ("down_proj", config.intermediate_size),
                       ("lm_head", config.hidden_size)):
        if (rows // tp) % group_size:
            raise ShardingError(
                f"quantization={mode!r} with tensor_parallel_size={tp}: {what} has {rows} input rows, {rows // tp} per shard, "
                f"not a multiple of quantization_group_size={group_size}; use int8 / fp8 or a smaller group size"
            )


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def lm_head_split(model_config: ModelConfig, config: EngineConfig) -> str:
    """How a model's embedding table and LM head split over "tensor" (EngineConfig.lm_head_parallel;
    "hidden" for a model, e.g. a draft model, whose vocabulary tp does not divide)."""
    vocab = config.lm_head_parallel == "vocab" and model_config.vocab_size % config.tensor_parallel_size == 0
    return "vocab" if vocab else "hidden"

"""`jaxinfer aot`: will this model fit on that chip, and how fast could decode be? Answered by
compiling every bucket of the serving step for the target, with no chip and no weights.

    jaxinfer aot --model llama-3.1-70b --topology v5e:2x4 -tp 8 --max-model-len 8192 --max-num-seqs 64

1. The weights per chip (from the sharded abstract parameters) must fit the chip's HBM: if not,
   an error says by how much.
2. The KV pool is sized as the engine sizes it (`jaxinfer.engine.memory`): `num_pages` as given,
   else what `kv_cache_memory_bytes` holds, else what `gpu_memory_utilization` (0.9) of the
   chip's HBM leaves beside the weights and the step's scratch; the scratch is measured by
   compiling the largest bucket over a pool of one sequence (`size_pool`, one compile), and
   also gives the largest pool that fits at all (`largest_pool_pages`).
3. Every bucket is compiled with that pool (at most the largest that fits): compile seconds and
   `memory_analysis()` per bucket, and an HLO check that no bucket copies the pool (the cache
   must be updated in place).
4. A decode estimate from bytes moved per step over the chip's HBM bandwidth: an HBM roofline,
   labelled as an estimate, not a measurement. With 2:4 sparse projections (`ServingShape.sparsity`,
   `--sparsity 2:4`: compressed, read by the sparse24_matmul kernel in every bucket) also the
   weight bytes a step reads against the same model dense, and both bounds (`_sparse24_lines`).
5. A vision model (a `VisionSpec`): its image encoder (jaxinfer.aot.vision_compile), and the image
   variant of the step for the largest prefill bucket, the batch with the image inputs (zeros) as
   the engine's warm-up compiles it (`mm_embeds`, `mm_mask`; Gemma 3's `span_end` and its
   both-ways image attention pass, Qwen3-VL's `mm_deepstack`): one line of its compile seconds
   and peak memory per chip.
6. The collectives of each bucket per chip and step, from its compiled program
   (sharding.hlo.bytes_per_step): over ICI inside a slice, and with several slices
   (`Target.num_slices`, `--num-slices`; the pipeline stages across them) over DCN between them.
   With pipeline stages the weights and KV per chip are one stage's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from jaxinfer.kv_groups import describe, span_tokens
from jaxinfer.aot.step_compile import AbstractStep, ServingShape
from jaxinfer.aot.targets import Target
from jaxinfer.aot.vision_compile import VisionCompile, VisionSpec, compile_vision, format_vision
from jaxinfer.engine.memory import kv_pool_pages, largest_bucket, pages_for_bytes, step_scratch_bytes
from jaxinfer.ops.batch import BucketKey
from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache
from sharding.hlo import bytes_per_step, pool_sized_copies
from sharding.mesh import ParallelConfig

GiB = 2**30
HBM_HEADROOM = 0.03  # of the chip's HBM kept free by "the largest pool that fits" (the runtime's own buffers, fragmentation)
PROBE_BELOW = 0.8  # a pool given that brings the chip past this share of HBM: the scratch is measured over a small one


class DoesNotFit(ValueError):
    """The model cannot be served on the target as asked; the message says by how much."""


@dataclasses.dataclass
class BucketCompile:
    key: BucketKey
    seconds: float
    argument_bytes: int  # per chip: weights, KV pool, inputs
    temp_bytes: int  # per chip: the step's scratch
    output_bytes: int
    alias_bytes: int  # outputs that reuse an argument's buffer (the donated KV pool)
    pool_copies: int  # pool-sized copies in the optimized program (0 when updated in place)
    scratch_bytes: int  # per chip, beyond weights and pool: temporaries, inputs, outputs not aliased
    # per chip and step, read from the compiled program (sharding.hlo.bytes_per_step): collective
    # buffers over ICI inside a slice, and what crosses slices over DCN, by collective kind
    link_bytes: dict = dataclasses.field(default_factory=lambda: {"ici": {}, "dcn": {}})

    @property
    def ici_bytes(self) -> int:
        return sum(self.link_bytes["ici"].values())

    @property
    def dcn_bytes(self) -> int:
        return sum(self.link_bytes["dcn"].values())

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def kind(self) -> str:
        if self.key.query_block == 1:
            return "decode"
        return "prefill" if self.key.num_seqs <= 4 else "mixed"


@dataclasses.dataclass
class SamplingCompile:
    """The sampling programs (every logits processor and the sampler) of steps of `rows` logits
    rows: one set per row count, whatever the bucket (runtime/step.py)."""

    rows: int
    programs: int
    seconds: float
    peak_bytes: int  # per chip: the largest program's arguments (the logits rows), temporaries and outputs


def _compile_sampling(step: AbstractStep, rows: int) -> SamplingCompile:
    start = time.perf_counter()
    compiled = step.compile_sampling(rows)
    seconds = time.perf_counter() - start
    peak = max(step_scratch_bytes(c.memory_analysis(), 0, 0) for c in compiled)
    return SamplingCompile(rows, len(compiled), seconds, peak)


@dataclasses.dataclass
class PoolSizing:
    """The KV pool of a deployment, per replica, as the engine would size it on the target."""

    probe: BucketCompile  # the largest bucket, compiled over a pool of `probe_pages`
    probe_pages: int
    weight_bytes: int  # per chip
    scratch_bytes: int  # per chip: the largest bucket's step (model or sampling programs) beyond weights and pool
    page_bytes: int  # per chip
    pages: int  # the engine's pool: num_pages, kv_cache_memory_bytes or gpu_memory_utilization
    sized_by: str
    largest_pages: int  # the largest pool that fits at all (1 - HBM_HEADROOM of the HBM)
    sampling: SamplingCompile | None = None  # the sampling programs of the most logits rows, compiled while sizing
    vision_bytes: int = 0  # per chip: the image encoder's weights (included in weight_bytes)

    def chip_bytes(self, pages: int) -> int:
        """Weights + pool of `pages` + step scratch, per chip."""
        return self.weight_bytes + pages * self.page_bytes + self.scratch_bytes


@dataclasses.dataclass
class Plan:
    step: AbstractStep
    buckets: list[BucketCompile]
    sizing: PoolSizing
    sampling: list[SamplingCompile] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0  # the whole plan, sizing included
    vision: VisionCompile | None = None  # the image encoder, for a multimodal model
    image_step: BucketCompile | None = None  # the largest prefill bucket's image variant, for a multimodal model
    image_inputs: tuple[int, int, bool] | None = None  # its image fields: (width, deepstack rows, span_end)

    @property
    def compile_seconds(self) -> float:
        """Every program the engine's warm-up compiles, one after the other."""
        return sum(b.seconds for b in self.buckets) + sum(c.seconds for c in self.sampling)

    @property
    def pages_requested(self) -> int:  # per replica: the engine's pool
        return self.sizing.pages

    @property
    def largest_pool_pages(self) -> int:  # per replica: what fits beside the weights and the largest bucket's scratch
        return self.sizing.largest_pages

    @property
    def target(self) -> Target:
        return self.step.target

    def decode_estimate(self, context: int, weight_bytes: int | None = None) -> tuple[int, float, float]:
        """(sequences per replica, seconds per decode step, tokens/s over all replicas) for the
        largest decode batch the compiled pool holds at `context` tokens each: per chip, the
        weights (`weight_bytes`, default the step's) plus those sequences' K and V are read once
        per step (a hybrid model's recurrent states read and written), at the chip's HBM
        bandwidth. An estimate."""
        s = self.step
        decode = [b.key.num_seqs for b in self.buckets if b.kind == "decode"] or [s.shape.max_num_seqs]
        held = s.pages_held(context)  # a sequence's pages, all groups
        # pipeline: each chip runs its stage's layers once per iteration, M = pp micro-batches in
        # M + pp - 1 iterations (jaxinfer.models.pipeline): its layers' weights are read that many
        # times, the embedding and LM head and each sequence's K/V of its layers once
        extra_reads = (2 * s.parallel.pp - 2) * s.layer_weight_bytes_per_chip()
        seqs = min(max(decode), (s.num_pages - 1) // held)
        page = s.kv_bytes_per_page_per_chip()  # a group's page holds page_size * its factor tokens of its layers
        # a sliding group reads its window (a chunked one at most its chunk)
        read = sum(min(span_tokens(w) or context, context) * page / (s.shape.page_size * f)
                   for w, f in zip(s.windows, s.page_factors))
        if s.kv.state is not None:  # a hybrid model's recurrent states: each sequence's read and written once
            read += 2 * s.state_bytes_per_chip() / s.kv.state.num_slots * s.parallel.num_replicas
        step_bytes = (s.weight_bytes_per_chip() if weight_bytes is None else weight_bytes) + extra_reads + seqs * read
        seconds = step_bytes / self.target.chip.hbm_bytes_per_second
        return seqs, seconds, seqs * s.parallel.num_replicas / seconds


def _compile_bucket(step: AbstractStep, key: BucketKey, image_inputs: tuple[int, int, bool] | None = None) -> BucketCompile:
    """`key`'s step (its image variant with `image_inputs`: `VisionSpec.image_inputs`) compiled for
    the target, with its memory per chip; DoesNotFit when the compiler runs out of HBM."""
    start = time.perf_counter()
    try:
        compiled = step.compile(key, image_inputs)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ValueError) and str(e).startswith("SMEM"):  # the attention kernel's page table (tpu.py)
            raise DoesNotFit(f"bucket {key}: {e}") from e
        if "RESOURCE_EXHAUSTED" in str(e) or "exceeds" in str(e):
            first = next(line for line in str(e).splitlines() if line.strip())
            raise DoesNotFit(f"bucket {key}: the compiler ran out of HBM: {first}") from e
        raise
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    hlo = compiled.as_text()
    copies = pool_sized_copies(hlo, step.kv_pool_elements_per_chip())
    scratch = step_scratch_bytes(m, step.weight_bytes_per_chip(), step.kv_bytes_per_chip())
    return BucketCompile(key, seconds, m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes,
                         m.alias_size_in_bytes, copies, scratch, bytes_per_step(hlo))


def size_pool(step: AbstractStep, vision: VisionCompile | None = None) -> PoolSizing:
    """The KV pool the engine would allocate on the target for `step.shape` (see the module
    docstring), from one compile of the largest bucket: over the pool given when it leaves room,
    else over a pool of one sequence (the scratch does not grow with the pool). `vision`: a
    multimodal model's image encoder, its weights held beside the step's and its scratch (it runs
    between steps) counted as the step's when larger."""
    shape, target = step.shape, step.target
    vision_bytes = vision.weight_bytes if vision else 0
    weights = step.weight_bytes_per_chip() + step.state_bytes_per_chip() + vision_bytes  # (a hybrid model's states: a fixed cost)
    page_bytes = step.kv_bytes_per_page_per_chip()
    given, sized_by = shape.num_pages, "num_pages"
    if given is None and shape.kv_cache_memory_bytes is not None:
        kernels = Kernels(platform=target.platform, interpret=False)
        replica_page = KVCache.page_bytes(step.config, shape.page_size, shape.kv_cache_dtype or shape.dtype,
                                          tp=step.parallel.tp, kernels=kernels)
        given = pages_for_bytes(shape.kv_cache_memory_bytes, replica_page, shape.pages_needed(step.windows, step.page_factors),
                                step.parallel.kv_shards)
        sized_by = f"kv_cache_memory_bytes={shape.kv_cache_memory_bytes}"
    roomy = given is not None and weights + given * page_bytes < PROBE_BELOW * target.chip.hbm_bytes
    probe_pages = given if roomy else shape.sequence_pages(step.windows, step.page_factors) + 1
    # the model's scratch, or the sampling programs' over the most logits rows (they run after it):
    # the two compiles side by side
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sampling_compile = pool.submit(_compile_sampling, step, max(k.num_logits for k in step.buckets.all_keys()))
        probe = _compile_bucket(step.with_num_pages(probe_pages), largest_bucket(step.buckets.all_keys()))
        sampling = sampling_compile.result()
    scratch = max(probe.scratch_bytes, sampling.peak_bytes, vision.scratch_bytes if vision else 0)
    fit = dict(capacity_bytes=target.chip.hbm_bytes, weight_bytes=weights, scratch_bytes=scratch,
               page_bytes=page_bytes)
    if given is None:
        given = kv_pool_pages(utilization=shape.gpu_memory_utilization, **fit)
        sized_by = f"gpu_memory_utilization={shape.gpu_memory_utilization}"
    # (context parallelism: page_bytes is a replica's page's share on a chip, 1 / sp of it; whole blocks per device)
    shards = step.parallel.kv_shards
    return PoolSizing(probe, probe_pages, weights, scratch, page_bytes, given // shards * shards, sized_by,
                      kv_pool_pages(utilization=1 - HBM_HEADROOM, **fit) // shards * shards, sampling, vision_bytes)


def plan_deployment(config: ModelConfig, target: Target, parallel: ParallelConfig, shape: ServingShape, *,
                    jobs: int = 1, on_bucket=None, vision: VisionSpec | None = None) -> Plan:
    """Compiles every bucket for the target (see the module docstring), and `vision`'s image
    encoder first when given (jaxinfer.aot.vision_compile: its weights join the step's on every
    chip). DoesNotFit when the weights, or the weights and one sequence at max_model_len, do not
    fit a chip."""
    if parallel.num_devices > target.num_chips:
        raise DoesNotFit(f"{parallel.describe()} needs {parallel.num_devices} chips; {target.name} has {target.num_chips}")
    target.mesh_devices(parallel)  # several slices: TargetError unless the mesh's outer axes split over them
    parallel.check_model(config)
    start = time.perf_counter()
    step = AbstractStep.build(config, target, parallel, shape)
    capacity = target.chip.hbm_bytes * (1 - HBM_HEADROOM)
    encoder = compile_vision(vision, step.mesh, shape.dtype) if vision is not None else None
    weights = step.weight_bytes_per_chip() + (encoder.weight_bytes if encoder else 0)
    if weights > capacity:
        raise DoesNotFit(
            f"the weights need {weights / GiB:.1f} GiB per chip ({parallel.describe()}, {shape.weights_name(config)}"
            f"{', the image encoder included' if encoder else ''}) "
            f"and a {target.chip.kind} holds {target.chip.hbm_bytes / GiB:.1f} GiB: {weights / capacity:.2f}x too much. "
            f"Use more chips (-tp) or smaller weights (--quantization int8 / int4)"
        )
    sizing = size_pool(step, encoder)
    one_sequence = shape.sequence_pages(step.windows, step.page_factors) + 1
    if sizing.largest_pages < one_sequence:
        raise DoesNotFit(
            f"after {weights / GiB:.1f} GiB of weights and {sizing.scratch_bytes / GiB:.1f} GiB of step scratch per chip, "
            f"{sizing.largest_pages} KV pages fit; one sequence of max_model_len={shape.max_model_len} needs "
            f"{one_sequence}. Use more chips, smaller weights, a smaller --max-model-len or an int8 KV cache"
        )
    if sizing.pages < one_sequence and shape.num_pages is None and shape.kv_cache_memory_bytes is None:
        raise DoesNotFit(  # as the engine refuses it
            f"{sizing.sized_by} leaves {sizing.pages} KV pages per replica after {weights / GiB:.1f} GiB of weights and "
            f"{sizing.scratch_bytes / GiB:.1f} GiB of step scratch per chip; one sequence of max_model_len="
            f"{shape.max_model_len} needs {one_sequence} (up to {sizing.largest_pages} would fit)"
        )
    keys = step.buckets.all_keys()
    largest = sizing.probe.key
    step = step.with_num_pages(min(sizing.pages, sizing.largest_pages))
    results = {}
    if step.num_pages == sizing.probe_pages:
        results[largest] = sizing.probe
        if on_bucket:
            on_bucket(sizing.probe)
    rest = [k for k in keys if k not in results]  # the largest again when the pool grew: with the rest
    rows = sorted({k.num_logits for k in keys} - {sizing.sampling.rows})
    # a vision model: the image variant of the largest prefill bucket (the engine's warm-up compiles
    # one per prefill and mixed bucket)
    prefills = [k for k in keys if k.query_block > 1]
    image_inputs = vision.image_inputs(config.hidden_size) if vision is not None and prefills else None
    images = [("image", largest_bucket(prefills))] if image_inputs else []
    # One pool for the buckets and the sampling programs, the longest first (the most tokens, then
    # a sampling set of ~10 s on 2 cores) so that the last to finish are short.
    tasks = sorted([("bucket", k) for k in rest] + images + [("sampling", r) for r in rows],
                   key=lambda t: -(128 if t[0] == "sampling" else t[1].num_tokens))

    def compile_one(task):
        kind, what = task
        if kind == "sampling":
            return _compile_sampling(step, what)
        return _compile_bucket(step, what, image_inputs if kind == "image" else None)

    sampling, image_step = [sizing.sampling], None
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for (kind, what), result in zip(tasks, pool.map(compile_one, tasks)):
            if kind == "sampling":
                sampling.append(result)
                continue
            if kind == "image":
                image_step = result
                continue
            results[what] = result
            if on_bucket:
                on_bucket(result)
    sampling.sort(key=lambda c: c.rows)
    return Plan(step, [results[k] for k in keys], sizing, sampling, time.perf_counter() - start, encoder,
                image_step, image_inputs)


def format_image_step(plan: Plan) -> str:
    """One line: the image variant of the largest prefill bucket, its compile and memory per chip."""
    b, (width, deepstack, span_end) = plan.image_step, plan.image_inputs
    T = b.key.num_tokens
    fields = [f"mm_embeds [{T}, {width}]", f"mm_mask [{T}]", *([f"span_end [{T}]"] if span_end else []),
              *([f"mm_deepstack [{deepstack}, {T}, {width}]"] if deepstack else []),
              *([f"rope_positions [3, {T}]"] if plan.step.with_rope_positions else [])]
    text = next((t for t in plan.buckets if t.key == b.key), None)
    versus = f", {(b.peak_bytes - text.peak_bytes) / GiB:+.2f} GiB against its text step" if text else ""
    attention = "; images attended both ways (the split-KV pass after the kernel)" if span_end else ""
    hbm = plan.target.chip.hbm_bytes
    return (f"image step: {b.kind} bucket T={T} S={b.key.num_seqs} R={b.key.num_logits} with image inputs "
            f"({', '.join(fields)}, zeros){attention}: compile {b.seconds:.1f} s, peak {_gib(b.peak_bytes)} GiB per chip "
            f"({100 * b.peak_bytes / hbm:.0f}% of HBM; arguments {_gib(b.argument_bytes)} + temporaries "
            f"{_gib(b.temp_bytes)}{versus}), pool copies {b.pool_copies}")


# ----------------------------------------------------------------------------- the table
def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _shard_note(s: AbstractStep) -> str:
    """Context parallelism: how the replica's pages lie on the chips of the sequence axis."""
    shards = s.parallel.kv_shards
    return f", {s.num_pages // shards} on each of the {shards} chips of the sequence axis" if shards > 1 else ""


def _group_lines(s: AbstractStep, held: int, whole: int, largest_pages: int) -> list[str]:
    """The KV layer groups' line (jaxinfer.kv_groups), for a model with sliding-window layers: what
    a sequence of max_model_len holds against a cache that kept every layer's whole sequence."""
    if s.windows == (None,):
        return []
    kinds = ", ".join(f"{s.windows.count(w)} {describe(w)}" for w in dict.fromkeys(s.windows))
    page = s.kv_bytes_per_page_per_chip()  # one page id: a group's layers, page_size * its factor tokens
    owners = s.config.num_layers - s.config.kv_shared_layers  # the layers that keep K/V
    token = sum(page / (s.shape.page_size * f) for f in s.page_factors) * owners / (s.kv.num_slots * len(s.windows))
    factors = "" if set(s.page_factors) == {1} else (
        f"; pages of {', '.join(f'{s.shape.page_size * f}' for f in s.page_factors)} tokens (groups of other K/V shapes)")
    return [f"KV layer groups: {len(s.windows)} ({kinds}), {s.kv.num_slots} slots each{factors}: a sequence of max_model_len "
            f"holds {held} pages, {whole} with every layer keeping it whole ({token / 1024:.1f} "
            f"KiB per token per chip); the largest pool holds {(largest_pages - 1) // held} such sequences, a "
            f"full-attention cache {(largest_pages - 1) // whole}"]


def _sparse24_lines(plan: Plan) -> list[str]:
    """2:4 sparse weights (`--sparsity 2:4`): the weight bytes a decode step reads per chip,
    compressed and dense, and the HBM-roofline decode bound both ways (batch 1: the weights alone;
    and the decode table's largest batch at its shortest context)."""
    s = plan.step
    stored, dense = s.sparse24_bytes_per_chip()
    if not dense:
        return []
    weights = s.weight_bytes_per_chip()
    dense_weights = weights - stored + dense
    bandwidth = plan.target.chip.hbm_bytes_per_second
    context = min(1024, s.shape.max_model_len)
    seqs, _, sparse_rate = plan.decode_estimate(context)
    _, _, dense_rate = plan.decode_estimate(context, dense_weights)
    return ["", f"2:4 sparsity (projections kept compressed, read by the sparse24_matmul kernel; HBM roofline, an estimate): "
            f"a decode step reads {_gib(weights)} GiB of weights per chip against {_gib(dense_weights)} GiB dense "
            f"({100 * weights / dense_weights:.0f}%: the 2:4 matrices {_gib(stored)} GiB of values and bitmasks for "
            f"{_gib(dense)} GiB dense); batch 1 bound {bandwidth / weights:,.0f} tokens/s against {bandwidth / dense_weights:,.0f} "
            f"dense ({dense_weights / weights:.2f}x); {seqs} sequences at {context} tokens: {sparse_rate:,.0f} tokens/s "
            f"against {dense_rate:,.0f} dense ({sparse_rate / dense_rate:.2f}x)"]


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _link_lines(plan: Plan) -> list[str]:
    """The collectives of each bucket's step per chip, over ICI and (several slices) over DCN, read
    from the compiled program (sharding.hlo.bytes_per_step); and, with pipeline stages, which
    layers each chip holds."""
    s, t = plan.step, plan.target
    if s.mesh.devices.size == 1:
        return []
    lines = []
    if s.parallel.pp > 1:
        per = s.config.num_layers // s.parallel.pp
        where = ("one per slice" if s.parallel.pp == t.num_slices else
                 f"{s.parallel.pp // t.num_slices} per slice" if t.num_slices > 1 and s.parallel.pp % t.num_slices == 0 else "")
        lines += ["", f"Pipeline: {s.parallel.pp} stages of {per} layers{f' ({where})' if where else ''}; stage i holds layers "
                  f"i*{per} .. i*{per}+{per - 1}, their weights and KV slots only (the per-chip figures are one "
                  f"stage's); {s.parallel.pp} micro-batches in {2 * s.parallel.pp - 1} iterations per step (the decode estimate reads a stage's weights once "
                  f"per iteration)"]
    slices = f" and across the {t.num_slices} slices over DCN" if t.num_slices > 1 else ""
    lines += ["", f"Collectives per step and chip, inside a slice over ICI{slices} (buffer bytes read from the compiled "
              f"program, loops times their trip counts; a DCN permute sends its buffer once):", "",
              "| tokens | seqs | logits rows | bucket | ICI bytes | ICI by kind | DCN bytes | DCN by kind |",
              "|---:|---:|---:|---|---:|---|---:|---|"]

    def kinds(d: dict) -> str:
        return ", ".join(f"{k} {_size(v)}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v) or "-"

    for b in plan.buckets:
        lines.append(f"| {b.key.num_tokens} | {b.key.num_seqs} | {b.key.num_logits} | {b.kind} | {b.ici_bytes:,} | {kinds(b.link_bytes['ici'])} | "
                     f"{b.dcn_bytes:,} | {kinds(b.link_bytes['dcn'])} |")
    return lines


def format_plan(plan: Plan) -> str:
    s, t = plan.step, plan.target
    shape = s.shape
    lines = [
        f"# {t.describe()}: {t.num_chips} x {t.chip.kind}, {t.chip.hbm_bytes / GiB:.1f} GiB HBM and "
        f"{t.chip.hbm_bytes_per_second / 1e9:.0f} GB/s per chip",
        f"model: {s.config.num_layers} layers, {s.config.num_heads}/{s.config.num_kv_heads} heads of {s.config.head_dim}, "
        f"{'MoE ' if s.config.is_moe else ''}weights {shape.weights_name(s.config)}, KV cache "
        f"{shape.kv_cache_dtype or shape.dtype}; mesh {s.parallel.describe()}",
        f"serving: max_model_len {shape.max_model_len}, max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens "
        f"{shape.max_num_batched_tokens}, page_size {shape.page_size}",
        "",
        "| bucket | tokens | seqs | logits rows | query block | compile s | arguments GiB | temporaries GiB | peak GiB | pool copies |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in plan.buckets:
        lines.append(f"| {b.kind} | {b.key.num_tokens} | {b.key.num_seqs} | {b.key.num_logits} | {b.key.query_block} | {b.seconds:.1f} | "
                     f"{_gib(b.argument_bytes)} | {_gib(b.temp_bytes)} | {_gib(b.peak_bytes)} | {b.pool_copies} |")
    if plan.sampling:
        lines += ["", "Sampling programs (every logits processor and the sampler), one set per count of logits rows:", "",
                  "| logits rows | programs | compile s | peak GiB |", "|---:|---:|---:|---:|"]
        lines += [f"| {c.rows} | {c.programs} | {c.seconds:.1f} | {_gib(c.peak_bytes)} |" for c in plan.sampling]
    lines += _link_lines(plan)
    lines += ["", f"Compile: {len(plan.buckets)} buckets and {sum(c.programs for c in plan.sampling)} sampling programs, "
              f"{plan.compile_seconds:.0f} s summed over the programs; this plan, sizing included, took "
              f"{plan.wall_seconds:.0f} s of wall time."]
    encoder = plan.vision
    peak = max(b.peak_bytes for b in plan.buckets) + (encoder.weight_bytes if encoder else 0)  # held beside the step's
    replicas = s.parallel.num_replicas
    tokens_fit = (plan.largest_pool_pages - 1) * shape.page_size
    tokens_asked = (plan.pages_requested - 1) * shape.page_size
    held = s.pages_held(shape.max_model_len)  # a decoding sequence's pages
    whole = sum(-(-shape.max_model_len // (shape.page_size * f)) for f in s.page_factors)  # ... were every layer to keep it all
    lines += [
        "",
        "| per chip | GiB |",
        "|---|---:|",
        f"| weights | {_gib(s.weight_bytes_per_chip())} |",
        f"| KV pool compiled ({s.num_pages} pages per replica{_shard_note(s)}) | {_gib(s.kv_bytes_per_chip())} |",
        *([f"| recurrent states ({s.kv.state.num_slots // replicas} slots per replica: max_num_seqs + 1, and the prefix "
           f"cache's saved states) | "
           f"{_gib(s.state_bytes_per_chip())} |"] if s.kv.state is not None else []),
        *([f"| image encoder weights (replicated) | {_gib(encoder.weight_bytes)} |",
           f"| image encoder scratch (temporaries, pixels, soft tokens; between steps) | {_gib(encoder.scratch_bytes)} |"]
          if encoder else []),
        f"| largest step scratch | {_gib(max(b.temp_bytes for b in plan.buckets))} |",
        f"| peak of the largest bucket{' (the image encoder weights included)' if encoder else ''} | {_gib(peak)} "
        f"({100 * peak / t.chip.hbm_bytes:.0f}% of HBM) |",
        *(["", format_vision(encoder, GiB)] if encoder else []),
        *([format_image_step(plan)] if plan.image_step else []),
        "",
        f"KV pool ({plan.sizing.sized_by}, as the engine sizes it): {plan.pages_requested} pages per replica = "
        f"{tokens_asked} tokens = {(plan.pages_requested - 1) // held} sequences at max_model_len "
        f"(max_num_seqs {shape.max_num_seqs}: {shape.pages_needed(s.windows, s.page_factors)} pages); weights + pool + scratch "
        f"{100 * plan.sizing.chip_bytes(plan.pages_requested) / t.chip.hbm_bytes:.1f}% of HBM",
        f"largest that fits: {plan.largest_pool_pages} pages = {tokens_fit} tokens per replica "
        f"= {(plan.largest_pool_pages - 1) // held} sequences at max_model_len"
        + (f"; {tokens_fit // s.parallel.kv_shards} tokens of KV per chip (context parallelism over "
           f"{s.parallel.kv_shards} chips)" if s.parallel.kv_shards > 1 else "")
        + ("" if plan.largest_pool_pages >= plan.pages_requested else
           f" (the requested pool does NOT fit: compiled with {s.num_pages} pages)"),
        *_group_lines(s, held, whole, plan.largest_pool_pages),
        "",
        "Decode estimate (HBM roofline: weights + KV read once per step at the chip's bandwidth; an estimate, not a measurement):",
        "",
        "| context | sequences per replica | step ms (= time per output token) | tokens/s (all replicas) |",
        "|---:|---:|---:|---:|",
    ]
    for context in sorted({min(1024, shape.max_model_len), shape.max_model_len // 2, shape.max_model_len}):
        if (s.num_pages - 1) * shape.page_size < context:
            continue
        seqs, seconds, tokens_per_second = plan.decode_estimate(context)
        lines.append(f"| {context} | {seqs} | {seconds * 1e3:.2f} | {tokens_per_second:,.0f} |")
    lines += _sparse24_lines(plan)
    if replicas > 1:
        lines.append(f"({replicas} replicas, each with its own batch and KV pool)")
    if any(b.pool_copies for b in plan.buckets + ([plan.image_step] if plan.image_step else [])):
        lines.append("WARNING: some bucket copies the whole KV pool every step (pool copies > 0)")
    return "\n".join(lines)

"""`jaxinfer aot`: will this model fit on that chip, and how fast could decode be? Answered by
compiling every bucket of the serving step for the target, with no chip and no weights.

    jaxinfer aot --model llama-3.1-70b --topology v5e:2x4 -tp 8 --max-model-len 8192 --max-num-seqs 64

1. The weights per chip (from the sharded abstract parameters) must fit the chip's HBM: if not,
   an error says by how much.
2. The largest bucket is compiled first with the requested KV pool (every sequence at
   max_model_len) or, when that cannot fit, the largest pool that can: its temporaries tell how
   much HBM the pool may take (`largest_pool_pages`).
3. Every bucket is compiled with that pool: compile seconds and `memory_analysis()` per bucket,
   and an HLO check that no bucket copies the pool (the cache must be updated in place).
4. A decode estimate from bytes moved per step over the chip's HBM bandwidth: an HBM roofline,
   labelled as an estimate, not a measurement.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from jaxinfer.aot.step_compile import AbstractStep, ServingShape
from jaxinfer.aot.targets import Target
from jaxinfer.ops.batch import BucketKey
from jaxinfer.config import ModelConfig
from sharding.hlo import pool_sized_copies
from sharding.mesh import ParallelConfig

GiB = 2**30
HBM_HEADROOM = 0.03  # of the chip's HBM kept free (the runtime's own buffers, fragmentation)
PROBE_BELOW = 0.8  # a requested pool that brings the chip past this share of HBM is sized from a probe compile


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

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def kind(self) -> str:
        if self.key.query_block == 1:
            return "decode"
        return "prefill" if self.key.num_seqs <= 4 else "mixed"


@dataclasses.dataclass
class Plan:
    step: AbstractStep
    buckets: list[BucketCompile]
    pages_requested: int  # per replica: max_num_seqs sequences at max_model_len
    largest_pool_pages: int  # per replica: what fits beside the weights and the largest bucket's temporaries

    @property
    def target(self) -> Target:
        return self.step.target

    def decode_estimate(self, context: int) -> tuple[int, float, float]:
        """(sequences per replica, seconds per decode step, tokens/s over all replicas) for the
        largest decode batch the compiled pool holds at `context` tokens each: per chip, the
        weights plus those sequences' K and V are read once per step, at the chip's HBM
        bandwidth. An estimate."""
        s = self.step
        decode = [b.key.num_seqs for b in self.buckets if b.kind == "decode"] or [s.shape.max_num_seqs]
        seqs = min(max(decode), (s.num_pages - 1) * s.shape.page_size // context)
        kv_per_token = s.kv_bytes_per_page_per_chip() / s.shape.page_size
        step_bytes = s.weight_bytes_per_chip() + seqs * context * kv_per_token
        seconds = step_bytes / self.target.chip.hbm_bytes_per_second
        return seqs, seconds, seqs * s.parallel.num_replicas / seconds


def _compile_bucket(step: AbstractStep, key: BucketKey) -> BucketCompile:
    start = time.perf_counter()
    try:
        compiled = step.compile(key)
    except Exception as e:  # noqa: BLE001
        if "RESOURCE_EXHAUSTED" in str(e) or "exceeds" in str(e):
            first = next(line for line in str(e).splitlines() if line.strip())
            raise DoesNotFit(f"bucket {key}: the compiler ran out of HBM: {first}") from e
        raise
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    copies = pool_sized_copies(compiled.as_text(), step.kv_pool_elements_per_chip())
    return BucketCompile(key, seconds, m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes,
                         m.alias_size_in_bytes, copies)


def plan_deployment(config: ModelConfig, target: Target, parallel: ParallelConfig, shape: ServingShape, *,
                    jobs: int = 1, on_bucket=None) -> Plan:
    """Compiles every bucket for the target (see the module docstring). DoesNotFit when the
    weights, or the weights and one sequence at max_model_len, do not fit a chip."""
    if parallel.num_devices > target.num_chips:
        raise DoesNotFit(f"{parallel.describe()} needs {parallel.num_devices} chips; {target.name} has {target.num_chips}")
    parallel.check_model(config)
    step = AbstractStep.build(config, target, parallel, shape)
    capacity = target.chip.hbm_bytes * (1 - HBM_HEADROOM)
    weights = step.weight_bytes_per_chip()
    if weights > capacity:
        raise DoesNotFit(
            f"the weights need {weights / GiB:.1f} GiB per chip ({parallel.describe()}, {shape.quantization or shape.dtype}) "
            f"and a {target.chip.kind} holds {target.chip.hbm_bytes / GiB:.1f} GiB: {weights / capacity:.2f}x too much. "
            f"Use more chips (-tp) or smaller weights (--quantization int8 / int4)"
        )
    page_bytes = step.kv_bytes_per_page_per_chip()
    pages_requested = shape.num_pages or shape.pages_needed()
    keys = step.buckets.all_keys()
    largest = max(keys, key=lambda k: (k.num_tokens, k.num_seqs, k.query_block))
    # The step's scratch does not grow with the pool (the pool is updated in place). When the
    # requested pool leaves little room, the largest bucket is first compiled over a pool of one
    # sequence to measure that scratch, then over the largest pool that fits.
    roomy = weights + pages_requested * page_bytes < PROBE_BELOW * capacity
    probe_pages = pages_requested if roomy else shape.pages_per_seq + 1
    probe = _compile_bucket(step.with_num_pages(probe_pages), largest)
    other_args = probe.argument_bytes - weights - probe_pages * page_bytes  # the batch, sampling inputs
    largest_pool = int((capacity - weights - probe.temp_bytes - max(other_args, 0)) // page_bytes)
    if largest_pool < 1 + shape.pages_per_seq:
        raise DoesNotFit(
            f"after {weights / GiB:.1f} GiB of weights and {probe.temp_bytes / GiB:.1f} GiB of step scratch per chip, "
            f"{max(largest_pool, 0)} KV pages fit; one sequence of max_model_len={shape.max_model_len} needs "
            f"{shape.pages_per_seq + 1}. Use more chips, smaller weights, a smaller --max-model-len or an int8 KV cache"
        )
    step = step.with_num_pages(min(pages_requested, largest_pool))
    results = {largest: probe if step.num_pages == probe_pages else _compile_bucket(step, largest)}
    if on_bucket:
        on_bucket(results[largest])
    rest = [k for k in keys if k not in results]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        for key, result in zip(rest, pool.map(lambda k: _compile_bucket(step, k), rest)):
            results[key] = result
            if on_bucket:
                on_bucket(result)
    return Plan(step, [results[k] for k in keys], pages_requested, largest_pool)


# ----------------------------------------------------------------------------- the table
def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def format_plan(plan: Plan) -> str:
    s, t = plan.step, plan.target
    shape = s.shape
    lines = [
        f"# {t.name}: {t.num_chips} x {t.chip.kind}, {t.chip.hbm_bytes / GiB:.1f} GiB HBM and "
        f"{t.chip.hbm_bytes_per_second / 1e9:.0f} GB/s per chip",
        f"model: {s.config.num_layers} layers, {s.config.num_heads}/{s.config.num_kv_heads} heads of {s.config.head_dim}, "
        f"{'MoE ' if s.config.is_moe else ''}weights {shape.quantization or shape.dtype}, KV cache "
        f"{shape.kv_cache_dtype or shape.dtype}; mesh {s.parallel.describe()}",
        f"serving: max_model_len {shape.max_model_len}, max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens "
        f"{shape.max_num_batched_tokens}, page_size {shape.page_size}",
        "",
        "| bucket | tokens | seqs | query block | compile s | arguments GiB | temporaries GiB | peak GiB | pool copies |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in plan.buckets:
        lines.append(f"| {b.kind} | {b.key.num_tokens} | {b.key.num_seqs} | {b.key.query_block} | {b.seconds:.1f} | "
                     f"{_gib(b.argument_bytes)} | {_gib(b.temp_bytes)} | {_gib(b.peak_bytes)} | {b.pool_copies} |")
    peak = max(b.peak_bytes for b in plan.buckets)
    replicas = s.parallel.num_replicas
    tokens_fit = (plan.largest_pool_pages - 1) * shape.page_size
    lines += [
        "",
        "| per chip | GiB |",
        "|---|---:|",
        f"| weights | {_gib(s.weight_bytes_per_chip())} |",
        f"| KV pool compiled ({s.num_pages} pages per replica) | {_gib(s.kv_bytes_per_chip())} |",
        f"| largest step scratch | {_gib(max(b.temp_bytes for b in plan.buckets))} |",
        f"| peak of the largest bucket | {_gib(peak)} ({100 * peak / t.chip.hbm_bytes:.0f}% of HBM) |",
        "",
        f"KV pool requested: {plan.pages_requested} pages per replica ({shape.max_num_seqs} sequences x {shape.max_model_len} "
        f"tokens); largest that fits: {plan.largest_pool_pages} pages = {tokens_fit} tokens per replica "
        f"= {tokens_fit // shape.max_model_len} sequences at max_model_len"
        + ("" if plan.largest_pool_pages >= plan.pages_requested else
           f" (the requested pool does NOT fit: compiled with {s.num_pages} pages)"),
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
    if replicas > 1:
        lines.append(f"({replicas} replicas, each with its own batch and KV pool)")
    if any(b.pool_copies for b in plan.buckets):
        lines.append("WARNING: some bucket copies the whole KV pool every step (pool copies > 0)")
    return "\n".join(lines)

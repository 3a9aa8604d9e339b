"""The Pallas kernels checked on the chip before serving: each kernel the step will run, run once
at the model's shapes (a small batch) against the XLA path it would otherwise take.

    shapes = step_shapes(model_config, params, parallel=parallel, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                         page_size=16, max_tokens=512)
    kernels = checked_kernels(resolve_kernels("auto"), shapes, cache=cache_root() / "kernel_checks.json")

Interpret mode and the ahead-of-time compiles (`jaxinfer.aot.kernel_check`) prove a kernel's
arithmetic and that the chip's compiler takes it; neither runs it on the chip. `build_engine`
does, when the kernels compile for the device it runs on (`EngineConfig.check_kernels`). For each
operation of the kernel table (`jaxinfer.ops.kernels.OPERATIONS`) whose entry is not already
the XLA path and that the step uses at these shapes, every case (`kernel_cases`) builds random
inputs on the device, runs the kernel and the XLA path (both jitted there) and compares them:
the largest difference relative to the largest reference entry, within a tolerance per dtype.
A mismatch, or an exception while compiling or running the kernel (a Mosaic / Triton lowering
error), fails the operation: it is named in the log

    kernel <name> failed its on-device check (<reason>): using the XLA path

and the returned table runs its XLA path (`Kernels.xla`). A case whose XLA path itself fails
leaves the kernel as it is ("unchecked", logged): falling back would not help.

The attention kernels are checked first: on TPU a failing ragged attention brings the XLA pool
layout with it, and the RoPE + KV-write kernel is then checked at that layout.

Verdicts are cached in a JSON file (`cache`), keyed by the device kind, the kernels' platform,
jaxinfer's version with a digest of the kernels' sources, JAX's version, the operation and the
function its entry runs, and the case's shapes: a cached verdict runs nothing. Delete the file
to check again.

Several processes (multi-host): each checks on its first local device, then they agree (after
each stage, through `multihost_utils.process_allgather`): an operation that fails anywhere runs
its XLA path everywhere, so every process compiles the same step. Every process must call this.

`scripts/kernel_selfcheck.py` runs every check at a preset architecture's shapes and prints a
table (for a GPU or TPU machine at hand).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Collection, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import pallas_kernels
from jaxinfer.config import ModelConfig
from jaxinfer.models.lora import A_BLOCKS, B_NAME
from jaxinfer.ops import kernels as kernel_table
from jaxinfer.ops.attention import FLASH_MIN_TOKENS
from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch
from jaxinfer.ops.kernels import OPERATIONS, Kernels
from jaxinfer.ops.kv_cache import is_quantized, latent_row_width
from jaxinfer.ops.linear_attention import CHUNK_SIZE
from jaxinfer.ops.quantization import QuantizedWeight
from jaxinfer.ops.sparsity import Sparse24Weight
from jaxinfer.tree import nested_to_flat
from pallas_kernels.flash_attention import flash_attention_reference
from pallas_kernels.gated_delta_rule.reference import l2_normalize
from pallas_kernels.quantized_matmul.reference import stored_rows
from pallas_kernels.ragged_paged_attention.combined import combine_kv, combine_scales
from pallas_kernels.ragged_paged_attention.reference import quantize_kv, storage_dtype
from sharding.mesh import ParallelConfig, kv_heads_per_shard

logger = logging.getLogger("jaxinfer")

# Checked in this order, stage by stage (the attention's verdict decides the pool layout).
STAGES = (("ragged_attention", "flash_attention"),
          ("rope_kv_write", "add_rms_norm", "swiglu_matmul", "quantized_matmul", "lora_delta", "gated_delta_rule", "causal_conv"))
# Largest difference allowed, relative to the largest entry of the XLA path's output (at least
# 1), by the least precise dtype of the case (bfloat16: the kernels keep float32 accumulators
# where the XLA path may round an intermediate; float32: room for TF32 dots on a GPU).
TOLERANCE = {"float32": 5e-3, "float16": 1e-2, "bfloat16": 3e-2}
TOKENS = 8  # the small batch of the norm, matmul and KV-write checks
DELTA_RULE_TOKENS = 135  # a prefill chunk of two whole chunks of 64 and a padded one (jaxinfer.ops.linear_attention)
CONV_TOKENS, CONV_VALID = 135, 130  # a prefill chunk's rows, the first 130 its own (the rest: padding)
LORA_TOKENS = 16


# ----------------------------------------------------------------------------- what the step runs
@dataclasses.dataclass(frozen=True)
class Tensor:
    """A shape and a dtype name (hashable and printable; a part of a case's description)."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(a, drop: int = 0) -> "Tensor":
        """The part of array (or ShapeDtypeStruct) `a` one device holds, its first `drop` axes left out."""
        sharding = getattr(a, "sharding", None)
        shape = tuple(sharding.shard_shape(a.shape)) if sharding is not None else tuple(a.shape)
        return Tensor(shape[drop:], jnp.dtype(a.dtype).name)

    def __str__(self):
        return f"{self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """One quantized weight as the quantized matmul reads it on one device (x has `in_features` columns)."""

    mode: str
    group_size: int | None
    in_features: int
    qweight: Tensor
    scales: Tensor
    offsets: Tensor | None

    def __str__(self):
        group = f" g{self.group_size}" if self.group_size else ""
        offsets = f" offsets {self.offsets}" if self.offsets else ""
        return f"{self.mode}{group} {self.in_features}->{self.qweight.shape[-1]} {self.qweight} scales {self.scales}{offsets}"


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """The LoRA stacks of one projection input: A [N, K, P R] and P B stacks [N, R, O_p]."""

    a: Tensor
    bs: tuple[Tensor, ...]

    def __str__(self):
        return f"A {self.a} B {', '.join(map(str, self.bs))}"


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """What the step's kernels see of a model on one device (one tensor-parallel shard)."""

    num_heads: int  # query heads on this device
    num_kv_heads: int  # KV heads on this device
    head_dim: int
    hidden: int
    dtype: str  # the activations'
    norm_dtype: str  # the norm weights'
    rms_norm_eps: float
    page_size: int
    kv_dtype: str
    sliding_window: int | None = None
    soft_cap: float | None = None  # attention logit soft-capping (Gemma 2)
    sinks: bool = False  # attention sinks (GPT-OSS)
    attention_chunk: int | None = None  # chunked local attention (Llama 4)
    spec_block: int = 0  # speculative verification chunks' query block (0: none)
    paged_attention: bool = True  # the ragged paged attention kernel runs (not with ring attention, nor with a
    # quantized pool in pages smaller than 128, which the XLA attention reads: jaxinfer.ops.kernels)
    flash_attention: bool = True  # steps are long enough for flash attention (FLASH_MIN_TOKENS)
    kv_write: bool = True  # the RoPE + KV-write kernel runs (one device's rows: no sequence parallelism)
    swiglu: tuple[Tensor, ...] = ()  # float gate | up weights [K, 2I] without bias
    quantized: tuple[QuantizedMatrix, ...] = ()
    grouped: tuple[QuantizedMatrix, ...] = ()  # quantized expert stacks [E, K', N] (GPT-OSS's mxfp4)
    lora: tuple[LoraSite, ...] = ()
    latent: tuple[int, int] | None = None  # MLA (DeepSeek): (value dims r, rope dims) of the latent rows
    linear: tuple[int, int, int] | None = None  # Gated DeltaNet layers: (value heads on this device, Dk, Dv)
    conv: tuple[int, int] | None = None  # and their causal conv: (q | k | v channels on this device, taps)


def step_shapes(config: ModelConfig, params, *, parallel: ParallelConfig = ParallelConfig(), dtype, kv_dtype,
                page_size: int, max_tokens: int, spec_block: int = 0) -> StepShapes:
    """The shapes the step's kernels see, from the model's config and its parameters: an
    nnx.State or a flat name -> array dict, arrays placed on the mesh (each device's shard is
    what counts) or ShapeDtypeStructs; QuantizedWeight leaves are the quantized matmul's inputs.
    max_tokens: the largest token bucket (flash attention runs from FLASH_MIN_TOKENS on)."""
    flat = params if isinstance(params, dict) else nested_to_flat(nnx.to_pure_dict(params))
    stacked = lambda name: 1 if name.startswith("layers.") or name.startswith("lora.") else 0  # noqa: E731  (the layer axis)
    quantized, grouped = [], []
    for name, w in flat.items():
        if not isinstance(w, QuantizedWeight) or w.activations is not None:
            continue  # int8 activations multiply integers
        drop = stacked(name)
        stack = w.qweight.ndim == 3 + drop  # [L, E, K', N]: the experts' grouped matmul
        qweight = Tensor.of(w.qweight, drop)
        rows = stored_rows(qweight, w.mode)
        whole = qweight.shape == tuple(w.qweight.shape[drop:])  # not split on its rows
        matrix = QuantizedMatrix(w.mode, w.group_size, w.in_features if w.in_features and whole else rows, qweight,
                                 Tensor.of(w.scales, drop), Tensor.of(w.offsets, drop) if w.offsets is not None else None)
        found = grouped if stack else quantized
        if matrix not in found:
            found.append(matrix)
    swiglu = []
    for name in ("layers.gate_up_proj", "layers.shared_gate_up"):
        w = flat.get(name)
        if w is not None and not isinstance(w, (QuantizedWeight, Sparse24Weight)) and "layers.gate_up_bias" not in flat:
            if Tensor.of(w, 1) not in swiglu:
                swiglu.append(Tensor.of(w, 1))
    lora = []
    for projection, modules in A_BLOCKS.items():
        if f"lora.{projection}_a" in flat:
            site = LoraSite(Tensor.of(flat[f"lora.{projection}_a"], 1),
                            tuple(Tensor.of(flat[f"lora.{B_NAME[m]}_b"], 1) for m in modules))
            if site not in lora:
                lora.append(site)
    ring = parallel.sp > 1 and parallel.sp_attention == "ring"
    quantized_pool = is_quantized(kv_dtype)
    norm = flat["final_norm"]
    heads, kv_heads, head_dim, latent = config.num_heads // parallel.tp, kv_heads_per_shard(config.num_kv_heads, parallel.tp), \
        config.head_dim, None
    linear = ((config.linear_value_heads // parallel.tp, config.linear_key_head_dim, config.linear_value_head_dim)
              if config.has_linear_layers else None)  # the gated delta rule's heads on one device
    conv = ((2 * config.linear_key_heads * config.linear_key_head_dim + config.linear_value_heads * config.linear_value_head_dim)
            // parallel.tp, config.linear_conv_kernel) if config.has_linear_layers else None
    if config.is_mla:  # MLA's own attention over latent rows; its flash path sees each head's K and V (models.deepseek)
        kv_heads, head_dim, latent = heads, config.qk_nope_head_dim + config.rotary_dim, (config.kv_lora_rank, config.rotary_dim)
    return StepShapes(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden=config.hidden_size, dtype=jnp.dtype(dtype).name, norm_dtype=jnp.dtype(norm.dtype).name,
        rms_norm_eps=config.rms_norm_eps, page_size=page_size, kv_dtype=jnp.dtype(kv_dtype).name,
        sliding_window=config.sliding_window, soft_cap=config.attn_logit_softcap, sinks=config.attention_sinks,
        attention_chunk=config.attention_chunk_size,
        spec_block=spec_block, paged_attention=not (ring or (quantized_pool and page_size % 128) or config.is_mla),
        flash_attention=not ring and max_tokens // parallel.sp >= FLASH_MIN_TOKENS,
        kv_write=parallel.sp == 1 and not quantized_pool and not config.is_mla, latent=latent, swiglu=tuple(swiglu), quantized=tuple(quantized), grouped=tuple(grouped), lora=tuple(lora),
        linear=linear, conv=conv,
    )


# ----------------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class Case:
    """One check: `inputs(key)` builds the arguments on the device; `kernel` and `reference`
    take them and return the outputs to compare (padding rows already left out)."""

    operation: str
    description: str
    inputs: Callable
    kernel: Callable
    reference: Callable
    tolerance: float


def _random(key, t: Tensor | tuple, dtype=None, scale: float = 1.0) -> jax.Array:
    """Random values of a shape and dtype: normal floats (times scale), integers over their range."""
    shape, dtype = (t.shape, t.dtype) if isinstance(t, Tensor) else (t, dtype)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
    if dtype == jnp.uint8:
        return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _tolerance(*dtypes) -> float:
    return max(TOLERANCE.get(jnp.dtype(d).name, TOLERANCE["bfloat16"]) for d in dtypes)


def _attention_batches(page_size: int, spec_block: int):
    """(name, chunks, pages per sequence): a decode step, and a mixed step (decodes, a chunk on
    top of a cached prefix, a fresh prompt, and with speculation a verification chunk)."""
    ps = page_size
    decode = [(3 * ps + 5, 1), (1, 1), (2 * ps, 1), (ps + 1, 1)]  # (length after the step, new tokens)
    mixed = [(2 * ps + 3, 1), (5, 1), (3 * ps + 2, 2 * ps + 3), (ps + 5, ps + 5)]
    if spec_block:
        mixed.append((7 + spec_block, spec_block))
    rng = np.random.default_rng(0)
    for name, seqs in (("decode", decode), ("mixed", mixed)):
        pages_per_seq = max(-(-length // ps) for length, _ in seqs)
        chunks, next_page = [], 1
        for length, new in seqs:
            pages = list(range(next_page, next_page + -(-length // ps)))
            next_page += len(pages)
            chunks.append(SequenceChunk(list(rng.integers(3, 100, new)), length - new, [pages], [new - 1]))
        yield name, chunks, pages_per_seq, next_page


def _ragged_attention_cases(kernels: Kernels, xla: Kernels, s: StepShapes) -> Iterator[Case]:
    Hq, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
    combined = kernels.combines_kv
    for name, chunks, pages_per_seq, num_pages in _attention_batches(s.page_size, s.spec_block):
        real = sum(len(c.token_ids) for c in chunks)
        buckets = Buckets.default(1 << max(7, (real - 1).bit_length()), 8, pages_per_seq, spec_block=s.spec_block)
        key, batch, _ = pack_batch(chunks, buckets, s.page_size)
        options = dict(num_kv_heads=Hkv, sm_scale=D**-0.5, sliding_window=s.sliding_window, query_block=key.query_block,
                       spec_block=key.spec_block, soft_cap=s.soft_cap, attention_chunk=s.attention_chunk,
                       sinks=jnp.linspace(-2.0, 2.0, Hq, dtype=jnp.float32) if s.sinks else None)

        def inputs(rng, key=key, batch=batch, num_pages=num_pages):
            """(q, k pages, v pages, page table, batch, k scales, v scales): a quantized pool's
            entries and scales from quantizing normal values (random e4m3 bytes hold NaNs)."""
            q_key, k_key, v_key = jax.random.split(rng, 3)
            shape = (num_pages, s.page_size, Hkv, D)
            batch = jax.tree.map(jnp.asarray, batch)
            q = _random(q_key, (key.num_tokens, Hq, D), s.dtype)
            if not is_quantized(s.kv_dtype):
                return q, _random(k_key, shape, s.kv_dtype), _random(v_key, shape, s.kv_dtype), batch.page_table[0], batch, None, None
            (k, k_scale), (v, v_scale) = (quantize_kv(_random(r, shape, jnp.float32), storage_dtype(s.kv_dtype)) for r in (k_key, v_key))
            return q, k, v, batch.page_table[0], batch, k_scale, v_scale

        def kernel(q, k_pages, v_pages, page_table, batch, k_scale, v_scale, real=real, options=options):
            if combined:  # the pool as the step holds it: one row of K and V per token, one scale pool
                kv_scale = None if k_scale is None else combine_scales(k_scale, v_scale)
                return kernels.ragged_attention(q, combine_kv(k_pages, v_pages), None, page_table, batch, k_scale=kv_scale,
                                                **options)[:real]
            return kernels.ragged_attention(q, k_pages, v_pages, page_table, batch, k_scale=k_scale, v_scale=v_scale,
                                            **options)[:real]

        def reference(q, k_pages, v_pages, page_table, batch, k_scale, v_scale, real=real, options=options):
            return xla.ragged_attention(q, k_pages, v_pages, page_table, batch, k_scale=k_scale, v_scale=v_scale,
                                        **options)[:real]

        layout = "combined" if combined else "separate"
        description = (f"{name} T={key.num_tokens} S={key.num_seqs} query_block={key.query_block} Hq={Hq} Hkv={Hkv} D={D} "
                       f"{layout} pool {s.kv_dtype}[{s.page_size}, {Hkv}, {D}] q {s.dtype} window={s.sliding_window}"
                       + (f" soft_cap={s.soft_cap:g}" if s.soft_cap else "") + (" sinks" if s.sinks else "")
                       + (f" chunk={s.attention_chunk}" if s.attention_chunk else ""))
        yield Case("ragged_attention", description, inputs, kernel, reference, _tolerance(s.dtype, s.kv_dtype))


def _mla_attention_cases(kernels: Kernels, xla: Kernels, s: StepShapes) -> Iterator[Case]:
    """MLA's attention over latent rows (one per token: every head's keys, the first r its values)
    in a decode and a mixed step, the pool's rows as wide as the platform stores them."""
    (r, rope), Hq = s.latent, s.num_heads
    D = r + rope
    width = latent_row_width(D, kernels)
    for name, chunks, pages_per_seq, num_pages in _attention_batches(s.page_size, s.spec_block):
        real = sum(len(c.token_ids) for c in chunks)
        buckets = Buckets.default(1 << max(7, (real - 1).bit_length()), 8, pages_per_seq, spec_block=s.spec_block)
        key, batch, _ = pack_batch(chunks, buckets, s.page_size)
        options = dict(value_dim=r, sm_scale=D**-0.5, query_block=key.query_block, spec_block=key.spec_block)

        def inputs(rng, key=key, batch=batch, num_pages=num_pages):
            q_key, row_key = jax.random.split(rng)
            rows = jnp.pad(_random(row_key, (num_pages, s.page_size, D), s.dtype), ((0, 0), (0, 0), (0, width - D)))
            batch = jax.tree.map(jnp.asarray, batch)
            return _random(q_key, (key.num_tokens, Hq, D), s.dtype), rows, batch.page_table[0], batch

        kernel = lambda *args, real=real, options=options: kernels.mla_attention(*args, **options)[:real]  # noqa: E731
        reference = lambda *args, real=real, options=options: xla.mla_attention(*args, **options)[:real]  # noqa: E731
        description = (f"{name} T={key.num_tokens} S={key.num_seqs} query_block={key.query_block} Hq={Hq} latent rows "
                       f"{s.dtype}[{s.page_size}, {width}] values {r} rope {rope}")
        yield Case("mla_attention", description, inputs, kernel, reference, _tolerance(s.dtype))


def _flash_attention_case(kernels: Kernels, s: StepShapes) -> Case:
    Hq, Hkv, D, T = s.num_heads, s.num_kv_heads, s.head_dim, FLASH_MIN_TOKENS
    cu_q_lens, num_seqs, real = np.array([0, 100, T - 20, T - 20, T - 20], np.int32), np.array([2], np.int32), T - 20
    # a model's chunk (8192 for Llama 4) would span both sequences whole: one short enough to cut them checks the same code
    chunk = None if s.attention_chunk is None else min(s.attention_chunk, 32)
    options = dict(sm_scale=D**-0.5, sliding_window=s.sliding_window, soft_cap=s.soft_cap, causal=True, attention_chunk=chunk)

    def inputs(rng):
        q_key, k_key, v_key = jax.random.split(rng, 3)
        return (_random(q_key, (T, Hq, D), s.dtype), _random(k_key, (T, Hkv, D), s.dtype), _random(v_key, (T, Hkv, D), s.dtype),
                jnp.asarray(cu_q_lens), jnp.asarray(num_seqs))

    kernel = lambda *args: kernels.flash_attention(*args, **options)[:real]  # noqa: E731
    reference = lambda *args: flash_attention_reference(*args, **options)[:real]  # noqa: E731
    description = (f"fresh prefill T={T} (2 sequences) Hq={Hq} Hkv={Hkv} D={D} {s.dtype} window={s.sliding_window}"
                   + (f" chunk={chunk}" if chunk else ""))
    return Case("flash_attention", description, inputs, kernel, reference, _tolerance(s.dtype))


def _rope_kv_write_case(kernels: Kernels, xla: Kernels, s: StepShapes) -> Case | None:
    Hq, Hkv, D, T, ps = s.num_heads, s.num_kv_heads, s.head_dim, TOKENS, s.page_size
    if kernels.combines_kv:
        return None  # a combined pool: the step rotates and writes in XLA (ops.attention.rope_and_write_kv)
    num_pages = 2 + -(-3 * T // ps)
    slots = ps + 3 * np.arange(T)  # distinct slots from page 1 on (page 0: the scratch page)
    write_page, write_offset = jnp.asarray(slots // ps, jnp.int32), jnp.asarray(slots % ps, jnp.int32)

    def inputs(rng):
        keys = jax.random.split(rng, 6)
        pool_shape = (num_pages, ps, Hkv, D)
        pools = [_random(k, pool_shape, s.kv_dtype) for k in keys[:2]]
        k, v = (_random(r, (T, Hkv, D), s.dtype) for r in keys[2:4])
        angles = jax.random.uniform(keys[4], (T, D // 2), jnp.float32, 0, 2 * np.pi)
        angles = jnp.concatenate([angles, angles], axis=-1)
        return (_random(keys[5], (T, Hq, D), s.dtype), k, v, jnp.cos(angles), jnp.sin(angles), *pools, write_page, write_offset)

    def outputs(fn):
        def run(*args):
            q, k, k_pages, v_pages = fn(*args)
            return q, k, k_pages[1:], v_pages[1:]
        return run

    description = f"T={T} Hq={Hq} Hkv={Hkv} D={D} {s.dtype} pool {s.kv_dtype}[{ps}, {Hkv}, {D}]"
    return Case("rope_kv_write", description, inputs, outputs(kernels.rope_kv_write), outputs(xla.rope_kv_write),
                _tolerance(s.dtype, s.kv_dtype))


def _add_rms_norm_cases(kernels: Kernels, xla: Kernels, s: StepShapes) -> Iterator[Case]:
    H, eps = s.hidden, s.rms_norm_eps
    for residual in (True, False):
        def inputs(rng, residual=residual):
            keys = jax.random.split(rng, 3)
            weight = (1.0 + 0.1 * jax.random.normal(keys[2], (H,), jnp.float32)).astype(s.norm_dtype)
            return _random(keys[0], (TOKENS, H), s.dtype), _random(keys[1], (TOKENS, H), s.dtype) if residual else None, weight

        description = f"T={TOKENS} H={H} {s.dtype} weight {s.norm_dtype}" + (" with residual" if residual else " no residual")
        yield Case("add_rms_norm", description, inputs, functools.partial(kernels.add_rms_norm, eps=eps),
                   functools.partial(xla.add_rms_norm, eps=eps), _tolerance(s.dtype, s.norm_dtype))


def _swiglu_case(kernels: Kernels, xla: Kernels, s: StepShapes, weight: Tensor) -> Case:
    K = weight.shape[0]

    def inputs(rng):
        x_key, w_key = jax.random.split(rng)
        return _random(x_key, (TOKENS, K), s.dtype), _random(w_key, weight, scale=K**-0.5)

    description = f"T={TOKENS} x {s.dtype} @ {weight}"
    return Case("swiglu_matmul", description, inputs, kernels.swiglu_matmul, xla.swiglu_matmul, _tolerance(s.dtype, weight.dtype))


def _scales_and_offsets(key_scales, key_offsets, m: QuantizedMatrix):
    """Random scales (and offsets) that give weights of about unit size: a quantized value's
    typical size, times the scale, is 1 / sqrt(K) (mxfp4: E2M1 values average about 2.5, so
    exponent bytes near 127 - log2(2.5 sqrt(K)))."""
    if m.mode == "mxfp4":
        bias = 127 - int(np.ceil(np.log2(2.5 * m.in_features**0.5)))
        return jax.random.randint(key_scales, m.scales.shape, bias - 1, bias + 1, jnp.int32).astype(jnp.uint8), None
    scale = 1.0 / ({"int8": 73.0, "int4": 8.0, "fp8": 1.0}[m.mode] * m.in_features**0.5)
    scales = (scale * jax.random.uniform(key_scales, m.scales.shape, jnp.float32, 0.5, 1.5)).astype(m.scales.dtype)
    return scales, None if m.offsets is None else _random(key_offsets, m.offsets, scale=8 * scale)


def _quantized_matmul_case(kernels: Kernels, xla: Kernels, s: StepShapes, m: QuantizedMatrix) -> Case:
    def inputs(rng):
        keys = jax.random.split(rng, 4)
        return (_random(keys[0], (TOKENS, m.in_features), s.dtype), _random(keys[1], m.qweight),
                *_scales_and_offsets(keys[2], keys[3], m))

    options = dict(mode=m.mode, group_size=m.group_size)
    return Case("quantized_matmul", f"T={TOKENS} x {s.dtype} @ {m}", inputs,
                functools.partial(kernels.quantized_matmul, **options), functools.partial(xla.quantized_matmul, **options),
                _tolerance(s.dtype, m.scales.dtype))


def _grouped_matmul_case(kernels: Kernels, xla: Kernels, s: StepShapes, m: QuantizedMatrix) -> Case:
    """Rows of a decode step's (token, expert) pairs over a device's experts, some empty (the
    expert-parallel padding)."""
    E = m.qweight.shape[0]
    rows = TOKENS * 4
    group_of_row = jnp.asarray(np.random.default_rng(0).integers(0, E + 1, rows), jnp.int32)  # E: an empty row

    def inputs(rng):
        keys = jax.random.split(rng, 4)
        return (_random(keys[0], (rows, m.in_features), s.dtype), group_of_row, _random(keys[1], m.qweight),
                *_scales_and_offsets(keys[2], keys[3], m))

    options = dict(mode=m.mode, group_size=m.group_size)
    return Case("grouped_matmul", f"rows={rows} x {s.dtype} @ {E}x {m}", inputs,
                functools.partial(kernels.grouped_matmul, **options), functools.partial(xla.grouped_matmul, **options),
                _tolerance(s.dtype, "bfloat16" if m.mode == "mxfp4" else m.scales.dtype))


def _lora_case(kernels: Kernels, xla: Kernels, s: StepShapes, site: LoraSite) -> Case:
    N, K = site.a.shape[:2]
    slot = jnp.asarray(np.random.default_rng(0).integers(0, N, LORA_TOKENS), jnp.int32)

    def inputs(rng):
        keys = jax.random.split(rng, 2 + len(site.bs))
        empty = lambda a: a.at[0].set(0)  # noqa: E731  (slot 0 is "no adapter": zeros, as the engine keeps it)
        a = empty(_random(keys[1], site.a, scale=K**-0.5))
        bs = [empty(_random(r, b)) for r, b in zip(keys[2:], site.bs)]
        return _random(keys[0], (LORA_TOKENS, K), s.dtype), a, bs, slot

    return Case("lora_delta", f"T={LORA_TOKENS} x {s.dtype}, {site}", inputs, kernels.lora_delta, xla.lora_delta,
                _tolerance(s.dtype, site.a.dtype))


def _gated_delta_rule_case(kernels: Kernels, xla: Kernels, s: StepShapes) -> Case:
    """One prefill chunk's delta rule from a saved state, its inputs as the model prepares them
    (q, k L2-normalised, q scaled; log decays <= 0, rates in (0, 1)), float32."""
    (Hv, Dk, Dv), T = s.linear, DELTA_RULE_TOKENS

    def inputs(rng):
        keys = jax.random.split(rng, 6)
        q, k = (l2_normalize(_random(r, (T, Hv, Dk), jnp.float32)) for r in keys[:2])
        return (q * Dk**-0.5, k, _random(keys[2], (T, Hv, Dv), jnp.float32), -0.3 * jnp.abs(_random(keys[3], (T, Hv), jnp.float32)),
                jax.nn.sigmoid(_random(keys[4], (T, Hv), jnp.float32)), _random(keys[5], (Hv, Dk, Dv), jnp.float32, scale=0.3))

    return Case("gated_delta_rule", f"prefill chunk T={T} Hv={Hv} Dk={Dk} Dv={Dv} chunk={CHUNK_SIZE} float32", inputs,
                functools.partial(kernels.gated_delta_rule, chunk_size=CHUNK_SIZE),
                functools.partial(xla.gated_delta_rule, chunk_size=CHUNK_SIZE), _tolerance(jnp.float32))


def _causal_conv_case(kernels: Kernels, xla: Kernels, s: StepShapes) -> Case:
    """One prefill chunk's causal conv from saved inputs, in the activations' dtype, its length
    (CONV_VALID of CONV_TOKENS rows) traced: the outputs of its own rows and its last K - 1 inputs."""
    (C, K), T = s.conv, CONV_TOKENS

    def inputs(rng):
        keys = jax.random.split(rng, 3)
        return (_random(keys[0], (T, C), s.dtype), _random(keys[1], (K - 1, C), s.dtype),
                _random(keys[2], (K, C), s.dtype, scale=0.5), jnp.int32(CONV_VALID))

    def outputs(fn):
        def run(*args):
            out, last = fn(*args[:3], valid_len=args[3])
            return out[:CONV_VALID], last
        return run

    return Case("causal_conv", f"prefill chunk T={T} valid {CONV_VALID} C={C} K={K} {s.dtype}", inputs,
                outputs(kernels.causal_conv), outputs(xla.causal_conv), _tolerance(s.dtype))


def kernel_cases(kernels: Kernels, shapes: StepShapes, operations: Collection[str] = OPERATIONS) -> Iterator[Case]:
    """Every check of `operations` the step runs with `kernels` at `shapes`: the operations whose
    entry is not the XLA path already, each at the shapes the step gives it."""
    xla = Kernels()
    runs_kernel = lambda op: op in operations and getattr(kernels, op) is not getattr(xla, op)  # noqa: E731
    s = shapes
    if runs_kernel("ragged_attention") and s.paged_attention:
        yield from _ragged_attention_cases(kernels, xla, s)
    if runs_kernel("mla_attention") and s.latent is not None and not is_quantized(s.kv_dtype):  # (quantized: XLA reads it)
        yield from _mla_attention_cases(kernels, xla, s)
    if runs_kernel("flash_attention") and kernels.flash_attention is not None and s.flash_attention:
        yield _flash_attention_case(kernels, s)
    if runs_kernel("rope_kv_write") and s.kv_write:
        case = _rope_kv_write_case(kernels, xla, s)
        if case is not None:
            yield case
    if runs_kernel("add_rms_norm"):
        yield from _add_rms_norm_cases(kernels, xla, s)
    if runs_kernel("swiglu_matmul"):
        for weight in s.swiglu:
            yield _swiglu_case(kernels, xla, s, weight)
    if runs_kernel("quantized_matmul"):
        for matrix in s.quantized:
            yield _quantized_matmul_case(kernels, xla, s, matrix)
    if runs_kernel("grouped_matmul"):
        for matrix in s.grouped:
            yield _grouped_matmul_case(kernels, xla, s, matrix)
    if runs_kernel("lora_delta"):
        for site in s.lora:
            yield _lora_case(kernels, xla, s, site)
    if runs_kernel("gated_delta_rule") and s.linear is not None:
        yield _gated_delta_rule_case(kernels, xla, s)
    if runs_kernel("causal_conv") and s.conv is not None:
        yield _causal_conv_case(kernels, xla, s)


# ----------------------------------------------------------------------------- running them
@dataclasses.dataclass
class Verdict:
    operation: str  # the kernel table's entry
    case: str  # the shapes
    verdict: str  # "pass" | "FAIL" | "unchecked" (the XLA path itself failed: nothing to compare with)
    error: float | None  # largest difference relative to the largest reference entry
    tolerance: float
    reason: str | None = None  # why it failed or was not checked
    seconds: float = 0.0  # building the inputs, compiling and running both
    cached: bool = False  # read from the cache: nothing ran

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"


def relative_error(got, want) -> float:
    """max |got - want| / max(1, max |want|) over every leaf (NaN / inf: inf)."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        if g.size == 0:
            continue
        diff = np.abs(g - w).max() / max(1.0, np.abs(w).max())
        worst = max(worst, float(diff) if np.isfinite(diff) else float("inf"))
    return worst


def _first_line(e: BaseException) -> str:
    line = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {line}"[:300]


def run_case(case: Case, device, seed: int = 0) -> Verdict:
    """Inputs, the XLA path and the kernel on `device`; never raises."""
    start = time.perf_counter()
    verdict = lambda v, error=None, reason=None: Verdict(  # noqa: E731
        case.operation, case.description, v, error, case.tolerance, reason, time.perf_counter() - start)
    with jax.default_device(device):
        try:
            args = case.inputs(jax.random.key(seed))
        except Exception as e:  # noqa: BLE001  (a broken check must not stop the engine)
            return verdict("unchecked", reason=f"its inputs failed: {_first_line(e)}")
        try:
            got = jax.block_until_ready(jax.jit(case.kernel)(*args))
        except Exception as e:  # noqa: BLE001  (a lowering or runtime error is the kernel's verdict)
            if "RESOURCE_EXHAUSTED" in str(e):  # the device's memory, not the kernel: keep it, check it next time
                return verdict("unchecked", reason=f"out of device memory: {_first_line(e)}")
            return verdict("FAIL", reason=f"{case.description}: {_first_line(e)}")
        try:
            want = jax.block_until_ready(jax.jit(case.reference)(*args))
        except Exception as e:  # noqa: BLE001
            return verdict("unchecked", reason=f"its XLA path failed: {_first_line(e)}")
    error = relative_error(got, want)
    if error <= case.tolerance:
        return verdict("pass", error)
    return verdict("FAIL", error, f"{case.description}: max error {error:.2e} > tolerance {case.tolerance:.0e}")


def device_kind(device, kernels: Kernels) -> str:
    """What a verdict holds for: the chip, and whose kernels in which mode."""
    mode = " in interpret mode" if kernels.interpret else ""
    return f"{getattr(device, 'device_kind', device.platform)}, {kernels.platform} kernels{mode}"


@functools.cache
def code_version() -> str:
    """jaxinfer's version and a digest of the kernels' sources (an edited kernel is checked again)."""
    try:
        version = importlib.metadata.version("jaxinfer")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256()
    for path in sorted(Path(pallas_kernels.__file__).parent.rglob("*.py")) + [Path(kernel_table.__file__), Path(__file__)]:
        digest.update(path.read_bytes())
    return f"{version}+{digest.hexdigest()[:12]}"


def kernel_name(fn) -> str:
    """The function an entry runs ("pallas_kernels.fused_rms_norm.gpu.add_rms_norm"), partials unwrapped."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _cache_key(kind: str, kernels: Kernels, case: Case) -> str:
    return " | ".join((kind, f"jaxinfer {code_version()}", f"jax {jax.__version__}",
                       f"{case.operation} ({kernel_name(getattr(kernels, case.operation))})", case.description))


def _read_cache(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        verdicts = json.loads(Path(path).read_text())
        return verdicts if isinstance(verdicts, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: checked again and rewritten


def _write_cache(path: Path | None, verdicts: dict) -> None:
    """Written whole through a temporary file (another process may read it meanwhile); a
    read-only cache folder only costs the check next time."""
    if path is None:
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump(verdicts, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:
        logger.debug("kernel check verdicts not cached in %s: %s", path, e)


def run_checks(kernels: Kernels, shapes: StepShapes, *, operations: Collection[str] = OPERATIONS, cache: Path | None = None,
               device=None, on_verdict: Callable[[Verdict], None] | None = None) -> list[Verdict]:
    """Every case of `kernel_cases` on `device` (default: the first local device), a cached
    verdict read instead of running it; new pass / FAIL verdicts are added to the cache file."""
    device = device or jax.local_devices()[0]
    kind = device_kind(device, kernels)
    cached = _read_cache(cache)
    verdicts, new = [], {}
    for case in kernel_cases(kernels, shapes, operations):
        key = _cache_key(kind, kernels, case)
        record = cached.get(key)
        if isinstance(record, dict) and record.get("verdict") in ("pass", "FAIL"):
            v = Verdict(case.operation, case.description, record["verdict"], record.get("error"), case.tolerance,
                        record.get("reason"), cached=True)
        else:
            v = run_case(case, device)
            if v.verdict != "unchecked":
                new[key] = dict(verdict=v.verdict, error=v.error, reason=v.reason)
        verdicts.append(v)
        if on_verdict:
            on_verdict(v)
    if new:
        _write_cache(cache, {**_read_cache(cache), **new})
    return verdicts


def _failed_anywhere(failed: set[str], operations: tuple[str, ...]) -> set[str]:
    """The operations that failed on any process (every process calls this with the same list)."""
    if jax.process_count() == 1:
        return failed
    flags = np.array([op in failed for op in operations], np.int32)
    every = np.asarray(multihost_utils.process_allgather(flags))  # [processes, operations]
    return {op for op, any_failed in zip(operations, every.max(axis=0)) if any_failed}


def checked_kernels(kernels: Kernels, shapes: StepShapes, *, operations: Collection[str] = OPERATIONS,
                    cache: Path | None = None, device=None) -> Kernels:
    """`kernels` with every operation whose kernel failed its check (`run_checks`) on the XLA
    path, each named in the log; see the module docstring."""
    start = time.perf_counter()
    verdicts = []
    for stage in STAGES:
        found = run_checks(kernels, shapes, operations=set(stage) & set(operations), cache=cache, device=device)
        verdicts += found
        failed = {v.operation for v in found if v.failed}
        for op in sorted(failed):
            cases = [v for v in found if v.operation == op and v.failed]
            more = f"; {len(cases) - 1} more of its cases failed" if len(cases) > 1 else ""
            cached = ", a cached verdict" if cases[0].cached else ""
            logger.warning("kernel %s failed its on-device check (%s%s%s): using the XLA path", op, cases[0].reason, more, cached)
        for v in found:
            if v.verdict == "unchecked":
                logger.warning("kernel %s could not be checked on the device (%s): kept", v.operation, v.reason)
        for op in sorted(_failed_anywhere(failed, stage) - failed):
            logger.warning("kernel %s failed its on-device check on another process: using the XLA path", op)
            failed.add(op)
        if failed:
            kernels = dataclasses.replace(kernels, xla=(*kernels.xla, *failed))
    ran = [v for v in verdicts if not v.cached]
    logger.info("on-device kernel check: %d cases, %d run (%.1f s), %d cached; XLA paths: %s", len(verdicts), len(ran),
                time.perf_counter() - start, len(verdicts) - len(ran), ", ".join(kernels.xla) or "none")
    return kernels


def with_kernels(graphdef: nnx.GraphDef, params: nnx.State, kernels: Kernels) -> nnx.GraphDef:
    """The model's structure running `kernels` (its table is static, in the graphdef); the
    parameters are not copied."""
    model = nnx.merge(graphdef, params)
    model.kernels = kernels
    return nnx.split(model)[0]

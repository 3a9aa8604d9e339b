"""Every Pallas kernel compiled by the real TPU (Mosaic) or GPU (Triton) compiler, at the shapes of
every supported model family, with no chip present.

Interpret mode proves a kernel's arithmetic; this proves the chip's compiler takes it (tiling,
DMA alignment, VMEM). `python -m jaxinfer.aot.kernel_check --target v6e:2x2` prints one line per
compile; tests/test_aot.py runs a subset in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.aot.targets import Target, compile_target
from pallas_kernels.causal_conv import gpu as conv_gpu
from pallas_kernels.causal_conv import tpu as conv_tpu
from pallas_kernels.flash_attention import flash_attention_gpu, flash_attention_tpu
from pallas_kernels.fused_rms_norm import add_rms_norm_gpu, add_rms_norm_tpu
from pallas_kernels.gated_delta_rule import gpu as gdn_gpu
from pallas_kernels.gated_delta_rule import tpu as gdn_tpu
from pallas_kernels.grouped_matmul import gpu as gmm_gpu
from pallas_kernels.grouped_matmul import tpu as gmm_tpu
from pallas_kernels.lora_sgmv import gpu as lora_gpu
from pallas_kernels.mla_attention import gpu as mla_gpu
from pallas_kernels.mla_attention import tpu as mla_tpu
from pallas_kernels.lora_sgmv import tpu as lora_tpu
from pallas_kernels.quantized_matmul import gpu as qmm_gpu
from pallas_kernels.quantized_matmul import tpu as qmm_tpu
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu
from pallas_kernels.ragged_paged_attention.combined import row_width
from pallas_kernels.ragged_paged_attention.reference import storage_dtype
from pallas_kernels.rope_kv_write import gpu_supports, rope_kv_write_gpu
from pallas_kernels.sparse24_matmul import gpu as s24_gpu
from pallas_kernels.sparse24_matmul import tpu as s24_tpu
from pallas_kernels.swiglu_matmul import swiglu_matmul_gpu, swiglu_matmul_tpu

# Each platform's kernels, called directly (not through jaxinfer.ops.kernels: no XLA fallbacks here).
TPU_KERNELS = dict(flash_attention=flash_attention_tpu, add_rms_norm=add_rms_norm_tpu, quantized_matmul=qmm_tpu.quantized_matmul,
                   ragged_paged_attention=rpa_tpu.ragged_paged_attention,
                   swiglu_matmul=swiglu_matmul_tpu, lora_sgmv_shrink=lora_tpu.sgmv_shrink, lora_sgmv_expand=lora_tpu.sgmv_expand,
                   grouped_matmul=gmm_tpu.grouped_quantized_matmul, mla_attention=mla_tpu.mla_attention,
                   gated_delta_rule=gdn_tpu.chunked, causal_conv=conv_tpu.causal_conv, sparse24_matmul=s24_tpu.sparse24_matmul)
GPU_KERNELS = dict(flash_attention=flash_attention_gpu, add_rms_norm=add_rms_norm_gpu, quantized_matmul=qmm_gpu.quantized_matmul,
                   ragged_paged_attention=rpa_gpu.ragged_paged_attention, rope_kv_write=rope_kv_write_gpu,
                   swiglu_matmul=swiglu_matmul_gpu, lora_sgmv_shrink=lora_gpu.sgmv_shrink, lora_sgmv_expand=lora_gpu.sgmv_expand,
                   grouped_matmul=gmm_gpu.grouped_quantized_matmul, mla_attention=mla_gpu.mla_attention,
                   gated_delta_rule=gdn_gpu.chunked, causal_conv=conv_gpu.causal_conv, sparse24_matmul=s24_gpu.sparse24_matmul)


@dataclasses.dataclass(frozen=True)
class FamilyShape:
    """What the kernels see of a model: heads, head_dim, hidden and MLP sizes (bf16 weights)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    window: int | None = None  # the sliding layers' window (their attention cases use it)
    soft_cap: float | None = None  # attention logit soft-capping (Gemma 2)
    sinks: bool = False  # attention sinks (GPT-OSS)
    chunk: int | None = None  # chunked local attention (Llama 4's RoPE layers)
    lane_blocks: int = 1  # a TPU pool's pages this many times wider: the layer's pages are lane blocks (Gemma 4's global layers)
    experts: int = 0  # experts one chip holds, kept quantized (mxfp4: GPT-OSS): the grouped matmul's cases
    experts_per_token: int = 0
    expert_parallel: int = 1  # the expert-parallel degree the plan uses (a chip's rows: ep x tokens x k)
    latent: int = 0  # multi-head latent attention: the latent row's values (its attention is the MLA kernel's)
    linear: tuple[int, int, int] | None = None  # Gated DeltaNet layers: (value heads, Dk, Dv) of the gated delta rule
    conv: tuple[int, int] | None = None  # and their causal conv: (channels 2 Hk Dk + Hv Dv, taps K)


FAMILY_SHAPES = {
    "llama-3.1-8b": FamilyShape(32, 8, 128, 4096, 14336),
    "llama-3.2-1b": FamilyShape(32, 8, 64, 2048, 8192),
    "mistral-7b": FamilyShape(32, 8, 128, 4096, 14336),
    "qwen2.5-7b": FamilyShape(28, 4, 128, 3584, 18944),
    "qwen3-8b": FamilyShape(32, 8, 128, 4096, 12288),
    "mixtral-8x7b": FamilyShape(32, 8, 128, 4096, 14336),
    "smollm2-135m": FamilyShape(9, 3, 64, 576, 1536),
    # the newer families: attention at their sliding layers' options (a global layer is the plain case)
    "gemma-2-9b": FamilyShape(16, 8, 256, 3584, 14336, window=4096, soft_cap=50.0),
    "gemma-3-27b": FamilyShape(32, 16, 128, 5376, 21504, window=1024),
    "gpt-oss-120b": FamilyShape(64, 8, 64, 2880, 2880, window=128, sinks=True, experts=128 // 8, experts_per_token=4,
                                expert_parallel=8),  # its 128 mxfp4 experts over 8 chips
    "phi-3-mini": FamilyShape(32, 32, 96, 3072, 8192, window=2047),  # head_dim 96: padded to 128 lanes
    "olmo-2-7b": FamilyShape(32, 32, 128, 4096, 11008),
    "smollm3-3b": FamilyShape(16, 4, 128, 2048, 11008),
    "llama-4-scout": FamilyShape(40, 8, 128, 5120, 8192, chunk=8192),
    "glm-4.5": FamilyShape(96, 8, 128, 5120, 12288),  # (its dense first layers' MLP)
    "minimax-m2": FamilyShape(48, 8, 128, 3072, 1536),  # (an expert's width)
    "gemma-4-31b": FamilyShape(32, 16, 256, 5376, 21504, window=1024),  # its sliding layers; the global ones:
    # head_dim 512, their K/V row half the sliding layers': on a TPU pool, pages read as lane blocks
    "gemma-4-31b-global": FamilyShape(32, 4, 512, 5376, 21504, lane_blocks=2),
    # DeepSeek-V3's latent attention (jaxinfer.models.deepseek): 128 query heads (one chip's, tp = 1)
    # over one latent row per token, the latent 512 and the RoPE key 64 (pallas_kernels.mla_attention)
    "deepseek-v3": FamilyShape(128, 1, 576, 7168, 18432, latent=512),
    # Qwen3.5 / Qwen3-Next: full-attention layers (head_dim 256) between Gated DeltaNet ones, whose
    # chunked delta rule runs over 48 / 32 value heads of 128 (pallas_kernels.gated_delta_rule), after a
    # causal conv of 4 taps over q | k | v: 16 key heads of 128 twice and the values (pallas_kernels.causal_conv)
    "qwen3.5-27b": FamilyShape(24, 4, 256, 5120, 17408, linear=(48, 128, 128), conv=(2 * 16 * 128 + 48 * 128, 4)),
    # (an expert's width; and qwen3-next-80b-a3b's shapes: the same heads, hidden size and experts)
    "qwen3.5-35b-a3b": FamilyShape(16, 2, 256, 2048, 512, linear=(32, 128, 128), conv=(2 * 16 * 128 + 32 * 128, 4)),
}

PAGE_SIZE = 16
QUANTIZED_PAGE_SIZE = 128  # a TPU's kernel reads a quantized pool's scales in pages of 128 (jaxinfer.ops.kernels)
NUM_PAGES = 2048
PAGES_PER_SEQ = 256  # 4096 tokens of context
# (bucket, tokens, sequences, query block): the engine's bucket kinds (jaxinfer.ops.batch.Buckets)
ATTENTION_BUCKETS = (("decode", 64, 64, 1), ("prefill", 512, 4, 64), ("mixed", 256, 64, 64))
DELTA_RULE_TOKENS, DELTA_RULE_CHUNK = 2048, 64  # a prefill step's rows (each chunk runs over them all), FLA's chunk
MATMUL_TOKENS = 256
LORA_SLOTS, LORA_RANK = 9, 16  # 8 adapters (+ slot 0), rank 16


@dataclasses.dataclass
class KernelCompile:
    kernel: str
    family: str
    case: str
    seconds: float
    error: str | None = None  # the compiler's first line when it refused


def kernel_cases(target: Target, shape: FamilyShape):
    """(kernel, case, function, abstract args) for every kernel of the target's platform."""
    spec = jax.ShapeDtypeStruct
    bf16, i32 = jnp.bfloat16, jnp.int32
    Hq, Hkv, D, H, F = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    tpu = target.platform == "tpu"
    k = TPU_KERNELS if tpu else GPU_KERNELS
    flash, add_rms_norm, quantized_matmul = k["flash_attention"], k["add_rms_norm"], k["quantized_matmul"]
    ragged_paged_attention, swiglu = k["ragged_paged_attention"], k["swiglu_matmul"]

    sm_scale = D**-0.5
    options = dict(sliding_window=shape.window, soft_cap=shape.soft_cap, **(dict(attention_chunk=shape.chunk) if shape.chunk else {}))
    sinks = shape.sinks
    named = "".join([f" window={shape.window}" if shape.window else "", f" soft_cap={shape.soft_cap:g}" if shape.soft_cap else "",
                     f" chunk={shape.chunk}" if shape.chunk else ""])
    paged_named = named + (" sinks" if sinks else "")
    kv_dtypes = (("bf16", bf16, {}), ("int8", jnp.int8, dict(k_scale=0.05, v_scale=0.05)),
                 ("fp8", jnp.float8_e4m3fn, dict(k_scale=0.05, v_scale=0.05)))
    if shape.latent:  # MLA: its own attention over latent rows (padded to 128 lanes on a TPU), in the model's dtype
        kv_dtypes = ()
        width = mla_tpu.padded_row(D) if tpu else D
        for bucket, T, S, Bq in ATTENTION_BUCKETS:
            fn = functools.partial(k["mla_attention"], value_dim=shape.latent, sm_scale=sm_scale, num_queries_per_block=Bq)
            args = (spec((T, Hq, D), bf16), spec((NUM_PAGES, PAGE_SIZE, width), bf16), spec((S,), i32),
                    spec((S, PAGES_PER_SEQ), i32), spec((S + 1,), i32), spec((1,), i32))
            yield "mla_attention", f"{bucket} T={T} S={S} latent[{PAGE_SIZE}, {width}] values {shape.latent}", fn, args
    if shape.linear:  # one prefill chunk's delta rule, float32 as the model prepares it (jaxinfer.ops.linear_attention)
        (Hv, Dk, Dv), T, f32 = shape.linear, DELTA_RULE_TOKENS, jnp.float32
        yield ("gated_delta_rule", f"prefill T={T} Hv={Hv} Dk={Dk} Dv={Dv} chunk={DELTA_RULE_CHUNK}",
               functools.partial(k["gated_delta_rule"], chunk_size=DELTA_RULE_CHUNK),
               (spec((T, Hv, Dk), f32), spec((T, Hv, Dk), f32), spec((T, Hv, Dv), f32), spec((T, Hv), f32), spec((T, Hv), f32),
                spec((Hv, Dk, Dv), f32)))
    if shape.conv:  # one prefill chunk's causal conv over q | k | v, in the model's dtype, its length traced
        (C, K), T = shape.conv, DELTA_RULE_TOKENS
        yield ("causal_conv", f"prefill T={T} C={C} K={K} bf16", k["causal_conv"],
               (spec((T, C), bf16), spec((K - 1, C), bf16), spec((K, C), bf16), spec((), i32)))
    for name, kv_dtype, scales in kv_dtypes:
        page_size, pages_per_seq, scale_pool = PAGE_SIZE, PAGES_PER_SEQ, ()
        lanes = {}
        if tpu:  # combined pages, one row of K and V per token (jaxinfer.ops.kv_cache)
            pools = (spec((NUM_PAGES, page_size, row_width(Hkv, D) * shape.lane_blocks), kv_dtype),)
            lanes = dict(lane_blocks=shape.lane_blocks) if shape.lane_blocks > 1 and not scales else {}
            if scales and shape.lane_blocks > 1:
                continue  # (a quantized pool holds one row width: jaxinfer.ops.kv_cache)
            if scales:  # a quantized pool as a TPU serves it: e4m3 as bytes, pages of 128 and a scale pool
                page_size, pages_per_seq, scales = QUANTIZED_PAGE_SIZE, PAGES_PER_SEQ * PAGE_SIZE // QUANTIZED_PAGE_SIZE, {}
                pools = (spec((NUM_PAGES, page_size, row_width(Hkv, D)), storage_dtype(kv_dtype)),)
                scale_pool = (spec((NUM_PAGES, Hkv * 2 * page_size), jnp.float32),)
        else:  # separate pools, one scale each for K and V
            pools = (spec((NUM_PAGES, page_size, Hkv, D), kv_dtype),) * 2
        for bucket, T, S, Bq in ATTENTION_BUCKETS:
            fn = functools.partial(ragged_paged_attention, sm_scale=sm_scale, num_queries_per_block=Bq, **scales, **options, **lanes)
            args = (spec((T, Hq, D), bf16), *pools, spec((S,), i32), spec((S, pages_per_seq), i32),
                    spec((S + 1,), i32), spec((1,), i32), *scale_pool)
            if sinks:
                fn = _with_sinks(fn, len(args))
                args += (spec((Hq,), jnp.float32),)
            layout = f"combined[{page_size}, {pools[0].shape[-1]}]" + (" + scale pool" if scale_pool else "") if tpu else f"[{Hkv}, {D}]"
            layout += f" as {shape.lane_blocks} lane blocks" if lanes else ""
            yield "ragged_paged_attention", f"{bucket} T={T} S={S} kv={name} {layout}{paged_named}", fn, args

    T = 512
    # (a layer with sinks never takes the flash path: jaxinfer.ops.attention.paged_attention; MLA never does)
    if not shape.latent:
        yield ("flash_attention", f"prefill T={T}{named}", functools.partial(flash, sm_scale=sm_scale, causal=True, **options),
               (spec((T, Hq, D), bf16), spec((T, Hkv, D), bf16), spec((T, Hkv, D), bf16), spec((5,), i32), spec((1,), i32)))

    T = MATMUL_TOKENS
    if not tpu and gpu_supports(D):  # a TPU writes its combined pages with XLA's scatter (pallas_kernels.rope_kv_write);
        # a GPU with a head_dim the kernel does not take, with the XLA path (jaxinfer.ops.kernels)
        pool = spec((NUM_PAGES, PAGE_SIZE, Hkv, D), bf16)
        yield ("rope_kv_write", f"T={T} Hkv={Hkv}", k["rope_kv_write"],
               (spec((T, Hq, D), bf16), spec((T, Hkv, D), bf16), spec((T, Hkv, D), bf16), spec((T, D), jnp.float32),
                spec((T, D), jnp.float32), pool, pool, spec((T,), i32), spec((T,), i32)))
    yield ("add_rms_norm", f"T={T} H={H}", functools.partial(add_rms_norm, eps=1e-5),
           (spec((T, H), bf16), spec((T, H), bf16), spec((H,), bf16)))
    if not (tpu and F % 128):  # (the kernel table gives a TPU's narrower MLPs to XLA: jaxinfer.ops.kernels)
        yield "swiglu_matmul", f"T={T} {H}->{F}", swiglu, (spec((T, H), bf16), spec((H, 2 * F), bf16))
    N = Hq * D  # the attention output projection
    yield ("quantized_matmul", f"int8 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="int8"),
           (spec((T, N), bf16), spec((N, H), jnp.int8), spec((H,), jnp.float32)))
    yield ("quantized_matmul", f"fp8 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="fp8"),
           (spec((T, N), bf16), spec((N, H), jnp.float8_e4m3fn), spec((H,), jnp.float32)))
    group = 128 if N % 128 == 0 else 64
    yield ("quantized_matmul", f"int4 g{group} T={T} {N}->{H}", functools.partial(quantized_matmul, mode="int4", group_size=group),
           (spec((T, N), bf16), spec((N // 2, H), jnp.uint8), spec((N // group, H), bf16)))
    yield ("quantized_matmul", f"mxfp4 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="mxfp4", group_size=32),
           (spec((T, N), bf16), spec((N // 2, H), jnp.uint8), spec((N // 32, H), jnp.uint8)))
    if N % 128 == 0:  # block-scaled fp8 (DeepSeek-V3, the FP8 releases): e4m3 with a scale per 128 rows
        yield ("quantized_matmul", f"fp8 g128 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="fp8", group_size=128),
               (spec((T, N), bf16), spec((N, H), jnp.float8_e4m3fn), spec((N // 128, H), jnp.float32)))
    # GGUF's grids as they load: Q4_1 (int4 g32, float16 scales and offsets), Q8_0 (int8 g32, float16
    # scales), Q4_K + Q6_K joined (int8 g16, float32 scales and offsets)
    f16 = jnp.float16
    yield ("quantized_matmul", f"int4 g32 offsets f16 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="int4", group_size=32),
           (spec((T, N), bf16), spec((N // 2, H), jnp.uint8), spec((N // 32, H), f16), spec((N // 32, H), f16)))
    yield ("quantized_matmul", f"int8 g32 f16 T={T} {N}->{H}", functools.partial(quantized_matmul, mode="int8", group_size=32),
           (spec((T, N), bf16), spec((N, H), jnp.int8), spec((N // 32, H), f16)))
    yield ("quantized_matmul", f"int8 g16 offsets T={T} {N}->{H}", functools.partial(quantized_matmul, mode="int8", group_size=16),
           (spec((T, N), bf16), spec((N, H), jnp.int8), spec((N // 16, H), jnp.float32), spec((N // 16, H), jnp.float32)))

    # 2:4 sparse weights read compressed (pallas_kernels.sparse24_matmul): the down projection
    if F % 8 == 0:
        yield ("sparse24_matmul", f"2:4 T={T} {F}->{H}", k["sparse24_matmul"],
               (spec((T, F), bf16), spec((4, F // 8, H), bf16), spec((F // 8, H), jnp.uint8)))

    # mxfp4 experts (GPT-OSS): the gate/up and down grouped matmuls over one chip's experts, for a
    # decode bucket's (token, expert) pairs on one chip and as an expert-parallel step receives them
    if shape.experts:
        G, k_pairs = shape.experts, shape.experts_per_token
        for rows in (64 * k_pairs, shape.expert_parallel * 64 * k_pairs):
            for K, N in ((H, 2 * F), (F, H)):
                yield ("grouped_matmul", f"mxfp4 rows={rows} {G}x {K}->{N}",
                       functools.partial(k["grouped_matmul"], mode="mxfp4", group_size=32),
                       (spec((rows, K), bf16), spec((rows,), i32), spec((G, K // 2, N), jnp.uint8),
                        spec((G, K // 32, N), jnp.uint8)))

    # LoRA (grouped by slot, blocks of one sublane tile / 16 rows): the widest shrink (gate | up
    # from the hidden size, down from the MLP size) and expand (into the MLP size), at a decode and
    # a prefill bucket's grouped rows
    lora_block = 16
    for T in (64, 512):
        rows = (T // lora_block + LORA_SLOTS - 1) * lora_block
        slots = spec((rows // lora_block,), i32)
        for K, P in ((H, 3), (F, 1)):
            fn = functools.partial(k["lora_sgmv_shrink"], **(dict(block=lora_block) if tpu else {}))
            yield ("lora_sgmv_shrink", f"T={T} {K}->{P}x{LORA_RANK}", fn,
                   (spec((rows, K), bf16), spec((LORA_SLOTS, K, P * LORA_RANK), bf16), slots))
        fn = functools.partial(k["lora_sgmv_expand"], **(dict(block=lora_block) if tpu else {}))
        yield ("lora_sgmv_expand", f"T={T} {LORA_RANK}->{F}", fn,
               (spec((rows, LORA_RANK), bf16), spec((LORA_SLOTS, LORA_RANK, F), bf16), slots))
    # a float32 table of rank 8 (sublane tile 8): q | k | v of 24 columns, and the expand into a
    # KV width (192 for SmolLM2: no multiple of 128 divides it)
    f32, rank, rows = jnp.float32, 8, (64 // 8 + LORA_SLOTS - 1) * 8
    slots = spec((rows // 8,), i32)
    fn = functools.partial(k["lora_sgmv_shrink"], **(dict(block=8) if tpu else {}))
    yield ("lora_sgmv_shrink", f"f32 T=64 {H}->3x{rank}", fn,
           (spec((rows, H), f32), spec((LORA_SLOTS, H, 3 * rank), f32), slots))
    fn = functools.partial(k["lora_sgmv_expand"], **(dict(block=8) if tpu else {}))
    yield ("lora_sgmv_expand", f"f32 T=64 {rank}->{Hkv * D}", fn,
           (spec((rows, rank), f32), spec((LORA_SLOTS, rank, Hkv * D), f32), slots))


def _with_sinks(fn, num_args: int):
    """fn taking the sinks [Hq] as one more positional argument (after its `num_args`)."""
    def call(*args):
        return fn(*args[:num_args], sinks=args[num_args])
    return call


def compile_for(target: Target, fn, args):
    """jit(fn) compiled for the target's first chip; returns the Compiled."""
    mesh = target.mesh(("x",), (1,))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for a in args]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*placed).compile()


def check_kernels(target: Target, families=None, kernels=None, on_result=None) -> list[KernelCompile]:
    """Compiles every kernel case for every family (names from FAMILY_SHAPES); never raises for a
    refused compile: it is reported in KernelCompile.error."""
    jax.clear_caches()  # kernels read the chip (VMEM, MXU width) while tracing: no trace of another target's
    results = []
    for family in families or FAMILY_SHAPES:
        for kernel, case, fn, args in kernel_cases(target, FAMILY_SHAPES[family]):
            if kernels and kernel not in kernels:
                continue
            start = time.perf_counter()
            error = None
            try:
                compiled = compile_for(target, fn, args)
                marker = {"tpu": "tpu_custom_call", "gpu": "xla.gpu.triton"}[target.platform]
                if marker not in compiled.as_text():
                    error = f"no {marker} (the kernel) in the compiled program"
            except Exception as e:  # noqa: BLE001  (the compiler's refusal is the result)
                error = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)[:300]
            result = KernelCompile(kernel, family, case, time.perf_counter() - start, error)
            results.append(result)
            if on_result:
                on_result(result)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="v5e:2x2, v6e:2x2, v5p:2x2x1, h100 ... (repeatable; default: the three TPUs)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILY_SHAPES))
    parser.add_argument("--kernel", action="append")
    args = parser.parse_args(argv)
    failures = 0
    for name in args.target or ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"]:
        target = compile_target(name)
        print(f"## {name} ({target.chip.kind})", flush=True)

        def show(r: KernelCompile):
            status = "ok" if r.error is None else f"REFUSED: {r.error}"
            print(f"{r.family:14s} {r.kernel:24s} {r.case:44s} {r.seconds:5.2f}s  {status}", flush=True)

        failures += sum(r.error is not None for r in check_kernels(target, args.family, args.kernel, show))
    print(f"{failures} refused")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

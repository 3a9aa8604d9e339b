"""The real TPU and GPU compilers, run on this CPU with no chip (jaxinfer.aot).

libtpu (the test extra's `jax[tpu]`) compiles for TPU v5e / v6e topologies; the CUDA plugin
(installed --no-deps) compiles for an H100 from its target description. Interpret mode proves a
kernel's arithmetic; these prove the chip's compiler takes it: Mosaic's tiling and DMA rules,
Triton's, and the whole serving step's memory.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxinfer.aot import kernel_check
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention as tpu_attention
from jaxinfer.aot.plan import DoesNotFit, plan_deployment, size_pool
from jaxinfer.aot.presets import read_model_config
from jaxinfer.aot.step_compile import AbstractStep, ServingShape
from jaxinfer.aot.targets import TargetError, compile_target
from jaxinfer.ops.batch import BucketKey, Buckets
from jaxinfer.config import ModelConfig
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache
from sharding.hlo import pool_sized_copies
from sharding.mesh import ParallelConfig

# A small Llama: 2 layers, GQA 4 / 2 heads of 128 (so tp=2 splits the KV heads), a 1 024-token vocabulary.
SMALL = ModelConfig.from_hf_dict(
    dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=128, vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-5,
         rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    source="test",
)
SHAPE = ServingShape(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=8)


pytestmark = pytest.mark.usefixtures("no_persistent_compilation_cache")  # executables for described chips: conftest


@pytest.fixture(scope="module")
def v5e():
    return compile_target("v5e:2x2")


@pytest.fixture(scope="module")
def v6e():
    return compile_target("v6e:2x2")


@pytest.fixture(scope="module")
def h100():
    return compile_target("h100")


def refused(results):
    return [(r.family, r.kernel, r.case, r.error) for r in results if r.error is not None]


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_every_tpu_kernel_compiles_at_a_gqa_and_a_smollm2_shape(chip, request):
    """Attention in decode, prefill and mixed buckets with bf16, int8 and fp8 combined pages, flash
    attention, add+RMSNorm, SwiGLU and int8 / fp8 / int4 / mxfp4 matmuls (fp8 also block-scaled, in
    groups of 128, where the inputs allow), and the GGUF
    grids (int4 with float16 offsets, int8 groups of 32 with float16 scales, of 16 with offsets),
    and LoRA's SGMV shrink and expand at a decode and a prefill bucket (bf16, rank 16) and with a
    float32 rank-8 table into a KV width, and the 2:4 sparse matmul of the down projection."""
    results = kernel_check.check_kernels(request.getfixturevalue(chip), families=["llama-3.1-8b", "smollm2-135m"])
    assert len(results) == 2 * 28 + 1  # the GPU's cases less the RoPE + KV write (XLA on a TPU: pallas_kernels.rope_kv_write)
    assert refused(results) == []


def test_every_triton_kernel_compiles_for_an_h100(h100):
    results = kernel_check.check_kernels(h100, families=["llama-3.1-8b", "smollm2-135m"])
    assert len(results) == 2 * 29 + 1  # (fp8 in groups of 128 at Llama's 4096 inputs; SmolLM2's 576 has none)
    assert refused(results) == []


@pytest.mark.parametrize("chip,family", [("v6e", "gemma-2-9b"), ("v6e", "gpt-oss-120b"), ("h100", "gpt-oss-120b"),
                                         ("h100", "phi-3-mini"), ("v6e", "llama-4-scout"), ("h100", "llama-4-scout"),
                                         ("v6e", "gemma-4-31b-global"), ("v6e", "deepseek-v3"), ("h100", "deepseek-v3")])
def test_attention_kernels_compile_with_each_newer_family_option(chip, family, request):
    """Ragged attention in a decode bucket (bf16 pages) and flash attention with a sliding window
    and soft-capping at head_dim 256 (Gemma 2, Mosaic), a window of 128 with sinks at head_dim 64
    (GPT-OSS, Mosaic and Triton), a window at head_dim 96 (Phi-3: Triton's blocks
    are powers of two, so the kernels pad it to 128), chunks of 8192 (Llama 4), head_dim 512 (Gemma 4's
    global layers; on a TPU pool their pages are lane blocks of pages twice as wide), and DeepSeek-V3's
    latent attention (the MLA kernel, 128 heads over rows of 512 + 64, in a decode and a prefill
    bucket: a TPU's query block shrinks to fit VMEM; no flash path)."""
    target = request.getfixturevalue(chip)
    compiled = []
    for kernel, case, fn, args in kernel_check.kernel_cases(target, kernel_check.FAMILY_SHAPES[family]):
        if kernel == "mla_attention" and not case.startswith("mixed"):
            kernel_check.compile_for(target, fn, args)
            compiled.append(kernel)
        if kernel == "flash_attention" or (kernel == "ragged_paged_attention" and case.startswith("decode") and "kv=bf16" in case):
            paged = kernel == "ragged_paged_attention"
            assert ("window=" in case) == (family not in ("llama-4-scout", "gemma-4-31b-global", "deepseek-v3"))
            assert ("lane blocks" in case) == (family == "gemma-4-31b-global" and paged and chip == "v6e")
            assert ("sinks" in case) == (family == "gpt-oss-120b" and paged) and ("chunk=" in case) == (family == "llama-4-scout")
            assert ("soft_cap" in case) == (family == "gemma-2-9b")
            kernel_check.compile_for(target, fn, args)
            compiled.append(kernel)
    assert compiled == (["mla_attention"] * 2 if family == "deepseek-v3" else ["ragged_paged_attention", "flash_attention"])


def test_the_gpu_kernel_fits_many_query_heads_per_kv_head_into_shared_memory(h100):
    """GLM-4.5: 12 query heads per KV head in a prefill's query blocks of 64 asked an H100 for 320
    KiB of shared memory (it has 227); the kernel shrinks its query block until the tile fits."""
    cases = [(case, fn, args) for kernel, case, fn, args in kernel_check.kernel_cases(h100, kernel_check.FAMILY_SHAPES["glm-4.5"])
             if kernel == "ragged_paged_attention" and case.startswith("prefill") and "kv=bf16" in case]
    assert len(cases) == 1
    kernel_check.compile_for(h100, cases[0][1], cases[0][2])


def test_a_mis_tiled_block_is_refused_by_the_tpu_compiler(v6e):
    """The check can fail: a (3, 5) block of a bf16 array is not whole (16, 128) tiles."""

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    mis_tiled = pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((6, 10), jnp.bfloat16), grid=(2, 2),
                               in_specs=[pl.BlockSpec((3, 5), lambda i, j: (i, j))], out_specs=pl.BlockSpec((3, 5), lambda i, j: (i, j)))
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        kernel_check.compile_for(v6e, mis_tiled, [jax.ShapeDtypeStruct((6, 10), jnp.bfloat16)])


def test_tpu_pools_keep_the_row_major_layout_the_kernels_read(v6e):
    """Every family's combined pool, as one chip holds it at every tp, keeps the row-major layout
    the attention kernel DMAs whole pages from (tests/test_kv_layout.py measures the bytes)."""
    mesh = v6e.mesh(("x",), (1,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for family in ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "smollm2-135m"):
        config = read_model_config(family)
        for tp in (1, 2, 8):
            if config.num_kv_heads % tp and tp % config.num_kv_heads:
                continue
            L, P, page, row = KVCache.shape(config, 64, 16, jnp.bfloat16, tp=tp, kernels=Kernels("tpu"))
            local = jax.ShapeDtypeStruct((L, P, page, row // tp), jnp.bfloat16, sharding=sharding)
            with jax.set_mesh(mesh):
                compiled = jax.jit(lambda a: a, donate_argnums=0).lower(local).compile()
            assert compiled.input_formats[0][0].layout.major_to_minor == (0, 1, 2, 3), (family, tp)


# ----------------------------------------------------------------------------- the whole step
def assert_in_place_with_kernels(plan: AbstractStep, key: BucketKey, *markers: str):
    compiled = plan.compile(key)
    hlo = compiled.as_text()
    for marker in markers:
        assert marker in hlo, f"{marker} (the platform's Pallas kernels, ...) is in the step"
    assert pool_sized_copies(hlo, plan.kv_pool_elements_per_chip()) == 0, "the donated pool is updated in place"
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= plan.kv_bytes_per_chip(), "the KV pool is aliased to the output"
    return memory


def test_whole_step_compiles_for_two_tpu_chips_with_tensor_parallelism(v6e):
    plan = AbstractStep.build(SMALL, v6e, ParallelConfig(tp=2), SHAPE)
    assert plan.mesh.devices.size == 2 and plan.kv.kv.sharding.shard_shape(plan.kv.kv.shape)[3] == 2 * 128  # 1 KV head per chip: its K and V
    keys = plan.buckets.all_keys()
    decode = next(k for k in keys if k.query_block == 1)
    mixed = max(keys, key=lambda k: (k.num_tokens, k.num_seqs))
    for key in (decode, mixed):
        assert_in_place_with_kernels(plan, key, "tpu_custom_call")


def test_a_step_with_a_quantized_kv_pool_compiles_for_a_tpu_and_updates_it_in_place(v6e):
    """int8 combined pages and their scales, tensor-parallel over two chips: quantized on write, read
    by the XLA attention (ops.kernels), the donated pool and scales aliased, no pool-sized copy."""
    plan = AbstractStep.build(SMALL, v6e, ParallelConfig(tp=2), dataclasses.replace(SHAPE, kv_cache_dtype="int8"))
    assert plan.kv.quantized and plan.kv.kv.dtype == jnp.int8 and plan.kv.kv_scale.shape[:2] == plan.kv.kv.shape[:2]
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "tpu_custom_call")  # the other kernels (norm, SwiGLU) stay


def test_a_quantized_pool_in_pages_of_128_is_read_by_the_tpu_kernel(v6e):
    """fp8 pages of 128 tokens: each head's scales of a page are whole 128-lane rows, so the
    attention kernel fetches them with the page (ops.kernels); the pool and its scales stay in
    place (8-bit rows of pages >= 32 tokens written by dynamic_update_slice, ops.attention) and
    are stored exactly."""
    plan = AbstractStep.build(SMALL, v6e, ParallelConfig(), dataclasses.replace(SHAPE, kv_cache_dtype="float8_e4m3fn", page_size=128))
    keys = plan.buckets.all_keys()
    decode = next(k for k in keys if k.query_block == 1)
    for key in (decode, max(keys, key=lambda k: (k.num_tokens, k.num_seqs))):  # 8-bit rows written one by one
        memory = assert_in_place_with_kernels(plan, key, "ragged_paged_attention")
    assert plan.kv.kv_scale.shape[-1] == SMALL.num_kv_heads * 2 * 128 and memory.alias_size_in_bytes >= plan.kv_bytes_per_chip()


def test_a_w8a8_step_compiles_for_a_tpu_with_integer_matmuls(v6e):
    """quantization="w8a8", tensor-parallel over two chips: the projections are int8 x int8 dots
    accumulated in int32 on the chip, and the pool is still updated in place."""
    plan = AbstractStep.build(SMALL, v6e, ParallelConfig(tp=2), dataclasses.replace(SHAPE, quantization="w8a8"))
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "tpu_custom_call")
    integer_dots = re.findall(r"= s32\[[^\n]*(?:convolution|dot)\(", plan.compile(decode).as_text())
    assert len(integer_dots) >= 5  # qkv, o, gate_up, down (in the layer loop) and the LM head


# A small GPT-OSS as released: 4 experts in mxfp4 (hidden and expert widths of 256), 2 layers.
SMALL_GPT_OSS = ModelConfig.from_hf_dict(
    dict(model_type="gpt_oss", hidden_size=256,
         intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
         vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=128, num_local_experts=4,
         num_experts_per_tok=2, attention_bias=True, rope_theta=150000.0, tie_word_embeddings=False, bos_token_id=1,
         eos_token_id=2, quantization_config={"quant_method": "mxfp4"}),
    source="test",
)


def test_a_gpt_oss_step_keeps_its_mxfp4_experts_over_two_tpu_chips(v6e):
    """Expert parallelism over two chips, the experts as the checkpoint stores them: each chip holds
    2 experts' E2M1 bytes and exponents (4.25 bits a weight), the grouped matmul kernel runs them in
    the step, the (token, expert) pairs travel by ragged all-to-all, and the pool is still updated
    in place. --no-keep-checkpoint-quantization plans bf16."""
    plan = AbstractStep.build(SMALL_GPT_OSS, v6e, ParallelConfig(ep=2), SHAPE)
    experts = plan.params["layers"]["experts_gate_up"].get_value()
    assert experts.mode == "mxfp4" and experts.qweight.sharding.shard_shape(experts.qweight.shape) == (2, 2, 128, 512)
    bf16 = AbstractStep.build(SMALL_GPT_OSS, v6e, ParallelConfig(ep=2), dataclasses.replace(SHAPE, keep_checkpoint_quantization=False))
    assert isinstance(bf16.params["layers"]["experts_gate_up"].get_value(), jax.ShapeDtypeStruct)
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "grouped_quantized_matmul", "ragged-all-to-all")


# A small DeepSeek-V3 as released: latent attention (4 heads, latent 128 + RoPE 64), a dense first
# layer then 4 experts and a shared one, every linear but kv_b_proj e4m3 in 128 x 128 blocks.
SMALL_DEEPSEEK = ModelConfig.from_hf_dict(
    dict(model_type="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
         num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
         vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
         eos_token_id=2, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
    source="test",
)


def test_glm5s_sparse_attention_step_compiles_for_tpu_and_gpu(v6e, h100):
    """DeepSeek sparse attention runs in XLA on every platform: the step (indexer, top-k, the
    picked rows' attention) compiles for a v6e (tensor parallel) and an H100, its pool's row
    holding the latent, the RoPE key and the indexer's key (128 + 64 + 128, 384 lanes on a TPU)."""
    config = ModelConfig.from_hf_dict(dict(
        model_type="glm_moe_dsa", hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, index_topk=64, index_n_heads=8,
        index_head_dim=128, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False), source="test")
    for target, parallel, row in ((v6e, ParallelConfig(tp=2), 2 * 384), (h100, ParallelConfig(), 320)):
        plan = AbstractStep.build(config, target, parallel, SHAPE)
        assert plan.kv.kv.shape[-1] == row
        plan.compile(next(k for k in plan.buckets.all_keys() if k.query_block == 1))


def test_a_hybrid_models_step_with_its_recurrent_states_compiles_for_tpu_and_gpu(v6e, h100):
    """Qwen3.5's Gated DeltaNet layers (prefill chunks through the platform's gated delta rule kernel,
    states beside the pages) compile for a v6e over two chips (each its key and value heads) and an
    H100; the states are their own line of the per-chip memory: max_num_seqs + 1 slots and as many
    saved prefix states."""
    config = ModelConfig.from_hf_dict(dict(
        model_type="qwen3_5_text", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=1024, max_position_embeddings=4096), source="test")
    for target, parallel, pick in ((v6e, ParallelConfig(tp=2), max), (h100, ParallelConfig(), min)):  # prefill chunks, decodes
        plan = AbstractStep.build(config, target, parallel, SHAPE)
        # 3 linear layers x 17 slots (scratch, 8 sequences, 8 saved prefix states) x (8 heads x 128 x 128 float32
        # + 3 inputs x 2048 channels in bf16), per chip
        assert plan.state_bytes_per_chip() == 3 * 17 * (8 * 128 * 128 * 4 + 3 * 2048 * 2) // parallel.tp
        plan.compile(pick(plan.buckets.all_keys(), key=lambda k: (k.num_tokens, k.query_block)))


def test_a_deepseek_step_keeps_its_fp8_weights_over_two_tpu_chips(v6e):
    """Tensor parallelism over two chips (two query heads each, the latent row on both), the FP8
    release's weights as stored: the projections through the quantized matmul, the experts through
    the grouped one, the pool updated in place."""
    plan = AbstractStep.build(SMALL_DEEPSEEK, v6e, ParallelConfig(tp=2), SHAPE)
    layers = plan.params["layers"]
    assert layers["q_b_proj"].get_value().mode == "fp8" and layers["experts_gate_up"].get_value().mode == "fp8"
    assert isinstance(layers["kv_b_proj"].get_value(), jax.ShapeDtypeStruct)  # read per head, absorbed: floats
    # the latent row (128 + 64) alone, in 256 lanes, once per chip (the global array: both chips' rows)
    assert plan.kv.kv.shape[-1] == 2 * 256 and plan.kv_bytes_per_chip() == plan.kv.kv.size // 2 * 2
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "grouped_quantized_matmul")
    assert "ragged_paged_attention" in plan.lower(decode).as_text()  # the TPU's MLA kernel (latent pages)
    # a 256-token prefill bucket: expanded (flash attention) for a fresh prefill, absorbed otherwise
    long = AbstractStep.build(SMALL_DEEPSEEK, v6e, ParallelConfig(tp=2), dataclasses.replace(SHAPE, max_num_batched_tokens=256))
    prefill = max(long.buckets.all_keys(), key=lambda k: (k.num_tokens, k.query_block))
    hlo = long.compile(prefill).as_text()
    assert prefill.num_tokens == 256 and "flash_attention" in hlo and "ragged_paged_attention" in hlo
    # an int8 latent pool: rows of 256 one-byte entries and a float32 scale each, still updated in place
    int8 = AbstractStep.build(SMALL_DEEPSEEK, v6e, ParallelConfig(tp=2), dataclasses.replace(SHAPE, kv_cache_dtype="int8"))
    assert int8.kv.kv.dtype == jnp.int8 and int8.kv.kv_scale.shape[-1] == 2 * SHAPE.page_size
    assert_in_place_with_kernels(int8, decode, "grouped_quantized_matmul")


@pytest.mark.parametrize("chip", ["v6e", "h100"])
def test_the_grouped_mxfp4_matmul_compiles_at_gpt_oss_120b_shapes(chip, request):
    """The experts' gate/up over one chip's 16 of 128 experts, as an 8-way expert-parallel decode
    step receives its pairs (`kernel_check` has the down projection and one chip's own rows too)."""
    target = request.getfixturevalue(chip)
    [(case, fn, args)] = [(case, fn, args) for kernel, case, fn, args in kernel_check.kernel_cases(
        target, kernel_check.FAMILY_SHAPES["gpt-oss-120b"]) if kernel == "grouped_matmul" and "rows=2048" in case and "->5760" in case]
    marker = {"tpu": "tpu_custom_call", "gpu": "xla.gpu.triton"}[target.platform]
    assert marker in kernel_check.compile_for(target, fn, args).as_text(), case


@pytest.mark.parametrize("chip", ["v5e", "v6e", "h100"])
def test_the_gated_delta_rule_compiles_at_qwen3_5_shapes(chip, request):
    """Qwen3.5-27B's Gated DeltaNet prefill chunk (pallas_kernels.gated_delta_rule): 48 value heads
    of 128, 2048 tokens in chunks of 64, float32; Mosaic reads each head as a 128-lane column block
    with the state in VMEM, Triton runs 4 programs of 32 value columns per head."""
    target = request.getfixturevalue(chip)
    [(case, fn, args)] = [(case, fn, args) for kernel, case, fn, args in kernel_check.kernel_cases(
        target, kernel_check.FAMILY_SHAPES["qwen3.5-27b"]) if kernel == "gated_delta_rule"]
    assert case == "prefill T=2048 Hv=48 Dk=128 Dv=128 chunk=64"
    marker = {"tpu": "tpu_custom_call", "gpu": "xla.gpu.triton"}[target.platform]
    assert marker in kernel_check.compile_for(target, fn, args).as_text(), case


@pytest.mark.parametrize("chip", ["v5e", "v6e", "h100"])
def test_the_causal_conv_compiles_at_qwen3_5_shapes(chip, request):
    """Qwen3.5-27B's Gated DeltaNet causal conv of a prefill chunk (pallas_kernels.causal_conv): 2048
    rows of the 10240 q | k | v channels in bf16, 4 taps, the chunk's length traced; Mosaic carries
    the rows before each token block in a VMEM scratch, Triton loads each tap at its row offset."""
    target = request.getfixturevalue(chip)
    [(case, fn, args)] = [(case, fn, args) for kernel, case, fn, args in kernel_check.kernel_cases(
        target, kernel_check.FAMILY_SHAPES["qwen3.5-27b"]) if kernel == "causal_conv"]
    assert case == "prefill T=2048 C=10240 K=4 bf16"
    marker = {"tpu": "tpu_custom_call", "gpu": "xla.gpu.triton"}[target.platform]
    assert marker in kernel_check.compile_for(target, fn, args).as_text(), case


@pytest.mark.parametrize("target", ["v6e", "h100"])
def test_a_lora_step_compiles_for_a_tpu_and_a_gpu(v6e, target):
    """enable_lora's slot table (4 adapters, rank 16), tensor-parallel over two TPU chips or one
    GPU: the delta runs as the platform's SGMV kernels (shrink and expand) beside the others, and
    the pool stays in place."""
    tpu = target == "v6e"
    plan = AbstractStep.build(SMALL, v6e if tpu else compile_target(target), ParallelConfig(tp=2 if tpu else 1),
                              dataclasses.replace(SHAPE, max_loras=4, max_lora_rank=16))
    assert any("lora" in str(path) for path, _ in jax.tree_util.tree_flatten_with_path(plan.params)[0])
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "tpu_custom_call" if tpu else "xla.gpu.triton")
    hlo = plan.compile(decode).as_text()
    assert "lora_sgmv_shrink" in hlo and "lora_sgmv_expand" in hlo


@pytest.mark.parametrize("target", ["v6e", "h100"])
def test_a_2_4_sparse_step_compiles_with_its_kernel_for_a_tpu_and_a_gpu(v6e, h100, target):
    """sparsity="2:4" (`jaxinfer aot --sparsity 2:4`): the projections kept compressed (values
    [L, 4, K / 8, N] and bitmasks [L, K / 8, N], split over two TPU chips on K for o_proj and
    down_proj) and read by the platform's sparse24_matmul kernel; the pool stays in place; a
    bfloat16 projection takes 9 / 16 of its dense bytes."""
    tpu = target == "v6e"
    plan = AbstractStep.build(SMALL, v6e if tpu else h100, ParallelConfig(tp=2 if tpu else 1),
                              dataclasses.replace(SHAPE, sparsity="2:4"))
    down = plan.params["layers"]["down_proj"].get_value()
    assert down.values.shape == (2, 4, 1024 // 8, 512) and down.mask.dtype == jnp.uint8
    if tpu:
        assert tuple(down.mask.sharding.spec)[1:] == ("tensor", None)  # (the layer axis: over pipeline, here of size 1)
    stored, dense = plan.sparse24_bytes_per_chip()
    assert stored * 16 == dense * 9
    decode = next(k for k in plan.buckets.all_keys() if k.query_block == 1)
    assert_in_place_with_kernels(plan, decode, "tpu_custom_call" if tpu else "xla.gpu.triton", "sparse24_matmul")


@pytest.mark.parametrize("max_model_len,max_num_seqs", [(131072, 64), (1048576, 4)])
def test_long_contexts_compile_for_a_tpu(v6e, max_model_len, max_num_seqs):
    """64 sequences of 128k tokens, 4 of 1M (pages of 16): page tables of 2 and 1 MiB, past the
    chip's 1 MiB of SMEM, so the attention kernel fetches a row per program (the pool's size does
    not matter to the kernel)."""
    shape = ServingShape(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, num_pages=1025)
    plan = AbstractStep.build(SMALL, v6e, ParallelConfig(), shape)
    most_seqs = max(plan.buckets.all_keys(), key=lambda k: (k.num_seqs, -k.num_logits))
    prefill = max((k for k in plan.buckets.all_keys() if k.query_block > 1), key=lambda k: (k.num_tokens, -k.num_logits))
    assert most_seqs.num_seqs == max_num_seqs
    for key in (most_seqs, prefill):
        hlo = plan.compile(key).as_text()
        assert "tpu_custom_call" in hlo and pool_sized_copies(hlo, plan.kv_pool_elements_per_chip()) == 0


def test_a_page_table_row_over_the_chips_smem_is_refused_naming_the_limit():
    """4M tokens in pages of 16: two rows of 262144 page ids are 2 MiB: an error before compiling."""
    with jax.set_mesh(AbstractStep.build(SMALL, compile_target("v6e:1"), ParallelConfig(), SHAPE).mesh):
        q = jax.ShapeDtypeStruct((8, 4, 128), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((64, 16, 2 * 2 * 128), jnp.bfloat16)  # combined: 2 KV heads of 128
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        with pytest.raises(ValueError, match=r"SMEM: .* two page-table rows of 262144 pages .* the chip holds 1048576"):
            jax.jit(tpu_attention).lower(q, pages, i32(1), i32(1, 262144), i32(2), i32(1))


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_whole_step_compiles_for_an_nvidia_gpu(gpu):
    """The H200's description is the H100's with its memory and bandwidth (targets.py)."""
    plan = AbstractStep.build(SMALL, compile_target(gpu), ParallelConfig(), SHAPE)
    key = max(plan.buckets.all_keys(), key=lambda k: (k.num_tokens, k.num_seqs))
    assert_in_place_with_kernels(plan, key, "xla.gpu.triton")


# ----------------------------------------------------------------------------- jaxinfer aot
def test_aot_prints_a_table_of_every_bucket_with_memory_and_a_decode_estimate(tmp_path, capsys):
    import json

    from jaxinfer.cli import main

    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_hf_dict()))
    args = ["aot", "--model", str(tmp_path / "config.json"), "--topology", "v6e:1", "--max-model-len", "1024",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| decode", "| prefill", "| mixed"))]
    assert len(rows) == len(Buckets.default(4, 4, pages_per_seq=1024 // 16).all_keys())
    assert all(line.rstrip().endswith("| 0 |") for line in rows), "no bucket copies the pool"
    assert "largest that fits" in out and "HBM roofline" in out and "TPU v6 lite" in out


# A tiny Gemma 3 with a vision tower: SigLIP of 2 layers over 64 px images in patches of 8 (64 patches),
# pooled to 4 soft tokens of the text model's 256.
TINY_GEMMA3 = dict(
    model_type="gemma3", mm_tokens_per_image=4, bos_token_id=2, eos_token_id=1,
    text_config=dict(model_type="gemma3_text", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1024, sliding_window=64,
                     sliding_window_pattern=2, query_pre_attn_scalar=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                     hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    vision_config=dict(model_type="siglip_vision_model", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, image_size=64, patch_size=8, vision_use_head=False),
)


def test_aot_compiles_a_gemma3_image_encoder_beside_the_step(tmp_path, capsys):
    """A config with a vision_config: `jaxinfer aot` also compiles the image encoder (SigLIP +
    projector, 2 images per step) for the chip and reports its weights, compiled memory and HLO
    FLOPs (the layer loop counted at its depth: within 25% of the matmuls' and attention's FLOPs),
    and its weights join the step's per chip."""
    import json

    from jaxinfer.aot.presets import read_hf_dict
    from jaxinfer.aot.vision_compile import compile_vision, vision_spec
    from jaxinfer.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY_GEMMA3))
    args = ["aot", "--model", str(tmp_path / "config.json"), "--topology", "v6e:1", "--max-model-len", "256",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "2", "--images-per-step", "2", "-j", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("image encoder:"))
    assert "Gemma 3 SigLIP (2 layers, 2 heads of 64, 64 patches) + projector to 256" in line
    assert "2 images of 64x64 per step -> 4 soft tokens each" in line and "TFLOP per step (HLO" in line
    assert "| image encoder weights (replicated) |" in out and "the image encoder weights included" in out
    # the image variant of the largest prefill bucket: the image inputs and the both-ways pass compile for the chip
    step = next(line for line in out.splitlines() if line.startswith("image step:"))
    assert re.search(r"prefill bucket T=2 S=2 R=2 with image inputs \(mm_embeds \[2, 256\], mm_mask \[2\], span_end \[2\], "
                     r"zeros\); images attended both ways .*: compile \d+\.\d s, peak \d+\.\d\d GiB per chip", step), step
    assert step.endswith("pool copies 0") and "mm_deepstack" not in step and "rope_positions" not in step

    spec = vision_spec(read_hf_dict(str(tmp_path / "config.json")), images=2)
    encoder = compile_vision(spec, compile_target("v6e:1").mesh(("x",), (1,)), "bfloat16")
    D, F, L, S, N, E, C = 128, 256, 2, 64, 2, 256, 3 * 8 * 8
    params = C * D + D + S * D + L * (4 * D + 4 * (D * D + D) + D * F + F + F * D + D) + 2 * D + D + D * E
    assert encoder.weight_bytes == 2 * params  # bf16
    assert encoder.argument_bytes >= encoder.weight_bytes + N * 3 * 64 * 64 * 4  # float32 pixels (and the chip's tile padding)
    assert encoder.output_bytes == N * 4 * E * 2 and encoder.scratch_bytes >= encoder.output_bytes
    matmuls = N * (2 * S * C * D + L * (8 * S * D * D + 4 * S * S * D + 4 * S * D * F) + 2 * 4 * D * E)
    assert 0.95 * matmuls < encoder.flops < 1.25 * matmuls, (encoder.flops, matmuls)
    with pytest.raises(ValueError, match="Gemma 3's encoder takes 64x64 images"):
        vision_spec(TINY_GEMMA3, images=1, image_size=(32, 32))
    assert vision_spec(TINY_GEMMA3, images=0) is None and vision_spec(TINY_GEMMA3["text_config"]) is None


def test_a_qwen2_5_vl_image_encoder_compiles_for_a_tpu():
    """Qwen2.5-VL's ViT + merger at an image size given (56 x 84 pixels: 4 x 6 patches, 6 soft
    tokens), one program per image: FLOPs of 3 images are 3 calls'."""
    from jaxinfer.aot.vision_compile import compile_vision, vision_spec

    hf = dict(model_type="qwen2_5_vl", vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                                                          out_hidden_size=256, fullatt_block_indexes=[1]))
    with pytest.raises(ValueError, match="multiples of 28 pixels"):
        vision_spec(hf, images=1, image_size=(56, 80))
    spec = vision_spec(hf, images=3, image_size=(56, 84))
    assert spec.grid == (1, 4, 6) and spec.soft_tokens == 6
    one = compile_vision(vision_spec(hf, images=1, image_size=(56, 84)), compile_target("v6e:1").mesh(("x",), (1,)))
    three = compile_vision(spec, compile_target("v6e:1").mesh(("x",), (1,)))
    assert three.flops == 3 * one.flops > 0 and three.peak_bytes == one.peak_bytes and three.output_bytes >= 6 * 256 * 2  # (tile padding)


def test_a_qwen3_vl_image_encoder_compiles_for_a_tpu_with_its_deepstack():
    """Qwen3-VL's ViT + merger + deepstack mergers (64 x 96 pixels: 4 x 6 patches of 16, 6 soft
    tokens), one program per image; the step's image variant carries one deepstack row per merger."""
    from jaxinfer.aot.vision_compile import compile_vision, vision_spec

    hf = dict(model_type="qwen3_vl", vision_config=dict(depth=3, hidden_size=128, intermediate_size=256, num_heads=2,
                                                        out_hidden_size=256, num_position_embeddings=16,
                                                        deepstack_visual_indexes=[0, 1]))
    with pytest.raises(ValueError, match="Qwen3-VL takes .* multiples of 32 pixels"):
        vision_spec(hf, images=1, image_size=(64, 80))
    spec = vision_spec(hf, images=2, image_size=(64, 96))
    assert spec.grid == (1, 4, 6) and spec.soft_tokens == 6 and spec.image_inputs(512) == (512, 2, False)
    assert "Qwen3-VL ViT (3 layers, 2 heads of 64, 24 patches) + merger and 2 deepstack mergers to 256" == spec.describe()
    one = compile_vision(vision_spec(hf, images=1, image_size=(64, 96)), compile_target("v6e:1").mesh(("x",), (1,)))
    two = compile_vision(spec, compile_target("v6e:1").mesh(("x",), (1,)))
    assert two.flops == 2 * one.flops > 0 and two.peak_bytes == one.peak_bytes
    assert one.output_bytes >= 3 * 6 * 256 * 2  # soft tokens and two deepstack rows each (bf16; tile padding)


def test_llama_8b_on_one_v6e_gets_a_pool_that_fills_85_to_90_percent_of_its_hbm_at_the_default_utilization(v6e):
    """One v6e chip (32 GB): the step's scratch measured by compiling its largest bucket once (64
    tokens, to keep the compile short), the pool sized as the engine sizes it at
    gpu_memory_utilization 0.9. Weights, pool and scratch then fill 85-90 % of the HBM: about
    100k tokens of cache, where the old fixed 1 GiB held 8k."""
    shape = ServingShape(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=64)
    sizing = size_pool(AbstractStep.build(read_model_config("llama-3.1-8b"), v6e, ParallelConfig(), shape))
    hbm = v6e.chip.hbm_bytes
    assert sizing.sized_by == "gpu_memory_utilization=0.9" and sizing.probe_pages == 8192 // 16 + 1
    assert 14.9 < sizing.weight_bytes / 2**30 < 15.0 and 0 < sizing.scratch_bytes < 0.05 * hbm
    assert 0.85 <= sizing.chip_bytes(sizing.pages) / hbm <= 0.90
    assert (sizing.pages - 1) * 16 > 90_000 and sizing.pages < sizing.largest_pages
    assert sizing.page_bytes == 32 * 16 * 2 * 8 * 128 * 2  # layers x tokens x (K, V) x KV heads x head_dim x bf16


def test_aot_refuses_a_model_whose_weights_do_not_fit_and_says_by_how_much(v5e):
    config = read_model_config("llama-3.1-70b")
    with pytest.raises(DoesNotFit, match=r"weights need 131\.\d GiB per chip .* 16\.0 GiB: 8\.\d\dx too much"):
        plan_deployment(config, v5e, ParallelConfig(), ServingShape(max_model_len=8192, max_num_seqs=64))


def test_targets_name_chips_and_refuse_unknown_ones():
    assert compile_target("v6e:1").num_chips == 1
    assert compile_target("v5e-8").num_chips == 8
    v5p = compile_target("v5p:2x2x1").chip  # a megacore of two TensorCores: both cores' HBM and bandwidth
    assert v5p.kind == "TPU v5" and v5p.hbm_bytes == 103 * 10**9 and v5p.hbm_bytes_per_second == 2.46e12
    h200 = compile_target("h200")
    assert h200.chip.hbm_bytes == 141 * 10**9 and h200.chip.hbm_bytes_per_second > compile_target("h100").chip.hbm_bytes_per_second
    with pytest.raises(TargetError, match="unknown target 'tpu9'"):
        compile_target("tpu9")

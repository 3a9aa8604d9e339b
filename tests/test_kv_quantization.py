"""Quantized KV cache (kv_cache_dtype int8 / fp8): every (token, head) row turned by a fixed
orthogonal matrix and stored as int8 / e4m3 entries with its own float32 scale.

Read as a specification: rows round-trip within the grid's step; the rotation keeps scores; a
quantized pool scores text like the float pool; every engine path (chunked prefill, prefix
caching, swap and recompute preemption, forks sharing pages, speculative rollback, tensor / data
/ sequence parallel pools, the TPU kernel table) gives with a quantized pool exactly what one
plain run with the same pool gives; the pool holds about twice a bfloat16 pool's sequences in the
same bytes; on SmolLM2 int8 costs under +0.5 % perplexity and fp8 under +2 %.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.ops.attention import kv_rotation
from jaxinfer.runtime.evaluate import perplexity, prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer
from pallas_kernels.ragged_paged_attention.reference import quantize_kv
from tiny_models import save_hf_model

BASE = dict(max_model_len=128, page_size=4, max_num_seqs=16, progress=False)
DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv-quant-model")
    save_hf_model("llama2", directory)  # 4 KV heads of 16: splits over tp = 2
    return str(directory)


def workload(n=16, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, 250, int(rng.integers(2, 40)))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(2, 16)), ignore_eos=True) for _ in range(n)]
    return prompts, params


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each request alone on a roomy int8 pool."""
    llm = LLM(model_dir, kv_cache_dtype="int8", num_pages=512, max_num_batched_tokens=128, **BASE)
    prompts, params = workload()
    return prompts, params, [tokens(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]


# ----------------------------------------------------------------------------- rows
def test_int8_rows_round_trip_within_half_a_step_and_fp8_within_its_mantissa():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 4, 64)) * np.array([1, 10, 0.1, 0])[None, :, None], jnp.float32)
    q, scale = quantize_kv(x, jnp.int8)
    assert q.dtype == jnp.int8 and scale.shape == (32, 4) and float(scale[:, 3].max()) == 0.0  # an all-zero row
    back = np.asarray(q, np.float32) * np.asarray(scale)[..., None]
    assert np.all(np.abs(back - np.asarray(x)) <= np.asarray(scale)[..., None] / 2 + 1e-7)
    q8, scale8 = quantize_kv(x, jnp.float8_e4m3fn)
    back8 = np.asarray(q8, np.float32) * np.asarray(scale8)[..., None]
    assert np.all(np.abs(back8 - np.asarray(x)) <= np.abs(np.asarray(x)) * 2**-4 + np.asarray(scale8)[..., None] * 2**-9)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
def test_the_rotation_is_orthogonal_so_scores_stay(head_dim):
    r = kv_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-5)
    q, k = np.random.default_rng(head_dim).normal(size=(2, 5, head_dim))
    np.testing.assert_allclose((q @ r) @ (k @ r).T, q @ k.T, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- what it computes
@pytest.mark.parametrize("name", DTYPES)
def test_a_quantized_pool_scores_text_like_the_float_pool(model_dir, name):
    source = resolve_model(model_dir)
    config = read_config(source)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    ids = list(np.random.default_rng(1).integers(3, 250, size=60))
    exact = prompt_log_softmax(config, graphdef, params, ids)
    quantized = prompt_log_softmax(config, graphdef, params, ids, kv_dtype=DTYPES[name])
    kl = np.sum(np.exp(exact) * (exact - quantized), axis=-1)
    # e4m3 keeps 3 mantissa bits (int8 about 7 at a row's scale): the tiny model's sharp distributions show it
    max_diff, max_kl = {"int8": (0.1, 1e-3), "fp8": (0.6, 5e-3)}[name]
    assert 0 < np.abs(quantized - exact).max() < max_diff and kl.mean() < max_kl, (np.abs(quantized - exact).max(), kl.mean())


# ----------------------------------------------------------------------------- every engine path
def test_chunked_prefill_prefix_caching_and_preemption_change_nothing(model_dir, reference):
    prompts, params, want = reference
    for mode in ("recompute", "swap"):
        small = LLM(model_dir, kv_cache_dtype="int8", num_pages=40, max_num_batched_tokens=16, preemption_mode=mode, **BASE)
        assert small.runner.kv.quantized and small.runner.kv.k.dtype == jnp.int8
        assert tokens(small, prompts, params) == want, mode
        assert small.engine.get_stats().num_preemptions > 0
        assert small.engine.block_manager.num_free_pages == small.engine.block_manager.num_usable_pages
    shared = [prompts[0][:8] + p for p in prompts[:6]]  # a common prefix: pages reused from the cache
    alone = LLM(model_dir, kv_cache_dtype="int8", num_pages=512, max_num_batched_tokens=128, enable_prefix_caching=False, **BASE)
    cached = LLM(model_dir, kv_cache_dtype="int8", num_pages=512, max_num_batched_tokens=128, **BASE)
    assert tokens(cached, shared, params[:6]) == tokens(alone, shared, params[:6])
    assert cached.engine.block_manager.stats.hits > 0


def test_forks_share_quantized_pages_and_speculation_rolls_back(model_dir):
    llm = LLM(model_dir, kv_cache_dtype="fp8", num_pages=256, max_num_batched_tokens=64, **BASE)
    prompt = list(range(3, 30))
    sampled = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], sampled, use_tqdm=False)[0].outputs]
    assert first == [c.token_ids for c in llm.generate([prompt], sampled, use_tqdm=False)[0].outputs]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    quoting = [list(range(3, 20)) * 3]  # repeats: prompt lookup drafts, some drafts rejected and rolled back
    spec = LLM(model_dir, kv_cache_dtype="fp8", num_pages=256, max_num_batched_tokens=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, **BASE)
    assert tokens(spec, quoting, greedy) == tokens(llm, quoting, greedy)
    assert spec.engine.get_stats().num_draft_tokens > 0


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2),
                                      dict(sequence_parallel_size=2, sequence_parallel_attention="ring"),
                                      dict(sequence_parallel_size=2, sequence_parallel_attention="allgather")],
                         ids=["tp2", "dp2", "sp2-ring", "sp2-allgather"])
def test_sharded_quantized_pools_give_what_one_device_gives(model_dir, reference, parallel):
    prompts, params, want = reference
    llm = LLM(model_dir, kv_cache_dtype="int8", num_pages=128, max_num_batched_tokens=64, **BASE, **parallel)
    assert tokens(llm, prompts, params) == want


def test_the_tpu_kernel_table_reads_a_quantized_pool_through_the_xla_path(model_dir, reference):
    """TPU pools are combined (kv_cache): a quantized pool holds one row of int8 K and V entries per
    token (head_dim 16 in 64 lanes each) and its scales in one pool, (head, K|V, token) within a
    page; the XLA attention reads them (ops.kernels)."""
    prompts, params, want = reference
    tpu = LLM(model_dir, kv_cache_dtype="int8", num_pages=128, max_num_batched_tokens=32, kernel_impl="pallas", **BASE)
    kv, heads, page_size = tpu.runner.kv, tpu.config.num_kv_heads, tpu.engine_config.page_size
    assert kv.combined and kv.kv.dtype == jnp.int8 and kv.kv.shape[-1] == heads * 2 * 64
    assert kv.kv_scale.shape == kv.kv.shape[:2] + (heads * 2 * page_size,) and kv.k is None
    assert tokens(tpu, prompts[:4], params[:4]) == want[:4]


def test_the_tpu_kernel_reads_a_quantized_pool_in_pages_of_128(model_dir, reference):
    """Pages of 128 tokens: the TPU attention kernel (interpret mode) reads the int8 entries and
    their scale pool itself (ops.kernels), and the 8-bit rows are written one by one
    (attention.write_page_rows): the tokens of the XLA path over pages of 16."""
    prompts, params, want = reference
    tpu = LLM(model_dir, kv_cache_dtype="int8", num_pages=16, max_num_batched_tokens=32, kernel_impl="pallas",
              **{**BASE, "page_size": 128})
    assert tpu.runner.kv.kv.shape[2] == 128 and tpu.runner.kv.kv_scale is not None
    assert tokens(tpu, prompts[:4], params[:4]) == want[:4]


# ----------------------------------------------------------------------------- memory
def test_the_pool_holds_about_twice_the_sequences_of_bfloat16_in_the_same_bytes(model_dir):
    config = read_config(resolve_model(model_dir))
    pages = {name: EngineConfig(model=model_dir, kv_cache_dtype=name, kv_cache_memory_bytes=1 << 20,
                                page_size=16).resolved(config).num_pages
             for name in ("float32", "bfloat16", "int8", "fp8")}
    # head_dim 16 here: an int8 row is 16 + 4 bytes against 32 (bf16): 1.6x; SmolLM2's 64 gives 1.88x
    assert pages["int8"] == pages["fp8"] and pages["int8"] / pages["bfloat16"] > 1.55 and pages["int8"] / pages["float32"] > 3.1
    smollm2 = read_config(resolve_model(None))
    smol = {name: EngineConfig(kv_cache_dtype=name, kv_cache_memory_bytes=256 << 20).resolved(smollm2).num_pages
            for name in ("float32", "bfloat16", "int8")}
    assert smol["int8"] / smol["bfloat16"] > 1.85 and smol["int8"] / smol["float32"] > 3.7


def test_an_unknown_kv_dtype_is_named():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.slow
def test_smollm2_perplexity_budgets():
    """int8 within +0.5 %, fp8 within +2 % of the float32 pool's perplexity on held-out text
    (measured 2026-11-25: int8 -0.07 %, fp8 +0.04 %; without the rotation int8 was +0.6 %)."""
    source = resolve_model(None)
    config = read_config(source)
    ids = load_tokenizer(source).encode((Path(__file__).parent / "data" / "perplexity_text.txt").read_text())
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    base = perplexity(config, graphdef, params, ids)
    for name, budget in (("int8", 0.005), ("fp8", 0.02)):
        ppl = perplexity(config, graphdef, params, ids, kv_dtype=DTYPES[name])
        assert ppl / base - 1 < budget, (name, ppl, base)

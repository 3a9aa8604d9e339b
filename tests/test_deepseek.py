"""DeepSeek-V3 (multi-head latent attention, DeepSeekMoE) through the engine, as a user runs it.

A tiny random DeepSeek-V3 (tests/tiny_models.py: queries through a low rank, a latent of 32 and
a shared RoPE key of 8, interleaved, YaRN with mscale_all_dim, a dense first layer then routed
and shared experts); its logits are tests/test_model_parity.py's and its meshes
tests/test_sharded_model.py's. Greedy text equals transformers' `generate` batched, alone, under
preemption and with prefix-cache hits; the cache holds the latent row alone, kv_lora_rank +
qk_rope_head_dim values per token and layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ConfigError
from test_model_families import hf_greedy
from tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3")
    return directory, save_hf_model("deepseek_v3", directory)


def test_greedy_decoding_equals_transformers_batched_alone_preempted_and_from_the_prefix_cache(deepseek_dir):
    directory, hf = deepseek_dir
    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(3, 250, 12)]
    prompts = [shared + [int(t) for t in rng.integers(3, 250, n)] for n in (1, 9, 17)]
    want = [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    # prefills in chunks of 8; 3 layers x pages of 4 tokens: 16 pages cannot hold all three at once
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=17, max_num_batched_tokens=8, max_num_seqs=3,
              enable_prefix_caching=True, progress=False)
    kv = llm.runner.kv  # the latent rows alone: (kv_lora_rank + qk_rope_head_dim) x 4 bytes per token and layer
    assert kv.v is None and kv.kv_scale is None and kv.pages.shape == (3, 17, 4, 32 + 8)
    assert kv.nbytes() / (3 * 17 * 4) == (32 + 8) * 4
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.get_stats().num_preemptions > 0
    assert batched == want
    alone = [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts]
    assert alone == want
    assert llm.engine.get_stats().prefix_cache_hit_rate > 0  # the shared 12 tokens: 3 whole pages


def test_lora_on_latent_attention_is_refused_by_name(deepseek_dir):
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        LLM(str(deepseek_dir[0]), enable_lora=True, max_model_len=32, progress=False)


def test_glm5s_sparse_attention_decodes_as_transformers_batched_preempted_and_from_the_prefix_cache(tmp_path):
    """GLM-5 (DeepSeek sparse attention, tests/tiny_models.py): each query attends to the 4
    earlier tokens its indexer scores highest. The indexer's key joins the latent row (16 more
    values per token and layer); greedy text equals transformers' across preemption and prefix hits."""
    hf = save_hf_model("glm_moe_dsa", tmp_path)
    rng = np.random.default_rng(13)
    shared = [int(t) for t in rng.integers(3, 250, 12)]
    prompts = [shared + [int(t) for t in rng.integers(3, 250, n)] for n in (1, 9, 17)]
    want = [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    llm = LLM(str(tmp_path), max_model_len=48, page_size=4, num_pages=17, max_num_batched_tokens=8, max_num_seqs=3,
              enable_prefix_caching=True, progress=False)
    kv = llm.runner.kv  # [c | k_rope | index key]: (32 + 8 + 16) x 4 bytes per token and layer
    assert kv.pages.shape == (3, 17, 4, 32 + 8 + 16) and kv.nbytes() / (3 * 17 * 4) == (32 + 8 + 16) * 4
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0


def test_what_sparse_attention_does_not_run_is_refused_by_name(tmp_path):
    """Layers that reuse an earlier layer's picks (GLM's "shared" indexer layers) and a quantized
    latent pool are refused, naming the field at fault."""
    from jaxinfer.config import ModelConfig
    from tiny_models import FAMILIES

    _, kw = FAMILIES["glm_moe_dsa"]
    base = dict(kw, model_type="glm_moe_dsa", n_routed_experts=4, index_n_heads=16)
    with pytest.raises(ConfigError, match="indexer_types.*shared"):
        ModelConfig.from_hf_dict(dict(base, indexer_types=["full", "shared", "full"]), source="config.json")
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf_dict(dict(base, q_lora_rank=None), source="config.json")
    save_hf_model("glm_moe_dsa", tmp_path)
    with pytest.raises(ValueError, match="sparse attention.*kv_cache_dtype"):
        LLM(str(tmp_path), max_model_len=32, kv_cache_dtype="int8", progress=False)


def test_a_long_fresh_prefill_runs_expanded_and_equals_transformers(deepseek_dir):
    """A step of 256 fresh tokens (two prompts) on a platform with a flash kernel (here the jnp
    reference in its place) attends expanded: every head's K and V, no pages read; the latent rows
    are written all the same, so the next decode (absorbed, from the pages) equals transformers too.
    A flash kernel that returns zeros changes the logits: the expanded path is the one that ran."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch, stack_replicas
    from jaxinfer.ops.kernels import Kernels
    from jaxinfer.ops.kv_cache import KVCache
    from jaxinfer.runtime.loading import load_params, read_config, resolve_model
    from jaxinfer.runtime.step import StepFunction
    from pallas_kernels.flash_attention.reference import flash_attention
    from test_model_parity import hf_logprobs, sequences

    directory, hf = deepseek_dir
    source = resolve_model(directory)
    config = read_config(source)
    prompts = sequences(5, [150, 106])
    truth = [hf_logprobs(hf, s, [len(s) - 1, 1]) for s in prompts]
    page_size, buckets = 16, Buckets((256,), max_num_seqs=2, pages_per_seq=16, num_groups=1)
    pages = [list(range(1, 11)), list(range(11, 19))]

    def run(flash):
        kernels = Kernels(flash_attention=flash)
        graphdef, params = load_params(source, config, jnp.float32, jnp.float32, kernels=kernels, progress=False)
        step, kv = StepFunction(graphdef, num_top_logprobs=0), KVCache.create(config, 32, page_size, kernels=kernels)
        out = []
        for chunks in ([SequenceChunk(s[:-1], 0, [p], list(range(len(s) - 1))) for s, p in zip(prompts, pages)],
                       [SequenceChunk(s[-1:], len(s) - 1, [p], [0]) for s, p in zip(prompts, pages)]):
            key, batch, rows = pack_batch(chunks, buckets, [page_size])
            logits, kv = step.forward(params, kv, step.place_inputs(stack_replicas([batch])), query_block=key.query_block)
            out.append([np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)[r] for r in rows])
        return [np.concatenate([prefill, decode]) for prefill, decode in zip(*out)]

    for got, want in zip(run(flash_attention), truth):
        assert np.abs(got - want).max() < 1e-4
    zeros = lambda q, k, v, *a, **kw: jnp.zeros_like(q)  # noqa: E731
    assert np.abs(run(zeros)[0][:149] - truth[0][:149]).max() > 1e-2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "float8_e4m3fn"])
def test_a_quantized_latent_cache_holds_a_row_and_a_scale_and_scores_as_transformers(deepseek_dir, kv_cache_dtype):
    """int8 / e4m3 latent rows (turned by a fixed orthogonal matrix, one float32 scale each): D + 4
    bytes per token and layer; a prompt in chunks of 8, so every chunk after the first reads the
    quantized rows, scores its tokens within 0.1 (int8) / 0.6 (e4m3) of transformers' logprobs: the
    GQA pools' bounds on tiny models (tests/test_kv_quantization.py; their distributions are sharp)."""
    from test_model_parity import hf_logprobs

    directory, hf = deepseek_dir
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=24, max_num_batched_tokens=8, max_num_seqs=2,
              kv_cache_dtype=kv_cache_dtype, progress=False)
    kv = llm.runner.kv
    assert kv.kv.dtype.itemsize == 1 and kv.nbytes() / (3 * 24 * 4) == (32 + 8) + 4
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 250, 30)]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)[0]
    truth = hf_logprobs(hf, ids, [len(ids)])
    err = max(abs(out.prompt_logprobs[p][ids[p]].logprob - truth[p - 1][ids[p]]) for p in range(1, len(ids)))
    assert err < (0.1 if kv_cache_dtype == "int8" else 0.6), err


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_a_converted_folders_config_reads_back_equal(family):
    """`jaxinfer convert` writes ModelConfig.to_hf_dict: the latent attention's fields, the
    indexer's, DeepSeek's shared experts and dense first layers read back into an equal config."""
    from jaxinfer.config import ModelConfig
    from tiny_models import FAMILIES

    cls, kw = FAMILIES[family]
    config = ModelConfig.from_hf_dict(cls(**kw).to_dict())
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config

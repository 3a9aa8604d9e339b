"""Context parallelism (`sequence_parallel_attention="context"`): with sequence_parallel_size sp > 1
the KV pool is split over the mesh axis "sequence" too, a sequence's page i on device i % sp
(jaxinfer.ops.attention.attend_context_parallel). Over 4 CPU devices it generates what one device
does, each device holding a quarter of the pages."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.block_manager import BlockManager
from tiny_models import save_hf_model

SHAPES = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96)
BASE = dict(max_model_len=96, page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32, progress=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


def test_block_manager_deals_a_sequences_pages_round_robin_over_the_shards():
    bm = BlockManager(16, 2, kv_shards=4)  # shards of 4 pages: 0-3, 4-7, 8-11, 12-15; 0, 4, 8, 12 scratch
    assert bm.num_usable_pages == 12 and bm.num_free_pages == 12
    bm.allocate("a", list(range(9)))  # 5 pages: shards 0 1 2 3 0
    assert [bm.shard_of(p) for p in bm.page_table("a")[0]] == [0, 1, 2, 3, 0]
    assert bm.num_free_pages == 4 * 1  # shard 0 has one page left
    bm.mark_computed("a", 9, list(range(9)))
    bm.allocate("b", list(range(8)) + [99])  # a prefix hit on a's first 4 pages, then shard 0 again
    assert bm.page_table("b")[0][:4] == bm.page_table("a")[0][:4]
    assert bm.shard_of(bm.page_table("b")[0][4]) == 0
    assert bm.num_free_pages == 0
    bm.check_invariants()
    with pytest.raises(ValueError, match="kv_shards=3"):
        BlockManager(16, 2, kv_shards=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("context-parallel")
    save_hf_model("llama3.1", directory, **SHAPES)
    return str(directory)


def generate(llm, prompts):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
                                                     for o in outs]


def test_context_parallel_over_4_devices_equals_one_device(model_dir):
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 250, 22)]  # 6 pages of 4 tokens
    prompts = [[prompt], [prompt + [7, 8, 9, 10, 11]]]  # the second hits the first's cached pages
    one = LLM(model_dir, **BASE)
    reference = [generate(one, p) for p in prompts]
    llm = LLM(model_dir, sequence_parallel_size=4, sequence_parallel_attention="context", **BASE)
    results = [generate(llm, p) for p in prompts]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(results, reference):
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    bm = llm.engine.block_manager
    assert bm.stats.hits > 0  # the second prompt reused the first's pages
    # each device of the sequence axis holds a quarter of the pages, and the cached prefix lies on all four
    pool = llm.runner.kv.k
    assert {shard.data.shape[1] for shard in pool.addressable_shards} == {pool.shape[1] // 4}
    assert {bm.shard_of(page) for page, _ in bm.cached_pages()} == {0, 1, 2, 3}
    bm.check_invariants()

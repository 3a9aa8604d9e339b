"""Context parallelism (`sequence_parallel_attention="context"`): with sequence_parallel_size sp > 1
the KV pool is split over the mesh axis "sequence" too, a sequence's page i on device i % sp
(jaxinfer.ops.attention.attend_context_parallel). Over 4 CPU devices it generates what one device
does, each device holding a quarter of the pages."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.aot.step_compile import AbstractStep, ServingShape
from jaxinfer.aot.targets import compile_target
from jaxinfer.engine.block_manager import BlockManager
from sharding.mesh import ParallelConfig
from test_aot import SMALL
from pallas_kernels.ragged_paged_attention import split_kv
from test_ragged_attention_reference import make_case
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


def test_strided_shares_of_the_page_table_merge_into_the_whole_attention():
    """split_kv over device j's share of each row (columns j, j + n, ...: `page_stride` n, `page_phase`
    j), for j = 0 .. n - 1, merged by lse, is the attention over the whole row (with a sliding window)."""
    case = make_case(np.random.default_rng(3), [9, 1, 1, 5, 0], [9, 23, 14, 19, 0], Hq=4, Hkv=2, D=16, page_size=4,
                     pad_seqs=2, pad_tokens=3)
    q, k_pages, v_pages, kv_lens, table, cu, num_seqs = case
    kw = dict(sm_scale=0.25, sliding_window=6, num_queries_per_block=4, num_kv_pages_per_block=2, return_lse=True)
    full_out, full_lse = split_kv.ragged_paged_attention(q, k_pages, v_pages, kv_lens, table, cu, num_seqs, **kw)
    n = 3
    table = np.pad(table, ((0, 0), (0, -table.shape[1] % n)))
    parts = [split_kv.ragged_paged_attention(q, k_pages, v_pages, kv_lens, table[:, j::n], cu, num_seqs, page_stride=n,
                                             page_phase=j, **kw) for j in range(n)]
    lse = np.logaddexp.reduce(np.stack([np.asarray(l) for _, l in parts]), axis=0)
    safe = np.where(np.isneginf(lse), 0.0, lse)
    out = sum(np.exp(np.asarray(l) - safe)[..., None] * np.asarray(o) for o, l in parts)
    np.testing.assert_allclose(out, full_out, atol=1e-5)
    np.testing.assert_allclose(lse, full_lse, atol=1e-5)


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
    """sp = 4 (and tp = 2: the 8 devices) against one device: a prompt of 6 pages, decodes after it, then a
    longer prompt whose first pages are a prefix hit."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 250, 22)]  # 6 pages of 4 tokens
    prompts = [[prompt], [prompt + [7, 8, 9, 10, 11]]]  # the second hits the first's cached pages
    one = LLM(model_dir, **BASE)
    reference = [generate(one, p) for p in prompts]
    llm = LLM(model_dir, sequence_parallel_size=4, sequence_parallel_attention="context", tensor_parallel_size=2, **BASE)
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


def test_aot_plans_a_quarter_of_the_kv_pool_per_chip_with_context_parallelism():
    """`jaxinfer aot -sp 4` (context parallelism): the same pool per replica costs each chip a
    quarter (built abstractly for a v6e 2x2, nothing compiled)."""
    target = compile_target("v6e:2x2")
    shape = ServingShape(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=64, num_pages=1024)
    one = AbstractStep.build(SMALL, target, ParallelConfig(), shape)
    four = AbstractStep.build(SMALL, target, ParallelConfig(sp=4, sp_attention="context"), shape)
    assert four.num_pages == one.num_pages == 1024
    assert four.kv_bytes_per_chip() * 4 == one.kv_bytes_per_chip()
    assert four.kv_bytes_per_page_per_chip() * 4 == one.kv_bytes_per_page_per_chip()

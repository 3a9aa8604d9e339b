"""`LLM(..., tensor_parallel_size=, data_parallel_size=, expert_parallel_size=, ...)`: the same
engine on a mesh of the 8 CPU devices generates what it generates on one device; bad parallel
configurations fail at once with a message naming the size at fault."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from sharding.mesh import ShardingError
from tiny_models import save_hf_model

# Four prompts (at most MAX_PREFILL_CHUNKS: all prefill in one step) of one length, generating the
# same number of tokens: each LLM compiles two step variants, a prefill and a decode (a compile of
# the sharded step takes seconds on the CPU; the suite's time is compiles).
BASE = dict(max_model_len=96, page_size=4, num_pages=160, max_num_seqs=8, max_num_batched_tokens=64, progress=False)
SHAPES = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dense-llm")
    save_hf_model("llama3.1", directory, **SHAPES)
    return str(directory)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe-llm")
    save_hf_model("mixtral", directory, **SHAPES, num_local_experts=8)
    return str(directory)


def prompts(n=4, seed=0, length=6):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 250, length)] for _ in range(n)]


def tokens(llm, prompt_list, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dense_reference(dense_dir):
    return tokens(LLM(dense_dir, **BASE), prompts())


def test_greedy_generation_with_tp4_equals_tp1_token_for_token(dense_dir, dense_reference):
    llm = LLM(dense_dir, tensor_parallel_size=4, **BASE)
    assert llm.mesh.shape["tensor"] == 4
    assert tokens(llm, prompts()) == dense_reference


def test_data_parallel_replicas_share_the_requests_and_change_nothing(dense_dir, dense_reference):
    llm = LLM(dense_dir, data_parallel_size=2, tensor_parallel_size=2, **BASE)
    assert tokens(llm, prompts()) == dense_reference
    engine = llm.engine
    assert len(engine.replicas) == 2
    # balanced: with eight requests arriving together, each replica takes four
    replicas = [engine.add_request(None, p, GREEDY).replica for p in prompts(8)]
    assert sorted(np.bincount(replicas)) == [4, 4]
    while engine.has_unfinished_requests():
        engine.step()
    for replica in engine.replicas:
        replica.block_manager.check_invariants()


def test_speculative_decoding_on_a_mesh_changes_no_greedy_token(dense_dir, dense_reference, tmp_path):
    """dp=2 x tp=2: each replica verifies its own sequences' drafts. The target returns hidden
    states for draft heads (untrained EAGLE-style: its drafts are mostly wrong), then drafts by
    prompt lookup and with its own first layer as a draft model (a second sharded runner)."""
    from jaxinfer.models.draft_heads import init_heads, save_heads

    heads = save_heads(tmp_path / "eagle", init_heads("eagle", 3, SHAPES["hidden_size"]), base_model=dense_dir)
    llm = LLM(dense_dir, data_parallel_size=2, tensor_parallel_size=2, **BASE,
              speculative_config={"method": "eagle", "model": str(heads), "num_speculative_tokens": 3})
    for config in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
                   {"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 3}):
        if config is not None:
            llm.engine.proposer = llm.make_proposer(config)
        drafted = llm.engine.get_stats().num_draft_tokens
        assert tokens(llm, prompts()) == dense_reference, config
        assert llm.engine.get_stats().num_draft_tokens > drafted, config
        for replica in llm.engine.replicas:
            replica.block_manager.check_invariants()
            assert replica.block_manager.num_free_pages == replica.block_manager.num_usable_pages


def test_a_request_goes_to_the_replica_holding_its_prefix(dense_dir):
    llm = LLM(dense_dir, data_parallel_size=2, **BASE)
    shared = list(range(3, 40))  # 9 full pages
    llm.generate([shared + [50]], GREEDY, use_tqdm=False)  # computes and caches them on one replica
    holder = next(i for i, r in enumerate(llm.engine.replicas) if r.block_manager.num_cached_pages)
    for _ in range(3):  # though the other replica is idle, the prefix wins
        assert llm.engine.add_request(None, shared + [60], GREEDY).replica == holder
    hits = llm.engine.replicas[holder].block_manager.stats.hits
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.replicas[holder].block_manager.stats.hits > hits


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    return tokens(LLM(moe_dir, **BASE), prompts())


def test_moe_generation_with_expert_parallelism_equals_one_device(moe_dir, moe_reference):
    reference = moe_reference
    assert tokens(LLM(moe_dir, expert_parallel_size=4, tensor_parallel_size=2, **BASE), prompts()) == reference
    # vLLM's spelling: the data-parallel replicas become expert-parallel ones
    llm = LLM(moe_dir, data_parallel_size=2, enable_expert_parallel=True, **BASE)
    assert (llm.parallel.dp, llm.parallel.ep) == (1, 2)
    assert tokens(llm, prompts()) == reference


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the model's 8 attention heads"),
    (dict(tensor_parallel_size=16), r"tensor_parallel_size=16 does not divide the model's 8 attention heads"),
    (dict(data_parallel_size=4, tensor_parallel_size=4), r"needs 16 devices, but only 8 are available"),
    (dict(expert_parallel_size=2), r"expert parallelism \(size 2\) needs a mixture-of-experts model"),
    (dict(sequence_parallel_size=4, max_num_batched_tokens=66), r"max_num_batched_tokens=66 must be a multiple of 4"),
    (dict(sequence_parallel_attention="ulysses", sequence_parallel_size=2), r"sp_attention='ulysses'"),
])
def test_bad_parallel_configurations_fail_at_once_naming_the_size(dense_dir, kwargs, message):
    start = time.monotonic()
    with pytest.raises((ShardingError, ValueError), match=message):
        LLM(dense_dir, **{**BASE, **kwargs})
    assert time.monotonic() - start < 5


def test_params_saved_from_one_mesh_restore_onto_others(dense_dir, dense_reference, tmp_path):
    """orbax save of sharded params (here from tp = 4, where each of the 2 KV heads is stored twice)
    writes the tp = 1 layout, each process its own shards; the folder restores onto any mesh."""
    from jaxinfer.runtime.loading import save_converted

    llm = LLM(dense_dir, tensor_parallel_size=4, **BASE)
    saved = save_converted(tmp_path / "converted", llm.config, llm.runner.params, llm.tokenizer, tp=4)
    for kwargs in ({}, dict(tensor_parallel_size=8), dict(data_parallel_size=2, tensor_parallel_size=2)):
        assert tokens(LLM(str(saved), **kwargs, **BASE), prompts()) == dense_reference, kwargs


def test_quantized_weights_split_over_tensor_shards(dense_dir):
    """int8 weights (per-column scales) shard like the float ones: column-parallel weights split
    scales with their columns, row-parallel ones keep them whole. int4 groups run along the input
    rows, so a row-parallel weight whose shard is not whole groups is refused by name."""
    reference = tokens(LLM(dense_dir, quantization="int8", **BASE), prompts())
    assert tokens(LLM(dense_dir, quantization="int8", tensor_parallel_size=2, **BASE), prompts()) == reference
    with pytest.raises(ShardingError, match=r"down_proj has 96 input rows, 48 per shard, not a multiple of quantization_group_size=32"):
        LLM(dense_dir, quantization="int4", quantization_group_size=32, tensor_parallel_size=2, **BASE)


def test_a_moe_model_converts_from_an_expert_parallel_mesh_and_restores_on_another(moe_dir, moe_reference, tmp_path):
    from jaxinfer.runtime.loading import save_converted

    reference = moe_reference
    llm = LLM(moe_dir, expert_parallel_size=2, tensor_parallel_size=2, **BASE)
    saved = save_converted(tmp_path / "converted", llm.config, llm.runner.params, llm.tokenizer, tp=2)
    assert tokens(LLM(str(saved), tensor_parallel_size=4, **BASE), prompts()) == reference


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_sequence_parallel_generation_equals_one_device(dense_dir, dense_reference, attention):
    llm = LLM(dense_dir, sequence_parallel_size=4, sequence_parallel_attention=attention, **BASE)
    assert llm.buckets.token_buckets[0] % 4 == 0  # every step's tokens split evenly
    assert tokens(llm, prompts()) == dense_reference

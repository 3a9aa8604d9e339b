"""Pipeline parallelism (jaxinfer.models.pipeline): the layers split into stages over the mesh axis
"pipeline", micro-batches handed stage to stage inside the step, give the one-device logits.

A tiny Llama of 4 layers (transformers-made, tests/tiny_models.py) runs mesh_model's scenario (a
ragged prefill, decodes, a chunked prefill beside them) on pipelines of 2 and 4 stages, alone and
with tensor and data parallelism; `LLM` generates the same greedy tokens and logprobs with pp = 2;
each stage holds only its layers' weights and KV slots; stages talk by collective permutes. The
two-process pipeline is in tests/test_multihost.py.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.ops.batch import SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kernels import Kernels
from mesh_model import BUCKETS, KEY, PAGE_SIZE, SHAPES, MeshModel, assert_same_logits, mesh_id, run_scenario
from sharding.hlo import collectives
from sharding.mesh import ParallelConfig
from tiny_models import save_hf_model

LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pipeline")
    save_hf_model("llama2", directory, **SHAPES, num_hidden_layers=LAYERS)
    return directory


@pytest.fixture(scope="module")
def truth(model_dir):
    return run_scenario(MeshModel(model_dir, ParallelConfig()))


@pytest.mark.parametrize("parallel", [ParallelConfig(pp=2), ParallelConfig(pp=2, tp=2), ParallelConfig(pp=4, dp=2)],
                         ids=mesh_id)
def test_pipeline_stages_give_the_one_device_logits(model_dir, truth, parallel):
    assert_same_logits(run_scenario(MeshModel(model_dir, parallel)), truth)


def test_each_stage_holds_only_its_layers_and_their_pages(model_dir):
    model = MeshModel(model_dir, ParallelConfig(pp=2, tp=2))
    qkv = model.params["layers"]["qkv_proj"].get_value()  # [L, H, qkv]
    assert qkv.sharding.shard_shape(qkv.shape) == (LAYERS // 2, qkv.shape[1], qkv.shape[2] // 2)
    stage_of_device = {d.id: stage for stage in range(2) for d in model.mesh.devices[stage].flat}
    for shard in qkv.addressable_shards:  # stage s's devices hold layers 2s, 2s + 1
        assert shard.index[0] == slice(2 * stage_of_device[shard.device.id], 2 * stage_of_device[shard.device.id] + 2)
    embed = model.params["embed"].get_value()
    assert embed.sharding.shard_shape(embed.shape)[0] == embed.shape[0]  # not a layer weight: on every stage
    pages = model.kv.k
    assert pages.shape[0] == LAYERS and pages.sharding.shard_shape(pages.shape)[0] == LAYERS // 2


@pytest.mark.parametrize("tp", [1, 2])
def test_stages_hand_micro_batches_on_by_collective_permutes(model_dir, tp):
    """Per iteration of the schedule, one permute of the hidden state and one of the residual
    ([T / pp, H] float32 each; with tensor parallelism each shard sends 1/tp of the columns, which
    the next stage all-gathers); the logits rows come from the last stage by one all-reduce."""
    model = MeshModel(model_dir, ParallelConfig(pp=2, tp=tp))
    batch = model.step.place_inputs(stack_replicas([pack_batch([SequenceChunk([5, 6, 7], 0, [[1]], [2])], BUCKETS,
                                                               PAGE_SIZE, KEY)[1]]))
    hlo = model.step._forward.lower(model.params, model.kv, batch, query_block=KEY.query_block).compile().as_text()
    ops = collectives(hlo)
    permutes = [op for op in ops if op.kind == "collective-permute"]
    assert len(permutes) == 2 and {op.bytes for op in permutes} == {KEY.num_tokens // 2 * SHAPES["hidden_size"] * 4 // tp}
    assert Counter(op.kind for op in ops)["all-reduce"] >= 1


def test_llm_with_a_pipeline_generates_the_one_device_tokens(model_dir):
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, 6 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    kwargs = dict(max_model_len=64, page_size=4, num_pages=48, max_num_seqs=4, max_num_batched_tokens=32, progress=False)
    want = LLM(str(model_dir), **kwargs).generate(prompts, params, use_tqdm=False)
    got = LLM(str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=2, **kwargs).generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_step.keys() == w_step.keys()
            assert all(abs(g_step[t].logprob - w_step[t].logprob) < 1e-5 for t in w_step)


def test_stages_that_do_not_split_the_layers_are_refused(model_dir):
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 .*must divide the model's 4 layers"):
        MeshModel(model_dir, ParallelConfig(pp=3))
    with pytest.raises(ConfigError, match="sequence parallelism in a pipeline is not supported"):
        MeshModel(model_dir, ParallelConfig(pp=2, sp=2))


def test_pallas_kernels_run_on_each_stages_micro_batches(model_dir, truth):
    """The attention kernels (interpret mode here; the TPU ones, on a combined pool) see each
    micro-batch as a ragged batch of its own."""
    assert_same_logits(run_scenario(MeshModel(model_dir, ParallelConfig(pp=2), Kernels("tpu", interpret=True))), truth)


@pytest.mark.parametrize("family,parallel", [
    ("gemma2", ParallelConfig(pp=2)),  # sliding / global alternating: a whole period per stage, windows and soft-caps
    ("qwen2_moe", ParallelConfig(pp=2, ep=2)),  # experts split over expert inside each stage
], ids=lambda x: x if isinstance(x, str) else mesh_id(x))
def test_other_families_in_a_pipeline_match_one_device(tmp_path, family, parallel):
    save_hf_model(family, tmp_path, **SHAPES, num_hidden_layers=4)
    assert_same_logits(run_scenario(MeshModel(tmp_path, parallel)), run_scenario(MeshModel(tmp_path, ParallelConfig())))


def test_stages_whose_layers_differ_are_refused(tmp_path):
    """Gemma 2 with 6 layers on 2 stages: stage 0 starts with a sliding layer, stage 1 with a global one."""
    save_hf_model("gemma2", tmp_path, **SHAPES, num_hidden_layers=6)
    with pytest.raises(ConfigError, match="layer 3 differs from layer 0 of the first stage"):
        MeshModel(tmp_path, ParallelConfig(pp=2))

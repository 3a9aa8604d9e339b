"""A model on a device mesh computes the logits it computes on one device.

Tiny dense (Llama, GQA 8:2) and MoE (Qwen2-MoE: 8 experts, top-2, a shared expert) models, saved
by transformers and loaded through the sharded loader, run the same steps on one device and on
meshes of the 8 CPU devices (tests/conftest.py): a ragged prefill of four prompts, three decode
steps, and a prompt prefilled in two chunks beside those decodes, through the paged cache. Every
logits row must match the one-device run to a relative error of 1e-5. With several replicas
(data parallelism; the expert axis also counts as one) the sequences are dealt out to them, each
replica with its own pages.
"""

from __future__ import annotations

from collections import Counter

import pytest

from jaxinfer.ops.batch import SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kernels import Kernels
from mesh_model import BUCKETS, KEY, PAGE_SIZE, REL_TOL, SHAPES, MeshModel, assert_same_logits, mesh_id, run_scenario
from sharding.hlo import split_by_layer_loop
from sharding.mesh import ParallelConfig
from tiny_models import save_hf_model, save_mxfp4_gpt_oss


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dense")
    save_hf_model("llama2", directory, **SHAPES)
    return directory


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe")
    save_hf_model("qwen2_moe", directory, **SHAPES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)
    return directory


@pytest.fixture(scope="module")
def dense_truth(dense_dir):
    return run_scenario(MeshModel(dense_dir, ParallelConfig()))


@pytest.fixture(scope="module")
def moe_truth(moe_dir):
    return run_scenario(MeshModel(moe_dir, ParallelConfig()))


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tp=2), ParallelConfig(tp=4), ParallelConfig(tp=8),
    ParallelConfig(dp=2), ParallelConfig(dp=2, tp=4),
    ParallelConfig(sp=2), ParallelConfig(sp=4, sp_attention="ring"),
], ids=mesh_id)
def test_dense_model_on_a_mesh_matches_one_device(dense_dir, dense_truth, parallel):
    assert_same_logits(run_scenario(MeshModel(dense_dir, parallel)), dense_truth)


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tp=2), ParallelConfig(tp=4), ParallelConfig(tp=8),
    ParallelConfig(dp=2),
    ParallelConfig(sp=4, sp_attention="ring"), ParallelConfig(sp=2),
    ParallelConfig(ep=2), ParallelConfig(ep=4), ParallelConfig(ep=8),
    ParallelConfig(tp=2, ep=4), ParallelConfig(tp=4, ep=2), ParallelConfig(dp=2, tp=4),
], ids=mesh_id)
def test_moe_model_on_a_mesh_matches_one_device(moe_dir, moe_truth, parallel):
    assert_same_logits(run_scenario(MeshModel(moe_dir, parallel)), moe_truth)


@pytest.mark.parametrize("family,parallel", [
    ("gpt_oss", ParallelConfig(tp=2, ep=2)),  # sinks split with the heads; expert biases; the down bias added once
    ("gpt_oss", ParallelConfig(sp=2)),  # sinks with the step's rows split (all-gathered K/V)
    ("olmo2", ParallelConfig(tp=2)),  # q/k norms over the whole projection: the sum of squares spans the shards
    ("glm4_moe", ParallelConfig(tp=2, ep=2)),  # a dense first layer, then grouped routing and an ungated shared expert
    # global layers of their own shape (2 KV heads on 4 shards: replicated), pages of 4 times the
    # tokens in the sliding groups, KV-shared layers, per-layer inputs, experts beside the MLP
    ("gemma4", ParallelConfig(tp=4, ep=2)),
    # multi-head latent attention: query heads and their K/V up-projections split, the latent row
    # (one KV head) on every shard; DeepSeekMoE's experts split
    ("deepseek_v3", ParallelConfig(tp=2, ep=2)),
    ("deepseek_v2", ParallelConfig(tp=2)),  # one q_proj (no q_lora_rank), split by heads
    ("glm_moe_dsa", ParallelConfig(tp=2, dp=2)),  # sparse attention: the indexer whole on every shard, the same picks
    # Gated DeltaNet: key and value heads (and their convolution channels, recurrent states) split
    # over the shards, each replica's state slots its own; experts split
    ("qwen3_next", ParallelConfig(tp=2, ep=2)),
    ("qwen3_5_text", ParallelConfig(tp=2, dp=2)),
], ids=lambda x: x if isinstance(x, str) else mesh_id(x))
def test_newer_families_on_a_mesh_match_one_device(tmp_path, family, parallel):
    extra = dict(num_key_value_heads=4) if family == "olmo2" else {}
    save_hf_model(family, tmp_path, **{**SHAPES, **extra})
    # Gemma 4 renormalises every branch's output (post-norms, per-layer inputs) and so amplifies the
    # shards' float32 rounding: 2e-6 to 1.7e-5 of the largest logit over seeds and meshes, no row apart
    rel_tol = 5e-5 if family == "gemma4" else REL_TOL
    assert_same_logits(run_scenario(MeshModel(tmp_path, parallel)), run_scenario(MeshModel(tmp_path, ParallelConfig())), rel_tol)


def test_mxfp4_experts_split_over_experts_match_one_device(tmp_path):
    """GPT-OSS with its experts kept 4-bit: each device holds its experts' E2M1 bytes and
    exponents, the (token, expert) pairs travel to them and through the grouped matmul (the TPU
    kernel here, interpret mode; empty rows of the exchange buffers included)."""
    import functools

    from pallas_kernels.grouped_matmul import tpu as grouped_tpu

    save_mxfp4_gpt_oss(tmp_path, **SHAPES)
    grouped = Kernels(grouped_matmul=functools.partial(grouped_tpu.grouped_quantized_matmul, interpret=True))
    model = MeshModel(tmp_path, ParallelConfig(ep=2, dp=2), grouped)
    experts = model.params["layers"]["experts_gate_up"].get_value()
    assert experts.mode == "mxfp4" and experts.qweight.sharding.shard_shape(experts.qweight.shape)[1] == 2  # 4 experts / ep 2
    assert_same_logits(run_scenario(model), run_scenario(MeshModel(tmp_path, ParallelConfig())))


@pytest.mark.parametrize("platform,parallel", [
    ("tpu", ParallelConfig(dp=2, tp=2)), ("gpu", ParallelConfig(dp=2, tp=2)), ("tpu", ParallelConfig(sp=2, sp_attention="ring")),
], ids=lambda x: x if isinstance(x, str) else mesh_id(x))
def test_pallas_kernels_run_per_device_on_a_mesh(dense_dir, dense_truth, platform, parallel):
    """The kernels (interpret mode here) see one device's heads and one replica's pages; with the
    TPU kernels the pool is combined (one row of K and V per token, head_dim 8 stored in 64 lanes
    each), split into whole heads per device, which the sequence-parallel ring writes into and
    reads its cached prefix from."""
    model = MeshModel(dense_dir, parallel, Kernels(platform, interpret=True))
    if platform == "tpu":
        assert model.kv.combined and model.kv.kv.shape[-1] == model.config.num_kv_heads * 2 * 64
    assert_same_logits(run_scenario(model), dense_truth)


def compiled_collectives(model_dir, parallel: ParallelConfig) -> tuple[Counter, Counter, list]:
    """(collectives in the layer loop's body, those outside it, all of them) of the compiled forward."""
    model = MeshModel(model_dir, parallel)
    per_replica = [pack_batch([SequenceChunk([5, 6, 7], 0, [[1]], [2])], BUCKETS, PAGE_SIZE, KEY)[1]] * model.replicas
    batch = model.step.place_inputs(stack_replicas(per_replica))
    hlo = model.step._forward.lower(model.params, model.kv, batch, query_block=KEY.query_block).compile().as_text()
    in_loop, outside = split_by_layer_loop(hlo)
    return Counter(op.kind for op in in_loop), Counter(op.kind for op in outside), in_loop + outside


def test_tensor_parallel_layers_do_two_all_reduces_each(dense_dir):
    """Megatron: column-parallel QKV and gate/up, row-parallel o and down, so one all-reduce of the
    [T, H] activations after o and one after down per layer; per step an all-gather of the
    embedded tokens (the table is split on H) and an all-reduce of the logits."""
    in_layer, outside, ops = compiled_collectives(dense_dir, ParallelConfig(tp=4))
    assert in_layer == Counter({"all-reduce": 2})
    assert outside == Counter({"all-gather": 1, "all-reduce": 1})
    T, H = KEY.num_tokens, SHAPES["hidden_size"]
    assert [op.bytes for op in ops[:2]] == [T * H * 4] * 2  # float32 [T, H]


def test_one_device_runs_no_collectives(dense_dir):
    assert compiled_collectives(dense_dir, ParallelConfig())[2] == []


def test_expert_parallel_layers_dispatch_with_all_to_all(moe_dir):
    """Per MoE layer, over the expert axis: an all-gather of who sends how many pairs to whom, then
    three exchanges (rows and their expert ids out, results back); the CPU's stand-in for the ragged
    all-to-all is a padded one plus one of where each block lands (the outward trip's shared by
    rows and ids): five all-to-alls (sharding.expert_parallel). The tensor axis' two all-reduces
    (attention, MLP); per step the logits are gathered from the 4 replicas the expert axis makes."""
    in_layer, outside, _ = compiled_collectives(moe_dir, ParallelConfig(tp=2, ep=4))
    assert in_layer == Counter({"all-to-all": 5, "all-gather": 1, "all-reduce": 2})
    assert outside == Counter({"all-gather": 2, "all-reduce": 1})

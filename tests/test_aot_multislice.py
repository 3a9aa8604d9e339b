"""Several TPU slices joined by DCN, compiled on this CPU with libtpu (jaxinfer.aot, `--num-slices`).

libtpu describes a multi-slice topology (`get_topology_desc(..., num_slices=2)`): every device
carries its `slice_index`, and what crosses slices is compiled into DCN transfers, which
sharding.hlo reads apart from the ICI collectives. The pipeline stages go across the slices
(stage i on slice i), everything else stays inside a slice.
"""

from __future__ import annotations

import json

import jax
import pytest

from jaxinfer.aot.plan import plan_deployment
from jaxinfer.aot.presets import read_model_config
from jaxinfer.aot.step_compile import AbstractStep, ServingShape
from jaxinfer.aot.targets import Chip, Target, TargetError, compile_target
from jaxinfer.cli import main
from jaxinfer.config import ModelConfig
from jaxinfer.ops.batch import BucketKey
from sharding.hlo import bytes_per_step, bytes_per_step_by_axis
from sharding.mesh import ParallelConfig

pytestmark = pytest.mark.usefixtures("no_persistent_compilation_cache")  # executables for described chips: conftest

# A small Llama of 4 layers (2 per stage at pp = 2), GQA 4 / 2 heads of 128.
SMALL = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def two_v5e_2x2():
    return compile_target("v5e:2x2", num_slices=2)


def test_a_two_slice_topology_lays_the_outer_axes_across_the_slices(two_v5e_2x2):
    t = two_v5e_2x2
    assert t.num_chips == 8 and t.num_slices == 2 and t.chips_per_slice == 4
    assert [d.slice_index for d in t.devices] == [0] * 4 + [1] * 4
    assert "2 slices over DCN" in t.describe()
    stages = t.mesh_devices(ParallelConfig(pp=2, tp=4))  # stage i on slice i
    assert [d.slice_index for d in stages] == [0] * 4 + [1] * 4
    fewer = t.mesh_devices(ParallelConfig(pp=2, tp=2))  # as many chips of each slice
    assert [d.slice_index for d in fewer] == [0, 0, 1, 1]
    assert [d.slice_index for d in t.mesh_devices(ParallelConfig(dp=2, tp=4))] == [0] * 4 + [1] * 4
    with pytest.raises(TargetError, match=r"pipeline_parallel_size=3 must be a multiple of the 2 slices or divide them"):
        t.mesh_devices(ParallelConfig(pp=3, tp=2))
    with pytest.raises(TargetError, match=r"only the pipeline and data axes may cross slices .* -pp 2"):
        t.mesh_devices(ParallelConfig(tp=8))
    with pytest.raises(TargetError, match="several slices over DCN are a TPU topology"):
        compile_target("h100", num_slices=2)
    assert [d.slice_index for d in compile_target("v5e-2", num_slices=2).devices] == [0, 0, 1, 1]


def test_data_parallel_replicas_over_two_slices_send_nothing_over_dcn(two_v5e_2x2):
    config = ModelConfig.from_hf_dict(SMALL, source="test")
    step = AbstractStep.build(config, two_v5e_2x2, ParallelConfig(dp=2, tp=4),
                              ServingShape(max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=2))
    links = bytes_per_step(step.compile(step.buckets.all_keys()[0]).as_text())
    assert links["dcn"] == {} and links["ici"]["all-reduce"] > 0  # tensor parallelism inside each slice


def test_aot_compiles_a_pipelined_70b_step_on_a_two_slice_v5e_topology():
    """Llama-3.1-70B (all 80 layers: the layer loop compiles once, ~5 s) over two v5e-8 slices,
    pp = 2 x tp = 8: each slice holds one stage's 40 layers, and only the stage-to-stage
    activations and the last stage's rows cross DCN."""
    config = read_model_config("llama-3.1-70b")
    target = compile_target("v5e:2x4", num_slices=2)
    parallel = ParallelConfig(pp=2, tp=8)
    step = AbstractStep.build(config, target, parallel, ServingShape(max_model_len=4096, max_num_seqs=8,
                                                                     max_num_batched_tokens=8, num_pages=256))
    for stage in range(2):  # stage i on slice i
        assert {d.slice_index for d in step.mesh.devices[stage].flat} == {stage}
    qkv = step.params["layers"]["qkv_proj"].get_value()
    assert qkv.sharding.shard_shape(qkv.shape)[0] == 40, "a chip holds its stage's 40 layers"
    assert step.kv.pages.sharding.shard_shape(step.kv.pages.shape)[0] == 40, "... and their KV slots"
    one_stage = AbstractStep.build(config, compile_target("v5e:2x4"), ParallelConfig(tp=8), step.shape)
    assert step.weight_bytes_per_chip() < 0.6 * one_stage.weight_bytes_per_chip()  # the layers halved; embedding, LM head kept
    decode = max((k for k in step.buckets.all_keys() if k.query_block == 1), key=lambda k: k.num_tokens)
    compiled = step.compile(decode)
    links = bytes_per_step(compiled.as_text())
    H, T, pp = config.hidden_size, decode.num_tokens, parallel.pp
    # hidden and residual of a micro-batch (T / pp rows, bf16) to the next stage, once per iteration,
    # each of the tp chips sending 1/tp of the columns (models.pipeline.hand_on)
    assert links["dcn"]["collective-permute"] == (2 * pp - 1) * 2 * (T // pp) * H * 2 // parallel.tp
    assert set(links["dcn"]) <= {"collective-permute", "all-reduce"}  # + the last stage's rows, broadcast
    assert links["ici"]["all-reduce"] >= 2 * config.num_layers // pp * (T // pp) * H * 2  # Megatron's, inside a slice
    assert compiled.memory_analysis().argument_size_in_bytes < target.chip.hbm_bytes


def test_aot_cli_prints_the_dcn_and_ici_bytes_of_a_pipeline_over_two_slices(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    args = ["aot", "--model", str(tmp_path / "config.json"), "--topology", "v5e:2x2", "--num-slices", "2", "-pp", "2",
            "-tp", "4", "--max-model-len", "1024", "--max-num-seqs", "2", "--max-num-batched-tokens", "2", "-j", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("# v5e:2x2 x 2 slices over DCN (8 chips)")
    assert "Pipeline: 2 stages of 2 layers (one per slice)" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 | 2 | 2 | decode | ") and "collective-permute" in line]
    assert rows, out
    # T = 2: micro-batches of one row, hidden and residual [1, 512] bf16, 3 iterations, 1/4 per chip (tp 4)
    assert "collective-permute 1.5 KiB" in rows[0]


def test_plan_refuses_a_pipeline_that_does_not_split_over_the_slices(two_v5e_2x2):
    config = ModelConfig.from_hf_dict(SMALL, source="test")
    with pytest.raises(TargetError, match="pipeline_parallel_size=3 must be a multiple of the 2 slices"):
        plan_deployment(config, two_v5e_2x2, ParallelConfig(pp=3, tp=2), ServingShape(max_model_len=1024, max_num_seqs=2))


def test_collectives_are_filed_by_the_mesh_axes_they_cross():
    """scripts/comm_model.py's table: the lowered step on 8 CPU devices (reference kernels), pp = 2 x tp = 2."""
    config = ModelConfig.from_hf_dict(SMALL, source="test")
    cpu = Target("reference", "4 CPU devices", jax.devices()[:4], Chip("cpu", 2**40, 10**12))
    step = AbstractStep.build(config, cpu, ParallelConfig(pp=2, tp=2),
                              ServingShape(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=8, num_pages=16))
    hlo = step.lower(BucketKey(4, 4, 4, query_block=1)).compiler_ir("hlo").as_hlo_text()
    got = bytes_per_step_by_axis(hlo, dict(step.mesh.shape))
    H, T = config.hidden_size, 4
    # stage to stage: hidden and residual of a micro-batch (T / 2 rows, bf16), 3 iterations, half the
    # columns from each tensor shard, all-gathered over tensor on arrival
    assert got[("collective-permute", ("pipeline",), True)] == 3 * 2 * (T // 2) * H * 2 // 2
    assert got[("all-gather", ("tensor",), True)] >= 3 * 2 * (T // 2) * H * 2
    # Megatron's two all-reduces per layer: 2 layers per stage, run in each of the 3 iterations
    assert got[("all-reduce", ("tensor",), True)] == 3 * 2 * 2 * (T // 2) * H * 2
    assert ("all-reduce", ("pipeline",), False) in got  # the last stage's rows, broadcast

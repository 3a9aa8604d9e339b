"""Sharded loading: the tensor-parallel column layout, each device's block read straight from the
checkpoint, big stacked params placed a few layers at a time, and converted (orbax) checkpoints
restored onto other meshes."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from checkpoints_conv import ArraySource, load_params, plan_params, read_blocks
from jaxinfer.config import ModelConfig
from jaxinfer.models.param_layout import loader_spec, param_shapes, relayout_indices
from sharding.mesh import ParallelConfig, make_mesh

L, H, HQ, HKV, D, I, V = 2, 16, 8, 2, 4, 24, 32
CONFIG = ModelConfig(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=HQ,
                     num_kv_heads=HKV, head_dim=D, qkv_bias=True)
RNG = np.random.default_rng(0)


def hf_tensors() -> dict[str, np.ndarray]:
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
              p + "self_attn.q_proj.weight": (HQ * D, H), p + "self_attn.k_proj.weight": (HKV * D, H),
              p + "self_attn.v_proj.weight": (HKV * D, H), p + "self_attn.o_proj.weight": (H, HQ * D),
              p + "self_attn.q_proj.bias": (HQ * D,), p + "self_attn.k_proj.bias": (HKV * D,), p + "self_attn.v_proj.bias": (HKV * D,),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)}
    return {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in t.items()}


HF = hf_tensors()


def load(tp: int, **kw):
    return load_params(HF, loader_spec(CONFIG, np.float32, tp), model_type="llama", source="ckpt", progress=False, **kw)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_columns_are_laid_out_shard_by_shard(tp):
    """qkv_proj = [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]: shard t holds its HQ/tp query heads and
    the KV heads they use (with tp > HKV each KV head is stored on tp / HKV shards); gate_up_proj =
    [gate_0 | up_0 | gate_1 | up_1 | ...]. Each shard's columns are contiguous."""
    params = load(tp)
    q, k, v = (HF[f"model.layers.1.self_attn.{n}_proj.weight"].T for n in "qkv")  # [H, heads * D]
    gate, up = HF["model.layers.1.mlp.gate_proj.weight"].T, HF["model.layers.1.mlp.up_proj.weight"].T
    qkv_shards = np.split(params["layers.qkv_proj"][1], tp, axis=-1)
    gate_up_shards = np.split(params["layers.gate_up_proj"][1], tp, axis=-1)
    q_per, i_per = HQ // tp, I // tp
    for t in range(tp):
        kv_heads = range(t * HKV // tp, t * HKV // tp + 1) if tp > HKV else range(t * HKV // tp, (t + 1) * HKV // tp)
        cols = lambda heads: np.concatenate([np.arange(h * D, (h + 1) * D) for h in heads])  # noqa: E731
        want = np.concatenate([q[:, cols(range(t * q_per, (t + 1) * q_per))], k[:, cols(kv_heads)], v[:, cols(kv_heads)]], axis=1)
        np.testing.assert_array_equal(qkv_shards[t], want)
        np.testing.assert_array_equal(gate_up_shards[t], np.concatenate([gate[:, t * i_per:(t + 1) * i_per],
                                                                         up[:, t * i_per:(t + 1) * i_per]], axis=1))
    assert params["layers.qkv_proj"].shape == param_shapes(CONFIG, tp)["layers.qkv_proj"]


def test_relayout_moves_columns_between_tensor_parallel_degrees():
    for tp_from, tp_to in [(1, 4), (4, 1), (2, 8), (8, 2)]:
        source, target = load(tp_from), load(tp_to)
        for name, idx in relayout_indices(CONFIG, tp_from, tp_to).items():
            np.testing.assert_array_equal(np.take(source[name], idx, axis=-1), target[name])


def test_a_device_block_reads_only_its_rows_of_each_tensor():
    """The block of shard 1 of 4 of qkv_proj layer 0 reads q rows 8:16, k rows 0:4 and v rows 0:4 of
    the HF tensors, nothing else."""
    reads = []
    source = ArraySource(HF)
    read = lambda name, index: (reads.append((name, index)), source.read(name, index))[1]  # noqa: E731
    plans = plan_params(source.listing(), loader_spec(CONFIG, np.float32, 4), model_type="llama", source="ckpt")
    width = param_shapes(CONFIG, 4)["layers.qkv_proj"][-1] // 4
    [block] = read_blocks(plans["layers.qkv_proj"], [(slice(0, 1), slice(0, H), slice(width, 2 * width))], read)
    assert [(name.split(".")[-2], index[0]) for name, index in reads] == [
        ("q_proj", slice(8, 16)), ("k_proj", slice(0, 4)), ("v_proj", slice(0, 4))]
    np.testing.assert_array_equal(block[0], load(4)["layers.qkv_proj"][0][:, width:2 * width])


def test_placed_with_shardings_and_layer_by_layer_it_is_the_same_array():
    mesh = make_mesh(ParallelConfig(dp=2, tp=4))
    spec = {"layers.qkv_proj": P(None, None, "tensor"), "layers.o_proj": P(None, "tensor", None), "embed": P(None, "tensor")}
    shardings = {name: NamedSharding(mesh, spec.get(name, P())) for name in param_shapes(CONFIG, 4)}
    whole = load(4)
    for max_host_bytes in (1 << 30, 64):  # 64 bytes: every layer of every stacked param placed on its own
        placed = load(4, shardings=shardings, max_host_bytes=max_host_bytes)
        for name, array in placed.items():
            assert array.sharding == shardings[name], name
            np.testing.assert_array_equal(np.asarray(array), whole[name])

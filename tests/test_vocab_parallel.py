"""The vocabulary-split LM head (`lm_head_parallel="vocab"`, docs/parallelism.md).

Sampling on the vocabulary shards (`ops.sampling.Vocab`) equals the whole-vocabulary sampler for
every setting: random logits split over 4 fake CPU devices on the vocabulary (201 tokens: 4 does
not divide it, so the last shard has padding columns), the same seeds, the same tokens and
logprobs. And a tiny tied-embedding Llama on tp = 2 with the vocabulary-split head gives the
one-device logits and greedy tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import mesh_model
from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.ops.batch import SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.sampling import MAX_BANNED_IDS, MAX_TREE_CHILDREN, SamplingTensors, Vocab, sample
from jaxinfer.runtime.placement import param_partition_specs, put_global
from jaxinfer.runtime.step import StepFunction
from mesh_model import KEY, SHAPES, MeshModel, assert_same_logits, run_scenario
from sharding.hlo import collectives
from sharding.mesh import ParallelConfig
from tiny_models import save_hf_model

TP, V, R, K = 4, 201, 8, 3
WIDTH = -(-V // TP)  # columns per shard; the last shard's past V are padding


def _tensors(setting: str, rng: np.random.Generator, logits: jax.Array) -> SamplingTensors:
    random_rows = np.arange(R) % 4 != 0  # rows 0 and 4 greedy
    st = SamplingTensors(
        temperature=jnp.asarray(np.where(random_rows, rng.uniform(0.5, 1.5, R), 0.0), jnp.float32),
        top_k=jnp.zeros(R, jnp.int32), top_p=jnp.ones(R, jnp.float32),
        seed=jnp.asarray(rng.integers(0, 2**31, R), jnp.uint32), counter=jnp.asarray(rng.integers(0, 50, R), jnp.int32),
        target_ids=jnp.asarray(np.where(np.arange(R) == 3, 7, -1), jnp.int32))
    if setting == "temperature":
        return st
    if setting == "greedy":
        return dataclasses.replace(st, temperature=jnp.zeros(R, jnp.float32))
    if setting == "top_k":
        return dataclasses.replace(st, top_k=jnp.asarray(rng.integers(0, 20, R), jnp.int32))
    if setting == "top_p":
        return dataclasses.replace(st, top_p=jnp.asarray(rng.uniform(0.3, 1.0, R), jnp.float32),
                                   top_k=jnp.asarray(np.where(np.arange(R) == 5, 30, 0), jnp.int32))
    if setting == "min_p":
        return dataclasses.replace(st, min_p=jnp.asarray(rng.uniform(0.0, 0.3, R), jnp.float32))
    if setting == "penalties":
        history = np.where(rng.random((R, 24)) < 0.8, rng.integers(0, V, (R, 24)), -1)
        return dataclasses.replace(
            st, history_ids=jnp.asarray(history, jnp.int32), num_prompt_history=jnp.asarray(rng.integers(0, 24, R), jnp.int32),
            repetition_penalty=jnp.asarray(rng.uniform(1.0, 2.0, R), jnp.float32),
            presence_penalty=jnp.asarray(rng.uniform(0.0, 1.0, R), jnp.float32),
            frequency_penalty=jnp.asarray(rng.uniform(0.0, 1.0, R), jnp.float32))
    if setting == "banned":
        banned = np.full((R, MAX_BANNED_IDS), -1)
        banned[:, :5] = rng.integers(0, V + 3, (R, 5))  # (ids past V are dropped)
        return dataclasses.replace(st, banned_ids=jnp.asarray(banned, jnp.int32))
    if setting == "allowed":
        words = -(-V // 32)
        mask = rng.integers(-(2**31), 2**31, (R, words))
        mask[1] = -1
        return dataclasses.replace(st, allowed_tokens=jnp.asarray(mask, jnp.int32))
    if setting == "logprobs":
        return dataclasses.replace(st, want_logprobs=jnp.ones(1, bool), top_k=jnp.asarray(rng.integers(0, 20, R), jnp.int32))
    if setting in ("draft", "draft_probs"):
        draft = np.where(np.arange(R) % 3 == 2, -1, rng.integers(0, V, R))
        draft[:4] = np.argsort(np.asarray(logits[:4]), axis=-1)[:, -1]  # likely tokens: some are accepted
        probs = None
        if setting == "draft_probs":
            probs = jnp.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=(R, V)) * 3, jnp.float32)), jnp.float32)
        return dataclasses.replace(st, draft_token=jnp.asarray(draft, jnp.int32), draft_probs=probs,
                                   return_probs=jnp.ones(1, bool))
    if setting == "tree":
        children = np.full((R, MAX_TREE_CHILDREN), -1)
        children[:6, :4] = rng.integers(0, V, (6, 4))
        children[:6, 1:3] = np.argsort(np.asarray(logits[:6]), axis=-1)[:, -3:-1]  # likely tokens: some are accepted
        return dataclasses.replace(st, tree_children=jnp.asarray(children, jnp.int32))
    raise ValueError(setting)


SETTINGS = ["greedy", "temperature", "top_k", "top_p", "min_p", "penalties", "banned", "allowed", "logprobs", "draft",
            "draft_probs", "tree"]


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:TP]), ("tensor",))


def _split_sample(mesh, logits, st):
    """The sampler on vocabulary shards: logits padded to TP * WIDTH (junk in the padding) and split."""
    padded = jnp.concatenate([logits, jnp.full((R, TP * WIDTH - V), 1e4, jnp.float32)], axis=1)
    return jax.jit(jax.shard_map(
        lambda lg, s: sample(lg, s, K, vocab=Vocab(V, "tensor")), mesh=mesh,
        in_specs=(PartitionSpec(None, "tensor"), PartitionSpec()), out_specs=PartitionSpec(), check_vma=False))(padded, st)


@pytest.mark.parametrize("setting", SETTINGS)
def test_split_sampler_equals_the_whole_vocabulary_sampler(mesh, setting):
    rng = np.random.default_rng(SETTINGS.index(setting))
    logits = jnp.asarray(rng.normal(size=(R, V)) * 3, jnp.float32)
    st = _tensors(setting, rng, logits)
    want = jax.jit(lambda lg, s: sample(lg, s, K))(logits, st)
    got = _split_sample(mesh, logits, st)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))
    np.testing.assert_allclose(np.asarray(got.top_logprobs), np.asarray(want.top_logprobs), atol=1e-5)
    for field in ("accepted", "accepted_child"):
        if getattr(want, field) is not None:
            assert np.any(np.asarray(getattr(want, field)) > 0)  # (some row accepts its draft)
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
    if want.probs is not None:
        np.testing.assert_allclose(np.asarray(got.probs), np.asarray(want.probs), atol=1e-6)
    assert np.all(np.asarray(got.tokens) < V)


# ---------------------------------------------------------------- end to end: a tied-embedding Llama


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tied")
    save_hf_model("llama3.2", directory, **SHAPES, vocab_size=260)  # tied embeddings; 260 = 2 x 130
    return directory


def _model(model_dir, parallel: ParallelConfig, lm_head_parallel: str) -> MeshModel:
    """MeshModel with the embedding / LM head laid out as `lm_head_parallel` says, a token buffer
    as wide as the bucket's rows (for the serving step)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mesh_model, "param_partition_specs",
                      lambda params, config: param_partition_specs(params, config, lm_head_parallel))
        patch.setattr(mesh_model, "StepFunction", functools.partial(StepFunction, max_rows=KEY.num_tokens))
        model = MeshModel(model_dir, parallel)
    model.params = put_global(model.params, model.step.param_specs, model.mesh)
    return model


def _greedy_tokens(model: MeshModel) -> tuple[np.ndarray, np.ndarray]:
    """The serving step (model program, then the sampler) on a prefill of two prompts: (greedy
    tokens, their logprobs) of the requested rows."""
    chunks = [SequenceChunk([5, 9, 30, 200, 7], 0, model.allocate(0, 5), [2, 4]),
              SequenceChunk([100, 3, 259], 0, model.allocate(0, 3), [0, 1, 2])]
    batch, rows = pack_batch(chunks, model.buckets, model.page_sizes, KEY)[1:]
    batch = model.step.place_inputs(stack_replicas([batch]))
    n = KEY.num_logits
    st = SamplingTensors(jnp.zeros((1, n), jnp.float32), jnp.zeros((1, n), jnp.int32), jnp.ones((1, n), jnp.float32),
                         jnp.zeros((1, n), jnp.uint32), jnp.zeros((1, n), jnp.int32), jnp.full((1, n), -1, jnp.int32))
    prev = model.step.place_inputs(np.zeros((1, KEY.num_tokens), np.int32))
    out, _, model.kv, _ = model.step(model.params, model.kv, batch, model.step.place_inputs(st), prev,
                                     query_block=KEY.query_block)
    rows = [r for chunk_rows in rows for r in chunk_rows]
    return np.asarray(out.tokens)[0][rows], np.asarray(out.logprobs)[0][rows]


def test_tied_llama_with_the_vocabulary_split_head_matches_one_device(tied_dir):
    truth = _model(tied_dir, ParallelConfig(), "hidden")
    split = _model(tied_dir, ParallelConfig(tp=2), "vocab")
    assert split.step.vocab_split and not truth.step.vocab_split
    assert split.params["embed"].get_value().sharding.spec[0] == "tensor"  # [V, H] split on the vocabulary
    assert_same_logits(run_scenario(split), run_scenario(truth))
    # the model program: no all-reduce of the [R, V] logits, no all-gather of the embedded tokens
    batch = split.step.place_inputs(stack_replicas([pack_batch([SequenceChunk([5, 9], 0, split.allocate(0, 2), [1])],
                                                               split.buckets, split.page_sizes, KEY)[1]]))
    prev = split.step.place_inputs(np.zeros((1, KEY.num_tokens), np.int32))
    ops = collectives(split.step.lower(split.params, split.kv, batch, prev, KEY).compiler_ir("hlo").as_hlo_text())
    assert {op.kind for op in ops} == {"all-reduce"} and all(op.bytes < KEY.num_logits * 260 * 4 for op in ops), ops
    truth, split = _model(tied_dir, ParallelConfig(), "hidden"), _model(tied_dir, ParallelConfig(tp=2), "vocab")
    (want, want_lp), (got, got_lp) = _greedy_tokens(truth), _greedy_tokens(split)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5)


def test_the_switch_is_checked():
    with pytest.raises(ValueError, match="lm_head_parallel='rows'"):
        EngineConfig(model="unused", lm_head_parallel="rows")
    config = EngineConfig(model="unused", tensor_parallel_size=2, lm_head_parallel="vocab")
    model = ModelConfig(model_type="llama", vocab_size=259, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                        num_kv_heads=2, head_dim=8, rope_theta=1e4, max_position_embeddings=256)
    with pytest.raises(ValueError, match="does not divide the vocabulary"):
        config.resolved(model)
    config.resolved(dataclasses.replace(model, vocab_size=260))

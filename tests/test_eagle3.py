"""EAGLE-3 heads in the published format as a speculative proposer (method "eagle3").

A tiny random Llama (transformers, saved locally; a vocabulary of 32 so that a random head's
guesses are sometimes right) and a random EAGLE-3 head written in the published format with a
draft vocabulary of 24 of those 32 ids. The reference is plain numpy (float64) of the published
formulas, fed with transformers' hidden states of the target (hidden_states[i] is the stream at
the input of layer i). Greedy text equals transformers' greedy text whatever the drafts; sampled
continuations keep the target's distribution.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from scipy import stats

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk
from jaxinfer.engine.eagle3 import Eagle3Proposer
from jaxinfer.engine.spec_decode import SpecConfigError, SpeculativeConfig, tree_parents
from jaxinfer.models.eagle3 import (eagle3_spec, head_config_dict, init_eagle3, internal_params, published_tensors,
                                    read_eagle3_config, read_eagle3_tensors, save_eagle3)
from jaxinfer.ops.batch import SequenceChunk, fresh_pages
from jaxinfer.runtime.evaluate import stream_states
from jaxinfer.training.eagle3 import draft_vocabulary, pack, train_eagle3
from test_spec_decode import target_distribution
from tiny_models import save_hf_model

V, DRAFT_V, LAYERS = 32, 24, 5
AUX = (1, 2, 3)  # the target layers whose input streams the head reads (its eagle_config)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False)


def write_head(path, target_config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A random head over the target (2 query heads of 24 dims: not the target's shapes), its draft
    vocabulary a random 24 of the 32 ids; returns its published tensors."""
    d = head_config_dict(target_config, draft_vocab=DRAFT_V, num_heads=2, num_kv_heads=1, head_dim=24, intermediate_size=80,
                         aux_layers=AUX)
    spec = eagle3_spec(d, target_config)
    draft_ids = np.sort(np.random.default_rng(seed).choice(V, DRAFT_V, replace=False))
    tensors = published_tensors(init_eagle3(spec, draft_ids, seed=seed, scale=2.0), spec)
    save_eagle3(path, d, tensors)
    return tensors


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    target_dir, head_dir = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("eagle3")
    hf = save_hf_model("llama2", target_dir, vocab_size=V, num_hidden_layers=LAYERS)
    write_head(head_dir, ModelConfig.from_hf_dict(json.loads((target_dir / "config.json").read_text())))
    llm = LLM(str(target_dir), max_model_len=48, page_size=4, num_pages=256, max_num_batched_tokens=32, max_num_seqs=32,
              speculative_config={"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2}, progress=False)
    return target_dir, head_dir, hf, llm


# ------------------------------------------------------------------------------ the numpy reference
def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta):  # x [T, heads, D], rotate-half
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rotated = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rotated * sin


def reference_head(t: dict, cfg: dict, embed: np.ndarray, aux: np.ndarray, next_tokens: list[int], guesses: list[int] = ()):
    """The head's draft log-probabilities (over the target's 32 ids, -inf outside the draft
    vocabulary): rows 0 .. n - 1 at positions 0 .. n - 1 read aux[p] and next_tokens[p]; then one
    more row per guess, reading the guess and the previous row's pre-norm output. [n + len(guesses), V]."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, Hq, Hkv, D = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    xs = list(aux.astype(np.float64) @ t["fc.weight"].T)  # x per row
    tokens = list(next_tokens)
    a = "midlayer.self_attn."
    for step in range(len(guesses) + 1):
        n = len(xs)
        x, e = np.stack(xs), embed[np.asarray(tokens)].astype(np.float64)
        h = np.concatenate([rms(e, t["midlayer.input_layernorm.weight"], eps), rms(x, t["midlayer.hidden_norm.weight"], eps)], -1)
        q = rope((h @ t[a + "q_proj.weight"].T).reshape(n, Hq, D), np.arange(n), cfg["rope_theta"])
        k = rope((h @ t[a + "k_proj.weight"].T).reshape(n, Hkv, D), np.arange(n), cfg["rope_theta"])
        v = (h @ t[a + "v_proj.weight"].T).reshape(n, Hkv, D)
        k, v = np.repeat(k, Hq // Hkv, 1), np.repeat(v, Hq // Hkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) + np.triu(np.full((n, n), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        y = x + np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(n, Hq * D) @ t[a + "o_proj.weight"].T
        m = rms(y, t["midlayer.post_attention_layernorm.weight"], eps)
        g, u = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
        out = y + (g / (1 + np.exp(-g)) * u) @ t["midlayer.mlp.down_proj.weight"].T  # the pre-norm output
        if step < len(guesses):
            xs.append(out[-1])
            tokens.append(guesses[step])
    logits = rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [n, Vd]
    full = np.full((len(xs), V), -np.inf)
    full[:, np.arange(DRAFT_V) + t["d2t"].astype(np.int64)] = logits
    return full - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)


def target_aux(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: the input of layer i
    return np.concatenate([hs[i][0].double().numpy() for i in AUX], -1)


def plain_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' argmax chain, EOS allowed (hf.generate's min_new_tokens would mask it)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def load_head(head_dir):
    cfg = json.loads((head_dir / "config.json").read_text())
    return cfg, load_file(str(head_dir / "model.safetensors"))


# ------------------------------------------------------------------------------ tests
def test_the_folder_round_trips_and_a_malformed_one_is_refused(eagle, tmp_path):
    target_dir, head_dir, _, _ = eagle
    target = ModelConfig.from_hf_dict(json.loads((target_dir / "config.json").read_text()))
    spec = read_eagle3_config(head_dir, target)
    assert spec.aux_layers == AUX and spec.draft_vocab == DRAFT_V and not spec.has_embed
    cfg, saved = load_head(head_dir)
    tensors = read_eagle3_tensors(head_dir, spec)
    again = published_tensors(internal_params(tensors), spec)
    assert sorted(again) == sorted(saved)
    for name in saved:
        np.testing.assert_array_equal(again[name], saved[name], err_msg=name)
    assert saved["t2d"].sum() == DRAFT_V and saved["d2t"].dtype == np.int64

    def broken(change, **extra):
        bad = {k: v for k, v in saved.items()}
        change(bad)
        save_eagle3(tmp_path / "bad", {**cfg, **extra}, bad)
        return read_eagle3_tensors(tmp_path / "bad", read_eagle3_config(tmp_path / "bad", target))

    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        broken(lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 128\)"):
        broken(lambda t: t.update({"fc.weight": t["fc.weight"][:, :128]}))
    with pytest.raises(ValueError, match="vocab_size=33"):
        broken(lambda t: None, vocab_size=33)
    with pytest.raises(ValueError, match="aux hidden-state layers"):
        broken(lambda t: None, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})
    with pytest.raises(SpecConfigError, match="'eagle3' needs 'model'"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2})


def test_the_head_scores_as_the_reference_from_the_targets_own_step(eagle):
    """Every row of a prompt and a chained guess: the head's log-probabilities (from the target
    step's aux streams, on the device) equal the numpy reference's."""
    _, head_dir, hf, llm = eagle
    cfg, t = load_head(head_dir)
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    ids = [int(x) for x in np.random.default_rng(3).integers(3, V, 12)]
    draft_ids = np.arange(DRAFT_V) + t["d2t"]
    scored_ids = [int(draft_ids[i % DRAFT_V]) for i in range(len(ids) - 1)]  # a draft-vocabulary id per row
    pages, n = fresh_pages(1, 4), len(ids) - 1
    target = llm.runner.dispatch([[ScheduledChunk(SequenceChunk(ids, 0, pages, [n]), RowSampling())]])
    head = llm.engine.proposer.runner
    scored = ScheduledChunk(SequenceChunk(ids[1:], 0, pages, list(range(n)), hidden_src=list(range(n))),
                            RowSampling(target_ids=scored_ids))
    first = head.dispatch([[scored]], want_logprobs=True, stream=target.stream)
    # one chained guess at position n: token g, the head's own stream of row n - 1
    g = int(draft_ids[5])
    chained = ScheduledChunk(SequenceChunk([g], n, pages, [0], hidden_src=[n - 1]), RowSampling(target_ids=[scored_ids[0]]))
    head.collect(first)
    head.collect(head.dispatch([[chained]], want_logprobs=True, stream=first.stream))
    llm.runner.collect(target)
    want = reference_head(t, cfg, embed, target_aux(hf, ids)[:n], ids[1:], [g])
    np.testing.assert_allclose([row.logprob for row in scored.results], want[np.arange(n), scored_ids], atol=2e-4)
    np.testing.assert_allclose(chained.results[0].logprob, want[n, scored_ids[0]], atol=2e-4)


def test_greedy_text_equals_transformers(eagle):
    _, _, hf, llm = eagle
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, V, n)] for n in (3, 9, 17, 6)]
    before = llm.engine.get_stats()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == [plain_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    stats_ = llm.engine.get_stats()
    assert stats_.num_draft_tokens > before.num_draft_tokens


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_sampled_continuations_keep_the_targets_distribution(eagle, drafts, request):
    """Three-token continuations (top 3 at temperature 0.9) of one prompt, each request alone,
    against the target's own probabilities of the 27 cells (chi-square): with chains (the head's
    sampled drafts, rejection sampling against their q) and with a static tree (the head's ranked
    guesses as one-hot proposals, multi-draft rejection sampling)."""
    llm = eagle[3] if drafts == "chain" else request.getfixturevalue("trees")
    temperature, top_k, samples = 0.9, 3, 800
    # (a prompt where the random head's ranked guesses are sometimes in the target's top 3: with
    # max_tokens 3 a tree is cut to its first node, the head's top guess, never a sampled one)
    prompt = [int(t) for t in np.random.default_rng(7 if drafts == "chain" else 25).integers(3, V, 6)]
    truth = target_distribution(llm, prompt, temperature, top_k)
    before = llm.engine.get_stats()
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i, detokenize=False)
              for i in range(samples)]
    counts = {key: 0 for key in truth}
    for out in llm.generate([prompt] * samples, params, use_tqdm=False):
        counts[tuple(out.outputs[0].token_ids)] += 1  # a continuation outside the top-3 support would raise
    after = llm.engine.get_stats()
    assert after.num_draft_tokens - before.num_draft_tokens >= samples  # every second token was a draft
    assert after.num_accepted_tokens > before.num_accepted_tokens
    keys = sorted(truth)
    assert stats.chisquare([counts[k] for k in keys], [truth[k] * samples for k in keys]).pvalue > 1e-3


def test_the_trainer_reads_the_targets_aux_streams_and_writes_a_loadable_head(eagle, tmp_path):
    """`stream_states` (the target's program with return_stream=layers) equals transformers' hidden
    states at the inputs of those layers; a few optax steps on them give a head the engine loads."""
    target_dir, head_dir, hf, llm = eagle
    spec = read_eagle3_config(head_dir, llm.config)
    rng = np.random.default_rng(2)
    texts = [rng.integers(3, V, n).astype(np.int32) for n in (12, 9, 14)]
    aux = [stream_states(llm.config, llm.runner.graphdef, llm.runner.params, list(t), AUX) for t in texts]
    np.testing.assert_allclose(aux[0], target_aux(hf, list(texts[0])), atol=1e-4)
    tokens, states = pack(texts, aux, 14)
    draft_ids = draft_vocabulary(texts, V, DRAFT_V)
    losses = []
    params = train_eagle3(spec, hf.model.embed_tokens.weight.detach().numpy(), tokens, states, draft_ids, steps=4,
                          batch_size=3, learning_rate=1e-2, log=lambda step, loss, acc: losses.append(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    save_eagle3(tmp_path / "trained", json.loads((head_dir / "config.json").read_text()), published_tensors(params, spec))
    again = internal_params(read_eagle3_tensors(tmp_path / "trained", spec))
    np.testing.assert_array_equal(again["draft_ids"], draft_ids)
    np.testing.assert_allclose(again["fc"], np.asarray(params["fc"]), rtol=1e-6)


# ------------------------------------------------------------------------------ draft trees
# ten first guesses (a random head's are right now and then), two second ones and a third
TREE = [(r,) for r in range(10)] + [(0, 0), (1, 0), (2, 0), (0, 0, 0)]  # breadth-first (parse_token_tree's order)


@pytest.fixture(scope="module")
def trees(eagle):
    target_dir, head_dir, _, _ = eagle
    return LLM(str(target_dir), max_model_len=48, page_size=4, num_pages=256, max_num_batched_tokens=32, max_num_seqs=32,
               speculative_config={"method": "eagle3", "model": str(head_dir), "speculative_token_tree": TREE},
               progress=False)


def record_drafts(proposer, monkeypatch, nodes: int) -> list:
    """Spies on the proposer: (the sequence's tokens, its drafted tokens, their parents) per tree.
    It asks for whole trees of `nodes` nodes every step (the engine verifies the first k of them:
    its back-off's budget), so that every proposal has deep nodes to check."""
    seen, real = [], proposer.propose

    def spy(ctx, asked):
        drafts = real(ctx, [(seq, nodes) for seq, _ in asked])
        for i, (seq, _) in enumerate(asked):
            if drafts.tokens[i]:
                seen.append((list(seq.token_ids), drafts.tokens[i], drafts.parents[i]))
        return drafts

    monkeypatch.setattr(proposer, "propose", spy)
    return seen


def greedy_with_trees(llm, hf, prompts, levels: int):
    """Greedy text equals transformers'; the verifications held trees (more nodes than levels on
    average) and accepted some nodes."""
    before = llm.engine.get_stats()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == [plain_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    after = llm.engine.get_stats()
    verifications = after.num_spec_verifications - before.num_spec_verifications
    assert verifications > 0 and after.num_draft_tokens - before.num_draft_tokens > levels * verifications
    assert after.num_accepted_tokens > before.num_accepted_tokens


def ranked_by_reference(eagle, seen, check) -> int:
    """For recorded trees: each node's log-probabilities under the numpy reference's chain along
    its ancestors (from the target's own aux streams), passed to check(logp, node index); how
    many nodes were checked."""
    _, head_dir, hf, _ = eagle
    cfg, t = load_head(head_dir)
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    checked = 0
    for tokens, drafts, parents in seen:
        aux, of_parent = target_aux(hf, tokens)[: len(tokens) - 1], {}
        for i, token in enumerate(drafts):
            if parents[i] not in of_parent:  # (siblings share their parent's distribution)
                ancestors, node = [], parents[i]
                while node >= 0:
                    ancestors.insert(0, drafts[node])
                    node = parents[node]
                of_parent[parents[i]] = reference_head(t, cfg, embed, aux, tokens[1:], ancestors)[-1]
            check(of_parent[parents[i]], i, token, drafts, parents)
            checked += 1
    return checked


def test_static_trees_draft_the_heads_ranked_guesses_and_keep_greedy_text(eagle, trees, monkeypatch):
    """method "eagle3" with a static speculative_token_tree: greedy text equals transformers', the
    verifications hold whole trees, and node (.., r) is the head's r-th ranked guess after its
    ancestors: the numpy reference's chain along its path ranks it there (every module row at its
    tree position, seeing its ancestors, reading its parent's stream; the cache's prefix ingested
    after earlier tree verifications)."""
    _, _, hf, _ = eagle
    assert trees.engine.proposer.tree == tuple(TREE)
    seen = record_drafts(trees.engine.proposer, monkeypatch, len(TREE))
    rng = np.random.default_rng(5)
    greedy_with_trees(trees, hf, [[int(t) for t in rng.integers(3, V, n)] for n in (4, 11, 7)], levels=3)

    def check(logp, i, token, drafts, parents):
        assert parents == tree_parents(TREE)[: len(drafts)]
        assert abs(logp[token] - np.sort(logp)[::-1][TREE[i][-1]]) < 1e-3, (i, drafts)  # (ties: either)

    assert ranked_by_reference(eagle, seen, check) >= 30  # (the later ones after tree verifications)


def test_dynamic_trees_keep_greedy_text(eagle, trees, monkeypatch):
    """speculative_token_tree="dynamic" (EAGLE-2: tree_top_k children of the best nodes per level,
    the k best kept): greedy text equals transformers'; each node is among its parent's top_k
    under the reference; a tree holds at most k nodes, parents first."""
    _, _, hf, _ = eagle
    k, top_k, depth = len(TREE), 8, 3  # (k: the LLM's num_speculative_tokens, the node budget)
    proposer = Eagle3Proposer(trees.engine.proposer.runner, tree="dynamic", tree_top_k=top_k, tree_depth=depth)
    monkeypatch.setattr(trees.engine, "proposer", proposer)  # (the same LLM: its target steps verify trees already)
    seen = record_drafts(proposer, monkeypatch, k)
    rng = np.random.default_rng(8)
    greedy_with_trees(trees, hf, [[int(t) for t in rng.integers(3, V, n)] for n in (5, 13, 8)], levels=depth)

    def check(logp, i, token, drafts, parents):
        assert len(drafts) <= k and all(-1 <= p < j for j, p in enumerate(parents))
        assert logp[token] >= np.sort(logp)[::-1][top_k - 1] - 1e-3, (i, drafts)

    assert ranked_by_reference(eagle, seen, check) >= 30

"""Draft trees verified in one step (speculative decoding: `speculative_token_tree`).

Greedy: token for token what plain decoding gives, for static and dynamic trees drafted by
medusa and eagle heads (random heads: their drafts are sometimes right), and for a proposer that
knows the greedy text and puts the right tokens off the top-ranked branch (so accepted paths
leave it, and their K/V must move: the cache then holds what a plain forward of the tokens
writes). Sampling: the per-row multi-draft rejection sampler against exact enumeration, and its
output distribution against the target's. Bad configs are refused by name."""

from __future__ import annotations

import itertools
import types

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.engine.build import check_token_tree
from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk, empty_inputs, every_processor_sampling
from jaxinfer.engine.spec_decode import (Drafts, SpecConfigError, SpeculativeConfig, accepted_path, tree_children,
                                         tree_masks, tree_parents)
from jaxinfer.models.draft_heads import init_heads, save_heads
from jaxinfer.ops.batch import SequenceChunk
from jaxinfer.ops.sampling import SamplingTensors, processed_probs, sample
from tiny_models import save_hf_model

BASE = dict(max_model_len=96, page_size=4, max_num_seqs=8, num_pages=256, max_num_batched_tokens=64, progress=False)
STATIC = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]  # parents [-1, -1, 0, 0, 1, 2]


# ----------------------------------------------------------------------------- the tree's bookkeeping
def test_tree_structure_masks_and_the_accepted_path():
    config = SpeculativeConfig.from_dict({"method": "medusa", "model": "h", "speculative_token_tree": str(STATIC[::-1])})
    assert config.tree_paths == tuple(STATIC) and config.num_speculative_tokens == 6 and config.spec_block == 8
    parents = tree_parents(STATIC)
    assert parents == [-1, -1, 0, 0, 1, 2]
    assert tree_children(parents) == [[1, 2], [3, 4], [5], [6], [], [], []]  # per row (0: the root)
    assert tree_masks(parents) == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101, 0b1001011]
    assert accepted_path(parents, [1, -1, 0, -1, -1, -1, -1]) == [2, 5]  # root -> (1,) -> (1, 0)
    assert accepted_path(parents, [0, 0, -1, 0, -1, -1, -1]) == [1, 3, 6]
    dynamic = SpeculativeConfig.from_dict({"method": "eagle", "model": "h", "num_speculative_tokens": 10,
                                           "speculative_token_tree": "dynamic", "tree_top_k": 3})
    assert (dynamic.tree_top_k, dynamic.tree_depth, dynamic.max_tree_depth, dynamic.spec_block) == (3, 4, 4, 16)


def test_bad_tree_configs_are_refused_by_name():
    eagle = {"method": "eagle", "model": "h"}
    cases = [
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": [(0,), (1,)]},
         r"speculative_token_tree'\] with method 'ngram'"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "speculative_token_tree": [(0,), (1,)]},
         r"with method 'draft_model'"),
        ({**eagle, "speculative_token_tree": [(0,), (1, 0)]}, r"path \(1, 0\) has no parent \(1,\)"),
        ({**eagle, "speculative_token_tree": [(0,), (0,)]}, "a path appears twice"),
        ({**eagle, "speculative_token_tree": [(0,), (-1,)]}, r"path \(-1,\) is not"),
        ({**eagle, "speculative_token_tree": [(i,) for i in range(32)]}, "32 nodes; a tree holds at most 31"),
        ({**eagle, "speculative_token_tree": "[(0,), "}, "expected 'dynamic' or a list of paths"),
        ({**eagle, "num_speculative_tokens": 3, "speculative_token_tree": [(0,), (1,)]},
         r"num_speculative_tokens'\]=3 but speculative_token_tree has 2 nodes"),
        ({**eagle, "num_speculative_tokens": 40, "speculative_token_tree": "dynamic"}, r"must be an integer in \[1, 31\]"),
        ({**eagle, "num_speculative_tokens": 8, "speculative_token_tree": "dynamic", "tree_top_k": 0}, r"tree_top_k'\]=0"),
        ({**eagle, "num_speculative_tokens": 2, "tree_depth": 3}, r"tree_depth'\] applies to speculative_token_tree='dynamic'"),
        ({**eagle, "speculative_token_tree": [(0,)], "tree_top_k": 2}, "not to a static tree"),
        ({**eagle, "speculative_token_tree": [(0,)], "draft_confidence_threshold": 0.5}, "does not apply to a speculative_token_tree"),
    ]
    for config, message in cases:
        with pytest.raises(SpecConfigError, match=message):
            SpeculativeConfig.from_dict(config)
    tree = SpeculativeConfig.from_dict({**eagle, "speculative_token_tree": STATIC})
    fine, refused = models_trees_refuse()
    engine = types.SimpleNamespace(kv_cache_outliers=0)
    check_token_tree(tree, fine, engine, types.SimpleNamespace(sp=1))
    for model, parallel, message in refused:
        with pytest.raises(ValueError, match=rf"speculative_token_tree'\] with .*{message}.* is not supported"):
            check_token_tree(tree, model, engine, types.SimpleNamespace(sp=parallel))


def models_trees_refuse():
    """A plain model's stand-in for `check_token_tree`, and (model, sequence-parallel size, the
    reason named) for each kind of model draft trees are refused on."""
    fine = types.SimpleNamespace(has_linear_layers=False, is_mla=False, model_type="llama", num_layers=2,
                                 layer_kind=lambda layer: types.SimpleNamespace(window=None, chunk=None))
    return fine, [
        (types.SimpleNamespace(**{**vars(fine), "has_linear_layers": True, "model_type": "qwen3_next"}), 1, "Gated DeltaNet"),
        (types.SimpleNamespace(**{**vars(fine), "is_mla": True, "model_type": "deepseek_v3"}), 1, "multi-head latent attention"),
        (fine, 2, "sequence_parallel_size > 1"),
        (types.SimpleNamespace(**{**vars(fine), "model_type": "gemma2", "layer_kind": lambda layer: types.SimpleNamespace(
            window=6 if layer % 2 else None, chunk=None)}), 1, "sliding-window or chunked attention"),
        (types.SimpleNamespace(**{**vars(fine), "model_type": "llama4", "layer_kind": lambda layer: types.SimpleNamespace(
            window=None, chunk=8192)}), 1, "sliding-window or chunked attention"),
    ]


# ----------------------------------------------------------------------------- the sampler
V = 6
N = 20000
LOGITS = np.log(np.array([0.30, 0.25, 0.2, 0.15, 0.07, 0.03]))
CHILDREN = [2, 0, 2, 4]  # rank order; the repeated 2 is rejected with the first


def tree_tensors(n, temperature, children, top_k=0) -> SamplingTensors:
    padded = np.full((n, 32), -1, np.int32)
    padded[:, : len(children)] = children
    return SamplingTensors(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.ones(n, jnp.float32), seed=jnp.arange(n, dtype=jnp.uint32) + 11, counter=jnp.zeros(n, jnp.int32),
        target_ids=jnp.full(n, -1, jnp.int32), min_p=jnp.zeros(n, jnp.float32), tree_children=jnp.asarray(padded))


def exact_outcomes(p, children) -> dict:
    """Exact probabilities of ("child", j) and ("drawn", token) of the multi-draft rejection
    sampler with one-hot drafts (each child accepted with p'(t), rejected tokens removed)."""
    out, reach, mass, seen = {}, 1.0, 1.0, set()
    for j, t in enumerate(children):
        if t in seen:
            continue
        seen.add(t)
        out["child", j] = reach * p[t] / mass
        reach *= 1 - p[t] / mass
        mass -= p[t]
    for t in range(len(p)):
        if t not in seen and p[t] > 0:
            out["drawn", t] = reach * p[t] / mass
    return out


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 4)])
def test_the_tree_sampler_matches_exact_enumeration_and_keeps_the_target_distribution(temperature, top_k):
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (N, 1))
    st = tree_tensors(N, temperature, CHILDREN, top_k)
    p = np.asarray(processed_probs(logits, st), np.float64)[0]
    out = sample(logits, st, 0)
    child, tokens = np.asarray(out.accepted_child), np.asarray(out.tokens)
    truth = exact_outcomes(p, CHILDREN)
    observed = {key: 0 for key in truth}
    for c, t in zip(child, tokens):
        observed[("child", int(c)) if c >= 0 else ("drawn", int(t))] += 1  # (an outcome outside the support raises)
    assert all(observed[k] == 0 for k in truth if truth[k] == 0)  # (top-k: a child outside the support)
    keys = sorted(k for k in truth if truth[k] > 0)
    expected = np.array([truth[k] for k in keys])
    assert stats.chisquare([observed[k] for k in keys], expected / expected.sum() * N).pvalue > 1e-3
    emitted = np.where(child >= 0, np.asarray(CHILDREN)[np.maximum(child, 0)], tokens)
    counts = np.bincount(emitted, minlength=V)
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], p[keep] / p[keep].sum() * N).pvalue > 1e-3
    assert np.asarray(out.logprobs).shape == (N,)


def test_greedy_tree_rows_accept_the_child_equal_to_the_argmax():
    logits = jnp.tile(jnp.asarray(LOGITS, jnp.float32), (3, 1))
    padded = np.array([[3, 0, 0] + [-1] * 29, [1, 2, -1] + [-1] * 29, [-1] * 32], np.int32)
    st = tree_tensors(3, 0.0, [])
    st.tree_children = jnp.asarray(padded)
    out = sample(logits, st, 0)
    assert np.asarray(out.accepted_child).tolist() == [1, -1, -1]  # the first child equal to the argmax (0)
    assert np.asarray(out.tokens).tolist() == [0, 0, 0]
    mixed = tree_tensors(3, 0.0, [])  # a greedy row in a batch with random rows takes the same decision
    mixed.tree_children = jnp.asarray(padded)
    mixed.temperature = jnp.array([0.0, 0.0, 1.0], jnp.float32)
    assert np.asarray(sample(logits, mixed, 0).accepted_child)[:2].tolist() == [1, -1]


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tree-model")
    save_hf_model("llama3.2", directory, max_position_embeddings=512)
    return str(directory)


@pytest.fixture(scope="module")
def heads_dirs(tmp_path_factory):
    """Random heads of both kinds (hidden size 64): their top guesses are the target's own
    next-token guesses, a little perturbed, so they are sometimes right."""
    rng = np.random.default_rng(0)
    eagle = init_heads("eagle", 3, 64, seed=1)
    eagle["c"] = jnp.asarray(rng.normal(size=(64, 64)) * 0.02, jnp.float32)
    medusa = {"w": jnp.asarray(rng.normal(size=(3, 64, 64)) * 0.05, jnp.float32), "b": jnp.zeros((3, 64), jnp.float32)}
    return {kind: str(save_heads(tmp_path_factory.mktemp("heads") / kind, heads, base_model="tiny"))
            for kind, heads in (("eagle", eagle), ("medusa", medusa))}


@pytest.fixture(scope="module")
def tree_llm(model_dir, heads_dirs):
    """One engine for every test (its compiled programs shared): its plain decoding
    (num_speculative_tokens=0 per request) is the reference, and with no prefix caching its pages
    are all free when it is idle (`plain_kv` writes there)."""
    return LLM(model_dir, **BASE, enable_prefix_caching=False,
               speculative_config={"method": "eagle", "model": heads_dirs["eagle"], "speculative_token_tree": STATIC})


def prompts_(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in (np.tile(rng.integers(3, 250, 3), 3) if i % 2 else rng.integers(3, 250, 10))] for i in range(n)]


def token_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PLAIN = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, num_speculative_tokens=0)


@pytest.mark.parametrize("proposer", [
    {"method": "eagle", "speculative_token_tree": STATIC},
    {"method": "medusa", "speculative_token_tree": STATIC},
    {"method": "eagle", "speculative_token_tree": "dynamic", "num_speculative_tokens": 6, "tree_top_k": 3, "tree_depth": 3},
], ids=["static-eagle", "static-medusa", "dynamic-eagle"])
def test_draft_head_trees_change_no_greedy_token(tree_llm, heads_dirs, proposer):
    prompts = prompts_(4, seed=1)
    want = token_ids(tree_llm, prompts, PLAIN)
    tree_llm.engine.proposer = tree_llm.make_proposer({**proposer, "model": heads_dirs[proposer["method"]]})
    before = tree_llm.engine.get_stats()
    assert token_ids(tree_llm, prompts, GREEDY) == want
    after = tree_llm.engine.get_stats()
    assert after.num_draft_tokens > before.num_draft_tokens and after.num_accepted_tokens > before.num_accepted_tokens
    bm = tree_llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages  # rejected nodes leak no page


class OracleTree:
    """Knows each prompt's greedy continuation and drafts STATIC-shaped trees whose right tokens
    sit off the top-ranked branch every other step: (1,) and (1, 0) right, the rest wrong; the
    other steps the top-ranked chain (0,), (0, 0), (0, 0, 0) right."""

    on_device = False

    def __init__(self, truth: dict):
        self.truth, self.calls = truth, itertools.count()

    def propose(self, ctx, asked):
        tokens, parents = [], []
        for seq, k in asked:
            full = self.truth[tuple(seq.request.prompt_token_ids)]
            nxt = full[len(seq.token_ids) : len(seq.token_ids) + 3]
            nxt += [7] * (3 - len(nxt))
            wrong = [(t + 1) % 256 for t in nxt]
            if next(self.calls) % 2:  # nodes (0,) (1,) (0,0) (0,1) (1,0) (0,0,0)
                tree = [wrong[0], nxt[0], wrong[1], wrong[1], nxt[1], wrong[2]]
            else:
                tree = [nxt[0], wrong[0], nxt[1], wrong[1], wrong[1], nxt[2]]
            tokens.append(tree[:k])
            parents.append(tree_parents(STATIC)[:k])
        return Drafts(tokens, parents=parents)


def plain_kv(llm, tokens):
    """K and V a plain prefill of `tokens` writes ([slots, len, Hkv, D] each), in pages 1.. of an
    idle LLM without prefix caching (a chunk without drafts: plain causal attention)."""
    runner, size = llm.runner, llm.runner.page_size
    pages = list(range(1, 1 + -(-len(tokens) // size)))
    runner.execute([[ScheduledChunk(SequenceChunk(tokens, 0, [pages], [len(tokens) - 1]), RowSampling(target_ids=[-1]))]])
    saved = runner.read_pages(0, pages)
    return [a.reshape(a.shape[0], -1, *a.shape[3:])[:, : len(tokens)] for a in (saved.k, saved.v)]


def test_accepted_side_branches_keep_greedy_tokens_and_move_their_kv(tree_llm):
    prompts = prompts_(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_speculative_tokens=0)
    truth = {tuple(p): p + out for p, out in zip(prompts, token_ids(tree_llm, prompts, plain))}
    engine, core = tree_llm.engine, tree_llm.engine.core
    engine.proposer = OracleTree(truth)
    side_before = core.num_tree_side_accepts
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, params)
    cached = []  # (tokens, their K and V in the cache) right after a path off the top-ranked branch was kept
    while engine.has_unfinished_requests():
        seen = core.num_tree_side_accepts
        outputs = engine.step()
        if core.num_tree_side_accepts > seen and len(cached) < 3:
            for seq in engine.scheduler.running:
                n = seq.num_computed
                pages = engine.block_manager.page_table(seq.seq_id)[0][: -(-n // tree_llm.runner.page_size)]
                saved = tree_llm.runner.read_pages(0, pages)
                cached.append((seq.token_ids[:n], [a.reshape(a.shape[0], -1, *a.shape[3:])[:, :n] for a in (saved.k, saved.v)]))
        for out in outputs:
            if out.finished:
                assert list(out.prompt_token_ids) + out.outputs[0].token_ids == truth[tuple(out.prompt_token_ids)]
    assert cached
    for tokens, got in cached:  # the engine is idle now: every page is free
        for a, b in zip(got, plain_kv(tree_llm, tokens)):
            np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-3)
    assert core.num_tree_side_accepts - side_before >= 4
    engine.block_manager.check_invariants()


def test_constrained_requests_draft_trees_their_grammar_prunes(tree_llm):
    """A constrained sequence's tree loses the nodes whose paths its grammar forbids (their
    subtrees with them), each remaining row is masked by the grammar's state after its own path,
    and the output is the unspeculated constrained greedy text."""
    so = StructuredOutputsParams(regex=r"(ab|cd|ef){2,8}g")
    prompts = [[5, 9, 13, 17], [21, 25, 29, 33, 37]]
    plain = SamplingParams(temperature=0.0, max_tokens=20, num_speculative_tokens=0, structured_outputs=so)
    want = token_ids(tree_llm, prompts, plain)
    truth = {tuple(p): p + list(out) for p, out in zip(prompts, want)}
    engine, core = tree_llm.engine, tree_llm.engine.core
    engine.proposer = OracleTree(truth)
    cut, before = core.num_draft_tokens_cut_by_grammar, engine.get_stats()
    assert token_ids(tree_llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so)) == want
    assert core.num_draft_tokens_cut_by_grammar > cut  # the oracle's wrong nodes are mostly outside the grammar
    assert engine.get_stats().num_accepted_tokens > before.num_accepted_tokens


def test_warmup_builds_the_tree_programs(tree_llm):
    """What warm-up compiles with draft trees: batches with tree masks (every batch of such an
    engine carries them: all plain causal when empty), the sampler verifying trees, the one K/V
    row move."""
    runner = tree_llm.runner
    key = runner.buckets.key_for(7, 1, 7)
    batch = empty_inputs(key, runner.buckets.pages_per_seq, 1, with_tree=True)
    assert batch.tree_base.shape == batch.tree_bits.shape == batch.tree_rope.shape == (1, key.num_tokens)
    vocab = tree_llm.config.vocab_size
    st = every_processor_sampling(key.num_logits, vocab, runner.max_history, 1, trees=True)
    out, _ = runner.step_fn.sample(jnp.zeros((1, key.num_logits, vocab), jnp.float32), st)
    assert np.asarray(out.accepted_child).tolist() == [[-1] * key.num_logits]  # (no row has children)
    runner.warmup_page_ops(max_copies=1)
    assert runner.max_tree_moves == BASE["max_num_seqs"] * 3  # (a tree 3 levels deep)

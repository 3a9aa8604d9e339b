"""Lookahead decoding (speculative_config method "lookahead": jaxinfer.engine.lookahead).

The bookkeeping: the config's keys and refusals, the trie of pool candidates, the window rows'
masks and RoPE offsets, the pool and the window's update rule on hand-made windows. The model: a
tiny Llama's step over root + trie + window rows gives every window row the logits of a plain
causal forward over its own context (root, level 0 up to its column, its column's levels above).
The engine: greedy output is token for token plain greedy decoding (pool candidates verified and
some accepted, window rows computed, n-grams collected, no page leaked, a request that runs to
max_model_len too); sampled output is valid and reproducible from its seed."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.build import check_token_tree
from jaxinfer.engine.lookahead import LookaheadProposer, NgramPool, trie, update_window, window_rows
from jaxinfer.engine.spec_decode import ExtraRows, SpecConfigError, SpeculativeConfig, tree_masks
from jaxinfer.engine.step_plan import tree_chunk
from jaxinfer.ops.batch import SequenceChunk
from test_spec_tree import models_trees_refuse
from test_tree_attention import TinyLlama
from tiny_models import save_hf_model


# ----------------------------------------------------------------------------- config
def test_lookahead_config_defaults_and_bad_configs_refused_by_name():
    config = SpeculativeConfig.from_dict({"method": "lookahead"})
    assert (config.lookahead_window, config.lookahead_ngram, config.lookahead_candidates) == (4, 3, 4)
    assert config.num_speculative_tokens == 16 and config.spec_block == 32  # 1 + (4 + 4) * 2 = 17 rows
    assert config.is_tree and config.max_tree_depth == 2
    cases = [
        ({"method": "lookahead", "lookahead_window": 8, "lookahead_ngram": 4, "lookahead_candidates": 4},
         r"make 1 \+ \(G \+ W\) \* \(N - 1\) = 37 rows per verification; at most 32"),
        ({"method": "lookahead", "lookahead_ngram": 1}, r"lookahead_ngram'\]=1: must be an integer in \[2, 31\]"),
        ({"method": "lookahead", "lookahead_window": "4"}, r"lookahead_window'\]='4'"),
        ({"method": "lookahead", "num_speculative_tokens": 5}, r"num_speculative_tokens'\]=5: method 'lookahead' drafts"),
        ({"method": "lookahead", "model": "m"}, "method 'lookahead' drafts with no model"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead_window": 4},
         r"lookahead_window'\] applies to method 'lookahead', not 'ngram'"),
        ({"method": "lookahead", "speculative_token_tree": [(0,)]}, r"speculative_token_tree'\] with method 'lookahead': its trees"),
    ]
    for bad, message in cases:
        with pytest.raises(SpecConfigError, match=message):
            SpeculativeConfig.from_dict(bad)
    fine, refused = models_trees_refuse()
    engine = types.SimpleNamespace(kv_cache_outliers=0)
    check_token_tree(config, fine, engine, types.SimpleNamespace(sp=1))
    for model, sp, message in refused:
        with pytest.raises(ValueError, match=rf"method 'lookahead' with .*{message}.* is not supported"):
            check_token_tree(config, model, engine, types.SimpleNamespace(sp=sp))


# ----------------------------------------------------------------------------- bookkeeping
def test_trie_of_candidates_and_the_window_rows_masks():
    tokens, parents = trie([(5, 6), (5, 7), (8, 6), (5, 6)])  # the repeated (5, 6) adds nothing
    assert (tokens, parents) == ([5, 6, 7, 8, 6], [-1, 0, 0, -1, 3])
    # 2 levels x 3 columns after the root and 2 nodes: window row j is chunk row 3 + j
    masks, offsets = window_rows(2, 3, 2)
    r = lambda level, column: 1 << (3 + 3 * level + column)  # noqa: E731
    assert masks == [1 | r(0, 0), 1 | r(0, 0) | r(0, 1), 1 | r(0, 0) | r(0, 1) | r(0, 2),
                     1 | r(0, 0) | r(1, 0), 1 | r(0, 0) | r(0, 1) | r(1, 1), 1 | r(0, 0) | r(0, 1) | r(0, 2) | r(1, 2)]
    assert offsets == [1, 2, 3, 2, 3, 4]  # row (l, i) rotates at root + 1 + i + l
    # each row's context, one token per position from the root on (bit order = position order)
    for mask, offset in zip(masks, offsets):
        assert bin(mask).count("1") == 1 + offset


def test_the_pool_and_the_window_update_rule():
    pool = NgramPool(3, per_key=2, max_keys=2)
    for ngram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7]):  # (1, 2, 3) again: the most recent; (1, 4, 5) out
        pool.add(ngram)
    assert pool.candidates(1, 4) == [(6, 7), (2, 3)] and pool.candidates(1, 1) == [(6, 7)]
    pool.add([9, 9, 9])
    pool.add([8, 1, 1])  # a third key: the least recently used (1) goes
    assert pool.candidates(1, 4) == [] and pool.candidates(9, 4) == [(9, 9)] and len(pool) == 2
    # N = 3: two levels of three columns; the new level's tokens for columns 0 and 2 (1 not computed)
    pool = NgramPool(3, per_key=4)
    levels = [[10, 11, 12], [20, 21, 22]]
    after = update_window(levels, [30, 21, 32], [0, 2], pool, 3)
    assert after == [[20, 21, 22], [30, 21, 32]]  # level 0 out, the new level in
    assert pool.candidates(10, 4) == [(20, 30)] and pool.candidates(12, 4) == [(22, 32)] and pool.candidates(11, 4) == []
    assert update_window([[10, 11, 12]], [20, 21, 22], [0, 1, 2], pool, 3) == [[10, 11, 12], [20, 21, 22]]  # warm-up


class Seq(types.SimpleNamespace):
    """A sequence as the proposer reads it (weakly referenced: its state goes with it)."""

    __hash__ = object.__hash__


def test_the_proposer_sends_the_trie_then_the_window_and_reads_the_last_level():
    proposer = LookaheadProposer(window=3, ngram=3, candidates=2)
    seq = Seq(seed=0, token_ids=[4, 5, 6, 4, 5, 7, 4])  # the pool: (4, 5, 6), (4, 5, 7), ...
    drafts = proposer.propose(None, [(seq, 31)])
    assert drafts.tokens == [[5, 7, 6]] and drafts.parents == [[-1, 0, 0]]  # (5, 7) the most recent
    extra = drafts.extra[0]
    state = proposer.state(seq)
    assert len(state.levels) == 1 and extra.tokens == state.levels[0] and extra.offsets == [1, 2, 3]
    assert extra.masks == window_rows(1, 3, 3)[0]
    proposer.observe(seq, [40, 41, 42])  # warm-up: the window grows by a level
    assert state.levels[1] == [40, 41, 42]
    seq.token_ids.append(9)
    first = state.levels[0]
    drafts = proposer.propose(None, [(seq, 5)])  # 9 starts no n-gram; room for two columns of the two levels
    assert drafts.tokens == [[]] and drafts.extra[0].tokens == first[:2] + [40, 41]
    assert drafts.extra[0].masks == window_rows(2, 2, 0)[0]
    proposer.observe(seq, [50, 51, 60])  # rows (1, 0), (1, 1) are the last level's: 60, and one the scheduler cut
    assert state.levels == [[40, 41, 42], [60, 41, 42]]  # level 0 out; column 1 keeps its guess, 2 was not sent
    assert proposer.num_ngrams_collected == 1 and state.pool.candidates(first[0], 4)[0] == (40, 60)


# ----------------------------------------------------------------------------- the model
def test_window_rows_logits_are_their_contexts_causal_logits():
    """Prompt (its last token the root), a trie of 3 nodes and a 2 x 3 window in one chunk: each
    window row's logits equal those of the prompt + its context run as a plain causal chunk, and
    each node's those of the prompt + its path."""
    model = TinyLlama()
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 128, size=6)]
    nodes, parents = trie([(11, 12), (13,)])
    levels, columns = 2, 3
    window = [[int(t) for t in rng.integers(3, 128, size=columns)] for _ in range(levels)]
    masks, offsets = window_rows(levels, columns, len(nodes))
    extra = ExtraRows([window[l][i] for l in range(levels) for i in range(columns)], masks, offsets)
    P, n = len(prompt), 1 + len(nodes) + levels * columns
    pages = model.pages(P + n)
    model.run([SequenceChunk(prompt[:-1], 0, pages)])
    chunk = SequenceChunk([prompt[-1]] + nodes + extra.tokens, P - 1, pages, logits_rows=list(range(n)))
    tree_chunk(chunk, parents, extra)
    assert chunk.tree_masks == tree_masks(parents) + masks and chunk.tree_base == P - 1
    got = model.run([chunk], with_tree=True)[0]

    contexts = [[], [11], [11, 12], [13]]  # the root's and each node's path
    contexts += [window[0][: i + 1] + [window[l][i] for l in range(1, level + 1)]
                 for level in range(levels) for i in range(columns)]
    want = []
    for first in range(0, len(contexts), 4):  # plain causal prefills, 4 sequences a step
        chunks = [SequenceChunk(prompt + c, 0, model.pages(P + len(c)), logits_rows=[P + len(c) - 1])
                  for c in contexts[first : first + 4]]
        want += [rows[0] for rows in model.run(chunks)]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4 * np.abs(want).max(), rtol=0)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lookahead-model")
    save_hf_model("llama3.2", directory, max_position_embeddings=512)
    return LLM(str(directory), max_model_len=96, page_size=4, max_num_seqs=4, num_pages=256, max_num_batched_tokens=64,
               progress=False, enable_prefix_caching=False,
               speculative_config={"method": "lookahead", "lookahead_window": 3, "lookahead_ngram": 3,
                                   "lookahead_candidates": 2})


def token_ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_lookahead_changes_no_greedy_token(llm):
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in np.tile(rng.integers(3, 250, 4), 3)],  # repeated text: the pool hits from the start
               [int(t) for t in rng.integers(3, 250, 10)],
               [int(t) for t in rng.integers(3, 250, 80)]]  # 80 + 16 = max_model_len: the window is cut at the end
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_speculative_tokens=0)
    want = token_ids(llm, prompts, plain)
    core, proposer = llm.engine.core, llm.engine.proposer
    before = (core.num_draft_tokens, core.num_accepted_tokens, proposer.num_window_rows, proposer.num_ngrams_collected)
    assert token_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)) == want
    after = (core.num_draft_tokens, core.num_accepted_tokens, proposer.num_window_rows, proposer.num_ngrams_collected)
    assert all(a > b for a, b in zip(after, before))  # candidates verified and accepted, window rows run, n-grams kept
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages  # the window rows' and rejected nodes' slots leak no page


def test_sampled_lookahead_output_is_valid_and_follows_its_seed(llm):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43]]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    first = token_ids(llm, prompts, params)
    assert [len(t) for t in first] == [12, 12] and all(0 <= t < 259 for out in first for t in out)
    assert token_ids(llm, prompts, params) == first

"""Speculative decoding in the batched engine: the output is exactly the target model's.

Greedy: token for token what non-speculative decoding gives, under continuous batching
(chunked prefill, preemption, n > 1, speculating and plain requests in one step). Sampling: the
distribution of three-token continuations (the second and third tokens come out of verification
steps) equals the target's, for every proposer, one of them deliberately bad. Rejected drafts
never leak pages."""

from __future__ import annotations

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from scipy import stats

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.request import SpecState
from jaxinfer.engine.spec_decode import Drafts, NgramProposer, SpecConfigError, SpeculativeConfig, make_proposer
from jaxinfer.evaluate import hidden_states, prompt_log_softmax
from jaxinfer.models.draft_heads import load_heads, save_heads, train_heads, training_pairs
from tiny_models import save_hf_model

BASE = dict(max_model_len=128, page_size=4, max_num_seqs=16, progress=False)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec-model")
    save_hf_model("llama3.2", directory, max_position_embeddings=512)
    return str(directory)


@pytest.fixture(scope="module")
def bad_draft_dir(tmp_path_factory):
    """Another random model with the target's vocabulary: a draft model that is deliberately bad."""
    directory = tmp_path_factory.mktemp("bad-draft")
    save_hf_model("llama3.2", directory, seed=7, max_position_embeddings=512)
    return str(directory)


def draft_models(bad_draft_dir):
    """The draft_model variants: the target itself (every draft right), its first layer only
    (self-speculation), the target in int8, and another model entirely."""
    base = {"method": "draft_model", "num_speculative_tokens": 3}
    return {"self": base, "first-layer": {**base, "num_layers": 1}, "int8": {**base, "quantization": "int8"},
            "other-model": {**base, "model": bad_draft_dir}}


class BadProposer:
    """Drafts k tokens unrelated to the text: nearly every draft is rejected."""

    on_device = False

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def propose(self, engine, asked):
        return Drafts([[int(t) for t in self.rng.integers(3, 250, k)] for _, k in asked])


def repetitive_prompts(n, seed=0):
    """Prompts that repeat a phrase (prompt lookup finds drafts) and random ones (it finds few)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append([int(t) for t in np.tile(rng.integers(3, 250, int(rng.integers(2, 6))), int(rng.integers(2, 5)))])
        else:
            out.append([int(t) for t in rng.integers(3, 250, int(rng.integers(1, 30)))])
    return out


def token_ids(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------------------- the proposer
def test_prompt_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    proposer = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=1)
    assert proposer.draft([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 4) == [7, 1, 2, 3]  # "1 2 3" last seen before 7
    assert proposer.draft([5, 6, 7, 5, 6], 2) == [7, 5]  # the longest n that recurs (here 2)
    assert proposer.draft([5, 6, 7, 8], 3) == []  # nothing recurs
    assert proposer.draft([4, 4, 4], 3) == [4]  # runs overlap the suffix
    assert NgramProposer(3, 3).draft([1, 2, 9, 2], 2) == []  # shorter n-grams are not tried below min


def test_config_errors_name_the_key():
    with pytest.raises(SpecConfigError, match=r"\['method'\]='eagle3'"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(SpecConfigError, match=r"num_speculative_tokens'\]=0"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(SpecConfigError, match=r"unknown key\(s\) \['lookahead'\]"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    assert SpeculativeConfig.from_dict({"prompt_lookup_max": 4, "num_speculative_tokens": 5}).method == "ngram"  # vLLM's shorthand


def test_draft_length_backs_off_when_drafts_are_rejected_and_recovers():
    spec = SpecState(max_k=4, k=4)
    for _ in range(3):
        spec.update(4, 0)
    assert spec.k == 1
    spec.update(1, 0)
    assert spec.pause == SpecState.PAUSE and [spec.tick() for _ in range(SpecState.PAUSE + 1)][-1]
    for _ in range(6):
        spec.update(spec.k, spec.k)
    assert spec.k == 4


# ----------------------------------------------------------------------------- greedy: token for token
@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, num_pages=1024, max_num_batched_tokens=64, **BASE)


def test_greedy_speculation_changes_no_token_under_continuous_batching(model_dir, plain):
    """Chunked prefill (a 16-token budget), speculating and plain requests (num_speculative_tokens=0)
    in the same steps, n > 1; for the prompt-lookup proposer and for a proposer whose drafts are
    almost always wrong."""
    prompts = repetitive_prompts(12)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, n=1 + (i % 5 == 0),
                             num_speculative_tokens=0 if i % 4 == 3 else None)
              for i, m in enumerate(np.random.default_rng(1).integers(4, 24, 12))]
    want = token_ids(plain, prompts, params)
    for proposer in ("ngram", "bad"):
        llm = LLM(model_dir, num_pages=1024, max_num_batched_tokens=16, speculative_config=NGRAM, **BASE)
        if proposer == "bad":
            llm.engine.proposer = BadProposer()
        assert token_ids(llm, prompts, params) == want, proposer
        stats_ = llm.engine.get_stats()
        assert stats_.num_spec_verifications > 0 and stats_.num_draft_tokens > 0
        if proposer == "ngram":
            assert stats_.acceptance_rate > 0.5 and stats_.mean_accepted_length > 1.5
        for replica in llm.engine.replicas:
            replica.block_manager.check_invariants()
            assert replica.block_manager.num_free_pages == replica.block_manager.num_usable_pages


def test_draft_models_change_no_greedy_token(model_dir, bad_draft_dir, plain):
    """One target, its proposer swapped between the draft-model variants (compiled once)."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in (np.tile(rng.integers(3, 250, 4), 3) if i % 2 else rng.integers(3, 250, 12))] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=1 + (i == 3)) for i in range(8)]
    want = token_ids(plain, prompts, params)
    llm = LLM(model_dir, num_pages=1024, max_num_batched_tokens=64, speculative_config=draft_models(bad_draft_dir)["self"], **BASE)
    rates = {}
    for name, config in draft_models(bad_draft_dir).items():
        llm.engine.proposer = llm.make_proposer(config)
        before = llm.engine.get_stats()
        assert token_ids(llm, prompts, params) == want, name
        after = llm.engine.get_stats()
        rates[name] = (after.num_accepted_tokens - before.num_accepted_tokens) / (after.num_draft_tokens - before.num_draft_tokens)
        llm.engine.block_manager.check_invariants()
        assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_usable_pages
    assert rates["self"] == 1.0  # the target drafting for itself is never wrong
    assert rates["other-model"] < rates["int8"]  # a bad draft is rejected more than a close one


@pytest.fixture(scope="module")
def heads_dir(model_dir, plain, tmp_path_factory):
    """Draft heads trained (briefly) on text the tiny target writes itself."""
    prompts = repetitive_prompts(12, seed=9)
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    pairs = [training_pairs(hidden_states(plain.config, plain.runner.graphdef, plain.runner.params, p + o.outputs[0].token_ids),
                            np.asarray(p + o.outputs[0].token_ids), 3, first=len(p) - 1) for p, o in zip(prompts, outs)]
    h, targets = np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs])
    lm_head = lambda x: x @ plain.runner.params["embed"].get_value().T  # noqa: E731  (tied embeddings)
    losses = []
    heads = train_heads(h, targets, lm_head, num_heads=3, steps=60, batch_size=64, learning_rate=3e-3,
                        log=lambda step, loss, acc: losses.append(loss))
    assert losses[-1] < losses[0]  # it learns
    return save_heads(tmp_path_factory.mktemp("heads") / "tiny", heads, base_model=model_dir)


def test_draft_heads_load_back_and_refuse_a_model_they_do_not_fit(heads_dir):
    heads = load_heads(heads_dir, hidden_size=64)
    assert heads["w"].shape == (3, 64, 64) and heads["b"].shape == (3, 64)
    with pytest.raises(ValueError, match="heads for hidden size 64, the model's is 96"):
        load_heads(heads_dir, hidden_size=96)
    with pytest.raises(ValueError, match="not a folder of draft heads"):
        load_heads(heads_dir.parent, hidden_size=64)


def test_medusa_heads_change_no_greedy_token(model_dir, heads_dir, plain):
    prompts = repetitive_prompts(8, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(model_dir, num_pages=1024, max_num_batched_tokens=64, **BASE,
              speculative_config={"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3})
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    stats_ = llm.engine.get_stats()
    assert stats_.num_draft_tokens > 0 and stats_.num_accepted_tokens > 0


def test_speculation_survives_preemption(model_dir, plain):
    prompts = repetitive_prompts(16, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = token_ids(plain, prompts, params)
    small = LLM(model_dir, num_pages=48, max_num_batched_tokens=32, speculative_config=NGRAM, **BASE)
    assert token_ids(small, prompts, params) == want
    assert small.engine.get_stats().num_preemptions > 0
    small.engine.block_manager.check_invariants()
    assert small.engine.block_manager.num_free_pages == small.engine.block_manager.num_usable_pages


# ----------------------------------------------------------------------------- sampling: in distribution
TEMPERATURE, TOP_K = 0.8, 3
N_SAMPLES = 20000


def target_distribution(llm, prompt) -> dict[tuple[int, int, int], float]:
    """The target's probability of every three-token continuation (top-3 at temperature 0.8),
    from the model's own log-probabilities."""
    def step_probs(prefix):
        logits = prompt_log_softmax(llm.config, llm.runner.graphdef, llm.runner.params, prefix)[-1] / TEMPERATURE
        top = np.argsort(-logits)[:TOP_K]
        p = np.exp(logits[top] - logits[top].max())
        return dict(zip(top.tolist(), p / p.sum()))

    out = {}
    for t1, p1 in step_probs(prompt).items():
        for t2, p2 in step_probs(prompt + [t1]).items():
            for t3, p3 in step_probs(prompt + [t1, t2]).items():
                out[t1, t2, t3] = p1 * p2 * p3
    return out


@pytest.fixture(scope="module")
def sampling_setup(model_dir):
    """An engine drafting with prompt lookup, a prompt whose likely first tokens all recur in it,
    and the target's distribution of its three-token continuations."""
    llm = LLM(model_dir, num_pages=600, max_num_batched_tokens=512, max_model_len=96, page_size=16, max_num_seqs=256,
              progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1})
    # the prompt starts with tokens likely to come first (grown until the three likeliest are among
    # them), so whichever comes first, prompt lookup drafts the two that followed it there
    context, lead = [11, 27, 93, 150, 201, 64, 7, 180], []
    while True:
        logprobs = prompt_log_softmax(llm.config, llm.runner.graphdef, llm.runner.params, lead + context)[-1]
        top = [int(t) for t in np.argsort(-logprobs)[:TOP_K]]
        if set(top) <= set(lead):
            break
        lead += [t for t in top if t not in lead]
    prompt = lead + context
    return llm, prompt, target_distribution(llm, prompt)


@pytest.mark.parametrize("proposer", ["ngram", "bad", "bad-draft-model", "medusa"])
def test_sampled_continuations_keep_the_targets_distribution(sampling_setup, bad_draft_dir, heads_dir, model_dir, proposer):
    llm, prompt, truth = sampling_setup
    if proposer in ("bad-draft-model", "medusa"):  # drafts sampled from a q of their own, verified against it
        config = {"method": "draft_model", "num_speculative_tokens": 2, "model": bad_draft_dir} if proposer != "medusa" else \
            {"method": "medusa", "num_speculative_tokens": 2, "model": str(heads_dir)}
        llm = LLM(model_dir, num_pages=600, max_num_batched_tokens=512, max_model_len=96, page_size=16, max_num_seqs=256,
                  progress=False, speculative_config=config)
    else:
        llm.engine.proposer = BadProposer(1) if proposer == "bad" else NgramProposer(prompt_lookup_max=1)
    drafted_before = llm.engine.get_stats().num_draft_tokens
    n = 100
    params = [SamplingParams(n=n, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=i, detokenize=False)
              for i in range(N_SAMPLES // n)]
    counts = {key: 0 for key in truth}
    for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
        for c in out.outputs:
            counts[tuple(c.token_ids)] += 1  # a continuation outside the top-3 support would raise
    stats_ = llm.engine.get_stats()
    assert stats_.num_draft_tokens - drafted_before > N_SAMPLES // 2  # most second tokens went through verification
    keys = sorted(truth)
    p = stats.chisquare([counts[k] for k in keys], [truth[k] * N_SAMPLES for k in keys]).pvalue
    assert p > 1e-3, (p, stats_.acceptance_rate)


# ----------------------------------------------------------------------------- no leaks
@hypothesis.settings(max_examples=6, deadline=None, database=None, derandomize=True)
@hypothesis.given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 16), st.booleans(), st.booleans()), min_size=4, max_size=14),
                  st.integers(0, 2**16))
def test_heavy_rejection_with_aborts_and_preemption_leaks_no_pages(fuzz_llm, requests, seed):
    llm = fuzz_llm
    engine = llm.engine
    engine.proposer = BadProposer(seed)
    rng = np.random.default_rng(seed)
    ids = []
    for i, (length, max_tokens, sample, abort) in enumerate(requests):
        prompt = [int(t) for t in rng.integers(3, 250, length)]
        params = SamplingParams(temperature=0.9 if sample else 0.0, max_tokens=max_tokens, seed=i, n=2 if i % 5 == 4 else 1)
        ids.append((engine.add_request(None, prompt, params).request_id, abort))
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for replica in engine.replicas:
            replica.block_manager.check_invariants()
        if step == 3:
            for request_id, abort in ids:
                if abort:
                    engine.abort_request(request_id)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_pages == bm.num_usable_pages


@pytest.fixture(scope="module")
def fuzz_llm(model_dir):
    return LLM(model_dir, num_pages=40, max_num_batched_tokens=32, speculative_config=NGRAM, **BASE)

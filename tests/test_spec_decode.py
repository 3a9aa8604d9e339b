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
from jaxinfer.engine.spec_decode import Drafts, NgramProposer, SpecConfigError, SpeculativeConfig
from jaxinfer.runtime.evaluate import hidden_states, prompt_log_softmax
from jaxinfer.models.draft_heads import head_state, load_heads, save_heads
from jaxinfer.training.draft_heads import train_heads, training_windows
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
    """The draft_model variants: the target itself (every draft right), the target in int4, and
    another model entirely (the SmolLM2 test drafts with the target's first layers)."""
    base = {"method": "draft_model", "num_speculative_tokens": 3}
    return {"self": base, "int4": {**base, "quantization": "int4"},
            "other-model": {**base, "model": bad_draft_dir}}


class BadProposer:
    """Drafts k tokens unrelated to the text: nearly every draft is rejected."""

    on_device = False

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def propose(self, ctx, asked):
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
    with pytest.raises(SpecConfigError, match=r"\['method'\]='jacobi'"):  # (an unknown method)
        SpeculativeConfig.from_dict({"method": "jacobi", "num_speculative_tokens": 2})
    with pytest.raises(SpecConfigError, match="method 'eagle' needs 'model'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(SpecConfigError, match=r"num_speculative_tokens'\]=0"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(SpecConfigError, match=r"draft_confidence_threshold'\]=1.5: must be a number in \[0, 1\)"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": "h", "num_speculative_tokens": 2, "draft_confidence_threshold": 1.5})
    with pytest.raises(SpecConfigError, match=r"draft_confidence_threshold'\] applies to methods 'eagle' and 'medusa', not 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.5})
    with pytest.raises(SpecConfigError, match=r"disable_by_batch_size'\]=1: must be an integer >= 2"):
        SpeculativeConfig.from_dict({**NGRAM, "disable_by_batch_size": 1})
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


def test_a_proposer_that_keeps_finding_nothing_pauses_so_steps_overlap_again():
    spec = SpecState(max_k=4, k=4)
    for _ in range(SpecState.EMPTY - 1):
        spec.proposed(0)
    spec.proposed(2)  # a draft resets the count
    assert spec.drafts_next_step
    for _ in range(SpecState.EMPTY):
        spec.proposed(0)
    assert not spec.drafts_next_step and spec.k == 4  # paused; the draft length is kept
    assert [spec.tick() for _ in range(SpecState.PAUSE + 1)] == [False] * SpecState.PAUSE + [True]


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


def test_no_sequence_drafts_while_the_batch_is_large(model_dir, plain):
    """disable_by_batch_size (vLLM's key): a step that starts with that many sequences running
    drafts nothing; once requests finish, the rest speculate again. Tokens stay the target's."""
    prompts = repetitive_prompts(6, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9, 40, 40)]
    want = token_ids(plain, prompts, params)
    llm = LLM(model_dir, num_pages=1024, max_num_batched_tokens=64, speculative_config={**NGRAM, "disable_by_batch_size": 3}, **BASE)
    ngram, running_when_asked = llm.engine.proposer, []

    class Recording:
        on_device = False

        def propose(self, ctx, asked):
            running_when_asked.append(len(llm.engine.scheduler.running))
            return ngram.propose(ctx, asked)

    llm.engine.proposer = Recording()
    assert token_ids(llm, prompts, params) == want
    assert running_when_asked and max(running_when_asked) < 3
    assert llm.engine.get_stats().num_draft_tokens > 0


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
    assert rates["other-model"] < rates["int4"]  # a bad draft is rejected more than a close one


def test_training_windows_pair_each_position_with_the_states_and_tokens_after_it():
    """At position t the heads read h_t and y = token t+1; guess i learns token t+1+i and the
    target's hidden state at t+i."""
    hidden = np.repeat(np.arange(6, dtype=np.float32)[:, None], 2, axis=1)  # position p -> [p, p]
    tokens = np.array([10, 11, 12, 13, 14, 15])
    states, window = training_windows(hidden, tokens, num_heads=2, first=1)
    assert window.tolist() == [[12, 13, 14], [13, 14, 15], [14, 15, -1]]  # t = 1, 2, 3
    assert states[..., 0].tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, 5]]


@pytest.fixture(scope="module")
def heads_dirs(model_dir, plain, tmp_path_factory):
    """Draft heads of both kinds trained (briefly) on text the tiny target writes itself."""
    prompts = repetitive_prompts(12, seed=9)
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    pairs = [training_windows(hidden_states(plain.config, plain.runner.graphdef, plain.runner.params, p + o.outputs[0].token_ids),
                              np.asarray(p + o.outputs[0].token_ids), 3, first=len(p) - 1) for p, o in zip(prompts, outs)]
    states, window = np.concatenate([a for a, _ in pairs]), np.concatenate([b for _, b in pairs])
    embed = plain.runner.params["embed"].get_value()
    lm_head = lambda x: x @ embed.T  # noqa: E731  (tied embeddings)
    dirs = {}
    for kind in ("eagle", "medusa"):
        losses = []
        heads = train_heads(states, window, lm_head, embed, kind=kind, steps=60, batch_size=64, learning_rate=3e-3,
                            log=lambda step, loss, acc: losses.append(loss))
        assert losses[-1] < losses[0]  # it learns
        dirs[kind] = save_heads(tmp_path_factory.mktemp("heads") / kind, heads, base_model=model_dir)
    return dirs


def test_draft_heads_load_back_and_refuse_a_model_they_do_not_fit(heads_dirs, plain, heads_llm):
    heads = load_heads(heads_dirs["medusa"], hidden_size=64)
    assert heads["w"].shape == (3, 64, 64) and heads["b"].shape == (3, 64)
    assert load_heads(heads_dirs["eagle"], hidden_size=64, kind="eagle")["a"].shape == (64, 64)
    with pytest.raises(ValueError, match="heads for hidden size 64, the model's is 96"):
        load_heads(heads_dirs["medusa"], hidden_size=96)
    with pytest.raises(ValueError, match=r"eagle heads, not medusa \(speculative_config\['method'\] must be 'eagle'\)"):
        load_heads(heads_dirs["eagle"], hidden_size=64, kind="medusa")
    with pytest.raises(ValueError, match="not a folder of draft heads"):
        load_heads(heads_dirs["medusa"].parent, hidden_size=64)
    with pytest.raises(ValueError, match="reads the target's hidden states, which this LLM's step does not return"):
        plain.make_proposer({"method": "eagle", "model": str(heads_dirs["eagle"]), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens=4 but .* has 3 heads"):
        heads_llm.make_proposer({"method": "medusa", "model": str(heads_dirs["medusa"]), "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def heads_llm(model_dir, heads_dirs):
    """A target whose step also returns hidden states, drafting with the EAGLE-style heads."""
    return LLM(model_dir, num_pages=1024, max_num_batched_tokens=64, **BASE,
               speculative_config={"method": "eagle", "model": str(heads_dirs["eagle"]), "num_speculative_tokens": 3})


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_draft_heads_change_no_greedy_token(heads_llm, heads_dirs, plain, kind):
    prompts = repetitive_prompts(8, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    heads_llm.engine.proposer = heads_llm.make_proposer({"method": kind, "model": str(heads_dirs[kind]), "num_speculative_tokens": 3})
    before = heads_llm.engine.get_stats()
    assert token_ids(heads_llm, prompts, params) == token_ids(plain, prompts, params)
    after = heads_llm.engine.get_stats()
    assert after.num_draft_tokens > before.num_draft_tokens and after.num_accepted_tokens > before.num_accepted_tokens


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
N_SAMPLES = 10000  # three-token continuations over 27 cells, per proposer


def target_distribution(llm, prompt, temperature: float = TEMPERATURE, top_k: int = TOP_K) -> dict[tuple[int, int, int], float]:
    """The target's probability of every three-token continuation (top_k ** 3 cells, by default
    top-3 at temperature 0.8), from the model's own log-probabilities."""
    def step_probs(prefix):
        logits = prompt_log_softmax(llm.config, llm.runner.graphdef, llm.runner.params, prefix)[-1] / temperature
        top = np.argsort(-logits)[:top_k]
        p = np.exp(logits[top] - logits[top].max())
        return dict(zip(top.tolist(), p / p.sum()))

    out = {}
    for t1, p1 in step_probs(prompt).items():
        for t2, p2 in step_probs(prompt + [t1]).items():
            for t3, p3 in step_probs(prompt + [t1, t2]).items():
                out[t1, t2, t3] = p1 * p2 * p3
    return out


def first_guess_confidences(llm, prompt, heads_dir, first_tokens) -> list[float]:
    """The EAGLE-style head's confidence (top probability, temperature 1) in its first guess
    after `prompt` + y, for each y: computed here from the heads and the tied LM head."""
    heads = load_heads(heads_dir, llm.config.hidden_size)
    h = hidden_states(llm.config, llm.runner.graphdef, llm.runner.params, prompt)[-1:]  # [1, H]
    embed = np.asarray(llm.runner.params["embed"].get_value())
    out = []
    for y in first_tokens:
        logits = np.asarray(head_state(heads, 0, h, h, embed[[y]]), np.float64) @ embed.T
        out.append(float(1.0 / np.exp(logits - logits.max()).sum()))  # softmax's top probability
    return out


@pytest.fixture(scope="module")
def sampling_setup(model_dir, heads_dirs):
    """One engine for every proposer (its step also returns hidden states, for the heads), a
    prompt whose likely first tokens all recur in it, and the target's distribution of its
    three-token continuations."""
    llm = LLM(model_dir, num_pages=600, max_num_batched_tokens=512, max_model_len=96, page_size=16, max_num_seqs=256,
              progress=False, speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(heads_dirs["eagle"])})
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


@pytest.mark.parametrize("proposer", ["ngram", "bad-draft-model", "eagle", "eagle-confident", "medusa"])
def test_sampled_continuations_keep_the_targets_distribution(sampling_setup, bad_draft_dir, heads_dirs, proposer):
    """Prompt lookup (a one-hot q: accepted with the target's probability of the token) and
    proposers that sample from a q of their own (verified against it): another random model,
    deliberately bad, and both kinds of heads; the EAGLE-style head also with drafts cut at its
    first unconfident guess (the cut must not bias what is verified)."""
    llm, prompt, truth = sampling_setup
    config = {"num_speculative_tokens": 2, "method": proposer,
              "model": bad_draft_dir if proposer == "bad-draft-model" else str(heads_dirs.get(proposer))}
    if proposer == "bad-draft-model":
        config["method"] = "draft_model"
    if proposer == "eagle-confident":  # cut the branches of the least confident first tokens
        confidence = first_guess_confidences(llm, prompt, heads_dirs["eagle"], sorted({t1 for t1, _, _ in truth}))
        config.update(method="eagle", model=str(heads_dirs["eagle"]),
                      draft_confidence_threshold=(min(confidence) + max(confidence)) / 2)
    llm.engine.proposer = NgramProposer(prompt_lookup_max=1) if proposer == "ngram" else llm.make_proposer(config)
    drafted_before = llm.engine.get_stats().num_draft_tokens
    n = 100
    params = [SamplingParams(n=n, temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=i, detokenize=False)
              for i in range(N_SAMPLES // n)]
    counts = {key: 0 for key in truth}
    for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
        for c in out.outputs:
            counts[tuple(c.token_ids)] += 1  # a continuation outside the top-3 support would raise
    stats_ = llm.engine.get_stats()
    drafted = stats_.num_draft_tokens - drafted_before
    if proposer == "eagle-confident":  # one draft per continuation (max_tokens=3), some cut
        assert 0 < drafted < N_SAMPLES, drafted
    else:
        assert drafted > N_SAMPLES // 2  # most second tokens went through verification
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

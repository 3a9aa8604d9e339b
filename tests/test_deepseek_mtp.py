"""DeepSeek-V3's multi-token-prediction layer as a speculative proposer (method "mtp").

A tiny random DeepSeek-V3 whose checkpoint carries an MTP layer after its last, as DeepSeek-V3's
does (tests/tiny_models.save_deepseek_with_mtp). transformers does not run that layer, so the
reference is written here with transformers' own modules: the layer's decoder block is the 4th
block of a 4-layer transformers model whose first three are the target's. The module's
log-probabilities equal that reference; its drafts (each guess from the one before) are the
reference's argmax chain; greedy text equals transformers' `generate` whatever the drafts; sampled
continuations keep the target's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.model_runner import RowSampling, ScheduledChunk
from jaxinfer.engine.spec_decode import SpecConfigError, SpeculativeConfig
from jaxinfer.ops.batch import SequenceChunk, fresh_pages
from test_model_families import hf_greedy
from test_spec_decode import target_distribution
from tiny_models import save_deepseek_with_mtp

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3_mtp")
    target, full, extra = save_deepseek_with_mtp(directory)
    llm = LLM(str(directory), max_model_len=64, page_size=4, num_pages=400, max_num_batched_tokens=64, max_num_seqs=32,
              speculative_config=MTP, progress=False)
    return directory, target, full, extra, llm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(full, extra, ids: list[int], guesses: list[int] = ()) -> torch.Tensor:
    """The MTP layer's logits at positions 0 .. L - 2 of `ids` (row p reads the target's stream
    h_p and ids[p + 1]), then one more row per guess g, at the next position, reading g and the
    layer's own stream at the row before: [L - 1 + len(guesses), V] float64."""
    N, eps = full.config.num_hidden_layers - 1, full.config.rms_norm_eps
    captured = []
    hook = full.model.layers[N - 1].register_forward_hook(lambda m, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        full.model(torch.tensor([ids[:-1]]))  # the target's layers: the stream after the last, before its norm
        hook.remove()
        h = captured[0][0]  # [L - 1, H]
        embed, block, head = full.model.embed_tokens, full.model.layers[N], full.lm_head

        def layer_input(tokens, hidden, first_position):
            e = embed(torch.tensor(tokens))
            if first_position == 0:
                e[0] = 0.0  # no embedding at position 0 (vLLM's DeepSeek MTP)
            x = torch.cat([rms_norm(e, extra["enorm.weight"], eps), rms_norm(hidden, extra["hnorm.weight"], eps)], dim=-1)
            return x @ extra["eh_proj.weight"].T

        def run(x):  # the block over rows 0 .. n - 1, causal, at positions 0 .. n - 1
            n = x.shape[0]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = block(x[None], attention_mask=mask, position_ids=positions,
                        position_embeddings=full.model.rotary_emb(x[None], positions))
            return (out[0] if isinstance(out, tuple) else out)[0]

        x = layer_input(ids[1:], h, 0)
        for g in guesses:
            y = run(x)
            x = torch.cat([x, layer_input([g], y[-1:], len(x))])
        y = run(x)
        return torch.log_softmax(head(rms_norm(y, extra["shared_head.norm.weight"], eps)).double(), dim=-1)


def test_the_module_scores_as_the_reference(mtp_model):
    """Every position of a prompt: the module's log-probability of the token after next equals
    the reference's (< 1e-4), computed from the target step's stream on the device."""
    _, _, full, extra, llm = mtp_model
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 250, 14)]
    pages = fresh_pages(1, 4)  # a free corner of both pools (every request has finished)
    target = llm.runner.dispatch([[ScheduledChunk(SequenceChunk(ids, 0, pages, [len(ids) - 1]), RowSampling())]])
    mtp_runner = llm.engine.proposer.runner
    n = len(ids) - 1  # module rows 0 .. L - 2, each scoring ids[p + 2] (the last row: whatever comes next)
    chunk = SequenceChunk(ids[1:], 0, pages, list(range(n)), hidden_src=list(range(n)))
    scored = ScheduledChunk(chunk, RowSampling(target_ids=ids[2:] + [-1]))
    mtp_runner.collect(mtp_runner.dispatch([[scored]], want_logprobs=True, stream=target.stream))
    llm.runner.collect(target)
    want = reference_mtp_logits(full, extra, ids).numpy()
    got = np.array([row.logprob for row in scored.results[:-1]])
    np.testing.assert_allclose(got, want[np.arange(n - 1), ids[2:]], atol=1e-4)


def test_drafts_chain_each_guess_from_the_one_before(mtp_model):
    """The first proposal after a prompt: guess 1 from the target's stream at the last prompt
    position and the first sampled token, guess 2 from guess 1 and the module's own stream."""
    _, _, full, extra, llm = mtp_model
    proposer = llm.engine.proposer
    seen = []
    propose = proposer.propose

    def recording(ctx, asked):
        drafts = propose(ctx, asked)
        seen.extend((list(seq.token_ids), tokens) for (seq, _), tokens in zip(asked, drafts.tokens))
        return drafts

    proposer.propose = recording
    try:
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, 9)]
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        del proposer.propose
    ids, drafted = seen[0]
    assert len(ids) == len(prompt) + 1 and len(drafted) == 2
    first = reference_mtp_logits(full, extra, ids)[-1]
    assert drafted[0] == int(first.argmax())
    assert drafted[1] == int(reference_mtp_logits(full, extra, ids, [drafted[0]])[-1].argmax())


def test_greedy_text_equals_transformers_batched_preempted_and_on_a_mesh(mtp_model):
    directory, target, _, _, _ = mtp_model
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (3, 9, 17, 6)]
    want = [hf_greedy(target, ids, GREEDY.max_tokens) for ids in prompts]
    # pages of 4 tokens: 9 pages (36 tokens) cannot hold all four (11 + 17 + 25 + 14 tokens) at once
    llm = LLM(str(directory), max_model_len=32, page_size=4, num_pages=10, max_num_batched_tokens=8, max_num_seqs=4,
              speculative_config=MTP, progress=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    stats_ = llm.engine.get_stats()
    assert got == want
    assert stats_.num_draft_tokens > 0 and stats_.num_preemptions > 0
    # experts over 2 replicas (each with its own batches, pools and streams), heads over 2 shards
    llm = LLM(str(directory), max_model_len=32, page_size=4, num_pages=64, max_num_batched_tokens=8, max_num_seqs=4,
              speculative_config=MTP, expert_parallel_size=2, tensor_parallel_size=2, progress=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.engine.get_stats().num_draft_tokens > 0


def test_sampled_continuations_keep_the_targets_distribution(mtp_model):
    """Three-token continuations (top 3 at temperature 0.8) of one prompt, 1600 of them, each
    request alone (a forked completion drafts only from its second token on: its MTP row at the
    prompt's end is its parent's), against the target's own probabilities of the 27 cells."""
    _, _, _, _, llm = mtp_model
    temperature, top_k, samples = 0.8, 3, 1600
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 250, 6)]
    truth = target_distribution(llm, prompt, temperature, top_k)
    drafted_before = llm.engine.get_stats().num_draft_tokens
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i, detokenize=False)
              for i in range(samples)]
    counts = {key: 0 for key in truth}
    for out in llm.generate([prompt] * samples, params, use_tqdm=False):
        counts[tuple(out.outputs[0].token_ids)] += 1  # a continuation outside the top-3 support would raise
    assert llm.engine.get_stats().num_draft_tokens - drafted_before >= samples  # every second token was a draft
    keys = sorted(truth)
    assert stats.chisquare([counts[k] for k in keys], [truth[k] * samples for k in keys]).pvalue > 1e-3


def test_glm5s_mtp_layer_with_its_own_indexer_scores_as_the_reference_and_keeps_greedy_text(tmp_path):
    """GLM-5's MTP layer is a sparse-attention layer (its own indexer over its own rows)."""
    target, full, extra = save_deepseek_with_mtp(tmp_path, family="glm_moe_dsa")
    llm = LLM(str(tmp_path), max_model_len=48, page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=4,
              speculative_config=MTP, progress=False)
    ids = [int(t) for t in np.random.default_rng(9).integers(3, 250, 14)]
    pages, n = fresh_pages(1, 4), len(ids) - 1
    step = llm.runner.dispatch([[ScheduledChunk(SequenceChunk(ids, 0, pages, [n]), RowSampling())]])
    scored = ScheduledChunk(SequenceChunk(ids[1:], 0, pages, list(range(n)), hidden_src=list(range(n))),
                            RowSampling(target_ids=ids[2:] + [-1]))
    mtp_runner = llm.engine.proposer.runner
    mtp_runner.collect(mtp_runner.dispatch([[scored]], want_logprobs=True, stream=step.stream))
    want = reference_mtp_logits(full, extra, ids).numpy()
    np.testing.assert_allclose([row.logprob for row in scored.results[:-1]], want[np.arange(n - 1), ids[2:]], atol=1e-4)
    prompts = [[int(t) for t in np.random.default_rng(4).integers(3, 250, m)] for m in (5, 11)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    assert llm.engine.get_stats().num_draft_tokens > 0


def test_mtp_is_refused_where_there_is_no_such_layer(tmp_path):
    with pytest.raises(SpecConfigError, match="'mtp'.*no model"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1, "model": "x"})
    from tiny_models import save_hf_model

    save_hf_model("deepseek_v2", tmp_path)
    with pytest.raises(ValueError, match="multi-token-prediction layer.*has none"):
        LLM(str(tmp_path), max_model_len=32, speculative_config=MTP, progress=False)

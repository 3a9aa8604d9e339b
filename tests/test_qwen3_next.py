"""Qwen3-Next and Qwen3.5 (Gated DeltaNet layers between full-attention ones) through the engine.

Tiny random models (tests/tiny_models.py; their logits are tests/test_model_parity.py's). Each
running sequence carries its recurrent states in a slot of its own beside the full-attention
layers' pages: greedy text equals transformers' `generate` batched with prompts of different
lengths prefilled in chunks, alone, under preemption (the states start over with the recompute),
and for forked completions (a child starts from its parent's states); on a data-parallel mesh each
replica holds its own slots. What the states do not support yet is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.ops.linear_state import LinearState
from test_model_families import hf_greedy
from tiny_models import save_hf_model

# min_tokens as transformers' min_new_tokens: the end-of-text token cannot win before the 8th
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
SMALL = dict(max_model_len=32, page_size=4, max_num_batched_tokens=8, max_num_seqs=4, progress=False)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def hybrid(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, directory)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (3, 9, 17, 6)]
    return directory, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_greedy_text_equals_transformers_batched_alone_preempted_and_forked(hybrid):
    directory, prompts, want = hybrid
    # one full-attention layer, pages of 4 tokens: 7 pages cannot hold the four sequences at once
    llm = LLM(str(directory), num_pages=8, **SMALL)
    kv = llm.runner.kv
    assert kv.pages.shape[0] == 1  # K/V of the one full layer
    # slots: scratch, 4 sequences, 4 saved states of the prefix cache (a readmitted sequence may resume one)
    assert kv.state.recurrent.shape == (3, 9, 4, 16, 8) and kv.state.conv.shape == (3, 9, 3, 2 * 32 + 32)
    assert LinearState.bytes_per_slot(llm.config, np.float32) == 3 * (3 * 96 + 4 * 16 * 8) * 4
    assert "recurrent states 9.4 KiB per sequence (a slot each, max_num_seqs of them) and per saved prefix state (4 of them)" \
        in llm.engine.kv_cache_summary
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.engine.get_stats().num_preemptions > 0
    assert [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == want
    forked = llm.generate([prompts[1]], SamplingParams(n=3, temperature=0.0, max_tokens=8, min_tokens=8),
                          use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [want[1]] * 3
    for replica in llm.engine.core.replicas:
        replica.block_manager.check_invariants()  # every state slot free again


def test_swap_preemption_saves_and_restores_the_recurrent_states(hybrid):
    """Swapped out, a sequence's states go to the host with its pages and come back into whatever
    slot it holds when it resumes (no recompute)."""
    directory, prompts, want = hybrid
    llm = LLM(str(directory), num_pages=8, preemption_mode="swap", **SMALL)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    for replica in llm.engine.core.replicas:
        replica.block_manager.check_invariants()


def test_swapped_sequences_resume_past_their_saved_state_positions(tmp_path):
    """Swap preemption with the prefix cache's saved states: a readmitted sequence restores more
    tokens than its prefix hit, past positions its state is saved at; its next chunk starts after
    them (no empty or negative chunk), and the text equals a run that never preempts."""
    from jaxinfer.engine import scheduler

    save_hf_model("qwen3_5_text", tmp_path)
    settings = dict(max_model_len=64, page_size=4, max_num_batched_tokens=8, max_num_seqs=4, progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in rng.integers(3, 20, 5)]
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), num_pages=128, **settings).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tmp_path), num_pages=14, preemption_mode="swap", **settings)
    sizes, schedule = [], scheduler.Scheduler.schedule

    def recording(self):
        plan = schedule(self)
        sizes.extend(s.num_tokens for s in plan.scheduled)
        return plan

    scheduler.Scheduler.schedule = recording
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    finally:
        scheduler.Scheduler.schedule = schedule
    assert llm.engine.get_stats().num_preemptions > 0 and min(sizes) >= 1


def test_data_parallel_replicas_hold_their_own_state_slots_split_over_tensor_shards(hybrid):
    """Two replicas (each with its own slots), each over two tensor shards (a shard's key and value
    heads, and its part of every state)."""
    directory, prompts, want = hybrid
    llm = LLM(str(directory), num_pages=64, data_parallel_size=2, tensor_parallel_size=2, **SMALL)
    assert llm.runner.state_slots_per_replica == 9  # scratch, 4 sequences, 4 saved prefix states
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_prefix_hits_resume_saved_recurrent_states_and_give_the_fresh_runs_tokens(tmp_path):
    """A hybrid model's prefix cache hits only where a recurrent state was saved: the end of a
    prompt's last full page, and where prompts sharing cached pages part. Each hit's text equals
    transformers' run of the whole prompt; so do prompts running side by side that share a prefix
    (one saves the state while another may already resume it), and a second turn of a conversation."""
    hf = save_hf_model("qwen3_5_text", tmp_path)
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, 250, 10)]  # two full pages of 4 and a half
    a, b, c, d, e = (shared + [int(t) for t in rng.integers(3, 250, 5)] for _ in range(5))
    llm = LLM(str(tmp_path), num_pages=64, num_prefix_states=8, **SMALL)  # (room for every state saved here)
    bm = llm.engine.core.replicas[0].block_manager

    def run(*prompts):
        return [o.outputs[0].token_ids for o in llm.generate(list(prompts), GREEDY, use_tqdm=False)]

    want_a = hf_greedy(hf, a, 8)
    assert run(a) == [want_a] and bm.stats.hits == 0 and bm.stats.states_saved == 1  # at 12: a's last full page
    assert run(a) == [want_a] and bm.stats.hits == 3  # resumed at 12
    assert run(b) == [hf_greedy(hf, b, 8)] and bm.stats.hits == 3  # its 2 shared pages have no state: saved at 8 (and 12)
    assert run(c) == [hf_greedy(hf, c, 8)] and bm.stats.hits == 5  # resumed at 8, where they part
    assert run(d, e) == [hf_greedy(hf, d, 8), hf_greedy(hf, e, 8)] and bm.stats.hits == 9
    second_turn = a + want_a[:4] + [5, 6, 7]  # a's pages up to 16 are this prompt's too, its state at 12
    hits = bm.stats.hits
    assert run(second_turn) == [hf_greedy(hf, second_turn, 8)] and bm.stats.hits == hits + 3
    bm.check_invariants()


class OracleProposer:
    """Drafts the text's true next tokens, the last of each draft wrong: every verification keeps
    some drafts and rejects one."""

    on_device = False

    def __init__(self, texts: dict):
        self.texts = texts  # prompt -> its greedy continuation

    def propose(self, ctx, asked):
        from jaxinfer.engine.spec_decode import Drafts

        drafts = []
        for seq, k in asked:
            done = len(seq.token_ids) - len(seq.request.prompt_token_ids)
            true = self.texts[tuple(seq.request.prompt_token_ids)][done : done + k]
            drafts.append(true[:-1] + [(true[-1] + 1) % 250] if len(true) > 1 else true)
        return Drafts(drafts)


@pytest.mark.parametrize("hybrid", ["qwen3_5_text"], indirect=True)  # (one family: the states' code is shared)
def test_speculative_decoding_keeps_the_texts_the_states_advancing_by_the_kept_tokens_only(hybrid):
    """A verifying chunk leaves its slot as it was and keeps its inputs; the slot advances by the
    tokens kept once they are known. With drafts partly right (some kept, one rejected each time)
    greedy text equals the plain engine's, batched with chunked prefills and under preemption
    (the verification chunks outnumber the prefill chunks a step may hold)."""
    directory, prompts, _ = hybrid
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)  # (no min_tokens: it holds drafts back)
    plain = LLM(str(directory), num_pages=64, **SMALL)  # (the first test: its texts are transformers')
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(directory), num_pages=10, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **SMALL)
    assert llm.runner.kv.state.drafts.k.shape[2] == 4  # a verification chunk's 1 + 3 tokens
    llm.engine.proposer = OracleProposer({tuple(p): w for p, w in zip(prompts, want)})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    core = llm.engine.core
    assert 0 < core.num_accepted_tokens < core.num_draft_tokens and llm.engine.get_stats().num_preemptions > 0
    for replica in core.replicas:
        replica.block_manager.check_invariants()


@pytest.mark.parametrize("setting, message", [
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}), "drafting with the model itself"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(tensor_parallel_size=4), "tensor_parallel_size=4"),
])
def test_what_the_recurrent_states_do_not_run_with_yet_is_refused_by_name(hybrid, setting, message):
    with pytest.raises(ValueError, match=f"{message}.*Gated DeltaNet"):
        LLM(str(hybrid[0]), num_pages=16, **SMALL, **setting)


def test_a_multimodal_qwen3_5_folder_runs_its_text_decoder(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (model_type qwen3_5): its text decoder under
    model.language_model, M-RoPE sections in its rope parameters (text positions: plain RoPE),
    the vision tower skipped; greedy text equals the same decoder's as a text-only model."""
    import torch
    import transformers

    from tiny_models import FAMILIES, build_hf_model, byte_tokenizer

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    text = build_hf_model("qwen3_5_text")
    torch.manual_seed(0)
    folder = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=FAMILIES["qwen3_5_text"][1],
                                                                                      vision_config=vision)).eval()
    folder.load_state_dict({k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                            for k, v in text.state_dict().items()}, strict=False)
    folder.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, 7)]
    llm = LLM(str(tmp_path), num_pages=32, **SMALL)
    assert llm.config.model_type == "qwen3_5"
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(text, prompt, GREEDY.max_tokens)


def test_a_hybrid_model_converts_to_orbax_and_runs_from_there(hybrid, tmp_path):
    """`jaxinfer convert`: the config (its Gated DeltaNet fields and layer types) and the weights
    (each kind's stacks) read back equal, and the converted folder decodes the same text."""
    from jaxinfer.cli import main

    directory, prompts, want = hybrid
    assert main(["convert", str(directory), str(tmp_path / "converted")]) == 0
    llm = LLM(str(tmp_path / "converted"), num_pages=64, **SMALL)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)] == want[:2]

"""The continuous-batching engine: scheduling never changes what a request generates."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.ops.batch import MAX_PREFILL_CHUNKS
from tiny_models import save_hf_model

BASE = dict(max_model_len=128, page_size=4, max_num_seqs=16, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine-model")
    save_hf_model("llama3.2", directory)
    return str(directory)


@pytest.fixture(scope="module")
def roomy(model_dir):
    """Plenty of pages and a large token budget: the unconstrained reference."""
    return LLM(model_dir, num_pages=1024, max_num_batched_tokens=128, **BASE)


def workload(n=64, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, 250, int(rng.integers(1, 40)))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in range(n)]
    return prompts, params


def alone(llm, prompts, params):
    return [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def together(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_64_requests_batched_with_chunked_prefill_equal_each_request_alone(model_dir, roomy):
    prompts, params = workload()
    reference = alone(roomy, prompts, params)
    # a 16-token budget: prompts are prefilled in chunks interleaved with other requests' decodes
    tight = LLM(model_dir, num_pages=1024, max_num_batched_tokens=16, **BASE)
    chunks_per_step = []  # multi-token chunks in each step
    pack = tight.runner.pack
    tight.runner.pack = lambda scheduled, **kw: (
        chunks_per_step.append(sum(len(s.chunk.token_ids) > 1 for s in scheduled[0])), pack(scheduled, **kw))[1]
    assert together(tight, prompts, params) == reference
    assert 1 < max(chunks_per_step) <= MAX_PREFILL_CHUNKS  # several prompts share steps, within the cap
    stats = tight.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_generated_tokens == sum(len(r) for r in reference)


def test_shared_prefixes_hit_the_cache_and_change_nothing(model_dir, roomy):
    system = [int(t) for t in np.random.default_rng(1).integers(3, 250, 30)]
    prompts = [system + [5 + i, 9, 17 + i] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    off = LLM(model_dir, num_pages=1024, max_num_batched_tokens=128, enable_prefix_caching=False, **BASE)
    without = together(off, prompts, params)
    assert off.engine.block_manager.stats.hits == 0
    on = LLM(model_dir, num_pages=1024, max_num_batched_tokens=16, **BASE)
    on.generate(prompts[:1], params, use_tqdm=False)  # computes and caches the shared pages
    hits_before = on.engine.block_manager.stats.hits
    assert together(on, prompts, params) == without
    assert on.engine.block_manager.stats.hits - hits_before >= 7 * (30 // 4)  # every later prompt reuses 7 full pages
    assert on.engine.get_stats().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_pool_too_small_preempts_and_everything_still_completes_identically(model_dir, roomy, mode):
    prompts, params = workload(24, seed=3)
    reference = alone(roomy, prompts, params)
    small = LLM(model_dir, num_pages=40, max_num_batched_tokens=32, preemption_mode=mode, **BASE)
    computed = []
    if mode == "swap":  # count the tokens restored from host memory instead of recomputed
        original = small.runner.write_pages
        small.runner.write_pages = lambda replica, pages, saved: (computed.append(len(pages)), original(replica, pages, saved))
    assert together(small, prompts, params) == reference
    assert small.engine.get_stats().num_preemptions > 0
    assert (sum(computed) > 0) == (mode == "swap")
    small.engine.block_manager.check_invariants()
    assert small.engine.block_manager.num_free_pages == small.engine.block_manager.num_usable_pages


def test_n_samples_share_prompt_pages(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=64, **BASE)
    prompt = list(range(3, 40))  # 37 tokens: 9 full pages and a shared partial one
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    # the same seed gives the same four completions when run again
    again = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_requests_that_will_fork_hold_all_their_places_in_max_num_seqs(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=64, **BASE)  # max_num_seqs=16
    for i in range(10):  # 10 requests x n=4: at most 4 of them run at once
        llm.engine.add_request(f"r{i}", list(range(3 + i, 20)), SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=4, ignore_eos=True))
    most = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        running = llm.engine.replicas[0].scheduler.running
        most = max(most, sum(1 if s.request.forked else s.request.params.n for s in running))
    assert most == 16


def test_abort_frees_pages_at_once_and_others_finish(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    engine = engine_ = llm.engine
    engine.add_request("keep", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    engine.add_request("drop", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    used = engine.block_manager.num_usable_pages - engine.block_manager.num_free_pages
    engine_.abort_request("drop")
    assert engine.block_manager.num_usable_pages - engine.block_manager.num_free_pages < used
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert set(done) == {"keep"} and len(done["keep"].outputs[0].token_ids) == 10
    engine.block_manager.check_invariants()


def test_an_over_long_prompt_fails_alone(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    engine = llm.engine
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=r"request 'long': the prompt has 200 tokens, over max_model_len=128"):
        engine.add_request("long", [5] * 200, SamplingParams(max_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "ok" and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_streaming_yields_growing_text_and_metrics(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    seen = [out for out in llm.stream("stream me", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))]
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 5 and seen[-1].finished and not seen[0].finished
    m = seen[-1].metrics
    assert m.ttft is not None and m.ttft >= 0 and m.e2e >= m.ttft and m.tpot is not None


def test_priority_runs_first_when_only_one_fits(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **{**BASE, "max_num_seqs": 1})
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("low", [5, 6], params, priority=5)
    engine.add_request("high", [7, 8], params, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_min_tokens_keeps_eos_away(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.eos_token_ids = {greedy[0]}  # the model's first greedy choice becomes its EOS
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [greedy[0]] and stopped.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 3 and greedy[0] not in held.token_ids[:3]


def test_repetition_penalty_changes_a_repetitive_greedy_output(model_dir):
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    prompts, _ = workload(24, seed=3)
    plain = llm.generate([prompts[11]], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain)) == 1  # this prompt makes the tiny model repeat one token
    penalized = llm.generate([prompts[11]], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=3.0,
                                                           frequency_penalty=1.0), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalized)) > 3


FUZZ_STEPS = []


@hypothesis.settings(max_examples=50, deadline=None, derandomize=True, database=None)
@hypothesis.given(data=st.data())
def test_fuzz_arrivals_aborts_forks_and_preemption_leak_no_pages(fuzz_llm, data):
    # a fresh engine (scheduler, pages, prefix cache) over the same compiled runner for each example
    config = EngineConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=6,
                          preemption_mode=data.draw(st.sampled_from(["recompute", "swap"])))
    engine = LLMEngine(config, fuzz_llm.runner, fuzz_llm.tokenizer, vocab_size=fuzz_llm.config.vocab_size, eos_token_ids=[2])
    bm = engine.block_manager
    live: list[str] = []
    for step in range(data.draw(st.integers(20, 100))):
        action = data.draw(st.sampled_from(["add", "add", "abort", "step", "step", "step"]))
        if action == "add":
            rid = f"r{step}-{data.draw(st.integers(0, 10**6))}"
            prefix = [7, 8, 9, 10, 11, 12, 13, 14]  # shared by many requests: prefix hits
            tail = data.draw(st.lists(st.integers(3, 250), min_size=0, max_size=20))
            params = SamplingParams(n=data.draw(st.integers(1, 3)), temperature=data.draw(st.sampled_from([0.0, 1.0])),
                                    seed=step, max_tokens=data.draw(st.integers(1, 12)), ignore_eos=True)
            engine.add_request(rid, prefix + tail, params)
            live.append(rid)
        elif action == "abort" and live:
            engine.abort_request(live.pop(data.draw(st.integers(0, len(live) - 1))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        bm.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        bm.check_invariants()
    assert not bm.seqs and bm.num_free_pages == bm.num_usable_pages  # nothing leaked, nothing still owned
    FUZZ_STEPS.append((engine.get_stats().num_steps, engine.scheduler.num_preemptions, bm.stats.hits))


def test_fuzz_covered_thousands_of_steps_with_preemptions_and_hits():
    """Runs after the fuzz above (same module): it really exercised what it claims to."""
    if not FUZZ_STEPS:
        pytest.skip("run together with the fuzz test")
    steps, preemptions, hits = (sum(col) for col in zip(*FUZZ_STEPS))
    assert steps >= 1000 and preemptions > 0 and hits > 0, (steps, preemptions, hits)


@pytest.fixture(scope="module")
def fuzz_llm(model_dir):
    # a small pool so that forks, copy-on-write and preemption all happen
    return LLM(model_dir, num_pages=16, max_num_batched_tokens=16, **{**BASE, "max_num_seqs": 6})


def hf_beam_search(hf, prompt, width, steps):
    """Reference: plain beam search over HF's log-softmax (no EOS handling: ignore_eos)."""
    import torch

    beams = [([], 0.0)]
    for _ in range(steps):
        cands = []
        for toks, score in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0, -1].double(), -1).numpy()
            for t in np.argsort(-lp)[: 2 * width]:
                cands.append((toks + [int(t)], score + float(lp[t])))
        beams = sorted(cands, key=lambda c: c[1], reverse=True)[:width]
    return beams


def test_beam_search_matches_a_reference_and_width_one_is_greedy(model_dir):
    from transformers import AutoModelForCausalLM

    from jaxinfer import BeamSearchParams

    llm = LLM(model_dir, num_pages=512, max_num_batched_tokens=64, **BASE)
    prompt = [9, 30, 41, 77, 12, 5]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))[0].sequences[0].token_ids == greedy
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=0.0))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = hf_beam_search(hf, prompt, 3, 4)
    assert [b.token_ids for b in out.sequences] == [toks for toks, _ in want]
    for beam, (_, score) in zip(out.sequences, want):
        assert abs(beam.cumulative_logprob - score) < 1e-3


def test_step_n_plus_1_is_dispatched_before_step_n_is_read(model_dir):
    """Host/device overlap: decode steps are launched before the previous step's tokens are read."""
    llm = LLM(model_dir, num_pages=256, max_num_batched_tokens=32, **BASE)
    runner, events, handles = llm.runner, [], []
    launch, collect = runner.launch, runner.collect

    def traced_launch(*a, **k):
        handle = launch(*a, **k)
        handles.append(handle)
        events.append(("dispatch", len(handles) - 1))
        return handle

    def traced_collect(handle):
        events.append(("collect", next(i for i, h in enumerate(handles) if h is handle)))
        return collect(handle)

    runner.launch, runner.collect = traced_launch, traced_collect
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    prompts, _ = workload(4, seed=5)
    out = together(llm, prompts, params)
    runner.launch, runner.collect = launch, collect
    steps = len(handles)
    assert sorted(i for kind, i in events if kind == "collect") == list(range(steps))  # every step read once
    overlapped = [k for k in range(steps - 1) if events.index(("dispatch", k + 1)) < events.index(("collect", k))]
    assert len(overlapped) >= steps // 2  # most steps were launched before their predecessor was read
    assert out == alone(llm, prompts, params)


def test_tpu_kernels_and_a_tpu_pool_swap_and_share_pages_like_the_reference(model_dir, roomy):
    """attention_impl="pallas" on the CPU: the TPU kernels in interpret mode over a pool laid out
    for a TPU (combined: one row of K and V per token, head_dim 16 stored in 64 lanes each).
    Swapping pages out and back and copy-on-write of a shared partial page move whole pages and
    change no token."""
    prompts, params = workload(8, seed=5)
    reference = alone(roomy, prompts, params)
    tpu = LLM(model_dir, num_pages=24, max_num_batched_tokens=32, preemption_mode="swap", attention_impl="pallas", **BASE)
    assert tpu.engine_config.kernel_impl == "pallas" and tpu.kernels.platform == "tpu"  # the option's old name still works
    assert tpu.runner.kv.combined and tpu.runner.kv.kv.shape[-1] == tpu.config.num_kv_heads * 2 * 64
    assert together(tpu, prompts, params) == reference
    assert tpu.engine.get_stats().num_preemptions > 0
    prompt = list(range(3, 21))  # 18 tokens: a shared partial page, copied on the first write
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert [c.token_ids for c in tpu.generate([prompt], greedy, use_tqdm=False)[0].outputs] == \
        [c.token_ids for c in roomy.generate([prompt], greedy, use_tqdm=False)[0].outputs]


def test_a_background_thread_drives_the_core_while_another_adds_and_aborts(fuzz_llm, roomy):
    """The shape the HTTP server takes: one thread only steps the engine, another adds and aborts
    requests whenever it likes. Every request that is not aborted gets exactly the tokens it gets
    alone; afterwards no page, sequence or request is left behind."""
    import threading

    engine = LLMEngine(EngineConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=6), fuzz_llm.runner,
                       fuzz_llm.tokenizer, vocab_size=fuzz_llm.config.vocab_size, eos_token_ids=[2])
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 250, int(rng.integers(3, 20)))] for _ in range(14)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 12)), ignore_eos=True) for _ in prompts]
    finished, stop, errors = {}, threading.Event(), []

    def drive():
        try:
            while not stop.is_set():
                if engine.core.wait_for_requests(timeout=0.02):
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
        except Exception as e:  # surfaced below
            errors.append(e)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    aborted = {"3", "8", "11"}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
        if i % 3 == 2:
            engine.abort_request(str(i - 2) if str(i - 2) in aborted else "no-such-request")
        threading.Event().wait(0.01)
    for rid in aborted:
        engine.abort_request(rid)  # running, queued or finished already: each is fine
    deadline = threading.Event()
    for _ in range(600):
        if not engine.has_unfinished_requests():
            break
        deadline.wait(0.05)
    stop.set()
    driver.join(timeout=30)
    assert not errors and not driver.is_alive()

    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    for i in range(len(prompts)):
        if str(i) not in aborted:
            assert finished[str(i)].outputs[0].token_ids == want[i], i
    assert not engine.has_unfinished_requests()
    for replica in engine.replicas:
        bm = replica.block_manager
        bm.check_invariants()
        assert not bm.seqs and bm.num_free_pages == bm.num_usable_pages
        assert not replica.scheduler.running and not replica.scheduler.waiting

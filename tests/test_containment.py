"""A failing step fails only its own requests; the engine, the LLM and the server go on.

Failures are injected where no check at the edge could have stopped them: a token id no int32
holds, planted after the request was accepted (packing its rows fails: that request's own
fault), and a step that dies on the device taking the KV pool with it (nobody's fault: the
requests in play fail, the pool is re-created).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jax
import pytest

from jaxinfer import LLM, RequestFailedError, SamplingParams
from tiny_models import save_hf_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("containment-model")
    save_hf_model("llama3.2", directory)
    return LLM(str(directory), max_model_len=128, page_size=4, num_pages=64, max_num_batched_tokens=32, max_num_seqs=2,
               progress=False)


def drive(engine) -> dict:
    """Steps until nothing is unfinished; the last output of each request."""
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return last


def alone(llm, prompt, max_tokens) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids


def assert_clean(llm):
    """Nothing queued, every page free (or cached), the block manager consistent."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert not bm.seqs and bm.num_free_pages == bm.num_usable_pages


class DiesOnTheDevice:
    """The runner's step function, failing its next call after consuming the pool (as a device
    error in a step whose cache was donated does)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, params, kv, *args, **kwargs):
        self.calls += 1
        out = self.real(params, kv, *args, **kwargs)
        jax.tree.map(lambda a: a.delete(), (kv, out[2]))
        raise RuntimeError("device halted")

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture()
def dying_step(llm):
    runner = llm.runner
    real = runner.step_fn
    runner.step_fn = DiesOnTheDevice(real)
    yield runner.step_fn
    runner.step_fn = real


def test_a_request_whose_step_input_cannot_be_built_fails_alone(llm):
    reference = alone(llm, [5, 6, 7, 8, 9], 6)
    engine = llm.engine
    engine.add_request("ok", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, **GREEDY))
    bad = engine.add_request("bad", [10, 11, 12, 13], SamplingParams(max_tokens=6, **GREEDY))
    bad.seqs[0].token_ids[2] = 2**40  # no int32 holds it: packing this request's tokens raises
    outs = drive(engine)
    assert outs["bad"].finished and outs["bad"].outputs[0].finish_reason == "error"
    assert "OverflowError" in outs["bad"].error
    assert outs["ok"].error is None and outs["ok"].outputs[0].token_ids == reference
    assert_clean(llm)
    assert alone(llm, [5, 6, 7, 8, 9], 6) == reference  # and the next request works


def test_a_step_that_dies_on_the_device_fails_its_requests_recreates_the_pool_and_runs_the_rest(llm, dying_step):
    reference = {}
    runner = llm.runner
    runner.step_fn = dying_step.real
    for name, prompt in [("a", [5, 6, 7]), ("b", [8, 9, 10, 11]), ("c", [12, 13, 14, 15, 16])]:
        reference[name] = alone(llm, prompt, 5)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    engine.add_request("b", [8, 9, 10, 11], SamplingParams(max_tokens=5, **GREEDY))
    engine.add_request("c", [12, 13, 14, 15, 16], SamplingParams(max_tokens=5, **GREEDY))  # waits: max_num_seqs=2
    engine.step()  # a and b prefill; c waits
    runner.step_fn = dying_step
    outs = {out.request_id: out for out in engine.step()}  # a and b decode: the device dies
    assert dying_step.calls == 1
    runner.step_fn = dying_step.real
    for name in "ab":
        assert outs[name].finished and outs[name].outputs[0].finish_reason == "error"
        assert "the engine step failed: RuntimeError: device halted" in outs[name].error
    assert not any(a.is_deleted() for a in jax.tree.leaves(runner.kv))  # a new pool
    rest = drive(engine)
    assert set(rest) == {"c"} and rest["c"].outputs[0].token_ids == reference["c"]
    assert_clean(llm)


def test_a_step_refused_before_it_reaches_the_device_keeps_the_pool(llm, monkeypatch):
    runner, engine = llm.runner, llm.engine
    pool, real = runner.kv, runner.launch

    def refused(*args, **kwargs):  # once, before anything is donated
        monkeypatch.setattr(runner, "launch", real)
        raise RuntimeError("launch refused")

    monkeypatch.setattr(runner, "launch", refused)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    outs = drive(engine)
    assert outs["x"].outputs[0].finish_reason == "error" and "launch refused" in outs["x"].error
    assert runner.kv is pool  # nothing consumed it: not re-created, its cached pages kept
    assert_clean(llm)


def test_a_failure_no_step_in_play_owns_fails_every_unfinished_request(llm, monkeypatch):
    """Scheduling (or drafting) raised: no request can be blamed and the same failure would come
    back at every step, so every unfinished request fails and the engine is empty again."""
    engine = llm.engine
    scheduler, real = engine.scheduler, engine.scheduler.schedule

    def broken():
        monkeypatch.setattr(scheduler, "schedule", real)
        raise RuntimeError("scheduler bug")

    engine.add_request("p", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    engine.add_request("q", [8, 9, 10], SamplingParams(max_tokens=3, **GREEDY))
    monkeypatch.setattr(scheduler, "schedule", broken)
    outs = drive(engine)
    assert {name: o.outputs[0].finish_reason for name, o in outs.items()} == {"p": "error", "q": "error"}
    assert "scheduler bug" in outs["p"].error
    assert_clean(llm)
    assert len(alone(llm, [5, 6, 7], 3)) == 3


def test_generate_raises_a_failed_requests_error_and_leaves_nothing_queued(llm, dying_step):
    with pytest.raises(RequestFailedError, match=r"prompt 0 \(request '\d+'\) failed: the engine step failed: "
                                                 r"RuntimeError: device halted"):
        llm.generate([[5, 6, 7], [8, 9], [10, 11, 12]], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert_clean(llm)  # the third prompt, waiting when the step failed, was aborted
    llm.runner.step_fn = dying_step.real
    assert len(alone(llm, [5, 6, 7], 4)) == 4


def test_generate_aborts_its_requests_when_interrupted(llm, monkeypatch):
    real_step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    assert len(alone(llm, [5, 6, 7], 3)) == 3


def test_the_server_answers_500_for_the_failed_request_503_on_health_while_broken_and_recovers(llm, monkeypatch):
    from http_server import running
    from jaxinfer.server.app import build_app

    def post(url, body):
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health(url):
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with running(build_app(llm, served_model_name="tiny")) as url:
        assert post(url, body)[0] == 200 and health(url) == 200
        real_step = llm.engine.step
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("cannot step")))
        status, answer = post(url, body)  # the engine cannot step at all: the request fails, the thread lives
        assert status == 500 and "cannot step" in answer["error"]["message"]
        assert health(url) == 503
        monkeypatch.setattr(llm.engine, "step", real_step)
        for _ in range(50):  # the idle engine thread probes with a one-token request each second
            if health(url) == 200:
                break
            time.sleep(0.1)
        assert health(url) == 200
        status, answer = post(url, body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 3

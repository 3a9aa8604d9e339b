"""Prefill/decode disaggregation: a prefill engine hands a prompt's KV pages to a decode engine
(jaxinfer.engine.kv_handoff), and over real processes: `jaxinfer serve --kv-role prefill`,
`jaxinfer serve --kv-role decode` and `jaxinfer router` on loopback ports, the pages moving
through JAX's transfer server (jaxinfer.server.kv_transfer). Greedy text equals a co-located
engine's, streamed or not, for completions and chat; the pages moved are counted; neither side
holds a page afterwards; a prefill instance that dies gets the router's client an error at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import pytest

from jaxinfer import LLM, SamplingParams
from tiny_models import save_hf_model

SETTINGS = dict(max_model_len=128, page_size=4, num_pages=64, max_num_batched_tokens=32)
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["hello there, how are you doing today?", "The capital of France is", "1 2 3 4 5", "x"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disagg-model")
    save_hf_model("qwen3", directory)  # (its greedy text varies from token to token)
    return str(directory)


@pytest.fixture(scope="module")
def colocated(model_dir):
    return LLM(model_dir, progress=False, **SETTINGS)


def finished(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    return outputs


def test_an_engine_resumes_the_prompt_pages_another_engine_handed_off(colocated, model_dir):
    """The prefill engine computes each prompt (one token sampled) and hands off the K/V of all
    but its last token; the decode engine restores them into its own pages, computes the last
    prompt token only and samples the co-located engine's text, also over another number of
    tensor shards. Neither holds a page afterwards."""
    prefill = LLM(model_dir, progress=False, **SETTINGS)
    want = [o.outputs[0].token_ids for o in colocated.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    colocated.engine.block_manager.reset_prefix_cache()  # (so the decode side cannot find them cached)
    computed = colocated.engine.get_stats().num_prompt_tokens_computed
    for i, prompt in enumerate(PROMPTS):
        prefill.engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
        (out,) = finished(prefill.engine)
        handoff = out.kv_handoff
        assert handoff.num_tokens == len(out.prompt_token_ids) - 1 and handoff.num_pages == -(-handoff.num_tokens // 4)
        colocated.engine.add_request(f"d{i}", prompt, SamplingParams(**GREEDY), kv_handoff=handoff)
        (result,) = finished(colocated.engine)
        assert result.outputs[0].token_ids == want[i], prompt
    assert colocated.engine.get_stats().num_prompt_tokens_computed == computed  # no prompt chunk ran on the decode side
    for llm in (prefill, colocated):
        llm.engine.block_manager.check_invariants()
        assert llm.engine.get_stats().kv_cache_usage == 0
    # a decode engine over two tensor shards: the pages (all heads) are resharded as they are written
    sharded = LLM(model_dir, progress=False, tensor_parallel_size=2, **SETTINGS)
    for i, prompt in enumerate(PROMPTS[:2]):
        prefill.engine.add_request(f"q{i}", prompt, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
        sharded.engine.add_request(f"s{i}", prompt, SamplingParams(**GREEDY), kv_handoff=finished(prefill.engine)[0].kv_handoff)
        assert finished(sharded.engine)[0].outputs[0].token_ids == want[i]
    with pytest.raises(ValueError, match="another prompt"):  # pages of one prompt never start another
        colocated.engine.add_request("wrong", "another prompt", SamplingParams(**GREEDY), kv_handoff=handoff)
    with pytest.raises(ValueError, match="n > 1"):
        prefill.engine.add_request("n2", PROMPTS[0], SamplingParams(n=2, max_tokens=1), export_kv=True)
    assert not colocated.engine.has_unfinished_requests() and not prefill.engine.has_unfinished_requests()


def test_a_pull_fails_in_bounded_time_when_the_offer_is_gone_and_params_are_checked(colocated, model_dir):
    """Two transfer servers in this process: an offer pulled once gives the pages; pulling it
    again (or an id never offered) is a RuntimeError after the timeout, not a hang; params that do
    not fit this instance are a ValueError naming the mismatch."""
    from jaxinfer.server.kv_transfer import KVTransfer

    prefill = KVTransfer("prefill", colocated.runner, "qwen3", timeout_s=1.0)
    decode = KVTransfer("decode", colocated.runner, "qwen3", timeout_s=1.0)
    colocated.engine.add_request("offer", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    handoff = finished(colocated.engine)[0].kv_handoff
    params = prefill.offer(handoff, handoff.prompt_token_ids)
    pulled = decode.pull(params)
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(pulled.pages), jax.tree.leaves(handoff.pages)))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no pages within 1.0 s"):
        decode.pull(params)  # pulled already
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="do not fit this instance"):
        decode.pull({**params, "num_pages": 10**6})
    with pytest.raises(ValueError, match="differ from this instance's"):
        decode.pull({**params, "geometry": {**params["geometry"], "page_size": 8}})


# ----------------------------------------------------------------------------- real processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxinfer(*args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not start within {seconds} s")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """{"prefill", "decode", "router"}: (URL, process) of three jaxinfer processes."""
    env = dict(os.environ, JAXINFER_CACHE=str(tmp_path_factory.mktemp("cache")))
    settings = ["--max-model-len", "128", "--page-size", "4", "--num-pages", "64", "--max-num-batched-tokens", "32"]
    procs = {}
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            procs[role] = (f"http://127.0.0.1:{port}",
                           jaxinfer("serve", model_dir, "--port", str(port), "--kv-role", role, *settings, env=env))
        for url, proc in procs.values():
            wait_healthy(url, proc)
        port = free_port()
        procs["router"] = (f"http://127.0.0.1:{port}", jaxinfer("router", "--port", str(port), "--prefill", procs["prefill"][0],
                                                               "--decode", procs["decode"][0], "--request-timeout", "30", env=env))
        wait_healthy(*procs["router"])
        yield procs
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def metric(url: str, name: str) -> float:
    line = next(line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def test_the_router_answers_as_one_colocated_server_streamed_or_not(cluster, colocated, model_dir):
    router, model = cluster["router"][0], os.path.basename(model_dir)
    want = [o.outputs[0].text for o in colocated.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    for prompt, text in zip(PROMPTS, want):
        body = {"model": model, "prompt": prompt, **GREEDY}
        assert httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == text
        with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert "".join(e["choices"][0]["text"] for e in events(r) if e["choices"]) == text
    chat_want = colocated.generate([colocated.chat_prompt(CHAT)], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    body = {"model": model, "messages": CHAT, **GREEDY}
    assert httpx.post(router + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"] == chat_want
    with httpx.stream("POST", router + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events(r)) == chat_want

    prefill, decode = cluster["prefill"][0], cluster["decode"][0]
    assert metric(prefill, "jaxinfer:kv_transfer_requests_total") == metric(decode, "jaxinfer:kv_transfer_requests_total") == 10
    assert metric(prefill, "jaxinfer:kv_transfer_pages_total") == metric(decode, "jaxinfer:kv_transfer_pages_total") > 10
    assert metric(decode, "jaxinfer:kv_transfer_bytes_total") > 0 and metric(decode, "jaxinfer:kv_transfer_seconds_total") > 0
    for url in (prefill, decode):  # nothing held on either side
        assert metric(url, "jaxinfer:kv_cache_usage_perc") == 0 and metric(url, "jaxinfer:num_requests_running") == 0
    assert metric(router, "jaxinfer_router:requests_total") == 10

    # the prefill leg drops what does not fit one token (min_tokens, echo, logprobs)
    body = {"model": model, "prompt": PROMPTS[0], **GREEDY, "min_tokens": 5}
    assert httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want[0]
    # a request the instances reject comes back as their 400; the router refuses instances in the wrong roles
    bad = httpx.post(router + "/v1/completions", json={"model": model, "prompt": "x", "n": 2}, timeout=60)
    assert bad.status_code == 400 and "n = 1" in bad.json()["error"]["message"]
    from jaxinfer.server.router import Router, RouterError
    import asyncio

    with pytest.raises(RouterError, match="is a decode instance, given as prefill"):
        asyncio.run(Router([decode], [decode]).check())


def test_a_dead_prefill_instance_gets_the_client_an_error_not_a_hang(cluster, model_dir):
    router, (_, prefill) = cluster["router"][0], cluster["prefill"]
    os.killpg(prefill.pid, signal.SIGKILL)
    prefill.wait()
    start = time.monotonic()
    response = httpx.post(router + "/v1/completions", json={"model": os.path.basename(model_dir), "prompt": "anyone?", "max_tokens": 3}, timeout=60)
    assert response.status_code == 502 and "every prefill instance failed" in response.json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert httpx.get(router + "/health", timeout=30).status_code == 503

"""Result caches of the OpenAI server (jaxinfer.server.result_cache): keys, LRU + TTL, the
determinism and Cache-Control rules, semantic lookups with a stand-in embedding function; then
through a real server (a tiny Llama, and the same model as an embedding model): exact hits
bypass the engine, no-cache / no-store, sampled requests, streams, /metrics, and a semantic
threshold measured on the real embeddings."""

from __future__ import annotations

import contextlib
import json
import re

import httpx
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.server.result_cache import ResultCache, cache_control, cache_key, is_deterministic, llm_embedder


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# ----------------------------------------------------------------------------- the cache alone
def test_lru_eviction_and_ttl():
    clock = Clock()
    cache = ResultCache(max_entries=2, ttl_s=10, clock=clock)
    for name in ("a", "b"):
        cache.insert(cache.lookup(name), {"answer": name})
    assert cache.lookup("a").response == {"answer": "a"}  # a is now the most recently used
    cache.insert(cache.lookup("c"), {"answer": "c"})  # over 2 entries: b, the least recently used, goes
    assert cache.lookup("b").response is None and cache.lookup("a").hit and cache.lookup("c").hit
    hit = cache.lookup("a")
    hit.response["answer"] = "changed"  # a hit hands out a copy
    assert cache.lookup("a").response == {"answer": "a"}
    clock.now += 9.9
    assert cache.lookup("a").hit and len(cache) == 2  # hits do not extend the TTL
    clock.now += 0.1
    assert not cache.lookup("a").hit and len(cache) == 0
    assert cache.hits == {"exact": 6, "semantic": 0} and cache.misses == {"exact": 5, "semantic": 0}
    with pytest.raises(ValueError, match="result_cache_size"):
        ResultCache(max_entries=0)
    with pytest.raises(ValueError, match="result_cache_ttl"):
        ResultCache(ttl_s=float("nan"))
    with pytest.raises(ValueError, match="similarity"):
        ResultCache(embed=lambda texts: np.ones((len(texts), 2)), similarity=1.5)
    with pytest.raises(ValueError, match="semantic"):
        ResultCache(similarity=0.9)


def test_keys_are_canonical_and_the_rules():
    params = SamplingParams(temperature=0, max_tokens=8, stop=["\n"])
    key = cache_key({"model": "m", "prompt": [1, 2, 3], "params": params})
    assert key == cache_key({"params": SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]), "prompt": (1, 2, 3),
                             "model": "m"})  # key order, tuples, 0 vs 0.0 (SamplingParams stores floats)
    assert len(key) == 64 and key != cache_key({"model": "m", "prompt": [1, 2, 3], "params": SamplingParams(
        temperature=0, max_tokens=9, stop=["\n"])})
    assert cache_key({"model": "m", "x": object()}) is None  # no JSON form: not cached
    assert cache_key({"x": np.int32(3)}) == cache_key({"x": 3})
    assert is_deterministic(SamplingParams(temperature=0)) and is_deterministic(SamplingParams(temperature=0.8, seed=1))
    assert not is_deterministic(SamplingParams(temperature=0.8))
    assert cache_control(None) == (True, True) and cache_control("max-age=0") == (True, True)
    assert cache_control("No-Cache") == (False, True) and cache_control("private, no-store") == (False, False)


def test_semantic_lookups_with_a_stand_in_embedding():
    vectors = {"capital of France?": [1.0, 0.0, 0.0], "the capital of France?": [0.96, 0.28, 0.0],
               "France's capital?": [0.9, 0.0, 0.436], "how to bake bread?": [0.0, 1.0, 0.0]}
    calls = []

    def embed(texts):
        calls.append(list(texts))
        if texts[0] not in vectors:
            raise ValueError("too long")
        return np.array([vectors[t] for t in texts]) * 2.0  # not normalized: the cache normalizes

    cache = ResultCache(embed=embed, similarity=0.95)
    first = cache.lookup("k1", partition="p", text="capital of France?")
    assert not first.hit and first.kind == "semantic"
    cache.insert(first, {"answer": "Paris"})
    again = cache.lookup("k1", partition="p", text="capital of France?")
    assert again.response == {"answer": "Paris"} and again.kind == "exact" and len(calls) == 1  # exact first: no embedding
    close = cache.lookup("k2", partition="p", text="the capital of France?")  # cosine 0.96
    assert close.response == {"answer": "Paris"} and close.kind == "semantic" and close.similarity == pytest.approx(0.96)
    assert not cache.lookup("k3", partition="p", text="France's capital?").hit  # cosine 0.9 < 0.95
    assert not cache.lookup("k2", partition="q", text="the capital of France?").hit  # another partition
    assert not cache.lookup("k4", partition="p", text="how to bake bread?").hit
    refused = cache.lookup("k5", partition="p", text="a text the embedding model refuses")
    assert not refused.hit and refused.kind == "exact" and refused.embedding is None
    cache.insert(refused, {"answer": "long"})  # stored for exact lookups only
    assert cache.lookup("k5", partition="p", text="a text the embedding model refuses").hit
    assert not cache.lookup("k6", partition="p").hit  # no text: exact only, not embedded
    assert cache.hits == {"exact": 2, "semantic": 1} and cache.misses == {"exact": 2, "semantic": 4}
    fresh = cache.ticket("k7", partition="p", text="how to bake bread?")  # no-cache: embedded, not looked up
    assert not fresh.looked_up and fresh.embedding is not None
    cache.insert(fresh, {"answer": "knead"})
    assert cache.lookup("k8", partition="p", text="how to bake bread?").response == {"answer": "knead"}


@pytest.mark.parametrize("flags, message", [
    (["--result-cache", "semantic"], "--embedding-model"),
    (["--result-cache", "semantic", "--embedding-model", "x", "--similarity", "1.5"], "--similarity"),
    (["--result-cache", "semantic", "--embedding-model", "x", "--similarity", "0"], "--similarity"),
    (["--result-cache-size", "5"], "--result-cache-size needs --result-cache"),
    (["--result-cache", "exact", "--similarity", "0.9"], "--similarity needs --result-cache semantic"),
    (["--result-cache", "exact", "--result-cache-ttl", "-1"], "--result-cache-ttl"),
])
def test_serve_refuses_bad_result_cache_flags(flags, message, capsys):
    from jaxinfer.cli import main

    assert main(["serve", *flags]) == 2  # before any model loads
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- through a real server
SETTINGS = dict(max_model_len=128, page_size=4, num_pages=128, max_num_batched_tokens=32, max_num_seqs=8, progress=False)
QUESTION, CLOSE, FAR = "What is the capital of France?", "What is the capital of France ?", "what is the capital of france?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import save_hf_model

    directory = tmp_path_factory.mktemp("result-cache-model")
    save_hf_model("llama3.2", directory)
    return str(directory)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SETTINGS)


@contextlib.contextmanager
def serving(llm, cache, **extra):
    """(base URL, llm, cache) of a server of `llm` with `cache`, on a free port; one at a time
    (a server's engine thread steps the LLM's one engine)."""
    from http_server import running

    from jaxinfer.server.app import build_app

    with running(build_app(llm, served_model_name="tiny", result_cache=cache)) as url:
        yield url, llm, cache, *extra.values()


@pytest.fixture(scope="class")
def exact(llm):
    with serving(llm, ResultCache(max_entries=64, ttl_s=600)) as server:
        yield server


@pytest.fixture(scope="class")
def semantic(llm, model_dir):
    """A semantic cache, the tiny model its own embedding model, its threshold between the
    measured similarities of QUESTION to CLOSE and to FAR; + the threshold."""
    embed = llm_embedder(LLM(model_dir, runner="pooling", **SETTINGS))
    q, close, far = embed([QUESTION, CLOSE, FAR])
    near_sim, far_sim = float(q @ close), float(q @ far)
    assert near_sim - far_sim > 2e-3, (near_sim, far_sim)  # a random model's embeddings; a threshold fits between
    threshold = (near_sim + far_sim) / 2
    with serving(llm, ResultCache(max_entries=64, ttl_s=600, embed=embed, similarity=threshold),
                 threshold=threshold) as server:
        yield server


def post(server, path, body, **headers):
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60)


def stats(llm):
    s = llm.engine.get_stats()
    return s.num_steps, s.num_prompt_tokens_computed, s.num_generated_tokens


def counters(server) -> dict:
    text = httpx.get(server[0] + "/metrics").text
    found = re.findall(r'^jaxinfer:result_cache_(hits|misses)_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {f"{what}.{kind}": float(value) for what, kind, value in found}


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


class TestExactCache:
    def test_hits_bypass_the_engine(self, exact):
        llm = exact[1]
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        first = post(exact, "/v1/completions", body)
        assert first.status_code == 200 and first.headers["x-result-cache"] == "miss"
        before = stats(llm)
        again = post(exact, "/v1/completions", body)
        assert again.headers["x-result-cache"] == "exact-hit" and stats(llm) == before  # the engine never saw it
        a, b = first.json(), again.json()
        assert a["choices"] == b["choices"] and a["usage"] == b["usage"] and a["model"] == b["model"] == "tiny"
        assert b["id"] != a["id"] and b["id"].startswith("cmpl-")

        chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        first = post(exact, "/v1/chat/completions", chat)
        before = stats(llm)
        again = post(exact, "/v1/chat/completions", {**chat, "model": "tiny"})  # the served model named or not: one key
        assert again.headers["x-result-cache"] == "exact-hit" and stats(llm) == before
        assert again.json()["choices"] == first.json()["choices"] and again.json()["id"].startswith("chatcmpl-")
        other = post(exact, "/v1/chat/completions", {**chat, "top_logprobs": 3})  # any parameter: another key
        assert other.headers["x-result-cache"] == "miss" and stats(llm) != before

    def test_cache_control_sampled_requests_and_metrics(self, exact):
        llm = exact[1]
        metrics_before = counters(exact)
        body = {"prompt": "Cache control", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        post(exact, "/v1/completions", body)  # a miss
        before = stats(llm)
        fresh = post(exact, "/v1/completions", body, **{"Cache-Control": "no-cache"})
        assert "x-result-cache" not in fresh.headers and stats(llm) != before  # the engine answered
        before = stats(llm)
        assert post(exact, "/v1/completions", body).headers["x-result-cache"] == "exact-hit" and stats(llm) == before
        unstored = {**body, "prompt": "Never stored"}
        post(exact, "/v1/completions", unstored, **{"Cache-Control": "no-store"})
        assert post(exact, "/v1/completions", unstored).headers["x-result-cache"] == "miss"  # no-store kept nothing

        sampled = {"prompt": "Roll the dice", "max_tokens": 5, "temperature": 0.9, "ignore_eos": True}
        for _ in range(2):
            before = stats(llm)
            response = post(exact, "/v1/completions", sampled)
            assert "x-result-cache" not in response.headers and stats(llm) != before  # never cached
        seeded = {**sampled, "seed": 7}
        first = post(exact, "/v1/completions", seeded)  # a miss
        before = stats(llm)
        again = post(exact, "/v1/completions", seeded)
        assert again.headers["x-result-cache"] == "exact-hit" and stats(llm) == before
        assert again.json()["choices"] == first.json()["choices"]
        after = counters(exact)
        assert after["hits.exact"] - metrics_before["hits.exact"] == 2
        assert after["misses.exact"] - metrics_before["misses.exact"] == 3
        assert after["hits.semantic"] == after["misses.semantic"] == 0
        assert re.search(r"^jaxinfer:result_cache_entries [1-9]", httpx.get(exact[0] + "/metrics").text, re.M)

    def test_streams_are_stored_and_replayed(self, exact):
        llm = exact[1]
        body = {"prompt": "Stream me", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        streamed = httpx.post(exact[0] + "/v1/completions", json=body, timeout=60)
        assert streamed.headers["x-result-cache"] == "miss"
        chunks = sse(streamed)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        before = stats(llm)
        whole = post(exact, "/v1/completions", {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        assert whole.headers["x-result-cache"] == "exact-hit" and whole.json()["choices"][0]["text"] == text  # from the stream
        replay = httpx.post(exact[0] + "/v1/completions", json=body, timeout=60)
        replayed = sse(replay)
        assert replay.headers["x-result-cache"] == "exact-hit" and replay.text.endswith("data: [DONE]\n\n")
        assert "".join(c["choices"][0]["text"] for c in replayed if c["choices"]) == text
        assert replayed[-1]["usage"] == chunks[-1]["usage"] and stats(llm) == before

        chat = {"messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        whole = post(exact, "/v1/chat/completions", chat).json()
        before = stats(llm)
        replay = httpx.post(exact[0] + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
        deltas = [c["choices"][0]["delta"] for c in sse(replay)]
        assert replay.headers["x-result-cache"] == "exact-hit" and stats(llm) == before
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content") or "" for d in deltas) == whole["choices"][0]["message"]["content"]


class TestSemanticCache:
    def test_threshold(self, semantic):
        url, llm, cache, threshold = semantic
        body = {"prompt": QUESTION, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
        first = post(semantic, "/v1/completions", body)
        assert first.headers["x-result-cache"] == "miss"
        before = stats(llm)
        close = post(semantic, "/v1/completions", {**body, "prompt": CLOSE})
        assert close.headers["x-result-cache"] == "semantic-hit" and stats(llm) == before
        assert float(close.headers["x-result-cache-similarity"]) >= threshold
        assert close.json()["choices"] == first.json()["choices"]  # the cached answer, to another question
        assert post(semantic, "/v1/completions", body).headers["x-result-cache"] == "exact-hit"  # exact first
        far = post(semantic, "/v1/completions", {**body, "prompt": FAR})
        assert far.headers["x-result-cache"] == "miss" and stats(llm) != before  # below the threshold: the engine answers
        elsewhere = post(semantic, "/v1/completions", {**body, "prompt": CLOSE, "max_tokens": 6})
        assert elsewhere.headers["x-result-cache"] == "miss"  # other parameters: another partition
        chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 7, "temperature": 0}
        post(semantic, "/v1/chat/completions", chat)
        before = stats(llm)
        hit = post(semantic, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": CLOSE}]})
        assert hit.headers["x-result-cache"] == "semantic-hit" and stats(llm) == before
        other_system = {**chat, "messages": [{"role": "system", "content": "Answer in French."},
                                             {"role": "user", "content": CLOSE}]}
        assert post(semantic, "/v1/chat/completions", other_system).headers["x-result-cache"] == "miss"  # earlier messages
        assert counters(semantic) == {"hits.exact": 1, "hits.semantic": 2, "misses.exact": 0, "misses.semantic": 5}

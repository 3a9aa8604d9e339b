"""The OpenAI-compatible server over real sockets on 127.0.0.1, driven by the `openai` client and
raw HTTP: completions and chat, streaming and not, n, logprobs, stops, usage, concurrency,
disconnects, bad requests, auth, the queue limit, and SIGTERM draining a real `jaxinfer serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.generation_defaults import generation_defaults
from jaxinfer.server.app import build_app
from http_server import running
from tiny_models import save_hf_model

SETTINGS = dict(max_model_len=128, page_size=4, num_pages=256, max_num_batched_tokens=32, max_num_seqs=16, progress=False)
KEY = "test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-model")
    save_hf_model("llama3.2", directory)
    return str(directory)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SETTINGS)


@pytest.fixture(scope="module")
def server(llm):
    """(base URL, app) of a server in this process, on a free port."""
    app = build_app(llm, served_model_name="tiny", api_key=KEY)
    with running(app) as url:
        yield url, app


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server[0] + path, content=raw if raw is not None else json.dumps(body), headers=headers, timeout=60)


def engine_idle(app, seconds=10.0) -> bool:
    """Waits until no request is left and every page is free again."""
    engine = app.state.engine.engine
    for _ in range(int(seconds / 0.05)):
        bm = engine.block_manager
        if not engine.has_unfinished_requests() and bm.num_free_pages == bm.num_usable_pages and not bm.seqs:
            return True
        time.sleep(0.05)
    return False


def test_completions_streamed_equal_not_streamed_with_usage(client):
    kwargs = dict(model="tiny", prompt="Hello there", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_equal_not_streamed_n_and_logprobs(client):
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and whole.usage.completion_tokens == 10
    assert len(choice.logprobs.content) == 10 and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == choice.message.content
    several = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=3, temperature=1.0, seed=5)
    assert sorted(c.index for c in several.choices) == [0, 1, 2]


def test_stop_strings_and_echo(client):
    sampled = dict(model="tiny", prompt="abc", max_tokens=24, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    base = client.completions.create(**sampled)  # seeded: the same text again below, up to the stop
    text = base.choices[0].text
    at = next(i for i in range(1, len(text)) if text.find(text[i : i + 2]) == i)  # a pair first seen past the start
    stop = text[at : at + 2]
    stopped = client.completions.create(**sampled, stop=[stop])
    assert stopped.choices[0].text == text[:at] and stopped.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("abc")


def test_models_health_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(server[0] + "/health").status_code == 200
    tokens = post(server, "/tokenize", {"prompt": "hi there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 128
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"].endswith("hi there")


def test_sixty_four_concurrent_clients_get_what_each_gets_alone(server, client):
    prompts = [f"prompt number {i}" for i in range(64)]
    alone = {p: client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts[:4]}

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)
        outs = await asyncio.gather(*(aclient.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0)
                                      for p in prompts))
        await aclient.close()
        return outs

    outs = asyncio.run(run())
    assert all(o.choices[0].finish_reason in ("length", "stop") for o in outs)
    assert {p: o.choices[0].text for p, o in zip(prompts, outs) if p in alone} == alone
    assert engine_idle(server[1])


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk arrived: the request holds pages now; leave
    assert engine_idle(server[1])
    assert server[1].state.engine.engine.get_stats().num_running == 0


def test_a_client_that_leaves_a_non_streamed_request_frees_its_pages(server):
    engine = server[1].state.engine.engine
    runner, real = engine.runner, engine.runner.launch

    def slow(*args, **kwargs):  # 60 tokens take over 3 s: the client leaves long before the end
        time.sleep(0.05)
        return real(*args, **kwargs)

    runner.launch = slow
    generated = engine.get_stats().num_generated_tokens
    try:
        with pytest.raises(httpx.ReadTimeout):
            post_body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
            httpx.post(server[0] + "/v1/completions", json=post_body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
        assert engine_idle(server[1], seconds=2.0)  # noticed within the handler's 0.1 s poll, then aborted
    finally:
        runner.launch = real
    assert engine.get_stats().num_generated_tokens - generated < 60


@pytest.mark.parametrize("body, raw, status, names", [
    (None, b"{not json", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, None, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, None, 400, "frobnicate"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ({"model": "tiny", "prompt": "x" * 400}, None, 400, "max_model_len"),
    ({"model": "tiny", "prompt": [[1, 2], "x"]}, None, 400, "prompt"),
    ({"model": "tiny"}, None, 400, "prompt"),
    ({"model": "other", "prompt": "x"}, None, 404, "other"),
    ({"model": "tiny", "prompt": "x", "logprobs": 50}, None, 400, "max_logprobs"),
])
def test_bad_requests_get_openai_errors_naming_the_field(server, body, raw, status, names):
    response = post(server, "/v1/completions", body, raw=raw)
    assert response.status_code == status
    error = response.json()["error"]
    assert names in error["message"] and error["code"] == status


def test_bad_chat_requests_and_the_server_keeps_serving(server, client):
    assert post(server, "/v1/chat/completions", {"model": "tiny", "messages": []}).status_code == 400
    assert post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}).status_code == 400
    assert post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "top_logprobs": 2}).json()["error"]["param"] == "top_logprobs"
    assert client.completions.create(model="tiny", prompt="still fine", max_tokens=2).choices[0].finish_reason
    assert engine_idle(server[1])


def test_an_api_key_is_required_on_v1_routes_and_tokenization(server):
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None).status_code == 401
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key="wrong").status_code == 401
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=KEY + "x").status_code == 401
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(server, "/detokenize", {"tokens": [3]}, key="wrong").status_code == 401
    assert httpx.get(server[0] + "/health").status_code == 200


def test_past_the_queue_limit_requests_get_429_with_retry_after(server):
    engine = server[1].state.engine
    engine.max_queue = 0  # every new request finds the queue full
    try:
        response = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    finally:
        engine.max_queue = None
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_metrics_report_latencies_and_engine_state(server, client):
    client.completions.create(model="tiny", prompt="measure me", max_tokens=3)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("jaxinfer:time_to_first_token_seconds_count", "jaxinfer:e2e_request_latency_seconds_count",
                 "jaxinfer:inter_token_latency_seconds", "jaxinfer:request_queue_time_seconds", "jaxinfer:num_requests_running",
                 "jaxinfer:num_requests_waiting", "jaxinfer:num_requests_swapped", "jaxinfer:kv_cache_usage_perc",
                 "jaxinfer:prefix_cache_hit_rate", "jaxinfer:num_preemptions_total", "jaxinfer:num_compiles_total",
                 "jaxinfer:spec_decode_acceptance_rate"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("jaxinfer:e2e_request_latency_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0_and_the_key_comes_from_the_environment(model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAXINFER_CACHE=str(tmp_path / "cache"), JAXINFER_API_KEY=KEY)  # the key from the environment
    proc = subprocess.Popen(
        [sys.executable, "-c", "from jaxinfer.cli import main; raise SystemExit(main())", "serve", model_dir, "--port", str(port), "--max-model-len", "128",
         "--page-size", "4", "--num-pages", "64", "--max-num-batched-tokens", "32", "--shutdown-timeout", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):  # start-up, bounded (60 s)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        assert httpx.get(url + "/v1/models").status_code == 401
        body = {"model": os.path.basename(model_dir), "prompt": "drain", "max_tokens": 48, "temperature": 0,
                "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)  # mid-request
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # it ran to its end
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_failure_fails_its_requests_with_500_and_the_server_goes_on(server, client):
    runner = server[1].state.engine.engine.runner
    real = runner.launch

    def broken(*args, **kwargs):  # the next step fails once
        runner.launch = real
        raise RuntimeError("injected failure")

    runner.launch = broken
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": "doomed", "max_tokens": 3})
    assert response.status_code == 500 and "injected failure" in response.json()["error"]["message"]
    next_one = client.completions.create(model="tiny", prompt="next one", max_tokens=3, extra_body={"ignore_eos": True})
    assert next_one.usage.completion_tokens == 3
    assert engine_idle(server[1])


# ----------------------------------------------------------------------------- OpenAI's defaults
def test_without_max_tokens_a_request_may_fill_the_rest_of_the_context(client):
    """OpenAI and vLLM: no max_tokens means up to the context (not 16); the prompts here leave ~30 tokens."""
    text = client.completions.create(model="tiny", prompt="y" * 100, temperature=0, extra_body={"ignore_eos": True})
    assert text.choices[0].finish_reason == "length" and text.usage.total_tokens == SETTINGS["max_model_len"]
    assert text.usage.completion_tokens > 16
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "z" * 90}], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.total_tokens == SETTINGS["max_model_len"]
    assert chat.usage.completion_tokens > 16


def test_a_prompt_that_fills_the_context_gets_400_naming_the_limit(server):
    response = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w" * 130}]})
    assert response.status_code == 400 and "max_model_len=128" in response.json()["error"]["message"]


def test_streamed_text_with_stop_strings_equals_the_whole_answer(client):
    """Stop strings of three characters straddle three tokens each (one token per byte): the
    stream never sends the start of one and then takes it back."""
    sampled = dict(model="tiny", prompt="abc", max_tokens=24, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    text = client.completions.create(**sampled).choices[0].text
    for stop in ([text[9:12]], [text[4:7], text[15:17] + "\x01"], [text[-2:] + "\x01"]):  # the last two never complete
        whole = client.completions.create(**sampled, stop=stop).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(**sampled, stop=stop, stream=True)
                           if c.choices)
        assert streamed == whole, stop
        assert whole == text[: min([text.find(s) for s in stop if s in text] or [len(text)])]


def test_generation_config_fills_the_sampling_fields_a_request_leaves_unset(server, client, model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 5, "temperature": 0.0, "top_k": 3, "do_sample": True, "eos_token_id": 2}))
    defaults = generation_defaults(str(tmp_path), model_dir)
    assert defaults == {"max_tokens": 5, "temperature": 0.0, "top_k": 3}  # vLLM's fields; max_new_tokens is max_tokens
    assert generation_defaults("vllm", tmp_path) == {} and generation_defaults("auto", model_dir) == {}
    app = server[1]
    kept, app.state.sampling_defaults = app.state.sampling_defaults, defaults
    try:
        greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        default = client.completions.create(model="tiny", prompt="abc", extra_body={"ignore_eos": True})
        assert default.usage.completion_tokens == 5 and default.choices[0].text == greedy.choices[0].text
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=7,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 7  # what a request sets wins
    finally:
        app.state.sampling_defaults = kept


def test_a_bad_generation_config_is_refused_naming_it(llm, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json.*temperature"):
        build_app(llm, generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="no generation_config.json"):
        generation_defaults(str(tmp_path / "missing"), None)
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model's file sets no sampling field


def test_a_chat_template_and_a_body_limit_of_the_servers_own(llm, server, tmp_path):
    """A second app over the same engine (it generates nothing: the fixture's engine thread does
    the stepping): --chat-template from a file renders the conversation; a body over the limit
    gets 413 before it is read whole."""
    assert engine_idle(server[1])
    (tmp_path / "template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}")
    app = build_app(llm, api_key=KEY, chat_template=str(tmp_path / "template.jinja"), max_request_bytes=1000)
    with running(app) as url:
        ids = post((url,), "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert llm.tokenizer.decode(ids) == "[user:hi]"
        big = post((url,), "/v1/completions", {"model": "tiny", "prompt": "x" * 1000})
        assert big.status_code == 413 and "1000 bytes" in big.json()["error"]["message"]
        assert post((url,), "/tokenize", {"prompt": "x" * 900}).status_code == 200
    with pytest.raises(ValueError, match="chat_template"):
        build_app(llm, chat_template="{% for m in messages %}")

"""Several models in one server and the policy that routes "model": "auto" (jaxinfer.server.routing,
jaxinfer.server.multi_model): the policy's rules with plain numbers, then two tiny models served by
one app over a real socket: each answers as it does offline, "auto" goes where the policy says and
says so, feedback moves the threshold, a loaded high-precision model hands "auto" to the other."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from jaxinfer.server.multi_model import memory_shares, model_settings, parse_model_spec
from jaxinfer.server.routing import Decision, RoutingPolicy

ROUTES = ["small", "large"]


# ----------------------------------------------------------------------------- the policy, with numbers
def test_length_rule_sends_long_prompts_to_the_large_model():
    policy = RoutingPolicy(ROUTES, long_prompt_tokens=100)
    assert policy.decide(prompt_tokens=100) == Decision("small", "default")
    long = policy.decide(prompt_tokens=101)
    assert (long.route, long.reason) == ("large", "long_prompt") and "101" in long.detail
    assert not policy.needs_confidence(101) and policy.needs_prompt
    assert policy.choices == {("small", "default"): 1, ("large", "long_prompt"): 1}


def test_confidence_rule_and_its_unknown_case():
    policy = RoutingPolicy(ROUTES, long_prompt_tokens=100, confidence_threshold=-2.0)
    assert policy.needs_confidence(10) and not policy.needs_confidence(500)
    assert policy.decide(10, confidence=-1.5).route == "small"
    assert policy.decide(10, confidence=-2.0).reason == "confident"  # at the threshold: small
    low = policy.decide(10, confidence=-2.5)
    assert (low.route, low.reason) == ("large", "low_confidence")
    assert low.header == "low_confidence; mean prompt logprob -2.500 < -2.000"
    unknown = policy.decide(10, confidence=None)  # the probe failed
    assert (unknown.route, unknown.reason) == ("large", "no_confidence")
    assert policy.decide(500, confidence=-0.1).reason == "long_prompt"  # length decides first


def test_feedback_moves_the_threshold_within_bounds_once_per_response():
    policy = RoutingPolicy(ROUTES, confidence_threshold=-2.0, threshold_min=-3.0, threshold_max=-1.0, feedback_step=0.5)
    for i in range(4):
        policy.remember(f"bad-{i}", policy.decide(10, confidence=-0.5))
    policy.feedback("bad-0", 0.0)  # a bad answer from the small model: stricter
    assert policy.confidence_threshold == -1.5
    policy.feedback("bad-1", 0.0)
    policy.feedback("bad-2", 0.0)
    assert policy.confidence_threshold == -1.0  # bounded
    policy.feedback("bad-3", 1.0)  # a good one: more to the small model
    assert policy.confidence_threshold == -1.5
    with pytest.raises(KeyError):
        policy.feedback("bad-3", 1.0)  # one verdict per response
    policy.remember("large-1", policy.decide(10, confidence=-9.0))
    policy.feedback("large-1", 0.0)  # the large model's answers do not move it
    assert policy.confidence_threshold == -1.5
    policy.remember("half", policy.decide(10, confidence=-0.5))
    policy.feedback("half", 0.75)  # a score moves it in proportion: 0.5 * (1 - 1.5)
    assert policy.confidence_threshold == pytest.approx(-1.75)
    assert policy.verdicts == {("small", "bad"): 3, ("small", "good"): 2, ("large", "bad"): 1}
    with pytest.raises(ValueError, match="score"):
        policy.feedback("x", 2.0)


def test_remembered_responses_are_bounded():
    policy = RoutingPolicy(ROUTES, max_remembered=3)
    for i in range(5):
        policy.remember(str(i), Decision("small", "default"))
    with pytest.raises(KeyError):
        policy.feedback("1", 1.0)
    assert policy.feedback("4", 1.0).route == "small"


def test_load_rule_moves_high_precision_requests_to_the_low_precision_model():
    routes = ["int8", "fp"]
    policy = RoutingPolicy(routes, small="int8", large="fp", long_prompt_tokens=10, high="fp", low="int8", queue=4)
    loads = {"fp": 4, "int8": 0}
    assert policy.decide(50, load=loads.get).route == "fp"  # 4 is not more than 4
    loads["fp"] = 5
    moved = policy.decide(50, load=loads.get)
    assert (moved.route, moved.reason) == ("int8", "under_load") and "fp holds 5 requests > 4" == moved.detail
    assert policy.named("fp", loads.get) == Decision("fp", "named")  # naming it: only with adaptive_precision
    adaptive = RoutingPolicy(routes, high="fp", low="int8", queue=4, adaptive_precision=True)
    assert adaptive.named("fp", loads.get).reason == "under_load" and adaptive.named("int8", loads.get).route == "int8"
    assert policy.snapshot()["choices"] == {"int8": {"under_load": 1}, "fp": {"long_prompt": 1, "named": 1}}


def test_options_from_the_command_line_and_their_errors():
    policy = RoutingPolicy.from_options(["a", "b", "c"], "small=b,large=c,long-prompt-tokens=64,confidence_threshold=-2",
                                        "high=c,low=a,queue=8", adaptive_precision=True)
    assert (policy.small, policy.large, policy.long_prompt_tokens, policy.confidence_threshold) == ("b", "c", 64, -2.0)
    assert (policy.high, policy.low, policy.queue, policy.adaptive_precision) == ("c", "a", 8, True)
    assert RoutingPolicy.from_options(["a", "b"]).snapshot()["small"] == "a"
    for policy_text, load_text, message in [
        ("small=x", None, "--routing-policy: small='x': no model of that name"),
        ("long_prompt_tokens=many", None, "--routing-policy: long_prompt_tokens='many' is not an integer"),
        ("speed=11", None, "--routing-policy: unknown option 'speed'"),
        ("small", None, "--routing-policy: expected KEY=VALUE"),
        ("confidence_threshold=1", None, "--routing-policy: confidence_threshold=1.0: outside"),
        (None, "high=a,queue=2", "--route-under-load: give high=NAME,low=NAME,queue=N"),
        (None, "high=a,low=a,queue=2", "--route-under-load: high='a' and low='a'"),
        (None, "high=a,low=z,queue=2", "--route-under-load: low='z': no model"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
            RoutingPolicy.from_options(["a", "b"], policy_text, load_text)
    with pytest.raises(ValueError, match="--adaptive-precision"):
        RoutingPolicy.from_options(["a", "b"], None, None, adaptive_precision=True)


def test_model_specs_and_memory_shares():
    spec = parse_model_spec("int8=./m,quantization=int8,memory-share=0.25,kv_cache_memory=512MiB")
    assert (spec.name, spec.path) == ("int8", "./m")
    assert spec.options == {"quantization": "int8", "memory_share": 0.25, "kv_cache_memory_bytes": 512 << 20}
    specs = [spec, parse_model_spec("a=org/name"), parse_model_spec("b=./x.gguf")]
    assert memory_shares(specs) == [0.25, 0.375, 0.375]
    settings = model_settings(specs, gpu_memory_utilization=0.8, kv_cache_memory_bytes=1 << 30)
    assert settings[0] == {"model": "./m", "gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 512 << 20,
                           "quantization": "int8"}
    assert settings[1] == {"model": "org/name", "gpu_memory_utilization": pytest.approx(0.3),
                           "kv_cache_memory_bytes": int((1 << 30) * 0.375)}
    assert model_settings(specs[1:], gpu_memory_utilization=0.9)[0] == {"model": "org/name", "gpu_memory_utilization": 0.45}
    for text, message in [("auto=./m", "'auto' is the router's name"), ("./m", "NAME=PATH"), ("a=", "no PATH"),
                          ("a=./m,bits=4", "unknown option 'bits'"), ("a=./m,num_pages=lots", "num_pages='lots' is not int"),
                          ("a=./m,memory_share=2", "memory_share=2.0")]:
        with pytest.raises(ValueError, match=message):
            parse_model_spec(text)
    with pytest.raises(ValueError, match="add up to 1.2"):
        memory_shares([parse_model_spec("a=x,memory_share=0.6"), parse_model_spec("b=y,memory_share=0.6")])
    with pytest.raises(ValueError, match="given twice"):
        model_settings([parse_model_spec("a=x"), parse_model_spec("a=y")], gpu_memory_utilization=0.9)


def test_serve_refuses_bad_routing_flags_by_name(capsys):
    from jaxinfer.cli import main

    for args, message in [
        (["--model", "a=./x", "--model", "b=./y", "--routing-policy", "small=z"], "--routing-policy: small='z': no model"),
        (["--model", "a=./x", "--model", "./y"], "--model: with several models each is NAME=PATH"),
        (["--model", "a=./x", "--model", "b=./y", "--route-under-load", "high=a"], "--route-under-load: give high="),
        (["--model", "a=./x", "--model", "b=./y", "--served-model-name", "m"], "not with --served-model-name"),
        (["./x", "--adaptive-precision"], "--adaptive-precision routes between several models"),
    ]:
        assert main(["serve", *args]) == 2
        assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- two models, one server
SETTINGS = dict(max_model_len=128, page_size=4, num_pages=256, max_num_batched_tokens=32, max_num_seqs=16, progress=False)
KEY = "test-key"
SHORT, LONG = "Hi there", "word " * 10  # 8 and 50 tokens (a token per byte)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, app, the two LLMs, each model's offline greedy answers to SHORT and LONG)."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.server.multi_model import build_multi_model_app
    from http_server import running
    from tiny_models import save_hf_model

    llms = {}
    for seed, name in enumerate(ROUTES):
        directory = tmp_path_factory.mktemp(f"routing-{name}")
        save_hf_model("llama3.2", directory, seed=seed)
        llms[name] = LLM(str(directory), **SETTINGS)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    offline = {name: dict(zip((SHORT, LONG), (o.outputs[0].text for o in llm.generate([SHORT, LONG], greedy))))
               for name, llm in llms.items()}
    assert offline["small"] != offline["large"]  # two models: where a request went shows in its answer
    policy = RoutingPolicy(ROUTES, long_prompt_tokens=24, confidence_threshold=-100.0, threshold_min=-100.0,
                           threshold_max=0.0, feedback_step=0.5, high="large", low="small", queue=0)
    app = build_multi_model_app(llms, policy=policy, api_key=KEY)
    with running(app) as url:
        yield url, app, llms, offline


def post(url, path, body, key=KEY, **kw):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60, **kw)


def complete(url, model, prompt, **more):
    return post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                         "ignore_eos": True, **more})


def test_each_model_answers_as_it_does_offline(served):
    url, app, llms, offline = served
    for name in ROUTES:
        r = complete(url, name, SHORT)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["text"] == offline[name][SHORT]
        assert (r.headers["x-jaxinfer-route"], r.headers["x-jaxinfer-route-reason"]) == (name, "named")
    assert complete(url, None, SHORT).json()["model"] == "small"  # no model: the first
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["small", "large", "auto"]
    missing = complete(url, "medium", SHORT)
    assert missing.status_code == 404 and "['small', 'large', 'auto']" in missing.json()["error"]["message"]
    assert post(url, "/v1/completions", {"model": "auto", "prompt": SHORT}, key=None).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    tokens = post(url, "/tokenize", {"model": "large", "prompt": SHORT}).json()
    assert tokens["count"] == len(SHORT)  # a token per byte


def test_auto_routes_by_length_and_confidence_and_says_so(served):
    url, app, llms, offline = served
    policy = app.state.policy
    long = complete(url, "auto", LONG)
    assert long.json()["model"] == "large" and long.json()["choices"][0]["text"] == offline["large"][LONG]
    assert long.headers["x-jaxinfer-route-reason"].startswith("long_prompt; 50 prompt tokens > 24")
    policy.confidence_threshold = -100.0  # every prompt is confident enough: the small model
    confident = complete(url, "auto", SHORT)
    assert confident.json()["model"] == "small" and confident.json()["choices"][0]["text"] == offline["small"][SHORT]
    assert confident.headers["x-jaxinfer-route-reason"].startswith("confident; mean prompt logprob")
    policy.confidence_threshold = 0.0  # none is: the large model, streamed through as it comes
    with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": "auto", "prompt": SHORT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.headers["x-jaxinfer-route"] == "large" and r.headers["x-jaxinfer-route-reason"].startswith("low_confidence")
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"large"} and "".join(c["choices"][0]["text"] for c in chunks) == offline["large"][SHORT]
    policy.confidence_threshold = -100.0  # chat: the small model's chat template renders the prompt it scores
    chat = post(url, "/v1/chat/completions", {"model": "auto", "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2})  # 21 tokens, templated
    assert chat.headers["x-jaxinfer-route-reason"].startswith("confident") and chat.json()["model"] == "small"
    policy.confidence_threshold = 0.0
    routing = httpx.get(url + "/v1/routing", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert routing["choices"]["large"]["long_prompt"] >= 1 and routing["choices"]["small"]["confident"] >= 1
    assert routing["choices"]["large"]["low_confidence"] >= 1 and routing["confidence_threshold"] == 0.0
    metrics = httpx.get(url + "/metrics").text
    assert 'jaxinfer:route_choices_total{reason="long_prompt",route="large"} 1.0' in metrics
    assert metrics.count("# TYPE jaxinfer:num_requests_running gauge") == 1  # one family, a sample per model
    assert 'jaxinfer:num_requests_running{model_name="small"}' in metrics and 'model_name="large"' in metrics
    assert "jaxinfer:route_confidence_threshold 0.0" in metrics


def test_feedback_moves_the_threshold(served):
    url, app, llms, offline = served
    app.state.policy.confidence_threshold = -50.0
    ids = [complete(url, "auto", SHORT).json()["id"] for _ in range(2)]
    bad = post(url, "/v1/routing/feedback", {"id": ids[0], "good": False})
    assert bad.status_code == 200 and bad.json() == {"id": ids[0], "route": "small", "reason": "confident",
                                                     "confidence_threshold": -49.5}
    assert post(url, "/v1/routing/feedback", {"id": ids[0], "good": True}).status_code == 404  # judged already
    assert post(url, "/v1/routing/feedback", {"id": ids[1], "score": 1}).json()["confidence_threshold"] == -50.0
    assert post(url, "/v1/routing/feedback", {"id": ids[1]}).status_code == 400
    routing = httpx.get(url + "/v1/routing", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert routing["feedback"]["small"] == {"good": 1, "bad": 1} and routing["confidence_threshold"] == -50.0
    assert 'jaxinfer:route_feedback_total{route="small",verdict="bad"} 1.0' in httpx.get(url + "/metrics").text


def test_a_busy_high_precision_model_hands_auto_to_the_other(served):
    url, app, llms, offline = served
    core = llms["large"].engine.core
    answers = []
    with core._lock:  # the large model's engine cannot step: a request sent to it stays there
        held = threading.Thread(target=lambda: answers.append(complete(url, "large", SHORT)))
        held.start()
        for _ in range(400):
            if app.state.models["large"].state.engine.num_requests:
                break
            time.sleep(0.01)
        moved = complete(url, "auto", LONG)  # long: the large model's, were it not busy
    held.join(30)
    assert (moved.headers["x-jaxinfer-route"], moved.json()["model"]) == ("small", "small")
    assert moved.headers["x-jaxinfer-route-reason"] == "under_load; large holds 1 requests > 0"
    assert moved.json()["choices"][0]["text"] == offline["small"][LONG]
    assert answers[0].json()["choices"][0]["text"] == offline["large"][SHORT]

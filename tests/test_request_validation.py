"""Every value a client sends is checked at the edge (`SamplingParams`, the engine's input checks,
the HTTP protocol): it is either refused, naming the field at fault (ValueError offline, HTTP 400
over the API, never a 500), or accepted and then served without error. And no value a client sends
compiles anything: every jit shape comes from the configuration's buckets and fixed widths.

Property tests (hypothesis) over every `SamplingParams` field and over OpenAI request bodies, all
through one tiny engine: offline first, then its compile count, then behind the real server."""

from __future__ import annotations

import dataclasses
import json
import math

import httpx
import hypothesis
import hypothesis.strategies as st
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.seeds import sampler_seed
from jaxinfer.runtime.compiles import compiles
from jaxinfer.server.app import build_app
from http_server import running
from tiny_models import VOCAB, save_hf_model

ENGINE_ARGS = dict(max_model_len=32, page_size=4, num_pages=64, max_num_batched_tokens=8, max_num_seqs=2, progress=False)
PROMPT = [5, 17, 99, 3, 42]
SETTINGS = hypothesis.settings(max_examples=40, deadline=None, database=None,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("validation-model")
    save_hf_model("llama3.2", directory)
    return LLM(str(directory), warmup=True, **ENGINE_ARGS)


# ----------------------------------------------------------------------------- values to try
HUGE = [2**31, 2**32, 2**40, 2**63, 2**64, 10**12, 10**30, -(2**63) - 1, -(2**31), 10**400]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e-300, 1e-45, 1e39, 1e308, -0.0]
# what a confused client might send for any field
ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE), st.floats(),
                     st.sampled_from(ODD_FLOATS), st.text(max_size=3), st.lists(st.integers(-2, 300), max_size=3))


def ints(low, high):
    return st.one_of(st.integers(low, high), st.sampled_from(HUGE))


def floats(low, high):
    return st.one_of(st.floats(low, high), st.sampled_from(ODD_FLOATS))


FLAG = st.booleans()
TOKEN_IDS = st.lists(st.one_of(st.integers(-2, VOCAB + 2), st.sampled_from(HUGE), st.booleans()), max_size=40)
# per SamplingParams field: values near and past its limits
FIELDS = {
    "n": ints(-1, 3),
    "temperature": floats(-1.0, 3.0),
    "top_p": floats(-0.5, 1.5),
    "top_k": ints(-3, VOCAB + 3),
    "min_p": floats(-0.5, 1.5),
    "repetition_penalty": floats(-1.0, 3.0),
    "presence_penalty": floats(-3.0, 3.0),
    "frequency_penalty": floats(-3.0, 3.0),
    "seed": st.one_of(st.integers(), st.sampled_from(HUGE)),
    "max_tokens": st.one_of(st.none(), ints(-1, 40)),
    "min_tokens": ints(-1, 40),
    "ignore_eos": FLAG,
    "logprobs": st.one_of(st.none(), ints(-2, 25), st.booleans()),
    "prompt_logprobs": st.one_of(st.none(), ints(-2, 25), st.booleans()),
    "stop_token_ids": st.one_of(st.none(), TOKEN_IDS),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "include_stop_str_in_output": FLAG,
    "skip_special_tokens": FLAG,
    "detokenize": FLAG,
    "num_speculative_tokens": st.one_of(st.none(), ints(-1, 3)),
}


@st.composite
def some_fields(draw, fields: dict, most: int = 4) -> dict:
    """A few fields (so that many draws pass), each near its limits or anything at all."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=most, unique=True))
    return {name: draw(st.one_of(fields[name], ANYTHING) if draw(st.integers(0, 9)) == 0 else fields[name])
            for name in names}


def names_a_field(message: str, fields) -> bool:
    return any(f"SamplingParams.{name}" in message for name in fields)


# ----------------------------------------------------------------------------- offline
@SETTINGS
@hypothesis.given(kwargs=some_fields(FIELDS))
def test_every_sampling_params_value_is_refused_naming_its_field_or_runs(llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert names_a_field(str(e), kwargs), str(e)
        hypothesis.event("refused by SamplingParams")
        return
    assert SamplingParams(**dataclasses.asdict(params)) == params  # what multi-process serving replays
    try:
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    except ValueError as e:  # the engine's checks (vocabulary, max_logprobs, max_num_seqs, ...)
        assert names_a_field(str(e), kwargs), str(e)
        hypothesis.event("refused by the engine")
        return
    hypothesis.event("served")
    assert len(out.outputs) == params.n
    for c in out.outputs:
        assert 0 < len(c.token_ids) <= (params.max_tokens or ENGINE_ARGS["max_model_len"])
        assert all(0 <= t < VOCAB for t in c.token_ids)
        if params.logprobs is not None:
            assert len(c.logprobs) == len(c.token_ids)


@pytest.mark.parametrize("field, value", [
    ("seed", -1), ("seed", 2**40), ("seed", -(2**70)), ("temperature", 1e-9), ("top_k", -1),
    ("stop_token_ids", (7, 8)), ("logprobs", True), ("n", 2),
])
def test_edge_values_are_accepted_and_run(llm, field, value):
    params = SamplingParams(max_tokens=3, min_tokens=2, **{field: value})
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=10**12), "top_k"),
    (dict(top_k=VOCAB + 1), "top_k"),
    (dict(stop_token_ids=[10**12], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=[VOCAB], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=list(range(40)), min_tokens=2), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=10**12), "prompt_logprobs"),
    (dict(n=3), "n"),
])
def test_values_past_the_engines_limits_are_refused_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=1e39), "temperature"), (dict(top_p=math.nan), "top_p"), (dict(min_p=math.nan), "min_p"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=math.nan), "presence_penalty"), (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(temperature=10**400), "temperature"), (dict(temperature=True), "temperature"),
    (dict(n=True), "n"), (dict(n=2.0), "n"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(seed=1.0), "seed"), (dict(seed=True), "seed"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(detokenize="no"), "detokenize"), (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
])
def test_sampling_params_refuse_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_vllm_normalizations():
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=0).top_k == 0  # both mean off
    assert SamplingParams(temperature=1e-9).temperature == 0.01  # vLLM raises tiny temperatures to 0.01
    assert SamplingParams(temperature=0).temperature == 0.0  # greedy stays greedy
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    import numpy as np
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.uint64(2**63))
    assert (type(p.n), type(p.temperature), p.seed) == (int, float, 2**63)


def test_any_python_int_seeds_the_sampler_through_a_stable_hash(llm):
    assert [sampler_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]  # the sampler's own range: as given
    reduced = [sampler_seed(s) for s in (-1, 2**32, 2**40, -(2**63), 10**400)]
    assert all(0 <= s < 2**32 for s in reduced) and len(set(reduced)) == len(reduced)
    assert sampler_seed(-1) == 0xF9358970  # pinned: documented in SamplingParams, the same in every process
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    sample = lambda seed: llm.generate([PROMPT], dataclasses.replace(p, seed=seed), use_tqdm=False)[0].outputs[0].token_ids
    assert sample(2**40) == sample(2**40) != sample(0)  # 2**40 is not cut to its low 32 bits (0)
    assert sample(-1) == sample(-1)


# ----------------------------------------------------------------------------- compiles
@st.composite
def served_params(draw) -> SamplingParams:
    """Any accepted settings, within this engine's limits and a prompt's few tokens."""
    max_tokens = draw(st.integers(1, 3))
    return SamplingParams(
        n=draw(st.integers(1, 2)), temperature=draw(st.sampled_from([0.0, 0.01, 0.7, 1.0, 50.0])),
        top_k=draw(st.integers(-1, VOCAB)), top_p=draw(st.floats(0.01, 1.0)), min_p=draw(st.floats(0.0, 1.0)),
        repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
        presence_penalty=draw(st.floats(-2.0, 2.0)), frequency_penalty=draw(st.floats(-2.0, 2.0)),
        seed=draw(st.one_of(st.none(), st.integers())), max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        stop_token_ids=draw(st.sampled_from([0, 1, 7, 8, 9, 16, 17, 30]).flatmap(
            lambda k: st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k, unique=True))),
        ignore_eos=draw(st.booleans()),
    )


def test_request_parameters_compile_nothing_after_warmup(llm):
    # The module's LLM was built with warmup=True: every program it can run is compiled, so no
    # setting below (penalties, ids held back until min_tokens, logprobs, prompt logprobs from a
    # prefill or after a prefix-cache hit, n forks and their page copies, structured outputs)
    # compiles anything, whether XLA compiles it or loads it from the persistent cache.
    compiling = []  # the settings that compiled a program

    @hypothesis.settings(SETTINGS, max_examples=30, phases=[hypothesis.Phase.generate])  # no shrinking: a variant compiles once
    @hypothesis.given(prompt=st.lists(st.integers(3, VOCAB - 1), min_size=5, max_size=5), params=served_params(),
                      constraint=st.sampled_from([None, {"choice": ["yes", "no"]}, {"regex": "[0-9]{1,3}"}]),
                      repeat=st.booleans())
    def serve(prompt, params, constraint, repeat):
        if constraint is not None:
            params = dataclasses.replace(params, structured_outputs=constraint)
        before = compiles(), llm.runner.num_compiles
        for _ in range(1 + repeat):  # the second time from the prefix cache
            llm.generate([prompt], params, use_tqdm=False)
        if (compiles(), llm.runner.num_compiles) != before:
            compiling.append({k: v for k, v in dataclasses.asdict(params).items() if v != getattr(SamplingParams(), k)})

    serve()
    assert not compiling, compiling[:3]


# ----------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(llm):
    """The module's engine behind the real app; the tests above no longer call it directly."""
    with running(build_app(llm, served_model_name="tiny")) as url:
        yield url


JSON_ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE), st.floats(),
                          st.sampled_from(ODD_FLOATS), st.text(max_size=3), st.lists(st.integers(-2, 300), max_size=3),
                          st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
HTTP_FIELDS = {  # an OpenAI body's sampling fields, as JSON
    **{name: values for name, values in FIELDS.items()
       if name not in ("detokenize", "num_speculative_tokens", "prompt_logprobs", "logprobs")},
    "seed": st.one_of(st.integers(), st.sampled_from(HUGE + [2**63 - 1, -(2**63)])),
}
COMPLETION_FIELDS = {**HTTP_FIELDS, "logprobs": st.one_of(st.none(), ints(-2, 25)), "echo": FLAG}
CHAT_FIELDS = {**HTTP_FIELDS, "logprobs": st.one_of(st.none(), FLAG), "top_logprobs": st.one_of(st.none(), ints(-2, 25)),
               "max_completion_tokens": st.one_of(st.none(), ints(-1, 40))}
# the SamplingParams field an engine-side error names for an OpenAI field of another name
ENGINE_NAMES = {"top_logprobs": "logprobs", "max_completion_tokens": "max_tokens"}


@st.composite
def http_body(draw, fields: dict) -> dict:
    return {name: draw(st.one_of(fields[name], JSON_ANYTHING) if draw(st.integers(0, 4)) == 0 else fields[name])
            for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True))}


def check_response(url: str, path: str, body: dict, fields: dict) -> None:
    response = httpx.post(url + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code in (200, 400), (body, response.text)
    hypothesis.event(f"HTTP {response.status_code}")
    if response.status_code == 200:
        return
    error = response.json()["error"]
    named = [name for name in fields if error["param"] == name or name in error["message"]
             or ENGINE_NAMES.get(name, name) in error["message"]]
    assert named, (body, error)


@SETTINGS
@hypothesis.given(fields=http_body(COMPLETION_FIELDS))
def test_completion_bodies_get_200_or_400_naming_the_field(server, fields):
    check_response(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, **fields}, fields)


@hypothesis.settings(SETTINGS, max_examples=25)
@hypothesis.given(fields=http_body(CHAT_FIELDS))
def test_chat_bodies_get_200_or_400_naming_the_field(server, fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    check_response(server, "/v1/chat/completions", body, fields)


@pytest.mark.parametrize("seed, status", [(2**63 - 1, 200), (-(2**63), 200), (2**63, 400), (-(2**63) - 1, 400)])
def test_http_seeds_are_signed_64_bit_as_in_vllm(server, seed, status):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "seed": seed}
    response = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert response.status_code == status
    if status == 400:
        assert response.json()["error"]["param"] == "seed"


def test_nan_and_infinity_in_a_body_are_refused_naming_the_field(server):
    for raw, field in ((b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
                       (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
                       (b'{"model": "tiny", "prompt": "x", "presence_penalty": -Infinity}', "presence_penalty")):
        response = httpx.post(server + "/v1/completions", content=raw, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == field

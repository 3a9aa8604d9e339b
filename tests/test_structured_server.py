"""Structured outputs and tool calls through `jaxinfer serve`'s OpenAI API, driven by the `openai`
client: response_format (json_object, json_schema with strict), vLLM's structured_outputs and
guided_* fields, tools with tool_choice required / named / auto / none, tool calls parsed into
message.tool_calls (streamed and not), and the tool-call parsers of both template families."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxinfer import LLM
from jaxinfer.server import tools
from jaxinfer.server.app import build_app
from http_server import running
from tiny_models import save_hf_model

SETTINGS = dict(max_model_len=512, page_size=8, num_pages=512, max_num_batched_tokens=256, max_num_seqs=16, progress=False)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("structured-server-model")
    save_hf_model("llama3.2", directory, max_position_embeddings=1024)
    return LLM(str(directory), **SETTINGS)


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def client(request, llm):
    with running(build_app(llm, served_model_name="tiny", tool_call_parser=request.param)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], **kw)


def test_response_format_json_schema_strict_gives_valid_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer",
              "minimum": 0, "maximum": 130}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    for temperature in (0.0, 1.0):
        reply = chat(client, temperature=temperature, seed=1, max_tokens=200,
                     response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert reply.choices[0].finish_reason == "stop"


def test_completions_take_response_format_and_guided_fields(client):
    out = client.completions.create(model="tiny", prompt="Pick: ", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert out.choices[0].text in ("red", "green", "blue")
    out = client.completions.create(model="tiny", prompt="Code: ", max_tokens=20, temperature=1.0, seed=4,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(out.choices[0].text) == 6 and out.choices[0].text[3] == "-"
    out = client.completions.create(model="tiny", prompt="Obj: ", max_tokens=200, temperature=0.0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {  # vLLM's completions take it too
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}})
    assert json.loads(out.choices[0].text)["n"] in range(10)


def test_bad_constraints_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="regex"):
        chat(client, max_tokens=5, extra_body={"guided_regex": "a(b"})
    with pytest.raises(openai.BadRequestError, match="at most one output constraint"):
        chat(client, max_tokens=5, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        chat(client, max_tokens=5, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        chat(client, max_tokens=5, response_format={"type": "xml"})
    reply = chat(client, max_tokens=3, temperature=0.0)  # the server is fine afterwards
    assert reply.choices[0].finish_reason in ("length", "stop")


def check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_always_gives_calls(client):
    for seed in range(3):
        reply = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            check_call(call)


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        reply = chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed, max_tokens=300,
                     parallel_tool_calls=False)
        [call] = reply.choices[0].message.tool_calls
        check_call(call)


def test_a_named_tool_choice_calls_that_function(client):
    reply = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 temperature=0.0, max_tokens=300)
    [call] = reply.choices[0].message.tool_calls
    check_call(call, names=("get_time",))


def test_a_streamed_tool_call_arrives_whole(client):
    stream = chat(client, tools=[WEATHER], tool_choice="required", temperature=0.0, max_tokens=300, stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])


def test_tool_results_go_back_into_the_conversation(client):
    reply = chat(client, tools=[WEATHER], tool_choice="required", temperature=0.0, max_tokens=300)
    call = reply.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0.0, tools=[WEATHER], tool_choice="none",
                                            messages=[{"role": "user", "content": "Weather in Oslo?"},
                                                      {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                                      {"role": "tool", "tool_call_id": call.id, "content": "12 C"}])
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("length", "stop")


# ----------------------------------------------------------------------------- the parsers, on known texts
def test_hermes_calls_are_found_between_tags():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
    content, calls = tools.parse_tool_calls(text, "hermes", {"get_weather", "get_time"})
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": 1})]
    assert tools.parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes", {"x"}) == ("<tool_call>{not json}</tool_call>", [])
    assert tools.parse_tool_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', "hermes", {"x"})[1] == []


def test_llama3_json_calls_are_the_whole_reply():
    content, calls = tools.parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": 3}}', "llama3_json", {"get_time"})
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": 3}
    assert tools.parse_tool_calls("It is sunny.", "llama3_json", {"get_time"}) == ("It is sunny.", [])


def test_the_parser_follows_the_chat_template():
    assert tools.detect_parser("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert tools.detect_parser("<|start_header_id|>ipython<|end_header_id|><|python_tag|>") == "llama3_json"

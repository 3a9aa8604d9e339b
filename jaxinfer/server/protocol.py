"""The OpenAI API's request and response shapes, checked field by field.

`parse_completion` / `parse_chat` turn a request body (a dict from JSON) into prompts and one
`SamplingParams`, raising `ApiError` (HTTP 400, OpenAI's error JSON) that names the field at
fault: an unknown field, a wrong type, a value out of range. The response builders turn the
engine's `RequestOutput`s back into OpenAI's JSON, whole or as stream chunks.

Accepted besides OpenAI's fields, as vLLM accepts them: top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, and the
output constraints structured_outputs (StructuredOutputsParams' fields), guided_json,
guided_regex, guided_choice, guided_grammar. OpenAI's response_format (json_object,
json_schema) becomes the same kind of constraint; chat's tools / tool_choice are handled with
`jaxinfer.server.tools`. At most one constraint per request.

Defaults, as OpenAI's and vLLM's: a sampling field the request leaves unset takes the server's
default (`defaults`: the model's generation_config.json, jaxinfer.generation_defaults), else
SamplingParams' own; max_tokens (chat: max_completion_tokens) left unset means up to the end of
the context, unless generation_config.json gives max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from jaxinfer.outputs import PositionLogprobs, RequestOutput
from jaxinfer.sampling_params import GUIDED_ALIASES, SamplingParams, StructuredOutputsParams
from jaxinfer.server import tools as tool_calls


class ApiError(Exception):
    """An error the client caused (or a limit it hit), as OpenAI's error JSON."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.headers = status, param, type, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


# field -> (accepted JSON types, SamplingParams field or None when handled here)
_SAMPLING = {
    "temperature": ((int, float), "temperature"),
    "top_p": ((int, float), "top_p"),
    "top_k": ((int,), "top_k"),
    "min_p": ((int, float), "min_p"),
    "n": ((int,), "n"),
    "seed": ((int,), "seed"),
    "presence_penalty": ((int, float), "presence_penalty"),
    "frequency_penalty": ((int, float), "frequency_penalty"),
    "repetition_penalty": ((int, float), "repetition_penalty"),
    "min_tokens": ((int,), "min_tokens"),
    "ignore_eos": ((bool,), "ignore_eos"),
    "stop_token_ids": ((list,), "stop_token_ids"),
    "include_stop_str_in_output": ((bool,), "include_stop_str_in_output"),
    "skip_special_tokens": ((bool,), "skip_special_tokens"),
    "stop": ((str, list), "stop"),
    "max_tokens": ((int,), "max_tokens"),
}
# field -> (least, greatest) integer over HTTP where SamplingParams takes more: vLLM's API bounds
# seed to a signed 64-bit int (SamplingParams takes any int and hashes it to the sampler's width)
_INT_BOUNDS = {"seed": (-(2**63), 2**63 - 1)}
_CONSTRAINTS = {"response_format": (dict,), "structured_outputs": (dict,), "guided_json": (dict, str),
                "guided_regex": (str,), "guided_choice": (list,), "guided_grammar": (str,)}
# kv_transfer_params: prefill/decode disaggregation (server.kv_transfer), as vLLM's connectors name it
_COMMON = {"model": (str,), "stream": (bool,), "stream_options": (dict,), "user": (str,), "kv_transfer_params": (dict,),
           **_CONSTRAINTS}
COMPLETION_FIELDS = {**_COMMON, "prompt": (str, list), "echo": (bool,), "logprobs": (int,), **{k: v[0] for k, v in _SAMPLING.items()}}
CHAT_FIELDS = {**_COMMON, "messages": (list,), "logprobs": (bool,), "top_logprobs": (int,), "max_completion_tokens": (int,),
               "tools": (list,), "tool_choice": (str, dict), "parallel_tool_calls": (bool,),
               **{k: v[0] for k, v in _SAMPLING.items()}}


@dataclasses.dataclass
class Parsed:
    prompts: list  # strings, token-id lists, or {"prompt", "prompt_token_ids"} dicts
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str | None = None
    tools: list = dataclasses.field(default_factory=list)  # chat: the functions the model may call
    tool_choice: str | dict = "none"
    tool_parser: str = "hermes"  # the call format of the model's chat template (server.tools)
    reasoning_parser: Any = None  # chat: a server.reasoning.ReasoningParser splitting off reasoning_content
    reasoning_opened: bool = False  # ... and whether the rendered prompt left a think block open


def _check_fields(body: Any, fields: dict[str, tuple]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(f"unknown field(s) {unknown}; this server accepts {sorted(fields)}", param=unknown[0])
    for name, value in body.items():
        if value is None:
            continue
        types = fields[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join({str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                                dict: "object"}[t] for t in types)
            raise ApiError(f"'{name}' must be {want}, got {type(value).__name__}", param=name)
    return {k: v for k, v in body.items() if v is not None}


def _constraint(body: dict, forced: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The request's one output constraint, from response_format, structured_outputs, a guided_*
    field or a forced tool call; ApiError naming the field if it is malformed or not alone."""
    given = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", dict(json_object=True)))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError("response_format.json_schema must be an object with a 'schema' object", param="response_format")
            given.append(("response_format", dict(json=spec.get("schema", {}))))  # no schema: any JSON value
        elif kind != "text":
            raise ApiError(f"response_format.type={kind!r}: expected 'text', 'json_object' or 'json_schema'",
                           param="response_format")
    if "structured_outputs" in body:
        given.append(("structured_outputs", body["structured_outputs"]))
    given += [(name, {field: body[name]}) for name, field in GUIDED_ALIASES.items() if name in body]
    if forced is not None:
        given.append(("tool_choice", forced))
    if len(given) > 1:
        raise ApiError(f"give at most one output constraint, got {', '.join(n for n, _ in given)}", param=given[1][0])
    if not given:
        return None
    name, value = given[0]
    if isinstance(value, StructuredOutputsParams):
        return value
    try:
        return StructuredOutputsParams(**value)
    except (TypeError, ValueError) as e:
        raise ApiError(f"{name}: {e}", param=name) from None


def _sampling_params(body: dict, *, max_tokens_field: str = "max_tokens", logprobs: int | None = None,
                     logprobs_field: str = "logprobs", constraint: StructuredOutputsParams | None = None,
                     defaults: dict | None = None) -> SamplingParams:
    """The body's SamplingParams; ApiError naming the body's field (`max_tokens_field` and
    `logprobs_field`: the fields that became max_tokens and logprobs). `defaults` fill the
    sampling fields the body leaves out (generation_config.json's)."""
    for name, (low, high) in _INT_BOUNDS.items():
        if name in body and not low <= body[name] <= high:
            raise ApiError(f"'{name}' must be in [{low}, {high}], got {body[name]}", param=name)
    kwargs = {field: body[name] for name, (_, field) in _SAMPLING.items() if name in body}
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    if max_tokens_field in body:
        kwargs["max_tokens"] = body[max_tokens_field]
    kwargs = {"max_tokens": None, **(defaults or {}), **kwargs}  # no max_tokens: up to the end of the context
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # "SamplingParams.<field>=<value>: why", or about several fields
        field, equals, rest = str(e).removeprefix("SamplingParams.").partition("=")
        if not equals or not field.isidentifier():
            raise ApiError(str(e).replace("SamplingParams", "the sampling parameters")) from None
        name = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(field, field)
        raise ApiError(f"{name}={rest}", param=name) from None


def _stream_options(body: dict) -> bool:
    options = body.get("stream_options") or {}
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(f"stream_options: unknown field(s) {unknown}", param="stream_options")
    if options and not body.get("stream"):
        raise ApiError("stream_options needs stream=true", param="stream_options")
    return bool(options.get("include_usage"))


def parse_completion(body: Any, *, defaults: dict | None = None) -> Parsed:
    """`defaults`: SamplingParams field -> value for the fields the request leaves unset."""
    body = _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise ApiError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                        for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt")
    params = _sampling_params(body, logprobs=body.get("logprobs"), constraint=_constraint(body), defaults=defaults)
    return Parsed(prompts, params, bool(body.get("stream")), _stream_options(body), bool(body.get("echo")), body.get("model"))


def parse_chat(body: Any, *, tool_parser: str = "hermes", defaults: dict | None = None) -> Parsed:
    """`tool_parser`: the call format of the served model's chat template (server.tools);
    `defaults`: SamplingParams field -> value for the fields the request leaves unset."""
    body = _check_fields(body, CHAT_FIELDS)
    try:
        tools, tool_choice = tool_calls.check_tools(body.get("tools"), body.get("tool_choice"))
    except tool_calls.ToolError as e:
        raise ApiError(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
    messages = body.get("messages")
    if not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            _check_tool_call_message(m, i)
            if content is None:
                m["content"] = content = ""
        if isinstance(content, list):  # OpenAI's content parts: text, and image_url for a vision model
            for j, part in enumerate(content):
                _check_content_part(part, f"messages[{i}].content[{j}]")
            if all(part["type"] == "text" for part in content):
                m["content"] = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or an array of content parts", param="messages")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = body.get("top_logprobs", 0) if body.get("logprobs") else None
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    forced = tool_calls.forced_call_constraint(tools, tool_choice, tool_parser, parallel=body.get("parallel_tool_calls", True))
    params = _sampling_params(body, max_tokens_field=max_field, logprobs=logprobs, logprobs_field="top_logprobs",
                              constraint=_constraint(body, forced), defaults=defaults)
    return Parsed([messages], params, bool(body.get("stream")), _stream_options(body), False, body.get("model"),
                  tools, tool_choice, tool_parser)


def _check_content_part(part, where: str) -> None:
    """A text part, or an image_url part whose url is a data: URI or an http(s) URL (a path is
    never read from the server's disk; a URL only from a domain the server allows)."""
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return
    if not (isinstance(part, dict) and part.get("type") == "image_url"):
        raise ApiError(f"{where}: expected a text or an image_url part", param="messages")
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url.lower().startswith(("data:", "http://", "https://")):
        raise ApiError(f"{where}: image_url.url must be a data: URI or an http(s) URL", param="messages")


def _check_tool_call_message(m: dict, i: int) -> None:
    """An assistant message holding earlier tool calls: their arguments become objects, which is
    what chat templates render (OpenAI sends them as JSON text)."""
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise ApiError(f"messages[{i}].tool_calls must be an array", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(f"messages[{i}].tool_calls[{j}] must hold a function with a name", param="messages")
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            except ValueError:
                raise ApiError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", param="messages") from None


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(positions: list[PositionLogprobs], token_ids: list[int], n: int, offset: int = 0) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, positions):
        chosen = entry[token]
        tokens.append(chosen.decoded_token or "")
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for tid, lp in list(entry.items())[: n + 1] if lp.rank is not None
                     or tid == token} if n else None)
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], n: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(text: str | None, lp: float) -> dict:
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for token, pos in zip(token_ids, positions):
        chosen = pos[token]
        top = sorted((lp for lp in pos.values() if lp.rank is not None), key=lambda lp: lp.rank)[:n]
        content.append({**entry(chosen.decoded_token, chosen.logprob), "top_logprobs": [entry(lp.decoded_token, lp.logprob) for lp in top]})
    return {"content": content}


def completion_response(request_id: str, model: str, outputs: list[RequestOutput], parsed: Parsed) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            prefix = (out.prompt or "") if parsed.echo else ""
            lp = None
            if parsed.params.logprobs is not None:
                lp = completion_logprobs(c.logprobs or [], c.token_ids, parsed.params.logprobs, len(prefix))
            choices.append({"index": i * parsed.params.n + c.index, "text": prefix + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(outputs)}


def chat_message(text: str, finish_reason: str | None, parsed: Parsed) -> tuple[dict, str | None]:
    """(the assistant message, the finish reason) of a finished reply: its reasoning in
    reasoning_content with a reasoning parser (server.reasoning), and tool calls parsed out of the
    content when the request offered tools (finish reason "tool_calls" then)."""
    message: dict = {"role": "assistant", "content": text}
    if parsed.reasoning_parser is not None:
        reasoning, message["content"] = parsed.reasoning_parser.extract(text, parsed.reasoning_opened)
        message["reasoning_content"] = reasoning
    if parsed.tools and parsed.tool_choice != "none" and message["content"] is not None:
        names = {t["function"]["name"] for t in parsed.tools}
        content, calls = tool_calls.parse_tool_calls(message["content"], parsed.tool_parser, names)
        if calls:
            return {**message, "content": content, "tool_calls": calls}, "tool_calls"
    return message, finish_reason


def chat_response(request_id: str, model: str, out: RequestOutput, parsed: Parsed) -> dict:
    choices = []
    for c in out.outputs:
        lp = chat_logprobs(c.logprobs or [], c.token_ids, parsed.params.logprobs) if parsed.params.logprobs is not None else None
        message, finish_reason = chat_message(c.text, c.finish_reason, parsed)
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage([out])}

"""The OpenAI API's request and response shapes, checked field by field.

`parse_completion` / `parse_chat` turn a request body (a dict from JSON) into prompts and one
`SamplingParams`, raising `ApiError` (HTTP 400, OpenAI's error JSON) that names the field at
fault: an unknown field, a wrong type, a value out of range. The response builders turn the
engine's `RequestOutput`s back into OpenAI's JSON, whole or as stream chunks.

Accepted besides OpenAI's fields, as vLLM accepts them: top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from jaxinfer.outputs import PositionLogprobs, RequestOutput
from jaxinfer.sampling_params import SamplingParams


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
_COMMON = {"model": (str,), "stream": (bool,), "stream_options": (dict,), "user": (str,)}
COMPLETION_FIELDS = {**_COMMON, "prompt": (str, list), "echo": (bool,), "logprobs": (int,), **{k: v[0] for k, v in _SAMPLING.items()}}
CHAT_FIELDS = {**_COMMON, "messages": (list,), "logprobs": (bool,), "top_logprobs": (int,), "max_completion_tokens": (int,),
               **{k: v[0] for k, v in _SAMPLING.items()}}


@dataclasses.dataclass
class Parsed:
    prompts: list  # strings, token-id lists, or {"prompt", "prompt_token_ids"} dicts
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str | None = None


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


def _sampling_params(body: dict, *, max_tokens_field: str = "max_tokens", logprobs: int | None = None) -> SamplingParams:
    kwargs = {field: body[name] for name, (_, field) in _SAMPLING.items() if name in body}
    if max_tokens_field in body:
        kwargs["max_tokens"] = body[max_tokens_field]
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # "SamplingParams.<field>=...: why"
        field = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
        raise ApiError(str(e).replace("SamplingParams.", ""), param=field) from None


def _stream_options(body: dict) -> bool:
    options = body.get("stream_options") or {}
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(f"stream_options: unknown field(s) {unknown}", param="stream_options")
    if options and not body.get("stream"):
        raise ApiError("stream_options needs stream=true", param="stream_options")
    return bool(options.get("include_usage"))


def parse_completion(body: Any) -> Parsed:
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
    params = _sampling_params(body, logprobs=body.get("logprobs"))
    return Parsed(prompts, params, bool(body.get("stream")), _stream_options(body), bool(body.get("echo")), body.get("model"))


def parse_chat(body: Any) -> Parsed:
    body = _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
            m["content"] = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or an array of text parts", param="messages")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = body.get("top_logprobs", 0) if body.get("logprobs") else None
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params = _sampling_params(body, max_tokens_field=max_field, logprobs=logprobs)
    return Parsed([messages], params, bool(body.get("stream")), _stream_options(body), False, body.get("model"))


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


def chat_response(request_id: str, model: str, out: RequestOutput, parsed: Parsed) -> dict:
    choices = []
    for c in out.outputs:
        lp = chat_logprobs(c.logprobs or [], c.token_ids, parsed.params.logprobs) if parsed.params.logprobs is not None else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": c.finish_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage([out])}

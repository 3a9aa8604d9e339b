"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

    jaxinfer serve ./model --port 8000 --api-key secret --max-queue 256
    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
         -d '{"model": "model", "messages": [{"role": "user", "content": "Hi"}]}'

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events, "data: [DONE]" last), GET /v1/models, GET /health, POST /tokenize, POST /detokenize,
GET /metrics (Prometheus). With an API key every /v1 route wants `Authorization: Bearer <key>`
(401 otherwise). Errors are OpenAI's JSON: 400 naming the field at fault, 401, 404, 429 with
Retry-After past --max-queue, 500 when the engine step holding the request failed, 504 past
--request-timeout. A client that disconnects aborts its request, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.llm import LLM
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import RequestOutput
from jaxinfer.server import protocol, tools
from jaxinfer.server.async_engine import AsyncEngine, EngineFailed
from jaxinfer.server.lockstep import Publisher
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.protocol import ApiError, Parsed


def build_app(llm: LLM, *, served_model_name: str | None = None, api_key: str | None = None,
              max_queue: int | None = None, request_timeout: float | None = None,
              publisher: Publisher | None = None, tool_call_parser: str | None = None,
              lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The app serving `llm`; its engine thread starts and stops with the app's lifespan. On
    several processes this is process 0's, and `publisher` feeds the others (server.lockstep).
    `tool_call_parser`: "hermes" or "llama3_json" (default: what the chat template suggests).
    `lora_modules`: adapter name -> PEFT folder, served as models of those names (the LLM needs
    enable_lora=True); more can be loaded and unloaded at run time on one process."""
    model_name = served_model_name or (llm.source.name if llm.source else "jaxinfer")
    if tool_call_parser is not None and tool_call_parser not in tools.PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r}: expected one of {tools.PARSERS}")
    tool_parser = tool_call_parser or tools.detect_parser(getattr(llm.tokenizer, "chat_template", None))
    adapters = LoraRegistry(llm.engine, model_name)
    for name, path in (lora_modules or {}).items():
        adapters.load(name, path)  # a bad one stops the server from starting, naming it
    metrics = ServerMetrics(llm.engine)
    engine = AsyncEngine(llm.engine, max_queue=max_queue, on_finished=metrics.observe, publisher=publisher)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, model_name

    async def check_api_key(request: Request):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise ApiError("invalid or missing API key (Authorization: Bearer <key>)", status=401, type="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])  # every /v1 route wants the key

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @v1.get("/models")
    async def models():
        now = int(time.time())
        base = {"id": model_name, "object": "model", "created": now, "owned_by": "jaxinfer", "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": now, "owned_by": "jaxinfer", "root": lr.lora_path, "parent": model_name,
             "max_model_len": llm.max_model_len} for name, lr in adapters.items()]}

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError("give 'lora_name' and 'lora_path' (strings)", param="lora_name")
        if publisher is not None:
            raise ApiError("adapters are loaded at start-up (--lora-modules) when serving on several processes", status=400)
        await asyncio.to_thread(adapters.load, name, path)
        return {"status": "ok", "lora_name": name}

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _json(request)
        if publisher is not None:
            raise ApiError("adapters cannot be unloaded when serving on several processes", status=400)
        adapters.unload(body.get("lora_name"))
        return {"status": "ok", "lora_name": body.get("lora_name")}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        if "messages" in body:
            ids = llm.chat_prompt(body["messages"])["prompt_token_ids"]
        elif isinstance(body.get("prompt"), str):
            ids = llm.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise ApiError("give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError("'tokens' must be an array of token ids", param="tokens")
        bad = [t for t in tokens if not 0 <= t < llm.config.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {llm.config.vocab_size})", param="tokens")
        return {"prompt": llm.tokenizer.decode(tokens)}

    @v1.post("/completions")
    async def completions(request: Request):
        parsed = protocol.parse_completion(await _json(request))
        lora = adapters.of_model(parsed.model)
        request_id = protocol.new_id("cmpl")
        streams = [engine.generate(p, parsed.params, request_id=f"{request_id}-{i}", timeout=request_timeout, lora_request=lora)
                   for i, p in enumerate(parsed.prompts)]
        if parsed.stream:
            return _sse(_completion_chunks(request_id, parsed.model or model_name, parsed, streams))
        outputs = await _until_done(request, [_last(s) for s in streams])
        if outputs is None:
            return _client_left()
        return protocol.completion_response(request_id, parsed.model or model_name, outputs, parsed)

    @v1.post("/chat/completions")
    async def chat(request: Request):
        parsed = protocol.parse_chat(await _json(request), tool_parser=tool_parser)
        lora = adapters.of_model(parsed.model)
        try:
            prompt = llm.chat_prompt(parsed.prompts[0], tools=parsed.tools if parsed.tool_choice != "none" else None)
        except Exception as e:  # noqa: BLE001 - the template rejected the conversation
            raise ApiError(f"messages: the chat template failed: {e}", param="messages") from None
        request_id = protocol.new_id("chatcmpl")
        stream = engine.generate(prompt, parsed.params, request_id=request_id, timeout=request_timeout, lora_request=lora)
        if parsed.stream:
            return _sse(_chat_chunks(request_id, parsed.model or model_name, parsed, stream))
        outputs = await _until_done(request, [_last(stream)])
        if outputs is None:
            return _client_left()
        return protocol.chat_response(request_id, parsed.model or model_name, outputs[0], parsed)

    app.include_router(v1)
    return app


# ----------------------------------------------------------------------------- helpers
def _client_left() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


class LoraRegistry:
    """The adapters served by name (a request's "model" picks one): name -> LoRARequest, ids
    handed out in order."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def items(self):
        with self._lock:
            return list(self._by_name.items())

    def load(self, name: str, path: str) -> LoRARequest:
        if self.engine.lora is None:
            raise ApiError("this server runs without LoRA (start it with --enable-lora)", param="lora_name")
        with self._lock:
            if name in self._by_name or name == self.model_name:
                raise ApiError(f"a model named {name!r} is already served", param="lora_name")
            lora = LoRARequest(name, next(self._ids), path)
        try:
            self.engine.lora.check(lora)
        except ValueError as e:
            raise ApiError(str(e), param="lora_path") from None
        with self._lock:
            self._by_name[name] = lora
        return lora

    def unload(self, name) -> None:
        with self._lock:
            lora = self._by_name.get(name)
            if lora is None:
                raise ApiError(f"no adapter named {name!r} is loaded", status=404, param="lora_name", type="not_found_error")
            in_use = self.engine.core.num_unfinished_with_adapter(lora.lora_int_id)
            if in_use:
                raise ApiError(f"adapter {name!r} is in use by {in_use} request(s); unload it when they finish", status=409,
                               param="lora_name")
            del self._by_name[name]  # no new request finds it now
            self.engine.lora.remove(lora.lora_int_id)

    def of_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's "model" names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        with self._lock:
            lora = self._by_name.get(model)
        if lora is None:
            served = [self.model_name] + [n for n, _ in self.items()]
            raise ApiError(f"model {model!r} is not served here; this server serves {served}", status=404,
                           param="model", type="not_found_error")
        return lora


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    return out


async def _until_done(request: Request, waits: list) -> list[RequestOutput] | None:
    """Awaits every request's final output; None if the client disconnects first, which cancels
    them (aborting each, freeing its pages). An engine failure is a 500."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.1, return_when=asyncio.ALL_COMPLETED)
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                return None
        return [t.result() for t in tasks]
    except EngineFailed as e:
        raise ApiError(f"the engine failed on this request: {e}", status=500, type="server_error") from None
    finally:
        for t in tasks:
            t.cancel()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except ApiError as e:  # after the headers went out: the error travels as an event
            yield f"data: {json.dumps(e.body())}\n\n"
        except EngineFailed as e:
            yield f"data: {json.dumps(ApiError(str(e), status=500, type='server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests' streams as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _completion_chunks(request_id: str, model: str, parsed: Parsed, streams) -> AsyncIterator[dict]:
    n, created = parsed.params.n, int(time.time())
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, completion) -> (chars, tokens) sent
    finals, done = {}, set()
    async for i, out in _merged(streams):
        for c in out.outputs:
            if (i, c.index) in done:
                continue
            chars, tokens = sent.get((i, c.index), (0, 0))
            prefix = (out.prompt or "") if parsed.echo and (i, c.index) not in sent else ""
            delta = c.text[chars:]
            if not (prefix or delta or c.finish_reason):
                continue
            lp = None
            if parsed.params.logprobs is not None:
                lp = protocol.completion_logprobs((c.logprobs or [])[tokens:], c.token_ids[tokens:], parsed.params.logprobs, chars)
            sent[(i, c.index)] = (len(c.text), len(c.token_ids))
            if c.finish_reason:
                done.add((i, c.index))
            yield {"id": request_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": i * n + c.index, "text": prefix + delta, "logprobs": lp,
                                "finish_reason": c.finish_reason}]}
        if out.finished:
            finals[i] = out
    if parsed.include_usage:
        yield {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": protocol.usage(list(finals.values()))}


async def _chat_chunks(request_id: str, model: str, parsed: Parsed, stream) -> AsyncIterator[dict]:
    created, sent, done, final = int(time.time()), {}, set(), None
    chunk = lambda choice: {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,  # noqa: E731
                            "choices": [choice]}
    if parsed.tools and parsed.tool_choice != "none":
        # a reply that may be a tool call is sent whole when it ends (content or tool_calls)
        async for out in stream:
            final = out
            for c in out.outputs:
                if c.finish_reason and c.index not in done:
                    done.add(c.index)
                    message, finish_reason = protocol.chat_message(c.text, c.finish_reason, parsed)
                    delta = {"role": "assistant", "content": message["content"]}
                    if "tool_calls" in message:
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                    yield chunk({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason})
        if parsed.include_usage and final is not None:
            yield {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                   "usage": protocol.usage([final])}
        return
    async for out in stream:
        for c in out.outputs:
            if c.index in done:
                continue
            if c.index not in sent:
                yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
                sent[c.index] = (0, 0)
            chars, tokens = sent[c.index]
            delta = c.text[chars:]
            if not (delta or c.finish_reason):
                continue
            lp = None
            if parsed.params.logprobs is not None:
                lp = protocol.chat_logprobs((c.logprobs or [])[tokens:], c.token_ids[tokens:], parsed.params.logprobs)
            sent[c.index] = (len(c.text), len(c.token_ids))
            if c.finish_reason:
                done.add(c.index)
            yield chunk({"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                         "finish_reason": c.finish_reason})
        final = out
    if parsed.include_usage and final is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": protocol.usage([final])}

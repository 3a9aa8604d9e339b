"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncEngine`.

    jaxinfer serve ./model --port 8000 --api-key secret --max-queue 256
    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
         -d '{"model": "model", "messages": [{"role": "user", "content": "Hi"}]}'

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events, "data: [DONE]" last), GET /v1/models, GET /health, POST /tokenize, POST /detokenize,
GET /metrics (Prometheus); with --allow-runtime-lora-updating, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter; a pooling model's server (--runner pooling) POST /v1/embeddings, /v1/score
and /v1/rerank instead of generating (server.pooling_api). With an API key (--api-key or JAXINFER_API_KEY) every /v1 route and
/tokenize, /detokenize want `Authorization: Bearer <key>` (401 otherwise; compared in constant
time); /health and /metrics stay open. Errors are OpenAI's JSON: 400 naming the field at fault,
401, 404, 409 (unloading an adapter in use), 413 for a body over --max-request-bytes, 429 with
Retry-After past --max-queue, 500 when the engine step holding the request failed, 504 past
--request-timeout. A client that disconnects aborts its request, which frees its pages at once.

Requests get OpenAI's and vLLM's defaults: max_tokens left unset runs to the end of the context,
and the sampling fields a request leaves unset take the model's generation_config.json values
(--generation-config auto | vllm | <folder>: jaxinfer.generation_defaults). Chat templating and
tokenization run in worker threads, never on the event loop. With --reasoning-parser, a chat
reply's <think>...</think> goes to reasoning_content and its constraint applies after it
(jaxinfer.server.reasoning).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import os
import threading
import time
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.generation_defaults import generation_defaults
from jaxinfer.llm import LLM
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import RequestOutput
from jaxinfer.server import protocol, tools
from jaxinfer.server.async_engine import AsyncEngine, EngineFailed
from jaxinfer.server.kv_transfer import KVTransfer, KVTransferCollector
from jaxinfer.server.lockstep import Publisher
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.pooling_api import ClientLeft, add_pooling_routes
from jaxinfer.server.protocol import ApiError, Parsed
from jaxinfer.server.reasoning import ReasoningParser
from jaxinfer.server.result_cache import Lookup, ResultCache, cache_control, cache_key, is_deterministic


MAX_REQUEST_BYTES = 16 * 2**20  # a request body's default limit: 16 MiB of JSON


def build_app(llm: LLM, *, served_model_name: str | None = None, api_key: str | None = None,
              max_queue: int | None = None, request_timeout: float | None = None,
              publisher: Publisher | None = None, tool_call_parser: str | None = None,
              lora_modules: dict[str, str] | None = None, allow_runtime_lora_updating: bool = False,
              chat_template: str | None = None, generation_config: str = "auto",
              max_request_bytes: int = MAX_REQUEST_BYTES, kv_transfer: KVTransfer | None = None,
              reasoning_parser: str | None = None, result_cache: ResultCache | None = None) -> FastAPI:
    """The app serving `llm`; its engine thread starts and stops with the app's lifespan. On
    several processes this is process 0's, and `publisher` feeds the others (server.lockstep).
    `tool_call_parser`: "hermes" or "llama3_json" (default: what the chat template suggests).
    `lora_modules`: adapter name -> PEFT folder, served as models of those names (the LLM needs
    enable_lora=True); with `allow_runtime_lora_updating`, more can be loaded (from any folder
    the server can read) and unloaded over HTTP, on one process. `chat_template`: a Jinja
    template, or a file holding one, in place of the tokenizer's. `generation_config`: where
    the sampling defaults come from ("auto", "vllm" or a folder; jaxinfer.generation_defaults).
    `max_request_bytes`: larger request bodies get 413. `kv_transfer`: this instance's role in
    prefill/decode disaggregation (server.kv_transfer; requests then carry kv_transfer_params).
    `reasoning_parser`: "qwen3" or "deepseek_r1" splits a chat reply's thinking into
    reasoning_content, and a request's output constraint then applies after it (server.reasoning).
    `result_cache`: answers repeated deterministic requests from memory (server.result_cache).
    ValueError for a bad setting, naming it."""
    model_name = served_model_name or (llm.source.name if llm.source else "jaxinfer")
    if tool_call_parser is not None and tool_call_parser not in tools.PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r}: expected one of {tools.PARSERS}")
    reasoning = ReasoningParser(reasoning_parser) if reasoning_parser is not None else None  # ValueError naming it
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes!r}: must be a positive integer")
    chat_template = _checked_chat_template(llm, chat_template)
    tool_parser = tool_call_parser or tools.detect_parser(chat_template or getattr(llm.tokenizer, "chat_template", None))
    model_folder = llm.source.path if llm.source is not None and llm.source.kind != "gguf" else None
    sampling_defaults = generation_defaults(generation_config, model_folder)
    adapters = LoraRegistry(llm.engine, model_name)
    for name, path in (lora_modules or {}).items():
        adapters.load(name, path)  # a bad one stops the server from starting, naming it
    metrics = ServerMetrics(llm.engine)
    if kv_transfer is not None:
        if publisher is not None:
            raise ValueError("kv_role: prefill/decode disaggregation serves from one process (the pages arrive on "
                             "process 0's devices)")
        metrics.registry.register(KVTransferCollector(kv_transfer))
    if result_cache is not None:  # jaxinfer:result_cache_hits_total / _misses_total / _entries
        metrics.registry.register(result_cache)
    engine = AsyncEngine(llm.engine, max_queue=max_queue, on_finished=metrics.observe, publisher=publisher)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()
        if engine.stopped:  # with kv_offloading_dir: the device's cached prefix pages to disk
            llm.engine.shutdown()

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, model_name
    app.state.sampling_defaults = sampling_defaults  # SamplingParams field -> what a request leaving it unset gets
    app.state.result_cache = result_cache
    expected_authorization = f"Bearer {api_key}".encode() if api_key is not None else None

    async def check_api_key(request: Request):
        given = request.headers.get("authorization", "").encode()
        if expected_authorization is not None and not hmac.compare_digest(given, expected_authorization):
            raise ApiError("invalid or missing API key (Authorization: Bearer <key>)", status=401, type="authentication_error")

    needs_key = [Depends(check_api_key)]
    v1 = APIRouter(prefix="/v1", dependencies=needs_key)  # every /v1 route wants the key

    async def body_of(request: Request):
        return await _json(request, max_request_bytes)

    def check_runtime_lora_updating():
        if not allow_runtime_lora_updating:
            raise ApiError("loading and unloading adapters over HTTP is off: start the server with "
                           "--allow-runtime-lora-updating (or JAXINFER_ALLOW_RUNTIME_LORA_UPDATING=1)", status=404,
                           type="not_found_error")
        if publisher is not None:
            raise ApiError("adapters are loaded at start-up (--lora-modules) when serving on several processes", status=400)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e)

    @app.get("/health")
    async def health():  # 503 while the engine cannot step (its last step raised)
        return Response(status_code=200 if engine.healthy else 503)

    @v1.get("/models")
    async def models():
        now = int(time.time())
        base = {"id": model_name, "object": "model", "created": now, "owned_by": "jaxinfer", "max_model_len": llm.max_model_len}
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": now, "owned_by": "jaxinfer", "root": lr.lora_path, "parent": model_name,
             "max_model_len": llm.max_model_len} for name, lr in adapters.items()]}

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        check_runtime_lora_updating()
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError("give 'lora_name' and 'lora_path' (strings)", param="lora_name")
        await asyncio.to_thread(adapters.load, name, path)
        return {"status": "ok", "lora_name": name}

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        check_runtime_lora_updating()
        body = await body_of(request)
        adapters.unload(body.get("lora_name"))
        return {"status": "ok", "lora_name": body.get("lora_name")}

    @app.get("/kv_transfer/info")
    async def kv_transfer_info():  # what a router checks before pairing instances
        if kv_transfer is None:
            raise ApiError("this instance has no KV transfer role (start it with --kv-role)", status=404, type="not_found_error")
        return {"model": model_name, **kv_transfer.info()}

    async def handoff_of(body: dict, parsed) -> dict:
        """generate()'s disaggregation arguments for a request's kv_transfer_params: a prefill
        instance exports its prompt's pages (one token computed), a decode instance pulls them first."""
        params = body.get("kv_transfer_params")
        if params is None:
            return {}
        if kv_transfer is None:
            raise ApiError("kv_transfer_params: this instance has no KV transfer role (start it with --kv-role)",
                           param="kv_transfer_params")
        if len(parsed.prompts) != 1 or parsed.params.n != 1:
            raise ApiError("kv_transfer_params: one prompt and n = 1 per disaggregated request", param="kv_transfer_params")
        if kv_transfer.role == "prefill":
            if not params.get("do_remote_decode") or parsed.stream:
                raise ApiError("kv_transfer_params: a prefill instance takes {\"do_remote_decode\": true}, not streamed",
                               param="kv_transfer_params")
            parsed.params = dataclasses.replace(parsed.params, max_tokens=1, min_tokens=0)
            return {"export_kv": True}
        try:
            return {"kv_handoff": await asyncio.to_thread(kv_transfer.pull, params)}
        except ValueError as e:
            raise ApiError(str(e), param="kv_transfer_params") from None
        except RuntimeError as e:
            raise ApiError(str(e), status=502, type="server_error") from None

    def with_offer(response: dict, outputs: list[RequestOutput]) -> dict:
        """A prefill instance's answer: the offer a decode instance pulls the pages with."""
        if outputs[0].kv_handoff is not None:
            response["kv_transfer_params"] = kv_transfer.offer(outputs[0].kv_handoff, outputs[0].prompt_token_ids)
        return response

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def chat_prompt(messages, tools=None) -> dict:
        """The conversation rendered and tokenized, in a worker thread; 400 if the template fails."""
        try:
            return await asyncio.to_thread(llm.chat_prompt, messages, chat_template=chat_template, tools=tools)
        except Exception as e:  # noqa: BLE001 - the template rejected the conversation
            raise ApiError(f"messages: the chat template failed: {e}", param="messages") from None

    @app.post("/tokenize", dependencies=needs_key)
    async def tokenize(request: Request):
        body = await body_of(request)
        if "messages" in body:
            if not isinstance(body["messages"], list):
                raise ApiError("'messages' must be an array", param="messages")
            prompt = await chat_prompt(body["messages"])
            if "prompt_token_ids" not in prompt:  # images: tokenized once their placeholders are expanded
                try:
                    prompt = {"prompt_token_ids": (await asyncio.to_thread(llm.engine.process, prompt, "messages"))[1]}
                except ValueError as e:
                    raise ApiError(str(e), param="messages") from None
            ids = prompt["prompt_token_ids"]
        elif isinstance(body.get("prompt"), str):
            ids = await asyncio.to_thread(llm.tokenizer.encode, body["prompt"],
                                          add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise ApiError("give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", dependencies=needs_key)
    async def detokenize(request: Request):
        body = await body_of(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError("'tokens' must be an array of token ids", param="tokens")
        bad = [t for t in tokens if not 0 <= t < llm.config.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {llm.config.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(llm.tokenizer.decode, tokens)}

    def generate(prompt, params, request_id: str, lora: LoRARequest | None, **handoff) -> AsyncIterator[RequestOutput]:
        """engine.generate, with the adapter pinned while the request lives here (see LoraRegistry.holding)."""
        stream = lambda: engine.generate(prompt, params, request_id=request_id, timeout=request_timeout,  # noqa: E731
                                         lora_request=lora, **handoff)
        return adapters.holding(lora, stream) if lora is not None else stream()

    async def cache_lookup(request: Request, body: dict, parsed: Parsed, parts: dict | None,
                           semantic: tuple[dict, str] | None) -> Lookup | None:
        """The result cache's Lookup of a request (`.response` on a hit; on a miss what `store`
        takes), keyed on `parts`; `semantic`: (the parts but the question, the question) for a
        semantic cache. None when the request bypasses the cache: no cache, no `parts`, sampled
        without a seed, disaggregated, Cache-Control: no-store (no-cache: not looked up, stored)."""
        if result_cache is None or parts is None or "kv_transfer_params" in body or not is_deterministic(parsed.params):
            return None
        look, keep = cache_control(request.headers.get("cache-control"))
        key = cache_key(parts) if keep else None
        if key is None:
            return None
        partition, question = (cache_key(semantic[0]), semantic[1]) if semantic is not None else (None, None)
        find = result_cache.lookup if look else result_cache.ticket
        if result_cache.embeds(question, partition):  # the embedding model runs: off the event loop
            return await asyncio.to_thread(find, key, partition=partition, text=question)
        return find(key, partition=partition, text=question)

    def cached_answer(found: Lookup, parsed: Parsed, id_prefix: str) -> Response:
        """A hit: the stored response with a fresh id and created time, streamed if asked (one
        chunk per choice)."""
        response = {**found.response, "id": protocol.new_id(id_prefix), "created": int(time.time())}
        if parsed.stream:
            return _cache_headed(found, _sse(_replayed(response, parsed.include_usage)))
        return _cache_headed(found, JSONResponse(response))

    def store(found: Lookup, outputs: list, respond) -> None:
        """Stores respond(outputs), the response of a miss, when every choice finished by stop or length."""
        if all(out is not None and out.finished and all(c.finish_reason in ("stop", "length") for c in out.outputs)
               for out in outputs):
            result_cache.insert(found, respond(outputs))

    @v1.post("/completions")
    async def completions(request: Request):
        body = await body_of(request)
        parsed = protocol.parse_completion(body, defaults=app.state.sampling_defaults)
        lora = adapters.of_model(parsed.model)
        handoff = await handoff_of(body, parsed)
        model = parsed.model or model_name
        parts = {"route": "completions", "model": model, "adapter": _adapter_key(lora), "prompts": parsed.prompts,
                 "params": parsed.params, "echo": parsed.echo}
        question = parsed.prompts[0] if len(parsed.prompts) == 1 and isinstance(parsed.prompts[0], str) else None
        found = await cache_lookup(request, body, parsed, parts, ({**parts, "prompts": None}, question) if question else None)
        if found is not None and found.hit:
            return cached_answer(found, parsed, "cmpl")
        request_id = protocol.new_id("cmpl")
        streams = [generate(p, parsed.params, f"{request_id}-{i}", lora, **handoff) for i, p in enumerate(parsed.prompts)]
        if parsed.stream:
            if found is None:
                return _sse(_completion_chunks(request_id, model, parsed, streams))
            finals: dict[int, RequestOutput] = {}  # each stream's last output: the response stored once all went out
            chunks = _completion_chunks(request_id, model, parsed, [_recorded(s, finals, i) for i, s in enumerate(streams)])
            done = lambda: store(found, [finals.get(i) for i in range(len(streams))],  # noqa: E731
                                 lambda outs: protocol.completion_response(request_id, model, outs, parsed))
            return _cache_headed(found, _sse(_storing(chunks, done)))
        outputs = await _until_done(request, [_last(s) for s in streams])
        if outputs is None:
            return _client_left()
        response = with_offer(protocol.completion_response(request_id, model, outputs, parsed), outputs)
        if found is None:
            return response
        store(found, outputs, lambda _: response)
        return _cache_headed(found, JSONResponse(response))

    @v1.post("/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        parsed = protocol.parse_chat(body, tool_parser=tool_parser, defaults=app.state.sampling_defaults)
        lora = adapters.of_model(parsed.model)
        prompt = await chat_prompt(parsed.prompts[0], tools=parsed.tools if parsed.tool_choice != "none" else None)
        if reasoning is not None:  # the reply's thinking goes to reasoning_content; a constraint applies after it
            parsed.reasoning_parser, parsed.reasoning_opened = reasoning, reasoning.opened_by(prompt.get("prompt"))
            if parsed.params.structured_outputs is not None:
                parsed.params = dataclasses.replace(parsed.params, structured_outputs=reasoning.constrain(
                    parsed.params.structured_outputs, parsed.reasoning_opened))
        handoff = await handoff_of(body, parsed)
        model, messages = parsed.model or model_name, parsed.prompts[0]
        parts = {"route": "chat", "model": model, "adapter": _adapter_key(lora),
                 "prompt_token_ids": prompt.get("prompt_token_ids"), "params": parsed.params, "tools": parsed.tools, "tool_choice": parsed.tool_choice,
                 "tool_parser": parsed.tool_parser, "reasoning_opened": parsed.reasoning_opened}
        last = messages[-1]  # semantic: the last user message is embedded; all else (earlier messages too) must match
        question = last["content"] if last.get("role") == "user" and isinstance(last.get("content"), str) else None
        semantic = ({**parts, "prompt_token_ids": None, "earlier_messages": messages[:-1]}, question) if question else None
        found = await cache_lookup(request, body, parsed, parts if "prompt_token_ids" in prompt else None, semantic)
        if found is not None and found.hit:
            return cached_answer(found, parsed, "chatcmpl")
        request_id = protocol.new_id("chatcmpl")
        stream = generate(prompt, parsed.params, request_id, lora, **handoff)
        if parsed.stream:
            if found is None:
                return _sse(_chat_chunks(request_id, model, parsed, stream))
            finals: dict[int, RequestOutput] = {}
            chunks = _chat_chunks(request_id, model, parsed, _recorded(stream, finals, 0))
            done = lambda: store(found, [finals.get(0)],  # noqa: E731
                                 lambda outs: protocol.chat_response(request_id, model, outs[0], parsed))
            return _cache_headed(found, _sse(_storing(chunks, done)))
        outputs = await _until_done(request, [_last(stream)])
        if outputs is None:
            return _client_left()
        response = with_offer(protocol.chat_response(request_id, model, outputs[0], parsed), outputs)
        if found is None:
            return response
        store(found, outputs, lambda _: response)
        return _cache_headed(found, JSONResponse(response))

    if llm.engine.core.pooler is not None:  # --runner pooling: /v1/embeddings, /v1/score, /v1/rerank
        add_pooling_routes(v1, llm=llm, engine=engine, model_name=model_name, body_of=body_of, until_done=_until_done,
                           last=_last, request_timeout=request_timeout)

        @app.exception_handler(ClientLeft)
        async def client_left(request: Request, e: ClientLeft):
            return _client_left()

    app.include_router(v1)
    return app


# ----------------------------------------------------------------------------- helpers
def _adapter_key(lora: LoRARequest | None) -> list | None:
    """A result cache key's adapter: its id too, so an adapter reloaded under its name is another key."""
    return None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]


def _cache_headed(found: Lookup, response: Response) -> Response:
    """X-Result-Cache: exact-hit | semantic-hit | miss (a looked-up request; no-cache ones get none),
    and a semantic hit's X-Result-Cache-Similarity."""
    if found.looked_up:
        response.headers["x-result-cache"] = f"{found.kind}-hit" if found.hit else "miss"
    if found.similarity is not None:
        response.headers["x-result-cache-similarity"] = f"{found.similarity:.4f}"
    return response


async def _recorded(stream: AsyncIterator[RequestOutput], finals: dict, i: int) -> AsyncIterator[RequestOutput]:
    """`stream`'s outputs, the last one kept in finals[i]."""
    async for out in stream:
        finals[i] = out
        yield out


async def _storing(chunks: AsyncIterator[dict], store) -> AsyncIterator[dict]:
    """`chunks`, then store(): only when they all went out (not on an error or a client gone)."""
    async for chunk in chunks:
        yield chunk
    store()


async def _replayed(response: dict, include_usage: bool) -> AsyncIterator[dict]:
    """A cached response as stream chunks: one per choice, holding its whole text (chat: its role,
    content, reasoning_content and tool calls in one delta), then the usage if asked."""
    head = {"id": response["id"], "object": "text_completion", "created": response["created"], "model": response["model"]}
    if response["object"] == "chat.completion":
        head["object"] = "chat.completion.chunk"
    for choice in response["choices"]:
        if "message" in choice:
            message = choice["message"]
            delta = {k: v for k, v in message.items() if k != "tool_calls"}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            choice = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                      "finish_reason": choice["finish_reason"]}
        yield {**head, "choices": [choice]}
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def _client_left() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json(request: Request, limit: int):
    """The request's JSON body; 413 past `limit` bytes, found before reading on (Content-Length)
    or while reading (a chunked body), so a huge body is never held whole."""
    too_large = ApiError(f"the request body is over the server's limit of {limit} bytes (--max-request-bytes)", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


def _checked_chat_template(llm: LLM, chat_template: str | None) -> str | None:
    """The template text of --chat-template (a file's content, or the template itself), checked
    by rendering a one-message conversation; ValueError naming it if it cannot be used."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    elif "{{" not in chat_template and "{%" not in chat_template:
        raise ValueError(f"chat_template={chat_template!r}: no such file, and not a Jinja template")
    try:
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                          chat_template=chat_template)
    except Exception as e:  # noqa: BLE001 - any template error: refuse it at start-up, naming it
        raise ValueError(f"chat_template: it does not render a conversation: {type(e).__name__}: {e}") from None
    return chat_template


class LoraRegistry:
    """The adapters served by name (a request's "model" picks one): name -> LoRARequest, ids
    handed out in order. A request holds its adapter (`holding`: a pin in the engine's
    LoraManager) while its stream runs, tokenization and the engine's queue included; the engine
    holds it from the request's creation until it finishes or is aborted. So an adapter is never
    unloaded (409) nor dropped from the host while a request naming it is queued, being tokenized
    or running; one unloaded between a request's parsing and its stream gets that request a 404."""

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
            if name in self._by_name:  # loaded by another request meanwhile: that one stands
                self.engine.lora.remove(lora.lora_int_id)
                raise ApiError(f"a model named {name!r} is already served", param="lora_name")
            self._by_name[name] = lora
        return lora

    def unload(self, name) -> None:
        with self._lock:
            lora = self._by_name.get(name)
            if lora is None:
                raise ApiError(f"no adapter named {name!r} is loaded", status=404, param="lora_name", type="not_found_error")
            try:
                self.engine.lora.remove(lora.lora_int_id)
            except ValueError:
                raise ApiError(f"adapter {name!r} is in use by requests queued, being tokenized or running; unload it "
                               f"when they finish", status=409, param="lora_name") from None
            del self._by_name[name]  # no new request finds it now

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

    async def holding(self, lora: LoRARequest, stream) -> AsyncIterator[RequestOutput]:
        """The outputs of `stream()` with `lora` pinned meanwhile; 404 if it was unloaded since
        the request named it."""
        with self._lock:
            if self._by_name.get(lora.lora_name) is not lora:
                raise ApiError(f"model {lora.lora_name!r} was unloaded", status=404, param="model", type="not_found_error")
            self.engine.lora.pin(lora.lora_int_id)
        try:
            async for out in stream():
                yield out
        finally:
            self.engine.lora.unpin(lora.lora_int_id)


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
    splits = {}  # choice index -> its ReasoningStream, with a reasoning parser (server.reasoning)

    def split(c) -> tuple[str, str]:  # (reasoning, content) added to choice c's text since the last call
        if c.index not in splits:
            splits[c.index] = parsed.reasoning_parser.stream(parsed.reasoning_opened)
        return splits[c.index].update(c.text, finished=bool(c.finish_reason))

    if parsed.tools and parsed.tool_choice != "none":
        # a reply that may be a tool call is sent whole when it ends (content or tool_calls); its
        # reasoning, with a reasoning parser, as it comes
        async for out in stream:
            final = out
            for c in out.outputs:
                if parsed.reasoning_parser is not None and c.index not in done:
                    reasoning, _ = split(c)
                    if reasoning:
                        first = {"role": "assistant"} if c.index not in sent else {}
                        sent[c.index] = True
                        yield chunk({"index": c.index, "delta": {**first, "reasoning_content": reasoning}, "logprobs": None,
                                     "finish_reason": None})
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
            if parsed.reasoning_parser is not None:
                delta = dict(zip(("reasoning_content", "content"), split(c)))
            else:
                delta = {"content": c.text[chars:]}
            delta = {k: v for k, v in delta.items() if v}
            if not (delta or c.finish_reason):
                continue
            lp = None
            if parsed.params.logprobs is not None:
                lp = protocol.chat_logprobs((c.logprobs or [])[tokens:], c.token_ids[tokens:], parsed.params.logprobs)
            sent[c.index] = (len(c.text), len(c.token_ids))
            if c.finish_reason:
                done.add(c.index)
            yield chunk({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason})
        final = out
    if parsed.include_usage and final is not None:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": protocol.usage([final])}

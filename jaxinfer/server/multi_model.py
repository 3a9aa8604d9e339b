"""Several models in one server, each with its own engine and KV pool, and a routing policy.

    jaxinfer serve --model small=./SmolLM2-135M-Instruct --model large=./Qwen2.5-7B-Instruct \\
                   --routing-policy long_prompt_tokens=1024,confidence_threshold=-2.5
    curl localhost:8000/v1/chat/completions -d '{"model": "auto", "messages": [...]}'

`build_multi_model_app(llms, policy=...)` builds one complete single-model app per route
(app.build_app, served under the route's name, each with its engine thread) and a top app that
owns them. A POST is dispatched in process (an ASGI call, no HTTP hop) to the app of the model its
JSON body names: the body is read once (413 past --max-request-bytes), and for "model": "auto" on
/v1/completions and /v1/chat/completions the policy (server.routing) picks the route; the body's
"model" is rewritten to it and the request forwarded, streamed responses passing through as they
come. So the answer's "model" field names the chosen model, and the headers say why:
`x-jaxinfer-route: <name>` and `x-jaxinfer-route-reason: <reason>[; <detail>]`. A request with no
"model" goes to the first model; an unknown name gets OpenAI's 404 naming the served ones; other
routes (/tokenize, /detokenize, /v1/embeddings ...) go to the named model (default and "auto":
the first). The top app's lifespan enters every model app's lifespan (their engine threads start
and stop with it).

The top app's own routes: GET /v1/models (every model, and "auto"), GET /health (200 when every
engine is healthy), GET /metrics (each model's metrics with a `model_name` label, as vLLM's, and
the router's `jaxinfer:route_choices_total{route, reason}`, `jaxinfer:route_feedback_total{route,
verdict}`, `jaxinfer:route_confidence_threshold`), GET /v1/routing (the policy's settings, counts
and current threshold, and each route's load), POST /v1/routing/feedback {"id": <response id>,
"good": true | false} or {"id": ..., "score": 0..1}. The API key guards /v1 routes and /tokenize,
/detokenize as in app.py.

The confidence rule costs a prefill: the small model's confidence is its mean prompt-token
logprob, measured by a one-token request with prompt_logprobs=0 on the small model's engine
(which computes the whole prompt: such a request skips the prefix-cache look-up, but registers its
pages). When the small model is then chosen, the real request's prefill finds the prompt's full
pages in its prefix cache. The probe runs as one of the small engine's requests (its metrics and
queue count it).

Pool sizing (`model_settings`): each model's pool is sized by its own engine as if alone, so each
model gets a share of --gpu-memory-utilization (and of --kv-cache-memory when given): equal
shares, or `memory_share=F` per model (the others split what is left). On a TPU / GPU a model's
weights, step scratch and pool must fit in its share of each device; on the CPU the pool is 1 GiB
per model unless --kv-cache-memory (split) or --num-pages (per model) says.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.app import MAX_REQUEST_BYTES, _checked_chat_template, _error, _json, _last, build_app
from jaxinfer.server.async_engine import EngineFailed
from jaxinfer.server.protocol import ApiError
from jaxinfer.server.routing import Decision, RoutingPolicy, parse_options

logger = logging.getLogger("jaxinfer.server")

AUTO = "auto"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")  # where "auto" asks the policy
OWN_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/v1/routing", "/v1/routing/feedback", "/docs",
                       "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RESPONSE_ID = re.compile(rb'"id":\s*"([^"\\]{1,200})"')  # the first key of an answer and of a stream's chunks


# ----------------------------------------------------------------------------- --model NAME=PATH
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One `--model NAME=PATH[,OPTION=VALUE...]`: a route's name, its model and its own settings."""

    name: str
    path: str
    options: dict  # LLM keyword -> value (and memory_share)


# option -> (LLM keyword, type); kv_cache_memory takes bytes as the flag does (8GiB, 512MiB, 1073741824)
MODEL_OPTIONS = {"quantization": ("quantization", str), "quantization_group_size": ("quantization_group_size", int),
                 "dtype": ("dtype", str), "kv_cache_dtype": ("kv_cache_dtype", str), "max_model_len": ("max_model_len", int),
                 "num_pages": ("num_pages", int), "kv_cache_memory": ("kv_cache_memory_bytes", "bytes"),
                 "revision": ("revision", str), "memory_share": ("memory_share", float)}


def is_model_spec(text: str) -> bool:
    """Whether a --model value is NAME=PATH (a name, then '='; a path or Hub id has none before it)."""
    name, sep, _ = text.partition("=")
    return bool(sep) and _NAME.fullmatch(name) is not None


def parse_model_spec(text: str) -> ModelSpec:
    """"int8=./model,quantization=int8" -> ModelSpec("int8", "./model", {"quantization": "int8"});
    ValueError naming --model. (A PATH holding ',' cannot be given this way.)"""
    usage = "--model: with several models each is NAME=PATH[,OPTION=VALUE...]"
    name, sep, rest = text.partition("=")
    if not sep or _NAME.fullmatch(name) is None:
        raise ValueError(f"{usage}, NAME of letters, digits, '_', '.', '-'; got {text!r}")
    if name == AUTO:
        raise ValueError(f"--model {text!r}: 'auto' is the router's name, not a model's")
    path, _, opts = rest.partition(",")
    if not path:
        raise ValueError(f"{usage}; got {text!r} (no PATH)")
    options = {}
    for key, value in (parse_options(opts, f"--model {name}") if opts else {}).items():
        if key not in MODEL_OPTIONS:
            raise ValueError(f"--model {name}: unknown option {key!r}; options: {sorted(MODEL_OPTIONS)}")
        keyword, kind = MODEL_OPTIONS[key]
        try:
            options[keyword] = _bytes(value) if kind == "bytes" else kind(value)
        except ValueError:
            raise ValueError(f"--model {name}: {key}={value!r} is not {'a byte count' if kind == 'bytes' else kind.__name__}") from None
    share = options.get("memory_share")
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--model {name}: memory_share={share}: expected a fraction in (0, 1]")
    return ModelSpec(name, path, options)


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(text)
    return int(float(m.group(1)) * 1024 ** (" KMGT".index(m.group(2).upper()) if m.group(2) else 0))


def memory_shares(specs: list[ModelSpec]) -> list[float]:
    """Each model's share of the device memory: its memory_share, the rest split equally among
    the models that give none. ValueError when they add up to more than 1."""
    given = [s.options.get("memory_share") for s in specs]
    taken = sum(g for g in given if g is not None)
    rest = [g is None for g in given].count(True)
    if taken > 1 + 1e-9 or (rest and taken >= 1):
        raise ValueError(f"--model: memory_share values add up to {taken:g}, leaving nothing for "
                         f"{rest} model(s) without one" if rest else f"--model: memory_share values add up to {taken:g} > 1")
    return [g if g is not None else (1 - taken) / rest for g in given]


def model_settings(specs: list[ModelSpec], *, gpu_memory_utilization: float,
                   kv_cache_memory_bytes: int | None = None) -> list[dict]:
    """Per model, the LLM keywords over the shared flags: its path, its options, its share of
    gpu_memory_utilization and of kv_cache_memory_bytes (when given and not its own)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--model: a name given twice in {names}")
    settings = []
    for spec, share in zip(specs, memory_shares(specs)):
        own = {k: v for k, v in spec.options.items() if k != "memory_share"}
        s = {"model": spec.path, "gpu_memory_utilization": gpu_memory_utilization * share}
        if kv_cache_memory_bytes is not None:
            s["kv_cache_memory_bytes"] = max(1, int(kv_cache_memory_bytes * share))
        settings.append({**s, **own})
    return settings


# ----------------------------------------------------------------------------- the app
def build_multi_model_app(llms: dict[str, LLM], *, policy: RoutingPolicy | None = None, api_key: str | None = None,
                          max_request_bytes: int = MAX_REQUEST_BYTES, chat_template: str | None = None,
                          **app_kwargs) -> FastAPI:
    """The app serving every LLM of `llms` (route name -> LLM; the first is the default) and
    "auto" through `policy` (default: RoutingPolicy(names): "auto" is the first model).
    `app_kwargs`: build_app's other settings, applied to every model. ValueError for a bad one."""
    names = list(llms)
    if not names:
        raise ValueError("no model to serve")
    for name in names:
        if _NAME.fullmatch(name) is None or name == AUTO:
            raise ValueError(f"model name {name!r}: letters, digits, '_', '.', '-', and not 'auto'")
    policy = policy or RoutingPolicy(names)
    if policy.routes != names:
        raise ValueError(f"the policy routes to {policy.routes}, the server serves {names}")
    models = {name: build_app(llm, served_model_name=name, api_key=api_key, max_request_bytes=max_request_bytes,
                              chat_template=chat_template, **app_kwargs) for name, llm in llms.items()}
    router = _Router(llms, models, policy, api_key, max_request_bytes,
                     _checked_chat_template(llms[policy.small], chat_template))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with contextlib.AsyncExitStack() as stack:  # a model that fails to start stops those started
            for sub in models.values():
                await stack.enter_async_context(sub.router.lifespan_context(sub))
            yield

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.models, app.state.policy, app.state.model_names = models, policy, names
    metrics = CollectorRegistry()
    metrics.register(_ModelsCollector(models))
    metrics.register(_RoutingCollector(policy))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(e)

    @app.get("/health")
    async def health():
        down = [name for name, sub in models.items() if not sub.state.engine.healthy]
        return Response(status_code=200) if not down else JSONResponse({"unhealthy": down}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(request: Request):
        router.check_key(request.scope)
        now = int(time.time())
        entry = lambda name, max_len, **more: {"id": name, "object": "model", "created": now, "owned_by": "jaxinfer",  # noqa: E731
                                               "max_model_len": max_len, **more}
        return {"object": "list", "data": [entry(name, llm.max_model_len) for name, llm in llms.items()] + [
            entry(AUTO, min(llm.max_model_len for llm in llms.values()), root="router", routes=names)]}

    @app.get("/v1/routing")
    async def routing(request: Request):
        router.check_key(request.scope)
        return {**policy.snapshot(), "load": {name: router.load(name) for name in names}}

    @app.post("/v1/routing/feedback")
    async def feedback(request: Request):
        router.check_key(request.scope)
        body = await _json(request, max_request_bytes)
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            raise ApiError("give 'id' (a response's id) and 'good' (true or false) or 'score' (0 to 1)", param="id")
        good, score = body.get("good"), body.get("score")
        if (good is None) == (score is None):
            raise ApiError("give one of 'good' (true or false) and 'score' (0 to 1)", param="good")
        if good is not None and not isinstance(good, bool):
            raise ApiError("'good' must be true or false", param="good")
        if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1):
            raise ApiError("'score' must be a number from 0 (bad) to 1 (good)", param="score")
        try:
            decision = policy.feedback(body["id"], float(good) if good is not None else float(score))
        except KeyError:
            raise ApiError(f"no routed response {body['id']!r} awaits feedback (unknown, already judged, or one of more "
                           f"than the last {policy.max_remembered})", status=404, param="id", type="not_found_error") from None
        return {"id": body["id"], "route": decision.route, "reason": decision.reason,
                "confidence_threshold": policy.confidence_threshold}

    app.add_middleware(_Dispatch, router=router)
    return app


class _Dispatch:
    """ASGI middleware: a request for a path the top app does not own goes to a model's app."""

    def __init__(self, app, router: "_Router"):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OWN_PATHS:
            return await self.app(scope, receive, send)
        try:
            await self.router.dispatch(scope, receive, send)
        except ApiError as e:  # before anything was forwarded
            await _error(e)(scope, receive, send)


class _Router:
    def __init__(self, llms: dict[str, LLM], models: dict[str, FastAPI], policy: RoutingPolicy, api_key: str | None,
                 max_request_bytes: int, chat_template: str | None):
        self.llms, self.models, self.policy = llms, models, policy
        self.default = next(iter(models))
        self.max_request_bytes, self.chat_template = max_request_bytes, chat_template
        self.authorization = f"Bearer {api_key}".encode() if api_key is not None else None
        self._probe_ids = itertools.count()

    def check_key(self, scope) -> None:
        if self.authorization is None:
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.authorization):
            raise ApiError("invalid or missing API key (Authorization: Bearer <key>)", status=401, type="authentication_error")

    def load(self, route: str) -> int:
        """Requests the route's engine holds, waiting or running (route probes included)."""
        return self.models[route].state.engine.num_requests

    async def dispatch(self, scope, receive, send) -> None:
        if scope["method"] != "POST":
            return await self.models[self.default](scope, receive, send)
        self.check_key(scope)  # before a probe could cost a prefill
        body = await _read_body(scope, receive, self.max_request_bytes)
        if body is None:
            return  # the client left while sending
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            data = None  # the model's app answers 400
        model = data.get("model") if isinstance(data, dict) else None
        generation = scope["path"] in GENERATION_PATHS
        decision = None
        if model == AUTO and generation:
            decision = await self.choose(scope["path"], data)
        elif model is None or model == AUTO or not isinstance(model, str):  # (a non-string: the app's 400)
            decision = self.policy.named(self.default, self.load) if generation else None
        elif model in self.models:
            decision = self.policy.named(model, self.load) if generation else None
        else:
            raise ApiError(f"model {model!r} is not served here; this server serves {list(self.models) + [AUTO]}",
                           status=404, param="model", type="not_found_error")
        named = isinstance(model, str) and model in self.models
        route = decision.route if decision is not None else model if named else self.default
        if isinstance(model, str) and model != route:
            data["model"] = route
            body = json.dumps(data).encode()
        await self.forward(route, decision, scope, body, receive, send)

    async def choose(self, path: str, data: dict) -> Decision:
        """The policy's route for an "auto" request: its prompts' length and, when the confidence
        rule asks, the small model's confidence on them."""
        if not self.policy.needs_prompt:
            return self.policy.decide(None, None, self.load)
        prompts = await self.prompt_ids(path, data)
        longest = max(map(len, prompts)) if prompts else None
        confidence = None
        if prompts and self.policy.needs_confidence(longest):
            confidence = await self.confidence(prompts)
        return self.policy.decide(longest, confidence, self.load)

    async def prompt_ids(self, path: str, data: dict) -> list[list[int]] | None:
        """The request's prompts as the small model's token ids (None when they cannot be had:
        a malformed request, whose route answers 400, or images)."""
        llm = self.llms[self.policy.small]
        try:
            if path == "/v1/chat/completions":
                prompt = await asyncio.to_thread(llm.chat_prompt, data["messages"], chat_template=self.chat_template)
                return [prompt["prompt_token_ids"]] if "prompt_token_ids" in prompt else None
            prompt = data["prompt"]
            if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
                prompt = [prompt]
            return [list(p) if isinstance(p, list) else await asyncio.to_thread(llm.tokenizer.encode, p) for p in prompt]
        except Exception:  # noqa: BLE001 - the model's app checks the request and names what is wrong
            return None

    async def confidence(self, prompts: list[list[int]]) -> float | None:
        """The small model's least mean prompt-token logprob over `prompts` (0 for a prompt of one
        token, nothing to score); None when a probe fails (the prompt is too long for it, its queue
        is full, its step failed)."""
        engine = self.models[self.policy.small].state.engine
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

        async def mean_logprob(ids: list[int]) -> float:
            out = await _last(engine.generate(ids, params, request_id=f"route-probe-{next(self._probe_ids)}"))
            scored = [next(iter(position.values())).logprob for position in (out.prompt_logprobs or [])[1:] if position]
            return sum(scored) / len(scored) if scored else 0.0

        try:
            return min(await asyncio.gather(*(mean_logprob(ids) for ids in prompts)))
        except (ApiError, EngineFailed, ValueError):  # 400 / 429 / 504 there, or its step failed
            return None
        except Exception:  # noqa: BLE001 - routing must not fail a request the large model can answer
            logger.exception("the routing probe on %r failed", self.policy.small)
            return None

    async def forward(self, route: str, decision: Decision | None, scope, body: bytes, receive, send) -> None:
        """The request (its body replayed, then the client's own receive: disconnects) through the
        route's app; its response passes through with the route's headers, and the answer's id is
        remembered for feedback."""
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        status, seen, looking = None, b"", decision is not None

        async def relay(message):
            nonlocal status, seen, looking
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(b"x-jaxinfer-route", route.encode())]
                if decision is not None:
                    extra.append((b"x-jaxinfer-route-reason", decision.header.encode("latin-1", "replace")))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif message["type"] == "http.response.body" and looking:
                seen += message.get("body", b"")
                found = _RESPONSE_ID.search(seen)
                if found is not None:
                    self.policy.remember(found.group(1).decode(), decision)
                if found is not None or status != 200 or len(seen) > 4096:
                    looking, seen = False, b""
            await send(message)

        await self.models[route]({**scope, "headers": headers}, replay, relay)


async def _read_body(scope, receive, limit: int) -> bytes | None:
    """The request body, 413 past `limit` bytes (declared or read); None if the client left."""
    too_large = ApiError(f"the request body is over the server's limit of {limit} bytes (--max-request-bytes)", status=413)
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_large
        if not message.get("more_body", False):
            return bytes(body)


# ----------------------------------------------------------------------------- /metrics
class _ModelsCollector:
    """Every model's metrics in one exposition: each family once, each sample labelled with its
    model's name (`model_name`, as vLLM labels its metrics)."""

    def __init__(self, models: dict[str, FastAPI]):
        self.models = models

    def describe(self):  # no collect() at registration: the engines are read when scraped
        return []

    def collect(self):
        merged: dict[str, Metric] = {}
        for name, sub in self.models.items():
            for family in sub.state.metrics.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    into.add_sample(s.name, {"model_name": name, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()


class _RoutingCollector:
    def __init__(self, policy: RoutingPolicy):
        self.policy = policy

    def describe(self):
        return []

    def collect(self):
        p = self.policy
        choices = CounterMetricFamily("jaxinfer:route_choices", "Generation requests per chosen route and reason "
                                      "(named: the request named it; else the routing policy's rule)", labels=["route", "reason"])
        feedback = CounterMetricFamily("jaxinfer:route_feedback", "Feedback verdicts per route (POST /v1/routing/feedback)",
                                       labels=["route", "verdict"])
        counted, verdicts = p.counts()
        for (route, reason), n in sorted(counted.items()):
            choices.add_metric([route, reason], n)
        for (route, verdict), n in sorted(verdicts.items()):
            feedback.add_metric([route, verdict], n)
        yield choices
        yield feedback
        if p.confidence_threshold is not None:
            yield GaugeMetricFamily("jaxinfer:route_confidence_threshold", "Mean prompt logprob of the small model "
                                    "below which \"auto\" goes to the large model", value=p.confidence_threshold)

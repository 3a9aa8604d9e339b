"""`jaxinfer router`: one OpenAI-compatible endpoint in front of prefill and decode instances.

    jaxinfer serve MODEL --port 8100 --kv-role prefill
    jaxinfer serve MODEL --port 8200 --kv-role decode
    jaxinfer router --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Each completion or chat request goes first to a prefill instance (the least loaded; another one
if it fails), as the same body with `"kv_transfer_params": {"do_remote_decode": true}`, one token
and no streaming: it computes the prompt and answers with the kv_transfer_params of its offered
pages (server.kv_transfer). Then the request goes, with those params, to the least loaded decode
instance, which pulls the pages device to device and generates; its answer (streamed or not)
is the client's. At start-up every instance must answer GET /kv_transfer/info with its role and
the same page geometry (model, page size, page arrays), else the router refuses to start,
naming the one at fault.

Failures: an instance that cannot be reached, errs (5xx) or takes over `timeout` seconds is
skipped for the next prefill instance, and when none is left the client gets 502 / 504 naming
what failed; a request the instance rejects (4xx) gets that answer as is. Pages are freed on both
sides either way: the prefill instance frees its pool's pages when the prompt is done (its offer
expires unpulled after --kv-transfer-timeout), a decode instance takes pages only once the pull
succeeded. Router counters at GET /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.background import BackgroundTask

ROUTES = ("/v1/completions", "/v1/chat/completions")


class RouterError(Exception):
    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        kind = "timeout" if self.status == 504 else "server_error"
        return JSONResponse({"error": {"message": str(self), "type": kind, "param": None, "code": self.status}},
                            status_code=self.status)


@dataclasses.dataclass(eq=False)
class Instance:
    url: str
    role: str
    in_flight: int = 0  # requests it is serving for this router now


class Router:
    def __init__(self, prefill: list[str], decode: list[str], *, timeout: float = 120.0, api_key: str | None = None):
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=5.0))
        self.registry = CollectorRegistry()
        count = lambda name, doc: Counter(f"jaxinfer_router:{name}", doc, registry=self.registry)  # noqa: E731
        self.requests = count("requests", "Requests routed")
        self.prefill_failures = count("prefill_failures", "Prefill attempts that failed (unreachable, 5xx, timeout)")
        self.decode_failures = count("decode_failures", "Decode attempts that failed (unreachable, 5xx, timeout)")

    async def check(self) -> None:
        """Every instance answers with its expected role and all share one page geometry and model;
        RouterError naming the first that does not."""
        seen = None
        for inst in self.prefill + self.decode:
            try:
                r = await self.client.get(f"{inst.url}/kv_transfer/info", timeout=10.0)
                r.raise_for_status()
                info = r.json()
            except (httpx.HTTPError, ValueError) as e:
                raise RouterError(f"{inst.url}: no KV transfer info ({type(e).__name__}: {e}); is it `jaxinfer serve "
                                  f"--kv-role {inst.role}`?") from None
            if info.get("role") != inst.role:
                raise RouterError(f"{inst.url} is a {info.get('role')} instance, given as {inst.role}")
            mine = (info.get("model"), info.get("geometry"))
            if seen is None:
                seen = (inst.url, mine)
            elif mine != seen[1]:
                raise RouterError(f"{inst.url} serves {mine[0]!r} with pages {mine[1]}, but {seen[0]} serves "
                                  f"{seen[1][0]!r} with pages {seen[1][1]}: their KV pages cannot move between them")

    @staticmethod
    def _by_load(pool: list[Instance]) -> list[Instance]:
        return sorted(pool, key=lambda inst: inst.in_flight)

    async def run_prefill(self, path: str, body: dict) -> dict | Response:
        """The prefill answer's kv_transfer_params (or the instance's 4xx answer for the client)."""
        # (one token, no stream: fields about the output's length, echo or logprobs would not fit it)
        dropped = ("stream_options", "max_completion_tokens", "min_tokens", "echo", "logprobs", "top_logprobs")
        prefill_body = {k: v for k, v in body.items() if k not in dropped}
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        failures = []
        for inst in self._by_load(self.prefill):
            inst.in_flight += 1
            try:
                r = await self.client.post(f"{inst.url}{path}", json=prefill_body)
            except httpx.TimeoutException:
                failures.append(f"{inst.url}: no answer within {self.timeout} s")
                self.prefill_failures.inc()
                continue
            except httpx.HTTPError as e:
                failures.append(f"{inst.url}: {type(e).__name__}: {e}")
                self.prefill_failures.inc()
                continue
            finally:
                inst.in_flight -= 1
            if 400 <= r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            if r.status_code != 200:
                failures.append(f"{inst.url}: HTTP {r.status_code} {r.text[:200]}")
                self.prefill_failures.inc()
                continue
            try:
                params = r.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if params is None:
                raise RouterError(f"{inst.url} answered without kv_transfer_params: is it a prefill instance?")
            return params
        status = 504 if failures and all("no answer within" in f for f in failures) else 502
        raise RouterError("every prefill instance failed: " + "; ".join(failures), status)

    async def run_decode(self, path: str, body: dict, params: dict) -> Response:
        """The decode instance's answer, streamed through as it comes."""
        inst = self._by_load(self.decode)[0]
        inst.in_flight += 1
        sent = False
        try:
            request = self.client.build_request("POST", f"{inst.url}{path}", json={**body, "kv_transfer_params": params})
            upstream = await self.client.send(request, stream=True)
            sent = True
        except httpx.TimeoutException:
            self.decode_failures.inc()
            raise RouterError(f"decode instance {inst.url}: no answer within {self.timeout} s", 504) from None
        except httpx.HTTPError as e:
            self.decode_failures.inc()
            raise RouterError(f"decode instance {inst.url}: {type(e).__name__}: {e}") from None
        finally:
            if not sent:  # (cancelled too: the client left)
                inst.in_flight -= 1

        async def done():
            inst.in_flight -= 1
            await upstream.aclose()

        if upstream.status_code != 200:
            content = await upstream.aread()
            await done()
            if upstream.status_code >= 500:
                self.decode_failures.inc()
            return Response(content, status_code=upstream.status_code, media_type="application/json")
        return StreamingResponse(_relay(upstream), status_code=200, media_type=upstream.headers.get("content-type"),
                                 background=BackgroundTask(done))

    async def route(self, path: str, body: dict) -> Response:
        self.requests.inc()
        params = await self.run_prefill(path, body)
        if isinstance(params, Response):
            return params
        return await self.run_decode(path, body, params)


async def _relay(upstream: httpx.Response):
    """The decode instance's bytes as they come; if it breaks off, an error event for the client."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        error = {"error": {"message": f"the decode instance broke off: {type(e).__name__}: {e}", "type": "server_error",
                           "code": 502}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="jaxinfer router")

    async def handle(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            return JSONResponse({"error": {"message": f"the request body is not valid JSON: {e}", "type": "invalid_request_error",
                                           "param": None, "code": 400}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object", "type": "invalid_request_error",
                                           "param": None, "code": 400}}, status_code=400)
        try:
            return await router.route(path, body)
        except RouterError as e:
            return e.response()

    def endpoint(path: str):
        async def forward(request: Request) -> Response:
            return await handle(request, path)
        return forward

    for path in ROUTES:
        app.add_api_route(path, endpoint(path), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        r = await router.client.get(f"{router.decode[0].url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():  # 200 when every instance is healthy
        async def ok(inst):
            try:
                return (await router.client.get(f"{inst.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False
        results = await asyncio.gather(*(ok(i) for i in router.prefill + router.decode))
        return Response(status_code=200 if all(results) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app


def run_router(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1", port: int = 8000,
               timeout: float = 120.0, api_key: str | None = None) -> int:
    """Checks the instances, then serves until SIGTERM / Ctrl-C. 2 if an instance does not fit."""
    import uvicorn

    router = Router(prefill, decode, timeout=timeout, api_key=api_key)
    try:
        asyncio.run(router.check())
    except RouterError as e:
        print(f"jaxinfer router: {e}", file=sys.stderr)
        return 2
    router.client = httpx.AsyncClient(headers=router.client.headers, timeout=router.client.timeout)  # (a fresh loop's)
    print(f"jaxinfer: routing {len(prefill)} prefill and {len(decode)} decode instances on http://{host}:{port}",
          file=sys.stderr, flush=True)
    uvicorn.run(build_router_app(router), host=host, port=port, log_level="warning")
    return 0

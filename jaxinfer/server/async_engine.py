"""The engine in its own thread, for asyncio handlers: they only enqueue and await.

    engine = AsyncEngine(llm.engine, max_queue=256); engine.start()
    async for out in engine.generate(prompt, params):     # RequestOutputs as the request advances
        ...

One thread, "jaxinfer-engine", loops over `LLMEngine.step()` while any request is unfinished
(sleeping on the core's condition otherwise) and hands each RequestOutput to the asyncio queue of
its request (`loop.call_soon_threadsafe`). `generate` adds the request (input checks run there:
a bad request raises `ApiError` 400 before the engine sees it), yields its outputs, and aborts it
when the consumer stops early (a client that disconnects, a timeout), which frees its pages at
once. A step that raises fails the requests it held (each consumer gets the error, HTTP 500) and
the loop goes on with the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import AsyncIterator

from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.request import Request
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.protocol import ApiError

logger = logging.getLogger("jaxinfer.server")


class EngineFailed(Exception):
    """The engine step that held this request raised; the message is the step's error."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_queue: int | None = None, on_finished=None):
        self.engine = engine
        self.max_queue = max_queue  # requests not yet scheduled, beyond which new ones get 429
        self.on_finished = on_finished  # called with each finished RequestOutput (metrics)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        """Requests added whose first step has not been scheduled yet."""
        with self._lock:
            return sum(r.metrics.first_scheduled_time is None for _, _, r in self._streams.values())

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        core = self.engine.core
        while not self._stop.is_set():
            if not core.wait_for_requests(timeout=0.05):
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue, _ = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.engine.abort_request(request_id)
            self._deliver(request_id, EngineFailed(f"{type(error).__name__}: {error}"))

    # ------------------------------------------------------------------ the handlers' side
    async def generate(self, prompt, params: SamplingParams, *, request_id: str | None = None,
                       timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as it advances (the last one finished). Raises ApiError:
        400 for a request the engine cannot run, 429 past max_queue, 504 past `timeout` seconds."""
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise ApiError(f"the server's queue is full ({self.max_queue} requests waiting); retry later", status=429,
                           type="rate_limit_error", headers={"Retry-After": "1"})
        request_id = request_id or f"req-{next(self._ids)}"
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        try:  # input checks and the core's lock: off the event loop
            request = await asyncio.to_thread(self.engine.input.make_request, request_id, prompt, params)
        except ValueError as e:
            raise ApiError(str(e)) from None
        with self._lock:
            self._streams[request_id] = (loop, queue, request)
        finished = False
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await asyncio.to_thread(self.engine.core.add, request)
            while not finished:
                left = None if deadline is None else deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    raise ApiError(f"request {request_id!r} took over the {timeout} s limit", status=504,
                                   type="timeout") from None
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if finished and self.on_finished is not None:
                    self.on_finished(item)
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the consumer left early: free the request's pages now
                self.engine.abort_request(request_id)

"""The engine in its own thread, for asyncio handlers: they only enqueue and await.

    engine = AsyncEngine(llm.engine, max_queue=256); engine.start()
    async for out in engine.generate(prompt, params):     # RequestOutputs as the request advances
        ...

One thread, "jaxinfer-engine", owns the engine. Handlers never call into it: `generate` checks
the request (tokenization and input checks, in a worker thread: a bad request raises `ApiError`
400 before the engine sees it) and posts an `Event` (a request added, or aborted when its consumer
stops early: a client that disconnects, a timeout) to the inbox. Each iteration of the engine
loop drains the inbox, applies its events, and steps while any request is unfinished (sleeping
on the inbox otherwise); each RequestOutput goes to the asyncio queue of its request
(`loop.call_soon_threadsafe`). So adding or aborting never waits for a running step, and an
aborted request's pages are free before the next step is scheduled.

Failures: the engine fails a request whose step failed (EngineCore: that request alone when the
failure is its own, else the requests of the steps in play) and goes on; its consumer gets
`EngineFailed` (HTTP 500), every other request runs on. Should a step raise all the same (the
engine could not recover), every request gets the error and `healthy` is False (`/health`
answers 503) until a step succeeds again: an idle engine thread tries one with a one-token
probe request each second. No exception ends the engine thread.

On several processes (`publisher`, jaxinfer.server.lockstep) each iteration's events are
published before they are applied, so that the other processes replay them and step with this one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import AsyncIterator

from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.kv_handoff import prepare_handoff
from jaxinfer.engine.request import Request
from jaxinfer.outputs import RequestOutput
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.lockstep import Event, Publisher, apply
from jaxinfer.server.protocol import ApiError

logger = logging.getLogger("jaxinfer.server")


class EngineFailed(Exception):
    """The engine step that held this request raised; the message is the step's error."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_queue: int | None = None, on_finished=None,
                 publisher: Publisher | None = None):
        self.engine = engine
        self.max_queue = max_queue  # requests not yet scheduled, beyond which new ones get 429
        self.on_finished = on_finished  # called with each finished RequestOutput (metrics)
        self.publisher = publisher  # the other processes' feed (multi-process serving), or None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._inbox: list[Event] = []  # applied at the start of the engine loop's next iteration
        self._lock = threading.Lock()
        self._posted = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._step_error: str | None = None  # why the last step raised; None once one succeeds
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.board.watch()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the engine loop (and the followers, on several processes)."""
        with self._posted:
            self._stop.set()
            self._posted.notify_all()
        self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        """The engine thread has ended (stop() joined it): the engine is this thread's to use."""
        return not self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """The engine thread runs and its last step did not raise."""
        return self._thread.is_alive() and self._step_error is None

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
        while True:
            with self._posted:
                if not self._busy():
                    self._posted.wait_for(lambda: self._inbox or self._stop.is_set(), timeout=1.0)
                events, self._inbox = self._inbox, []
                stopping = self._stop.is_set()
            if stopping:
                if self.publisher is not None:
                    self.publisher.stop()
                    self.publisher.board.close()
                return
            try:
                if self._step_error is not None and not events and not self._busy():
                    events = [self._probe()]  # idle but unhealthy: find out whether it can step again
                self._iterate(events)
            except Exception as e:  # noqa: BLE001 - the engine could not recover: fail what it holds, keep serving
                logger.exception("engine step failed")
                self._step_error = f"{type(e).__name__}: {e}"
                self._fail_all(e)
                if self.publisher is not None:  # the other processes cannot follow this one: the set ends
                    self.publisher.board.end(f"process 0's step raised {self._step_error}")
                time.sleep(0.05)  # a step that keeps failing must not spin

    def _probe(self) -> Event:
        """A one-token request nobody waits for: the step that runs it clears `healthy`'s error."""
        params = PoolingParams() if self.engine.input.pooler is not None else SamplingParams(max_tokens=1, temperature=0.0)
        request = self.engine.input.make_request(f"health-probe-{next(self._ids)}", [0], params)
        return Event(request=request)

    def _busy(self) -> bool:
        try:
            return self.engine.has_unfinished_requests()
        except Exception:  # noqa: BLE001
            return False

    def _iterate(self, events: list[Event]) -> None:
        """One iteration of the engine loop: this iteration's adds and aborts, then a step."""
        if self.publisher is not None:
            self.publisher.publish(events)
        apply(self.engine, events)
        if not self.engine.has_unfinished_requests():
            return
        outputs = self.engine.step()
        self._step_error = None
        failed = [out.request_id for out in outputs if out.error is not None]
        if failed and self.publisher is not None:  # the followers must have failed the same ones
            self.publisher.board.agree(self.publisher.num_sent - 1, failed)
        for out in outputs:
            if out.error is not None:  # the engine failed this request (and only it)
                self._deliver(out.request_id, EngineFailed(out.error))
            else:
                self._deliver(out.request_id, out)

    def _post(self, event: Event) -> None:
        with self._posted:
            self._inbox.append(event)
            self._posted.notify_all()

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            loop, queue, _ = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        """The requests the failed step held get the error; they are aborted at the next iteration."""
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self._post(Event(abort_id=request_id))
            self._deliver(request_id, EngineFailed(f"{type(error).__name__}: {error}"))

    # ------------------------------------------------------------------ the handlers' side
    async def generate(self, prompt, params: SamplingParams, *, request_id: str | None = None,
                       timeout: float | None = None, lora_request=None, export_kv: bool = False,
                       kv_handoff=None) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs as it advances (the last one finished). Raises ApiError:
        400 for a request the engine cannot run, 429 past max_queue, 504 past `timeout` seconds.
        `export_kv` / `kv_handoff`: prefill/decode disaggregation (engine.kv_handoff)."""
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise ApiError(f"the server's queue is full ({self.max_queue} requests waiting); retry later", status=429,
                           type="rate_limit_error", headers={"Retry-After": "1"})
        request_id = request_id or f"req-{next(self._ids)}"
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        # tokenization and input checks: off the event loop. A request made but never queued (the
        # client left meanwhile, its id taken) gives back what making it took (its adapter's pin).
        making = asyncio.ensure_future(asyncio.to_thread(self.engine.input.make_request, request_id, prompt, params,
                                                         lora_request=lora_request))
        try:
            request = await asyncio.shield(making)
        except ValueError as e:
            raise ApiError(str(e)) from None
        except asyncio.CancelledError:
            making.add_done_callback(lambda f: f.cancelled() or f.exception() or self.engine.discard(f.result()))
            raise
        try:
            prepare_handoff(request, export_kv, kv_handoff, recurrent_states=self.engine.runner.kv.state is not None)
        except ValueError as e:
            self.engine.discard(request)
            raise ApiError(f"kv_transfer_params: {e}", param="kv_transfer_params") from None
        with self._lock:
            taken = request_id in self._streams
            if not taken:
                self._streams[request_id] = (loop, queue, request)
        if taken:
            self.engine.discard(request)
            raise ApiError(f"request id {request_id!r} is already in use")
        self._post(Event(request=request))
        finished = False
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
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
            if not finished:  # the consumer left early: its pages are freed before the next step
                self._post(Event(abort_id=request_id))

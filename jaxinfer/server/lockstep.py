"""Serving on several processes: process 0 takes the requests, every process runs the same steps.

With a mesh over several processes the engine's step is one SPMD program: every process must
dispatch the same steps, with the same batches, in the same order. The engine's host side is
deterministic: processes that see the same requests added and aborted at the same points between
steps schedule the same steps. So process 0, which serves HTTP, publishes before each iteration of
its engine loop the inputs that arrived since the last one, and every other process applies them,
then steps exactly when process 0 does (whenever a request is unfinished):

    process 0 (AsyncEngine)                     process i > 0 (follow)
    events = inbox drained                      message = receive(n)
    publish(n, events)          ---- KV ---->   apply(message.events)
    apply(events); step()       <- collectives -> step()         (if a request is unfinished)

An `Event` is a request added (its id, prompt text and token ids, SamplingParams, the seed it was
given, priority and arrival time: everything the scheduler's order depends on) or a request
aborted. Messages travel through the key-value store of `jax.distributed`'s coordinator (no other
port or service), one key per iteration, `jaxinfer/lockstep/<n>`, deleted `KEEP` iterations later.
`STOP` ends the followers. What the processes compute on the device stays in step on its own
(every collective needs all of them); only the inputs travel.

Failures (`FailureBoard`): the engine fails a request whose step failed and goes on (EngineCore),
and a failure that comes from the request (its input, its results) comes the same way on every
process, which then all take the same path. So a process whose step failed requests posts their
ids for that iteration, `jaxinfer/lockstep/failures/<n>/<process>`, and waits (in a thread) up to
`agree_s` seconds for every other process's ids for the same iteration. Equal sets: all go on.
A missing or different set (the failure was this host's, not the request's), or a step that
raised outright, ends the whole set: the process posts `jaxinfer/lockstep/failed` with the reason
and exits, and every process watches that key from a thread and exits too, even one stuck in a
collective that will never complete. The cluster manager then restarts the job, as for any SPMD
program; nothing hangs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time

import jax
from jax._src import distributed  # the coordinator's key-value store: no public API exposes it

from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.request import Request
from jaxinfer.lora_request import LoRARequest
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger("jaxinfer.server")

KEY_PREFIX = "jaxinfer/lockstep/"
KEEP = 4096  # iterations a message stays in the store (followers lag by a step or two: collectives tie them)
STOP = "stop"
FAILED_KEY = "jaxinfer/lockstep/failed"  # set once, by the first process that ends the set
FAILURES_PREFIX = "jaxinfer/lockstep/failures/"  # <iteration>/<process>: the ids that process's step failed
EXIT_CODE = 70  # a process that leaves because the set ended (EX_SOFTWARE)


@dataclasses.dataclass(frozen=True)
class Event:
    """An input to the engine between two steps: `request` added, or `abort_id` aborted."""

    request: Request | None = None
    abort_id: str | None = None


def encode(events: list[Event]) -> bytes:
    """The wire form of one iteration's events (JSON)."""
    items = []
    for e in events:
        if e.request is None:
            items.append({"abort": e.abort_id})
            continue
        r = e.request
        items.append({"add": {"id": r.request_id, "prompt": r.prompt, "ids": r.prompt_token_ids,
                              "params": dataclasses.asdict(r.params), "seed": r.seed, "priority": r.priority,
                              "arrival": r.metrics.arrival_time, "lora": dataclasses.asdict(r.lora) if r.lora else None}})
    return json.dumps(items).encode()


def apply(engine: LLMEngine, events: list[Event]) -> None:
    """Adds and aborts, in order, as the iteration's first act."""
    for e in events:
        if e.request is not None:
            engine.core.add(e.request)
        else:
            engine.abort_request(e.abort_id)


def decode(engine: LLMEngine, payload: bytes) -> list[Event]:
    """Events from their wire form; each added request is rebuilt by this process's InputProcessor
    (the same checks pass: every process has the same configuration)."""
    events = []
    for item in json.loads(payload):
        if "abort" in item:
            events.append(Event(abort_id=item["abort"]))
            continue
        a = item["add"]
        request = engine.input.make_request(a["id"], {"prompt": a["prompt"], "prompt_token_ids": a["ids"]},
                                            SamplingParams(**a["params"]), priority=a["priority"],
                                            arrival_time=a["arrival"], seed=a["seed"],
                                            lora_request=LoRARequest(**a["lora"]) if a.get("lora") else None)
        events.append(Event(request=request))
    return events


def _client():
    """The coordinator's key-value store client (jax.distributed must be initialized)."""
    if distributed.global_state.client is None:
        raise RuntimeError("multi-process serving needs jax.distributed to be initialized (sharding.mesh.initialize_distributed)")
    return distributed.global_state.client


class FailureBoard:
    """Keeps the processes of a serving set on one path when a step fails (module docstring).

    `agree(n, failed_ids)` after a step of iteration `n` that failed requests; `end(reason)` for a
    failure this process cannot share (its step raised); `watch()` starts the thread that leaves
    when any process has ended the set. `on_end(reason)` is what leaving means (default: log and
    exit the process with EXIT_CODE; a thread cannot interrupt a stuck collective)."""

    def __init__(self, client=None, *, process_index: int | None = None, num_processes: int | None = None,
                 agree_s: float = 30.0, poll_ms: int = 1000, on_end=None):
        self._client = client or _client()
        self.process_index = jax.process_index() if process_index is None else process_index
        self.num_processes = jax.process_count() if num_processes is None else num_processes
        self.agree_s, self.poll_ms = agree_s, poll_ms
        self.on_end = on_end or _exit
        self._ended = threading.Event()
        self._threads: list[threading.Thread] = []

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="jaxinfer-lockstep-board", daemon=True)
        thread.start()
        self._threads.append(thread)

    def agree(self, iteration: int, failed_ids: list[str]) -> None:
        """Posts the ids this process's step `iteration` failed, then checks in a thread that
        every other process failed the same ones within `agree_s` seconds."""
        mine = json.dumps(sorted(failed_ids))
        self._client.key_value_set(f"{FAILURES_PREFIX}{iteration}/{self.process_index}", mine)
        self._start(self._check, iteration, mine)

    def _check(self, iteration: int, mine: str) -> None:
        deadline = time.monotonic() + self.agree_s
        for other in range(self.num_processes):
            if other == self.process_index:
                continue
            left_ms = max(1, int(1000 * (deadline - time.monotonic())))
            try:
                theirs = self._client.blocking_key_value_get(f"{FAILURES_PREFIX}{iteration}/{other}", left_ms)
            except jax.errors.JaxRuntimeError:
                theirs = None
            if theirs != mine:
                said = "nothing" if theirs is None else theirs
                self.end(f"iteration {iteration}: process {self.process_index} failed requests {mine}, "
                         f"process {other} {said} within {self.agree_s} s: a failure of one host, not of the requests")
                return

    def end(self, reason: str) -> None:
        """Ends the whole set: posts the reason for every process's watcher, then leaves."""
        reason = f"process {self.process_index}: {reason}"  # what every process logs, whichever thread leaves first
        try:
            self._client.key_value_set(FAILED_KEY, reason)
        except jax.errors.JaxRuntimeError:  # another process ended it first
            pass
        self._leave(reason)

    def watch(self) -> None:
        """Starts the thread that leaves once any process has ended the set."""
        def run():
            while not self._ended.is_set():
                try:
                    reason = self._client.blocking_key_value_get(FAILED_KEY, self.poll_ms)
                except jax.errors.JaxRuntimeError:
                    continue
                self._leave(reason)
                return
        self._start(run)

    def close(self) -> None:
        """Stops watching (a clean shutdown): no thread may sit in the store's client at exit."""
        self._ended.set()
        for thread in self._threads:
            thread.join()

    def _leave(self, reason: str) -> None:
        if self._ended.is_set():
            return
        self._ended.set()
        logger.error("the serving set ends (%s); leaving", reason)
        self.on_end(reason)


def _exit(reason: str) -> None:
    logging.shutdown()
    os._exit(EXIT_CODE)


class Publisher:
    """Process 0's side: one message per iteration of its engine loop."""

    def __init__(self, client=None, board: FailureBoard | None = None):
        self._client = client or _client()
        self.num_sent = 0
        self.board = board or FailureBoard(self._client)  # start its watch() when serving starts

    def publish(self, events: list[Event]) -> None:
        self._send(encode(events))

    def stop(self) -> None:
        self._send(STOP.encode())

    def _send(self, payload: bytes) -> None:
        n = self.num_sent
        self._client.key_value_set_bytes(f"{KEY_PREFIX}{n}", payload)
        if n >= KEEP:
            self._client.key_value_delete(f"{KEY_PREFIX}{n - KEEP}")
        self.num_sent = n + 1


def follow(engine: LLMEngine, *, client=None, poll_ms: int = 1000, grace_s: float = 60.0,
           board: FailureBoard | None = None) -> int:
    """A process other than 0: replays process 0's inputs and steps with it until it says stop.
    Returns the number of iterations followed. A step that fails requests is checked against the
    other processes (`FailureBoard`); one that raises ends the set.

    SIGTERM / SIGINT (a cluster manager stopping every host at once) do not stop a follower while
    process 0 drains its requests, since leaving would stall process 0's steps; the follower
    waits for process 0's stop, up to `grace_s` seconds after the signal."""
    client = client or _client()
    board = board or FailureBoard(client)
    board.watch()
    signalled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: signalled.append(time.monotonic()))
    n = 0
    while True:
        try:
            payload = client.blocking_key_value_get_bytes(f"{KEY_PREFIX}{n}", poll_ms)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            if signalled and time.monotonic() - signalled[0] > grace_s:
                logger.warning("process 0 sent no stop within %s s of the signal; leaving", grace_s)
                board.close()
                return n
            continue
        if payload == STOP.encode():
            board.close()
            return n
        apply(engine, decode(engine, payload))
        if engine.has_unfinished_requests():
            try:
                failed = [out.request_id for out in engine.step() if out.error is not None]
            except Exception as e:  # noqa: BLE001 - this process cannot go on in step with the others
                logger.exception("engine step failed")
                board.end(f"iteration {n}: the step raised {type(e).__name__}: {e}")
                raise
            if failed:
                board.agree(n, failed)
        n += 1

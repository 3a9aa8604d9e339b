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

Limits: a step that raises on one process only (not on all: a host failure, not a bad request)
leaves the others waiting in a collective; the run must then be restarted, as for any SPMD job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
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


class Publisher:
    """Process 0's side: one message per iteration of its engine loop."""

    def __init__(self, client=None):
        self._client = client or _client()
        self.num_sent = 0

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


def follow(engine: LLMEngine, *, client=None, poll_ms: int = 1000, grace_s: float = 60.0) -> int:
    """A process other than 0: replays process 0's inputs and steps with it until it says stop.
    Returns the number of iterations followed.

    SIGTERM / SIGINT (a cluster manager stopping every host at once) do not stop a follower while
    process 0 drains its requests, since leaving would stall process 0's steps; the follower
    waits for process 0's stop, up to `grace_s` seconds after the signal."""
    client = client or _client()
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
                return n
            continue
        if payload == STOP.encode():
            return n
        apply(engine, decode(engine, payload))
        if engine.has_unfinished_requests():
            engine.step()
        n += 1

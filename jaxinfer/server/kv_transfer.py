"""Prefill/decode disaggregation, the transport: prompt pages moved device to device through
JAX's transfer server (`jax.experimental.transfer`), never through HTTP bodies.

    prefill instance                           decode instance
    ----------------                           ---------------
    request with kv_transfer_params            request with the prefill's kv_transfer_params
      {"do_remote_decode": true}                 {"remote_address", "uuid", "num_tokens", ...}
    engine runs it (one token), hands off  ->  KVTransfer.pull: connect(remote_address).pull(uuid)
    its pages (engine.kv_handoff)                into this process's device, checked against
    KVTransfer.offer: await_pull(uuid, pages)    its own page geometry, then the engine resumes
      (dropped after `timeout_s` unpulled)       the request from them (engine.kv_handoff)

Each instance runs one transfer server (`start_transfer_server` on host:port). The offer is the
handoff's arrays on this process's first device; the pull lands them on the decode process's
first device and the swap-in write reshards them over its mesh, so the two sides may run
different tensor-parallel degrees as long as `page_geometry` (model type, page size, every page
array's global per-page shape and dtype) is the same; a mismatch is refused naming what differs.
Both sides count pages, bytes and seconds (the `kv_transfer` Prometheus metrics).
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import jax

from jaxinfer.engine.kv_handoff import KVHandoff, handoff_specs, page_geometry

KV_ROLES = ("prefill", "decode")


class KVTransfer:
    def __init__(self, role: str, runner, model_type: str, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 60.0):
        """This instance's end: `role` "prefill" (offers pages) or "decode" (pulls them), its
        transfer server on host:port (0: any free port), `timeout_s` for an offer to be pulled and
        for a pull to complete."""
        from jax.experimental import transfer

        if role not in KV_ROLES:
            raise ValueError(f"kv_role={role!r}: expected one of {KV_ROLES}")
        if runner.kv.state is not None or runner.kv_windows != (None,):
            raise ValueError(f"kv_role: {model_type}'s recurrent states or sliding-window layer groups are not handed "
                             f"off yet (prefill/decode disaggregation moves one full-attention page-table row)")
        self.role, self.runner, self.timeout_s = role, runner, timeout_s
        self.device = jax.local_devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, f"{host}:{port}", [f"{host}:0"])
        self.address = self.server.address()
        self.geometry = page_geometry(runner, model_type)
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()
        self.pages = self.bytes = self.transfers = 0  # totals: offered (prefill) or pulled (decode)
        self.seconds = 0.0  # decode: time spent pulling

    def info(self) -> dict:
        return {"role": self.role, "address": self.address, "geometry": self.geometry}

    def offer(self, handoff: KVHandoff, prompt_token_ids: list[int]) -> dict:
        """Makes a handoff's pages pullable once (for timeout_s) and returns the kv_transfer_params
        a decode instance needs to fetch them."""
        uuid = secrets.randbits(63)  # (not guessable: the transfer server has no other access control)
        if handoff.pages is not None:
            arrays = jax.tree.leaves(jax.device_put(handoff.pages, self.device))
            self.server.await_pull(uuid, arrays, timeout=_deadline(self.timeout_s))
        with self._lock:
            self.pages += handoff.num_pages
            self.bytes += handoff.num_bytes
            self.transfers += 1
        return {"remote_address": self.address, "uuid": uuid, "num_tokens": handoff.num_tokens,
                "num_pages": handoff.num_pages, "prompt_token_ids": list(prompt_token_ids), "geometry": self.geometry}

    def pull(self, params: dict) -> KVHandoff:
        """The pages a prefill instance offered (`offer`'s params) on this process's device (the
        engine checks they are the request's prompt's: kv_handoff.prepare_handoff). ValueError for
        params that do not fit this instance; RuntimeError when the transfer fails (the prefill
        instance is gone, the offer expired)."""
        try:
            address, uuid, num_tokens, num_pages = (params[k] for k in ("remote_address", "uuid", "num_tokens", "num_pages"))
        except KeyError as e:
            raise ValueError(f"kv_transfer_params lacks {e.args[0]!r} (give the prefill instance's kv_transfer_params)") from None
        if params.get("geometry") != self.geometry:
            raise ValueError(f"kv_transfer_params: the prefill instance's pages {params.get('geometry')} differ from this "
                             f"instance's {self.geometry} (the same model, page size and KV cache dtype are needed)")
        prompt_token_ids = params.get("prompt_token_ids")
        if not (isinstance(num_tokens, int) and isinstance(num_pages, int) and 0 <= num_tokens
                and num_pages == -(-num_tokens // self.runner.page_size) <= self.runner.buckets.pages_per_seq):
            raise ValueError(f"kv_transfer_params: {num_pages} pages for {num_tokens} tokens do not fit this instance "
                             f"(pages of {self.runner.page_size} tokens, at most {self.runner.buckets.pages_per_seq})")
        if not num_pages:  # (a one-token prompt: nothing to move)
            with self._lock:
                self.transfers += 1
            return KVHandoff(None, num_tokens, prompt_token_ids)
        specs = handoff_specs(self.runner, num_pages, self.device)
        start = time.perf_counter()
        try:
            leaves = self._connection(address).pull(uuid, jax.tree.leaves(specs), timeout=_deadline(self.timeout_s))
            # (the pull returns at once; an offer that is gone never completes: wait with a deadline)
            while not all(leaf.is_ready() for leaf in leaves):
                if time.perf_counter() - start > self.timeout_s:
                    raise TimeoutError(f"no pages within {self.timeout_s} s (the offer expired, was pulled already, "
                                       f"or the prefill instance is gone)")
                time.sleep(0.002)
            jax.block_until_ready(leaves)  # (raises a transfer's error)
        except Exception as e:  # noqa: BLE001 - the transport's errors are runtime errors of many kinds
            with self._lock:
                self._connections.pop(address, None)  # (a restarted peer needs a new connection)
            raise RuntimeError(f"pulling the prompt's KV pages from the prefill instance at {address} failed: "
                               f"{type(e).__name__}: {e}") from None
        handoff = KVHandoff(jax.tree.unflatten(jax.tree.structure(specs), leaves), num_tokens, prompt_token_ids)
        with self._lock:
            self.seconds += time.perf_counter() - start
            self.pages += handoff.num_pages
            self.bytes += handoff.num_bytes
            self.transfers += 1
        return handoff

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self.server.connect(address)
            return self._connections[address]


def _deadline(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


class KVTransferCollector:
    """The `kv_transfer` Prometheus metrics of an instance, read at scrape time."""

    def __init__(self, kv: KVTransfer):
        self.kv = kv

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        verb = "offered" if self.kv.role == "prefill" else "pulled"
        for name, doc, value in (
            ("kv_transfer_pages", f"KV pages {verb} for prefill/decode disaggregation", self.kv.pages),
            ("kv_transfer_bytes", f"KV bytes {verb}", self.kv.bytes),
            ("kv_transfer_requests", f"Requests whose prompt pages were {verb}", self.kv.transfers),
            ("kv_transfer_seconds", "Seconds spent pulling KV pages (decode instances)", self.kv.seconds),
        ):
            yield CounterMetricFamily(f"jaxinfer:{name}", doc, value=value)

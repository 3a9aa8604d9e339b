"""Result caches of the OpenAI server (`jaxinfer serve --result-cache exact | semantic`): a
repeated deterministic request is answered from memory, the engine never seeing it.

    cache = ResultCache(max_entries=1024, ttl_s=600)                       # exact
    cache = ResultCache(embed=llm_embedder(LLM(path, runner="pooling")), similarity=0.95)  # semantic
    found = cache.lookup(key, partition=partition, text=question)   # a Lookup: .response, or None
    ...                                                              # a miss: the engine answers
    cache.insert(found, response)

Keys (`cache_key`) are SHA-256 digests of the canonical JSON (sorted keys, no whitespace) of what
decides a response: the server builds them from the parsed request (model, adapter, prompt token
ids or prompts, every SamplingParams field after the server's defaults, n, logprobs, echo,
tools...). Only deterministic requests are cached (`is_deterministic`: temperature 0, or a
seed); `cache_control` reads a request's Cache-Control header (no-cache: no lookup, the answer
replaces the entry; no-store: neither lookup nor insert).

Storage: at most `max_entries` responses, least recently used evicted first, each dropped
`ttl_s` seconds after it was stored (a hit does not extend it). A stored response is JSON text, so
a hit hands out a fresh copy.

Semantic lookups (an `embed` function given: texts -> L2-normalized rows): a request whose
exact key misses but that has a `text` (the question) and a `partition` (the key of everything
else: model, sampling parameters, earlier messages) is embedded, and the stored entry of the same
partition with the highest cosine similarity answers it when that is >= `similarity`. A
near-duplicate question may have another right answer ("... in 2023?" vs "... in 2024?"): a
semantic cache can answer wrongly, by design; it is opt-in. A text the embedding function
refuses (too long for its model) is looked up exactly only.

Thread-safe (one lock over the storage; embedding calls are serialized by another, outside the
first); `clock` is injectable for tests. `collect()` makes it a Prometheus collector:
jaxinfer:result_cache_hits_total / _misses_total{kind="exact"|"semantic"} (kind: the lookup that
decided: a request the cache embedded counts as semantic, any other as exact) and
jaxinfer:result_cache_entries.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import json
import logging
import math
import threading
import time
from typing import Any, Callable

import numpy as np

log = logging.getLogger("jaxinfer")

KINDS = ("exact", "semantic")
DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 600.0


# ----------------------------------------------------------------------------- keys and rules
def _plain(value: Any) -> Any:
    """`value` as JSON's types: dataclasses as dicts, tuples as lists, NumPy scalars as numbers;
    TypeError for anything else (such a request is not cached rather than keyed loosely)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"a non-finite number {value!r} in a cache key")
        return value
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a cache key's dict keys must be strings")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"a {type(value).__name__} in a cache key")


def canonical_json(value: Any) -> str:
    """One text per value: sorted keys, no whitespace, dataclasses as dicts. TypeError for a
    value that has no JSON form."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def cache_key(parts: Any) -> str | None:
    """The SHA-256 hex digest of `parts`' canonical JSON; None when `parts` has no JSON form."""
    try:
        text = canonical_json(parts)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def is_deterministic(params) -> bool:
    """Whether a request's answer is a function of the request: greedy (temperature 0) or seeded
    sampling. Anything else (temperature > 0 without a seed) is never cached."""
    return params.temperature == 0 or params.seed is not None


def cache_control(header: str | None) -> tuple[bool, bool]:
    """(look up, store) for a request's Cache-Control header: no-cache skips the lookup (a fresh
    answer, which then replaces the entry), no-store skips both; other directives are ignored."""
    directives = {d.strip().split("=", 1)[0].lower() for d in (header or "").split(",")}
    if "no-store" in directives:
        return False, False
    return "no-cache" not in directives, True


# ----------------------------------------------------------------------------- the cache
@dataclasses.dataclass
class Lookup:
    """A lookup's outcome, which `insert` takes back on a miss. `response`: the cached response
    (a fresh dict) on a hit, else None; `kind`: the lookup that decided ("exact", or "semantic"
    when the request was embedded); `similarity`: a semantic hit's cosine similarity;
    `looked_up`: False for a `ticket` (stored, never looked up)."""

    key: str
    partition: str | None = None
    embedding: np.ndarray | None = None
    response: dict | None = None
    kind: str = "exact"
    similarity: float | None = None
    looked_up: bool = True

    @property
    def hit(self) -> bool:
        return self.response is not None


@dataclasses.dataclass
class _Entry:
    body: str  # the response's JSON
    expires: float
    partition: str | None
    embedding: np.ndarray | None


class ResultCache:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S, *,
                 embed: Callable[[list[str]], np.ndarray] | None = None, similarity: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`embed` (texts -> one L2-normalized row each) makes it a semantic cache answering at
        cosine similarity >= `similarity` (in (0, 1]; default 0.95). ValueError naming a bad
        setting."""
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"result_cache_size={max_entries!r}: expected a positive integer")
        if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not (0 < ttl_s < math.inf):
            raise ValueError(f"result_cache_ttl={ttl_s!r}: expected a positive number of seconds")
        if embed is None and similarity is not None:
            raise ValueError("similarity applies to a semantic result cache (give an embedding model)")
        if embed is not None:
            similarity = 0.95 if similarity is None else similarity
            if isinstance(similarity, bool) or not isinstance(similarity, (int, float)) or not 0 < similarity <= 1:
                raise ValueError(f"similarity={similarity!r}: expected a cosine similarity in (0, 1]")
        self.max_entries, self.ttl_s, self.similarity = max_entries, float(ttl_s), similarity
        self.kind = "semantic" if embed is not None else "exact"
        self._embed, self._clock = embed, clock
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # oldest use first
        self._partitions: dict[str, dict[str, np.ndarray]] = {}  # partition -> key -> embedding
        self._lock = threading.Lock()
        self._embed_lock = threading.Lock()
        self.hits = dict.fromkeys(KINDS, 0)
        self.misses = dict.fromkeys(KINDS, 0)

    @property
    def semantic(self) -> bool:
        return self._embed is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    def embeds(self, text: str | None, partition: str | None) -> bool:
        """Whether `lookup` would call the embedding function (slow: call it off the event loop)."""
        return self._embed is not None and text is not None and partition is not None

    def lookup(self, key: str, *, partition: str | None = None, text: str | None = None) -> Lookup:
        """The cached response of `key`; in a semantic cache, when that misses and `text` and
        `partition` are given, the most similar entry of `partition` at >= `similarity`."""
        with self._lock:
            found = Lookup(key, partition)
            body = self._get(key, self._clock())
            if body is not None:
                found.response = json.loads(body)
                self.hits["exact"] += 1
                return found
            if not self.embeds(text, partition):
                self.misses["exact"] += 1
                return found
        found.kind = "semantic"
        found.embedding = self._embedding(text)
        with self._lock:
            if found.embedding is None:  # the embedding model refused it: an exact miss
                found.kind, found.partition = "exact", None
                self.misses["exact"] += 1
                return found
            best = self._nearest(partition, found.embedding, self._clock())
            if best is not None:
                found.similarity, hit_key = best
                found.response = json.loads(self._entries[hit_key].body)
                self._entries.move_to_end(hit_key)
                self.hits["semantic"] += 1
            else:
                self.misses["semantic"] += 1
        return found

    def ticket(self, key: str, *, partition: str | None = None, text: str | None = None) -> Lookup:
        """What `insert` takes for a request that was not looked up (Cache-Control: no-cache):
        embedded as `lookup` would, nothing counted."""
        found = Lookup(key, partition, looked_up=False)
        if self.embeds(text, partition):
            found.embedding = self._embedding(text)
        return found

    def insert(self, found: Lookup, response: dict) -> None:
        """Stores `response` (JSON-serializable) under the key (and, embedded, in the partition)
        of the lookup `found` that missed; evicts the least recently used entries past
        `max_entries`."""
        body = json.dumps(response, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            now = self._clock()
            self._drop(found.key)
            embedding = found.embedding if found.partition is not None else None
            self._entries[found.key] = _Entry(body, now + self.ttl_s, found.partition, embedding)
            if embedding is not None:
                self._partitions.setdefault(found.partition, {})[found.key] = embedding
            self._expire(now)
            while len(self._entries) > self.max_entries:
                self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._partitions.clear()

    # ------------------------------------------------------------------------- internals (lock held)
    def _get(self, key: str, now: float) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= now:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.body

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.embedding is not None:
            members = self._partitions.get(entry.partition, {})
            members.pop(key, None)
            if not members:
                self._partitions.pop(entry.partition, None)

    def _expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self._drop(key)

    def _nearest(self, partition: str, query: np.ndarray, now: float) -> tuple[float, str] | None:
        members = self._partitions.get(partition)
        if not members:
            return None
        for key in [k for k in members if self._entries[k].expires <= now]:
            self._drop(key)
        members = self._partitions.get(partition)
        if not members:
            return None
        keys = list(members)
        sims = np.stack([members[k] for k in keys]) @ query
        best = int(np.argmax(sims))
        return (float(sims[best]), keys[best]) if sims[best] >= self.similarity else None

    def _embedding(self, text: str) -> np.ndarray | None:
        """`text`'s normalized embedding; None if the embedding function refuses it."""
        try:
            with self._embed_lock:
                rows = np.asarray(self._embed([text]), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - e.g. longer than the embedding model's context
            log.warning("result cache: not embedding a request (%s: %s); looked up exactly only", type(e).__name__, e)
            return None
        if rows.ndim != 2 or rows.shape[0] != 1 or not np.all(np.isfinite(rows)):
            raise ValueError(f"the embedding function returned shape {rows.shape}, expected (1, dim) of finite numbers")
        row = rows[0]
        norm = float(np.linalg.norm(row))
        return row / norm if norm > 0 else row

    # ------------------------------------------------------------------------- Prometheus
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, doc, counts in (("result_cache_hits", "Requests answered from the result cache, by the lookup that "
                                   "found them", self.hits),
                                  ("result_cache_misses", "Result cache lookups that found nothing, by the lookup that "
                                   "decided", self.misses)):
            family = CounterMetricFamily(f"jaxinfer:{name}", doc, labels=["kind"])
            for kind in KINDS:
                family.add_metric([kind], counts[kind])
            yield family
        yield GaugeMetricFamily("jaxinfer:result_cache_entries", f"Responses held by the {self.kind} result cache",
                                value=len(self))


def llm_embedder(llm) -> Callable[[list[str]], np.ndarray]:
    """The embedding function of an `LLM(path, runner="pooling")`: `llm.embed` (normalized, as
    the model's pooler config says; normalized again by the cache), rows as float32. A text longer
    than the model's context is refused (ValueError), never truncated: two long texts that differ
    past the cut would look identical."""
    def embed(texts: list[str]) -> np.ndarray:
        ids = [llm.tokenizer.encode(t) for t in texts]
        too_long = [len(i) for i in ids if len(i) > llm.max_model_len]
        if too_long:
            raise ValueError(f"a text of {too_long[0]} tokens is over the embedding model's max_model_len={llm.max_model_len}")
        outs = llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)

    return embed

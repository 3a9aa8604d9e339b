"""The KV cache's lower tiers: prefix pages evicted from the device pool, kept in host memory and
on disk, and loaded back when a later prompt starts with them.

    tiers = KVTiers(HostTier(4 << 30), DiskTier("/var/cache/kv", layout, fingerprint))
    # built by jaxinfer.engine.build from kv_offloading_size / kv_offloading_dir

A prefix page's K/V can sit in three tiers, always under its prefix-cache chain key
(`block_manager.page_key`: 16 bytes that commit to every token up to the page's end and to the
LoRA salt):

  * device: the block manager's prefix cache (evictable pages in the KV pool);
  * host:   `HostTier`, an LRU of page contents bounded by bytes (kv_offloading_size GiB);
  * disk:   `DiskTier`, one file per page under kv_offloading_dir/<the fingerprint's first 16 hex
            digits>/, bounded by bytes (kv_offloading_disk_size GiB; None: unbounded), least
            recently used deleted first.

Flow. When the block manager evicts a cached page to reuse it, it reports (page, key); before
anything of that step writes the page, the engine core reads it to host memory
(`ModelRunner.read_pages_to_host`, one read per step, dispatched without waiting for the device)
and hands it to `KVTiers.offload`: into the host tier, and written through to disk by a
background thread. When `BlockManager.allocate` runs out of device hits, it asks `KVTiers.fetch`
for the next pages in order (host first, then disk, which promotes a hit to the host tier); each
page found gets a fresh device page, registered in the device prefix cache as computed, and the
core writes its content there (`ModelRunner.write_pages`) before the step that reads it. Keys
chain, so page i + 1 is only looked up when page i was found somewhere.

Page content: a dict, array name (the `KVCache` page field: k, v, k_scale, v_scale, kv, kv_scale)
-> that page's array [slots, page_size, ...] of every layer (`PageLayout` lists them). Host
entries are jax arrays in `pinned_host` memory where the device offers it (the eviction read then
costs the host nothing, and the write back is an asynchronous copy), numpy otherwise.

Disk file format (version 1; one file per page, named by the hex of its chain key; the host's
byte order, which must be little-endian):

  offset   size  what
  0        8     magic b"JXKVPAGE"
  8        4     version, uint32 (1)
  12       4     header length H, uint32
  16       H     header, UTF-8 JSON: {"key": hex chain key (= the file name),
                 "fingerprint": hex sha256 of the model and page geometry (`fingerprint`),
                 "arrays": [{"name", "dtype", "shape"}, ...]}
  16 + H   ...   the arrays' raw bytes, C order, one after another in the header's order
  end - 32 32    sha256 of every byte before it

No pickle anywhere. A file is written to a temporary name and renamed, so a reader never sees a
half-written one. A file that is short, corrupt (checksum), of another format version, of
another model or page geometry (fingerprint, arrays), or named for another key is a miss: logged
(a warning the first time for each kind of problem), dropped from the index and never read
again by this process (a later write of the same key replaces it); never an error, never data
used. Several models may share a directory: each model and page geometry keeps its files in a
subdirectory of its own (its fingerprint's first 16 hex digits), with its own size bound. A
temporary file a crashed writer left is deleted when the directory is next read.

Not supported (refused by name in EngineConfig / build_engine): hybrid models' recurrent states,
sliding-window or chunked layer groups (the tiers hold one full-attention page per key), the disk
tier with LoRA adapters (adapter ids are not stable across processes) or on several processes.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import struct
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

logger = logging.getLogger("jaxinfer")

MAGIC = b"JXKVPAGE"
VERSION = 1
_FIXED = struct.Struct("<8sII")  # magic, version, header length
_DIGEST = 32  # sha256
PAGE_FIELDS = ("k", "v", "k_scale", "v_scale", "kv", "kv_scale",  # KVCache's page arrays, in this order
               "k_outlier", "v_outlier", "outlier_token", "outlier_error")
GiB = 2**30

PageContent = dict  # array name -> [slots, page_size, ...] (jax array in host memory, or numpy)


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The arrays one page holds: (name, shape [slots, page_size, ...], numpy dtype) each."""

    arrays: tuple[tuple[str, tuple[int, ...], np.dtype], ...]

    @staticmethod
    def of_pool(kv) -> "PageLayout":
        """The layout of a KV pool's pages (a `KVCache` [slots, P, page_size, ...]; states not counted)."""
        arrays = []
        for name in PAGE_FIELDS:
            a = getattr(kv, name)
            if a is not None:
                arrays.append((name, (a.shape[0], *a.shape[2:]), np.dtype(a.dtype)))
        return PageLayout(tuple(arrays))

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in self.arrays)

    def describe(self) -> list[dict]:
        """The header's "arrays" entry (JSON)."""
        return [{"name": name, "dtype": dtype.name, "shape": list(shape)} for name, shape, dtype in self.arrays]


def fingerprint(description: Mapping[str, Any]) -> str:
    """Hex sha256 of a JSON description of the model and page geometry (what makes a page's
    bytes mean the same thing): files from a model whose description differs are misses."""
    def canonical(o):
        if isinstance(o, (set, frozenset)):
            return sorted(map(str, o))
        return str(o)

    text = json.dumps(description, sort_keys=True, default=canonical)
    return hashlib.sha256(text.encode()).hexdigest()


def content_bytes(content: PageContent) -> int:
    """Host bytes a page content holds (a jax array: every copy its shards keep)."""
    total = 0
    for a in content.values():
        shards = getattr(a, "addressable_shards", None)
        total += sum(s.data.nbytes for s in shards) if shards is not None else a.nbytes
    return total


def as_numpy(content: PageContent) -> PageContent:
    """The content as numpy arrays (waits for a pending read; raises if that read failed)."""
    return {name: np.asarray(a) for name, a in content.items()}


class _WarnOnce:
    """Logs the first problem of each kind as a warning, later ones at debug level."""

    def __init__(self):
        self._seen: set[str] = set()

    def __call__(self, kind: str, message: str, *args) -> None:
        level = logging.DEBUG if kind in self._seen else logging.WARNING
        self._seen.add(kind)
        logger.log(level, message, *args)


# ---------------------------------------------------------------------- host memory
class HostTier:
    """An LRU of page contents, keyed by chain key, bounded by `capacity_bytes`."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"the host tier needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: collections.OrderedDict[bytes, tuple[PageContent, int]] = collections.OrderedDict()  # LRU first
        self.num_bytes = 0
        self.evictions = 0
        self._warn = _WarnOnce()

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def touch(self, key: bytes) -> None:
        """Marks an entry most recently used."""
        self._entries.move_to_end(key)

    def put(self, key: bytes, content: PageContent) -> None:
        """Keeps a page (most recently used), dropping least recently used ones beyond the bound.
        A page larger than the whole tier is not kept."""
        if key in self._entries:
            self.touch(key)
            return
        size = content_bytes(content)
        if size > self.capacity_bytes:
            return
        self._entries[key] = (content, size)
        self.num_bytes += size
        while self.num_bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def get(self, key: bytes) -> PageContent | None:
        """The page's content, most recently used (arrays in pinned host memory stay there: their
        copy back to the devices is asynchronous); None when absent, or when the read that made it
        failed (a step that failed on the device)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        content, _ = entry
        try:
            jax.block_until_ready([a for a in content.values() if isinstance(a, jax.Array)])  # (a failed read raises)
        except Exception as error:  # noqa: BLE001 - a read from a failed step: a miss
            self._warn("failed read", "KV host tier: a page read from the device failed (%s); dropped", error)
            self._drop(key)
            return None
        self.touch(key)
        return content

    def _drop(self, key: bytes) -> None:
        _, size = self._entries.pop(key)
        self.num_bytes -= size


# ---------------------------------------------------------------------- disk
def encode_page(key: bytes, fingerprint_hex: str, layout: PageLayout, content: PageContent) -> bytes:
    """A page file's bytes (module docstring); `content` as numpy arrays of `layout`."""
    header = json.dumps({"key": key.hex(), "fingerprint": fingerprint_hex, "arrays": layout.describe()},
                        sort_keys=True).encode()
    parts = [_FIXED.pack(MAGIC, VERSION, len(header)), header]
    for name, shape, dtype in layout.arrays:
        a = np.ascontiguousarray(content[name])
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(f"page array {name!r}: {a.dtype}{list(a.shape)}, the layout says {dtype}{list(shape)}")
        parts.append(a.tobytes())
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


class PageFileError(ValueError):
    """A page file that is no valid page of this model (`kind`: truncated, corrupt, foreign)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def decode_page(data: bytes, key: bytes, fingerprint_hex: str, layout: PageLayout) -> PageContent:
    """The content of a page file's bytes; PageFileError when they are not a page of `key` for
    this fingerprint and layout."""
    if len(data) < _FIXED.size + _DIGEST:
        raise PageFileError("truncated", f"{len(data)} bytes, shorter than any page file")
    magic, version, header_len = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise PageFileError("foreign", "not a jaxinfer KV page file (magic)")
    if version != VERSION:
        raise PageFileError("foreign", f"format version {version}, this jaxinfer reads {VERSION}")
    if len(data) < _FIXED.size + header_len + _DIGEST:
        raise PageFileError("truncated", f"{len(data)} bytes, shorter than its {header_len}-byte header says")
    if hashlib.sha256(memoryview(data)[:-_DIGEST]).digest() != data[-_DIGEST:]:
        raise PageFileError("corrupt", "checksum mismatch (truncated or damaged)")
    try:
        header = json.loads(data[_FIXED.size : _FIXED.size + header_len])
    except (ValueError, UnicodeDecodeError) as error:
        raise PageFileError("corrupt", f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise PageFileError("corrupt", f"the header is a JSON {type(header).__name__}, not an object")
    if header.get("fingerprint") != fingerprint_hex:
        raise PageFileError("foreign", "written for another model or page geometry (fingerprint)")
    if header.get("arrays") != layout.describe():
        raise PageFileError("foreign", f"arrays {header.get('arrays')}, this engine's pages hold {layout.describe()}")
    if header.get("key") != key.hex():
        raise PageFileError("foreign", f"holds page {header.get('key')}, not the page its name says")
    offset = _FIXED.size + header_len
    if offset + layout.nbytes != len(data) - _DIGEST:
        raise PageFileError("corrupt", f"{len(data) - _DIGEST - offset} bytes of arrays, the layout needs {layout.nbytes}")
    content = {}
    for name, shape, dtype in layout.arrays:
        count = int(np.prod(shape))
        content[name] = np.frombuffer(data, dtype, count, offset).reshape(shape)
        offset += count * dtype.itemsize
    return content


def _key_of_file_name(name: str) -> bytes | None:
    try:
        return bytes.fromhex(name) if len(name) == 32 else None
    except ValueError:
        return None


class DiskTier:
    """One file per page under `directory` (module docstring), written by a background thread.

    The index (keys on disk, least recently used first, with their sizes) is read from the
    directory at start and kept in memory; pages queued for writing count as present (they are
    read from the queue), so what hits does not depend on the writer's timing."""

    def __init__(self, directory: str | os.PathLike, layout: PageLayout, fingerprint_hex: str, *,
                 capacity_bytes: int | None = None):
        if sys.byteorder != "little":
            raise ValueError("kv_offloading_dir: the page file format is little-endian; this host is not")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"the disk tier needs a positive size (or None: unbounded), got {capacity_bytes} bytes")
        # one subdirectory per model and page geometry: models sharing `directory` never see (nor
        # evict, nor overwrite) each other's pages, whose chain keys depend on the tokens alone
        self.directory = Path(directory) / fingerprint_hex[:16]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"kv_offloading_dir={str(directory)!r}: cannot make it ({error})") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offloading_dir={str(directory)!r}: not a directory this process can write to")
        self.layout = layout
        self.fingerprint = fingerprint_hex
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max(64 * layout.nbytes, 256 << 20)  # write-through queue bound (beyond it, pages are not written)
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> file bytes, LRU first
        self._pending: dict[bytes, PageContent] = {}  # queued for writing, not yet on disk
        self._pending_bytes = 0
        self.num_bytes = 0
        self.writes = self.deletions = self.bad_files = self.dropped_writes = 0
        self._warn = _WarnOnce()
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxinfer-kv-disk", daemon=True)
        self._thread.start()
        _register_exit_flush(self)

    # ------------------------------------------------------------------ index
    def _scan(self) -> None:
        """The directory's page files, oldest (least recently used) first, by modification time."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(".tmp") and entry.is_file():
                    try:  # a write a crashed process left half done
                        os.remove(entry.path)
                    except OSError:
                        pass
                    continue
                key = _key_of_file_name(entry.name)
                if key is None or not entry.is_file():
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        for _, _, key, size in sorted(found):
            self._index[key] = size
            self.num_bytes += size

    def _path(self, key: bytes) -> Path:
        return self.directory / key.hex()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------------ reading
    def get(self, key: bytes) -> PageContent | None:
        """The page's content (numpy), read and checked, or None: absent, or a bad file (dropped)."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None and key not in self._index:
                return None
        if pending is not None:
            try:
                return as_numpy(pending)
            except Exception:  # noqa: BLE001 - a read from a failed step (the writer skips it too)
                return None
        path = self._path(key)
        try:
            data = path.read_bytes()
            content = decode_page(data, key, self.fingerprint, self.layout)
        except Exception as error:  # noqa: BLE001 - whatever a file holds, it is a miss, never a failed step
            kind = error.kind if isinstance(error, PageFileError) else "unreadable"
            self._warn(kind, "KV disk tier: %s is a miss (%s: %s)", path, kind, error)
            with self._lock:
                size = self._index.pop(key, None)
                self.num_bytes -= size or 0
                self.bad_files += 1
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)  # most recently used (and on disk, for the next process)
        try:
            os.utime(path)
        except OSError:
            pass
        return content

    # ------------------------------------------------------------------ writing (background)
    def put(self, key: bytes, content: PageContent) -> bool:
        """Queues a page for writing unless it is on disk or queued already; False when the queue
        is full (or the tier closed): the page is not written."""
        size = self.layout.nbytes
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if self._closed or self._pending_bytes + size > self.max_pending_bytes:
                self.dropped_writes += 1
                return False
            self._pending[key] = content
            self._pending_bytes += size
        self._queue.put(key)
        return True

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            except Exception as error:  # noqa: BLE001 - the writer never dies; the page is just not on disk
                self._warn("write", "KV disk tier: writing a page failed: %s", error)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            content = self._pending.get(key)
        try:
            if content is None:
                return
            try:
                content = as_numpy(content)
            except Exception:  # noqa: BLE001 - a read from a failed step: nothing to write
                return
            data = encode_page(key, self.fingerprint, self.layout, content)
            path = self._path(key)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
            with self._lock:
                self.num_bytes += len(data) - self._index.pop(key, 0)
                self._index[key] = len(data)
                self.writes += 1
                victims = []
                while self.capacity_bytes is not None and self.num_bytes > self.capacity_bytes and len(self._index) > 1:
                    old, size = self._index.popitem(last=False)
                    self.num_bytes -= size
                    victims.append(old)
            for old in victims:
                try:
                    os.remove(self._path(old))
                    self.deletions += 1
                except OSError:
                    pass
        finally:
            with self._lock:
                if self._pending.pop(key, None) is not None:
                    self._pending_bytes -= self.layout.nbytes

    def flush(self) -> None:
        """Waits until every queued page is on disk."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Writes every queued page, then stops the writer (later pages are not written)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # (no page is queued after this)
        self._queue.put(None)  # behind every queued page
        self._thread.join()
        _open_disk_tiers.discard(self)


_open_disk_tiers: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()
_exit_hook_registered = False


def _register_exit_flush(tier: DiskTier) -> None:
    """At interpreter exit every open disk tier writes what it has queued (its writer is a daemon
    thread, which would otherwise die with its queue)."""
    global _exit_hook_registered
    _open_disk_tiers.add(tier)
    if not _exit_hook_registered:
        atexit.register(lambda: [t.close() for t in list(_open_disk_tiers)])
        _exit_hook_registered = True


# ---------------------------------------------------------------------- the tiers together
@dataclasses.dataclass
class TierStats:
    offloaded: int = 0  # pages the device evicted into the host tier
    host_hits: int = 0  # pages fetched from the host tier
    disk_hits: int = 0  # pages fetched from the disk tier


class KVTiers:
    """The host tier and the optional disk tier behind it, as the block manager and the core see
    them: `contains` / `fetch` (a prefix look-up), `offload` (an evicted page)."""

    def __init__(self, host: HostTier, disk: DiskTier | None = None):
        self.host = host
        self.disk = disk
        self.stats = TierStats()

    def contains(self, key: bytes) -> bool:
        return key in self.host or (self.disk is not None and key in self.disk)

    def fetch(self, key: bytes) -> tuple[str, PageContent] | None:
        """("host" | "disk", the page's numpy content), or None. A disk hit joins the host tier."""
        content = self.host.get(key)
        if content is not None:
            self.stats.host_hits += 1
            return "host", content
        if self.disk is None:
            return None
        content = self.disk.get(key)
        if content is None:
            return None
        self.host.put(key, content)
        self.stats.disk_hits += 1
        return "disk", content

    def wants(self, key: bytes) -> bool:
        """Whether an evicted page must be read to keep it (not in host memory already: then it
        is only marked recently used)."""
        if key in self.host:
            self.host.touch(key)
            return False
        return True

    def offload(self, key: bytes, content: PageContent) -> None:
        """An evicted page's content: into the host tier, and written through to disk."""
        self.stats.offloaded += 1
        self.host.put(key, content)
        if self.disk is not None:
            self.disk.put(key, content)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

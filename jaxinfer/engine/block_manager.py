"""Host-side page (block) manager: ref-counted KV pages, a prefix cache over full pages, LRU
eviction and copy-on-write for forked sequences. No device code: it hands out page ids and
tells the caller which page copies to perform.

Vocabulary. A sequence (identified by any hashable id) owns a list of pages (its page-table
row). `num_tokens` is how many token slots it has reserved (positions 0..num_tokens-1 have a
page); `num_computed` is how many of those hold K/V already (the caller reports progress with
`mark_computed`). Every page id 1..num_pages-1 is in exactly one state:

  * free       ref count 0, no cached content, on the free list;
  * in use     ref count = number of sequences holding it (>= 1);
  * evictable  ref count 0 but its content is registered in the prefix cache; it can be
               reused by a later prefix hit, or evicted (least recently released first) when
               the free list is empty.

Page 0 is the scratch page (jaxinfer.ops.batch.SCRATCH_PAGE) and is never handed out.

Prefix cache. Page i of a sequence, once full and computed, is keyed by
`blake2b(key of page i-1 || page_size token ids as little-endian int32)` (16-byte digest; the
first page chains from `salt`, e.g. a LoRA id). The key commits to the whole prefix, so a hit
on page i means pages 0..i match too; a 128-bit cryptographic digest makes accidental
collisions negligible, so hits do not compare tokens (and the table need not keep them).

Back-off rule. `allocate` only looks up full pages that lie entirely before the last prompt
token, i.e. the first (len(prompt) - 1) // page_size pages. The last prompt token is therefore
always computed (it produces the logits), and when a page-aligned prompt is entirely cached its
last page is recomputed into a fresh page rather than being written in place: cached pages stay
immutable and no device copy is needed, at the cost of recomputing at most one page of tokens.
A caller that needs some tokens' outputs recomputed (prompt logprobs: a row per prompt token)
caps the look-up with `max_cached_tokens`; the sequence's pages are still registered as they
are computed, for later sequences to reuse.

Copy-on-write. `fork` shares every page of the parent, including a partial last page. Writes
only go to positions >= num_tokens, and the only existing page such a write can touch is the
partial page holding position num_tokens. `prepare_append(seq, n)` reserves n more slots; if
that partial page is shared (ref count > 1) the sequence gets a fresh private page and the
call returns [(src_page, dst_page)], which the caller must copy on the device before the step
that writes into it. Full shared pages are never written.

Stats count prefix-cache queries and hits in pages (tokens = pages * page_size).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Hashable, Sequence

import numpy as np

SCRATCH_PAGE = 0  # same as jaxinfer.ops.jaxinfer.ops.batch.SCRATCH_PAGE (not imported: keep this module free of JAX)


class OutOfPagesError(RuntimeError):
    """Raised when a request for pages cannot be met; the manager's state is left unchanged."""


@dataclasses.dataclass
class SeqPages:
    pages: list[int] = dataclasses.field(default_factory=list)
    num_tokens: int = 0  # token slots reserved
    num_computed: int = 0  # slots whose K/V are written
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain keys of its first full pages
    salt: bytes = b""


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt pages looked up
    hits: int = 0  # of those, pages found and reused
    evictions: int = 0  # cached pages whose content was dropped to be reused

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def page_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full page, chained from its parent's key."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (page 0 is scratch) and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._key_of_page: dict[int, bytes] = {}
        self._page_of_key: dict[bytes, int] = {}
        self.seqs: dict[Hashable, SeqPages] = {}
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages whose content is registered in the prefix cache (in use or evictable)."""
        return len(self._page_of_key)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by at least one sequence."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def num_cached_prefix_pages(self, token_ids: Sequence[int], *, salt: bytes = b"",
                                max_cached_tokens: int | None = None) -> int:
        """How many leading pages of a prompt `allocate` would find in the prefix cache now (a
        read-only look-up: no stats, no state change)."""
        num_lookup = self._num_lookup(len(token_ids), max_cached_tokens)
        ps, parent = self.page_size, salt
        for i in range(num_lookup):
            parent = page_key(parent, token_ids[i * ps : (i + 1) * ps])
            if parent not in self._page_of_key:
                return i
        return num_lookup

    def _num_lookup(self, num_tokens: int, max_cached_tokens: int | None) -> int:
        """Leading pages of a num_tokens prompt to look up: the full ones before its last token,
        and at most max_cached_tokens tokens' worth (None: no cap)."""
        if not self.enable_prefix_caching:
            return 0
        num_lookup = (num_tokens - 1) // self.page_size
        if max_cached_tokens is not None:
            num_lookup = min(num_lookup, max_cached_tokens // self.page_size)
        return num_lookup

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of num_tokens fits, ignoring prefix hits (conservative)."""
        return self.pages_needed(num_tokens) <= self.num_free_pages

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        return self._append_cost(self.seqs[seq_id], num_new_tokens) <= self.num_free_pages

    def page_table(self, seq_id: Hashable) -> list[int]:
        return list(self.seqs[seq_id].pages)

    # ------------------------------------------------------------------ page pool
    def _take_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)  # least recently released
        del self._page_of_key[self._key_of_page.pop(page)]
        self.stats.evictions += 1
        return page

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if page in self._key_of_page:
                self._evictable[page] = None  # most recently used end
            else:
                self._free.append(page)

    # ------------------------------------------------------------------ sequences
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, salt: bytes = b"",
                 max_cached_tokens: int | None = None) -> int:
        """Reserve pages for a new sequence's prompt, reusing cached prefix pages (at most
        max_cached_tokens tokens' worth; None: as many as the back-off rule allows).

        Returns num_cached_tokens: the prompt tokens whose K/V are already in the cache (a
        multiple of page_size, always < len(token_ids)); prefill starts there.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r}: empty prompt")
        ps = self.page_size
        hit_pages: list[int] = []
        keys: list[bytes] = []
        num_lookup = self._num_lookup(len(token_ids), max_cached_tokens)
        parent = salt
        for i in range(num_lookup):
            parent = page_key(parent, token_ids[i * ps : (i + 1) * ps])
            page = self._page_of_key.get(parent)
            if page is None:
                break
            hit_pages.append(page)
            keys.append(parent)
        num_new = self.pages_needed(len(token_ids)) - len(hit_pages)
        available = self.num_free_pages - sum(1 for p in hit_pages if p in self._evictable)
        if num_new > available:
            raise OutOfPagesError(
                f"sequence {seq_id!r}: needs {num_new} new pages for {len(token_ids)} tokens "
                f"({len(hit_pages)} cached), only {available} available"
            )
        # commit (nothing below can fail)
        self.stats.queries += num_lookup
        self.stats.hits += len(hit_pages)
        for page in hit_pages:
            self._evictable.pop(page, None)
            self.ref_counts[page] += 1
        new_pages = [self._take_page() for _ in range(num_new)]
        for page in new_pages:
            self.ref_counts[page] = 1
        cached = len(hit_pages) * ps
        self.seqs[seq_id] = SeqPages(hit_pages + new_pages, len(token_ids), cached, keys, salt)
        return cached

    def _append_cost(self, seq: SeqPages, n: int) -> int:
        cost = self.pages_needed(seq.num_tokens + n) - len(seq.pages)
        if n > 0 and seq.num_tokens % self.page_size and self.ref_counts[seq.pages[-1]] > 1:
            cost += 1  # copy-on-write of the shared partial page
        return cost

    def prepare_append(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve num_new_tokens more slots (positions num_tokens..) before a step writes them.

        Returns the (src_page, dst_page) copies the caller must do on the device first: at most
        one, when the partial last page is shared with a fork.
        """
        seq = self.seqs[seq_id]
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")
        cost = self._append_cost(seq, num_new_tokens)
        if cost > self.num_free_pages:
            raise OutOfPagesError(
                f"sequence {seq_id!r}: needs {cost} pages to append {num_new_tokens} tokens, only {self.num_free_pages} free"
            )
        copies = []
        if num_new_tokens > 0 and seq.num_tokens % self.page_size and self.ref_counts[seq.pages[-1]] > 1:
            src, dst = seq.pages[-1], self._take_page()
            self.ref_counts[dst] = 1
            self._release(src)  # still held by someone else: ref count stays >= 1
            seq.pages[-1] = dst
            copies.append((src, dst))
        while len(seq.pages) < self.pages_needed(seq.num_tokens + num_new_tokens):
            page = self._take_page()
            self.ref_counts[page] = 1
            seq.pages.append(page)
        seq.num_tokens += num_new_tokens
        return copies

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give back the slots from position num_tokens on (speculative decoding's rollback: the
        K/V written for rejected draft tokens are dropped by rewinding the length). Pages no
        longer needed are released; a kept partial page's stale slots are simply overwritten by
        later writes. Only slots not yet marked computed can be given back."""
        seq = self.seqs[seq_id]
        if not seq.num_computed <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r}: cannot truncate to {num_tokens} tokens "
                f"({seq.num_computed} computed, {seq.num_tokens} reserved)"
            )
        keep = self.pages_needed(num_tokens)
        for page in reversed(seq.pages[keep:]):
            self._release(page)
        del seq.pages[keep:]
        seq.num_tokens = num_tokens

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        """Record that the first num_computed_tokens of the sequence hold K/V; pages that became
        full are registered in the prefix cache. token_ids: the sequence's tokens (at least
        num_computed_tokens of them)."""
        seq = self.seqs[seq_id]
        if not seq.num_computed <= num_computed_tokens <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(
                f"sequence {seq_id!r}: num_computed_tokens={num_computed_tokens} must lie in "
                f"[{seq.num_computed}, {min(seq.num_tokens, len(token_ids))}]"
            )
        seq.num_computed = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        for i in range(len(seq.hashes), num_computed_tokens // ps):
            key = page_key(seq.hashes[-1] if seq.hashes else seq.salt, token_ids[i * ps : (i + 1) * ps])
            seq.hashes.append(key)
            page = seq.pages[i]
            # another page may hold the same content already (computed concurrently): keep that one
            if key not in self._page_of_key and page not in self._key_of_page:
                self._page_of_key[key] = page
                self._key_of_page[page] = key

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give child_id all of parent_id's pages (shared; copy-on-write on the next append)."""
        parent = self.seqs[parent_id]
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} already has pages")
        if parent.num_computed != parent.num_tokens:
            raise ValueError(
                f"sequence {parent_id!r}: cannot fork with reserved but uncomputed slots "
                f"({parent.num_computed} of {parent.num_tokens} computed)"
            )
        for page in parent.pages:
            self.ref_counts[page] += 1
        self.seqs[child_id] = dataclasses.replace(parent, pages=list(parent.pages), hashes=list(parent.hashes))

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence's references (finished or aborted). Its pages are released tail
        first, so a prefix's later pages are evicted before its earlier ones."""
        seq = self.seqs.pop(seq_id)
        for page in reversed(seq.pages):
            self._release(page)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached page (pages in use keep their entries)."""
        for page in self._evictable:
            del self._page_of_key[self._key_of_page.pop(page)]
            self._free.append(page)
        self._evictable.clear()

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        held = collections.Counter()
        for sid, seq in self.seqs.items():
            assert len(set(seq.pages)) == len(seq.pages), f"{sid!r} holds a page twice: {seq.pages}"
            assert SCRATCH_PAGE not in seq.pages, f"{sid!r} holds the scratch page"
            assert len(seq.pages) == self.pages_needed(seq.num_tokens), f"{sid!r}: {len(seq.pages)} pages for {seq.num_tokens} tokens"
            assert 0 <= seq.num_computed <= seq.num_tokens
            assert len(seq.hashes) <= seq.num_computed // self.page_size
            for i, key in enumerate(seq.hashes):
                page_key_now = self._key_of_page.get(seq.pages[i])
                assert page_key_now in (None, key), f"{sid!r}: page {seq.pages[i]} cached under another key"
            for page in seq.pages[len(seq.hashes) :]:
                assert page not in self._key_of_page, f"{sid!r}: page {page} cached before it was computed"
            if seq.num_computed < seq.num_tokens:  # pages still to be written must be private
                for page in seq.pages[seq.num_computed // self.page_size :]:
                    assert self.ref_counts[page] == 1, f"{sid!r}: page {page} is shared but will be written"
            held.update(seq.pages)
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a page twice"
        assert self.ref_counts[SCRATCH_PAGE] == 0 and SCRATCH_PAGE not in free and SCRATCH_PAGE not in self._evictable
        for page in range(1, self.num_pages):
            states = (page in free) + (page in self._evictable) + (held[page] > 0)
            assert states == 1, f"page {page}: free={page in free} evictable={page in self._evictable} held={held[page]}"
            assert self.ref_counts[page] == held[page], f"page {page}: ref count {self.ref_counts[page]}, held by {held[page]}"
            if page in free:
                assert page not in self._key_of_page, f"free page {page} has cached content"
            if page in self._evictable:
                assert page in self._key_of_page, f"evictable page {page} has no cached content"
        assert len(self._key_of_page) == len(self._page_of_key)
        for page, key in self._key_of_page.items():
            assert self._page_of_key[key] == page, f"hash table and page {page} disagree"
        if not self.enable_prefix_caching:
            assert not self._key_of_page and not self._evictable

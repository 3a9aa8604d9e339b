"""Host-side page (block) manager: ref-counted KV pages, a prefix cache over full pages, LRU
eviction, copy-on-write for forked sequences, and layer groups that give back what their window
no longer sees. No device code: it hands out page ids and tells the caller which page copies to
perform.

Vocabulary. A sequence (identified by any hashable id) owns one page list per layer group (its
page-table rows; `jaxinfer.kv_groups`: layers keeping the same span share a row). `num_tokens`
is how many token slots it has reserved; `num_computed` is how many of those hold K/V already
(the caller reports progress with `mark_computed`). Every page id 1..num_pages-1 is in exactly
one state, whichever group uses it:

  * free       ref count 0, no cached content, on the free list;
  * in use     ref count = number of sequences holding it (>= 1), all in one group;
  * evictable  ref count 0 but its content is registered in the prefix cache; it can be
               reused by a later prefix hit, or evicted (least recently released first) when
               the free list is empty.

Page 0 is the scratch page (jaxinfer.ops.batch.SCRATCH_PAGE) and is never handed out; a
sliding group's row holds it in place of the pages it gave back.

Groups. `windows` gives each group's cache spec (jaxinfer.kv_groups: a sliding window W, a
Chunk(C) of chunked local attention, None for full attention, the default one group). A full group holds pages for every reserved slot, 0..num_tokens-1. A group with window W
holds only what its layers will still read: once num_computed = n, the next query (position n)
sees keys n - W + 1 .. n, so pages wholly before n - W + 1 go back to the pool (`mark_computed`)
and the row holds the scratch page there (a Chunk(C) group likewise from the start of the next
query's chunk, `kv_groups.first_kept`). It also takes pages only for the slots about to be
computed: a new sequence's prompt reserves a full group's pages at once (`allocate`: admission
checks the whole prompt fits) but a sliding group's only for the chunk a step computes
(`allocate`'s `lookahead`, then `reserve`), so a long prompt prefilled in chunks holds about a
window of pages in each sliding group, never the prompt.

KV eviction (a group whose spec is a `KVEviction`: jaxinfer.ops.kv_eviction) is a sliding group
that also holds its first `kv_groups.kept_prefix_pages` pages (StreamingLLM's sinks, H2O's
heavy-hitter slots) for good: it gives back the pages between those and its window, so a sequence
holds at most those pages and a window's, however long it runs. No prefix caching with it (an H2O
group rewrites its kept pages).

Prefix cache. Page i of a sequence, once full and computed, is keyed by
`blake2b(key of page i-1 || page_size token ids as little-endian int32)` (16-byte digest; the
first page chains from `salt`, e.g. a LoRA id), per group: group g's page is registered under
(g, key). The key commits to the whole prefix, so a hit on page i means pages 0..i match too; a
128-bit cryptographic digest makes accidental collisions negligible, so hits do not compare
tokens (and the table need not keep them). A prefix of n pages is a hit when every full group
holds all n pages and every sliding group the pages its window sees from position n * page_size
(the ones before may long be gone): the look-up takes the longest n all groups agree on.

Back-off rule. `allocate` only looks up full pages that lie entirely before the last prompt
token, i.e. the first (len(prompt) - 1) // page_size pages. The last prompt token is therefore
always computed (it produces the logits), and when a page-aligned prompt is entirely cached its
last page is recomputed into a fresh page rather than being written in place: cached pages stay
immutable and no device copy is needed, at the cost of recomputing at most one page of tokens.
A caller that needs some tokens' outputs recomputed (prompt logprobs: a row per prompt token)
caps the look-up with `max_cached_tokens`; the sequence's pages are still registered as they
are computed, for later sequences to reuse.

Copy-on-write. `fork` shares every page of the parent, including a partial last page. Writes
only go to positions >= num_computed, and the only existing page such a write can find shared
is the partial page holding position num_computed. `reserve` (and `prepare_append`) give the
sequence a fresh private page there and return [(src_page, dst_page)] (one per group), which
the caller must copy on the device before the step that writes into it. Full shared pages are
never written.

Groups of another shape (`page_factors`, jaxinfer.kv_groups: Gemma 4's sliding layers have half
the K/V row of its global ones): group g's pages hold page_size * f_g tokens, and every count above
is in the group's own pages. Prefix-cache keys stay per page_size tokens; group g's page i is
registered under the key of the last page_size block it holds (block (i + 1) * f_g - 1), and a hit
is a prefix of whole pages in every group: a multiple of lcm(f_g) blocks.

Recurrent states (hybrid models: jaxinfer.ops.linear_state). Each sequence holding pages also
holds a state slot (`num_state_slots`, slot 0 the scratch one). Pages alone cannot resume a
Gated DeltaNet layer: it needs its state at the hit's end. So with `num_prefix_states` > 0 the
manager keeps that many *saved states* (slots num_state_slots.. of the table), each a copy of a
sequence's state at a page boundary, registered under the chain key of the page ending there; a
prefix hit is then the longest prefix whose pages are cached AND whose end has a saved state
(`allocate` names the saved slot to copy into the sequence's own: `restore_slot`). A sequence
saves its state where a later prompt is likely to stop (`checkpoints`): the end of its prompt's
last full page (what the same prompt, or a longer one starting with it, will hit) and, when its
pages were cached further than any saved state, the end of those cached pages (the point where
prompts sharing a prefix part: the next one like it hits there). The scheduler ends a chunk at
each such position; the engine copies the slot after the step (`save_state`). Saved states are
evicted least recently used first when the slots run out, and with the page whose key they carry.

Lower tiers (`lower_tiers`: jaxinfer.engine.kv_tiers.KVTiers, or anything with its `contains(key)`
and `fetch(key) -> (tier name, content) | None`). With them, a cached page evicted by `_take_page`
is reported in `evicted` as (page, key): the caller reads its content to the tiers before anything
writes the page, and clears the list. `allocate`'s look-up goes on past the device's hits: each next
page is the device's (a later page still cached) or fetched from a lower tier, up to the first found
nowhere; a fetched page gets a fresh page, registered in the prefix cache as computed at once and
listed in `pending_loads` as (page, key, content) for the caller to write before the step that reads
it (and clear the list). Admission checks pages as if every fetch after the first lower-tier page
failed, so a fetch that fails at commit (a bad disk file) only shortens the hit. One full-attention
group and no recurrent states (the tiers hold one page per key).

Context parallelism (`kv_shards` n > 1: the replica's pool split over the mesh axis "sequence",
jaxinfer.ops.attention.attend_context_parallel). Shard j is the block of pages j * P / n ..
(j + 1) * P / n - 1 that device j of the axis holds; its first page is that device's scratch page
(page 0's twin: rows it does not own are written there), never handed out. A sequence's page
i comes from shard i % n (each shard has its own free list), so every device holds about 1/n of
every sequence and of its attention work. A prefix hit, a copy-on-write copy and a lower tier's
page keep their index in the sequence, hence their shard. `num_free_pages` counts n times the
fewest pages any shard can give (free or evictable), so what it promises every shard can give.

Stats count prefix-cache queries and hits in prompt pages (tokens = pages * page_size): `hits`
on the device, `host_hits` / `disk_hits` loaded back from the lower tiers.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from typing import Hashable, Sequence

import numpy as np

from jaxinfer.kv_groups import first_kept, kept_prefix_pages, span_tokens, window_pages

SCRATCH_PAGE = 0  # same as jaxinfer.ops.batch.SCRATCH_PAGE (not imported: keep this module free of JAX)


class OutOfPagesError(RuntimeError):
    """Raised when a request for pages cannot be met; the manager's state is left unchanged."""


@dataclasses.dataclass
class SeqPages:
    pages: list[list[int]]  # per group: page of each page index (a sliding group: SCRATCH_PAGE where given back)
    num_tokens: int = 0  # token slots reserved
    num_computed: int = 0  # slots whose K/V are written
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain keys of its first full pages
    salt: bytes = b""
    first_held: list[int] = dataclasses.field(default_factory=list)  # per group: pages before it were given back
    state_slot: int = 0  # its slot of the recurrent states (hybrid models; 0: none)
    restore_slot: int = 0  # a saved state its prefix hit resumes from, to copy into state_slot first (0: none)
    checkpoints: list[int] = dataclasses.field(default_factory=list)  # positions to save its state at (ascending)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # full prompt pages looked up
    hits: int = 0  # of those, pages found and reused on the device
    host_hits: int = 0  # of those, pages loaded back from the host tier (lower_tiers)
    disk_hits: int = 0  # of those, pages loaded back from the disk tier
    evictions: int = 0  # cached pages whose content was dropped to be reused
    states_saved: int = 0  # recurrent states saved at page boundaries (hybrid models)
    state_evictions: int = 0  # of those, dropped to make room (or with their page)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def page_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of one full page, chained from its parent's key."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), page_factors: Sequence[int] | None = None, num_state_slots: int = 0,
                 num_prefix_states: int = 0, lower_tiers=None, kv_shards: int = 1):
        """`num_state_slots`: a hybrid model's recurrent-state slots (jaxinfer.ops.linear_state),
        slot 0 the scratch one: each sequence holding pages also holds a slot of its own.
        `num_prefix_states`: saved states for its prefix cache (slots num_state_slots.. of the
        table; module docstring); a hybrid model's prefix cache hits only where one is saved.
        `lower_tiers`: where evicted prefix pages go and prefix look-ups go on (module docstring).
        `kv_shards`: the pool's shards over the sequence axis (context parallelism: module docstring)."""
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2 (page 0 is scratch) and page_size >= 1, got {num_pages}, {page_size}")
        if not windows or any(w is not None and span_tokens(w) < 1 for w in windows):
            raise ValueError(f"windows={tuple(windows)}: one entry per layer group, None, a window >= 1 or a Chunk")
        if enable_prefix_caching and any(kept_prefix_pages(w, page_size) for w in windows):
            raise ValueError("prefix caching with KV eviction (a group that keeps its first pages) is not supported: "
                             "pass enable_prefix_caching=False")
        if kv_shards < 1 or num_pages % kv_shards or num_pages // kv_shards < 2:
            raise ValueError(f"kv_shards={kv_shards}: the {num_pages} pages must split into that many shards of at least "
                             f"2 pages (each shard's first is a scratch page)")
        self.kv_shards = kv_shards
        self.shard_pages = num_pages // kv_shards  # pages per shard (context parallelism), its first the scratch one
        self.num_pages = num_pages
        self.page_size = page_size  # tokens per page of a group of factor 1, and per prefix-cache block
        self.windows = tuple(windows)
        self.page_factors = tuple(page_factors or (1,) * len(self.windows))
        if len(self.page_factors) != len(self.windows) or min(self.page_factors) < 1:
            raise ValueError(f"page_factors={self.page_factors}: one factor >= 1 per layer group ({len(self.windows)})")
        self.page_sizes = tuple(page_size * f for f in self.page_factors)  # per group: tokens per page
        self._hit_blocks = math.lcm(*self.page_factors)  # a prefix hit is a multiple of this many blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        # per shard, its free pages (one shard but with context parallelism)
        self._frees = [collections.deque(range(j * self.shard_pages + 1, (j + 1) * self.shard_pages)) for j in range(kv_shards)]
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._evictable_in_shard = [0] * kv_shards
        self._key_of_page: dict[int, tuple[int, bytes]] = {}  # page -> (group, chain key)
        self._page_of_key: dict[tuple[int, bytes], int] = {}
        self._group_of_page = [0] * num_pages  # the group a page in use belongs to
        self.pages_in_use = [0] * len(self.windows)  # per group: pages held by some sequence
        self.seqs: dict[Hashable, SeqPages] = {}
        self.stats = PrefixCacheStats()
        self.num_state_slots = num_state_slots
        self._free_state_slots = list(range(num_state_slots - 1, 0, -1))  # (pop() hands out 1 first)
        if num_prefix_states and (not num_state_slots or self.windows != (None,) or self.page_factors != (1,)):
            raise ValueError("num_prefix_states: saved recurrent states need state slots and one full-attention layer group")
        self.num_prefix_states = num_prefix_states
        self._free_saved_slots = list(range(num_state_slots + num_prefix_states - 1, num_state_slots - 1, -1))
        self._saved_state: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # page key -> slot, LRU first
        if lower_tiers is not None and (self.windows != (None,) or self.page_factors != (1,) or num_state_slots
                                        or not enable_prefix_caching):
            raise ValueError("lower_tiers: the KV tiers need prefix caching, one full-attention layer group and no recurrent states")
        self.lower_tiers = lower_tiers
        self.evicted: list[tuple[int, bytes]] = []  # (page, key) evicted since the caller last read them (lower_tiers)
        self.pending_loads: list[tuple[int, bytes, object]] = []  # (page, key, content) to write before the next step

    # ------------------------------------------------------------------ queries
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def _free(self) -> collections.deque[int] | list[int]:
        """The free pages (every shard's)."""
        return self._frees[0] if self.kv_shards == 1 else [p for free in self._frees for p in free]

    def shard_of(self, page: int) -> int:
        """The shard (device of the sequence axis, context parallelism) holding `page`."""
        return page // self.shard_pages

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - self.kv_shards

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free plus evictable (with shards: the fewest any shard
        can give, times the shards, as a sequence takes its pages from them in turn)."""
        if self.kv_shards == 1:
            return len(self._frees[0]) + len(self._evictable)
        return self.kv_shards * min(len(free) + n for free, n in zip(self._frees, self._evictable_in_shard))

    @property
    def num_cached_pages(self) -> int:
        """Pages whose content is registered in the prefix cache (in use or evictable)."""
        return len(self._page_of_key)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by at least one sequence."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    def pages_held(self, seq_id: Hashable) -> list[int]:
        """Per group, how many pages the sequence holds now (the scratch page not counted)."""
        return [sum(p != SCRATCH_PAGE for p in row) for row in self.seqs[seq_id].pages]

    def pages_needed(self, num_tokens: int, group: int = 0) -> int:
        """Pages of `group` (page_size * its factor tokens each) that num_tokens take."""
        return -(-num_tokens // self.page_sizes[group])

    def can_allocate(self, num_tokens: int, lookahead: int | None = None) -> bool:
        """Whether a new sequence of num_tokens surely fits (`allocate`'s pages, whatever its prefix hits:
        a sliding group holds at most its window and the lookahead's pages)."""
        if lookahead is None:
            return sum(self.pages_needed(num_tokens, g) for g in range(self.num_groups)) <= self.num_free_pages
        need = sum(window_pages(w, num_tokens, ps, max(lookahead, 1)) for w, ps in zip(self.windows, self.page_sizes))
        return need <= self.num_free_pages

    def _first_kept(self, group: int, num_computed: int) -> int:
        """The first page index group `group` still needs once num_computed tokens are done (past
        its kept prefix: `_kept_prefix`)."""
        return first_kept(self.windows[group], num_computed) // self.page_sizes[group]

    def _kept_prefix(self, group: int) -> int:
        """Leading pages group `group` never gives back (KV eviction's sinks / heavy slots; else 0)."""
        return kept_prefix_pages(self.windows[group], self.page_sizes[group])

    def page_table(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's page-table rows, one per group."""
        return [list(row) for row in self.seqs[seq_id].pages]

    def held_rows(self, seq_id: Hashable) -> tuple[list[int], list[list[int]]]:
        """(offsets, rows): each group's row from its first held page on (a long sequence's
        sliding rows are mostly scratch, which the step's page table holds already), and where
        in the full row it starts; a group with a kept prefix (KV eviction): its whole row)."""
        seq = self.seqs[seq_id]
        offsets = [0 if self._kept_prefix(g) else first for g, first in enumerate(seq.first_held)]
        return offsets, [row[first:] for first, row in zip(offsets, seq.pages)]

    # ------------------------------------------------------------------ prefix look-up
    def _num_lookup(self, num_tokens: int, max_cached_tokens: int | None) -> int:
        """Leading pages of a num_tokens prompt to look up: the full ones before its last token,
        and at most max_cached_tokens tokens' worth (None: no cap)."""
        if not self.enable_prefix_caching:
            return 0
        num_lookup = (num_tokens - 1) // self.page_size
        if max_cached_tokens is not None:
            num_lookup = min(num_lookup, max_cached_tokens // self.page_size)
        return num_lookup

    def _lookup(self, token_ids: Sequence[int], salt: bytes, max_cached_tokens: int | None) -> tuple[int, list[bytes]]:
        """(n, keys): the longest cached prefix of n pages every group agrees on (module
        docstring), and the chain keys of the pages looked up."""
        ps, parent, keys = self.page_size, salt, []
        for i in range(self._num_lookup(len(token_ids), max_cached_tokens)):
            parent = page_key(parent, token_ids[i * ps : (i + 1) * ps])
            keys.append(parent)
        # cached[g][i]: group g's page i is cached (it ends at block (i + 1) * f - 1)
        cached = [[(g, keys[(i + 1) * f - 1]) in self._page_of_key for i in range(len(keys) // f)]
                  for g, f in enumerate(self.page_factors)]
        n = len(keys) - len(keys) % self._hit_blocks  # (n: blocks)
        for g, w in enumerate(self.windows):
            if w is None:  # a full group: every page from the first
                n = min(n, next((i for i, hit in enumerate(cached[g]) if not hit), len(cached[g])) * self.page_factors[g])
        n -= n % self._hit_blocks

        def all_agree(n: int) -> bool:
            return all(all(cached[g][self._first_kept(g, n * ps) : n // self.page_factors[g]])
                       for g, w in enumerate(self.windows) if w is not None)

        while n and not all_agree(n):
            n -= self._hit_blocks
        if self.num_state_slots:  # a hybrid model resumes only where a state was saved
            n = next((m for m in range(n, 0, -1) if keys[m - 1] in self._saved_state), 0)
        return n, keys

    def _cached_pages(self, keys: list[bytes]) -> int:
        """How many of the looked-up pages are cached, from the first (one full group)."""
        return next((i for i, key in enumerate(keys) if (0, key) not in self._page_of_key), len(keys))

    def cached_pages(self) -> list[tuple[int, bytes]]:
        """(page, key) of every page whose content the prefix cache holds (one full group)."""
        return [(page, key) for page, (_, key) in self._key_of_page.items()]

    def num_cached_prefix_pages(self, token_ids: Sequence[int], *, salt: bytes = b"",
                                max_cached_tokens: int | None = None) -> int:
        """How many leading pages of a prompt `allocate` would find in the prefix cache now, the
        lower tiers' included (a read-only look-up: no stats, no state change)."""
        num_hit, keys = self._lookup(token_ids, salt, max_cached_tokens)
        return num_hit + len(self._lower_walk(keys, num_hit))

    def _lower_walk(self, keys: list[bytes], start: int) -> list[tuple[int | None, bool]]:
        """Past the device's hits (lower tiers only): for each next page, (its device page, False)
        when still cached there, (None, True) when a lower tier holds it, up to the first found
        nowhere (nothing is fetched)."""
        found = []
        if self.lower_tiers is None:
            return found
        for key in keys[start:]:
            page = self._page_of_key.get((0, key))
            if page is None and not self.lower_tiers.contains(key):
                break
            found.append((page, page is None))
        return found

    # ------------------------------------------------------------------ page pool
    def _take_page(self, group: int, index: int = 0) -> int:
        """A page for a sequence's page `index` (its shard: index % kv_shards) of `group`."""
        shard = index % self.kv_shards
        if self._frees[shard]:
            page = self._frees[shard].popleft()
        else:
            if self.kv_shards == 1:
                page, _ = self._evictable.popitem(last=False)  # least recently released
            else:
                page = next((p for p in self._evictable if self.shard_of(p) == shard), None)
                if page is None:
                    raise OutOfPagesError(f"no page left in shard {shard} of {self.kv_shards}")
                del self._evictable[page]
            self._evictable_in_shard[shard] -= 1
            cached_as = self._key_of_page.pop(page)  # (its group, its key)
            del self._page_of_key[cached_as]
            self._drop_saved_state(cached_as[1])  # (its prefix cannot be hit any more)
            self.stats.evictions += 1
            if self.lower_tiers is not None:
                self.evicted.append((page, cached_as[1]))  # its content goes down a tier before it is overwritten
        self.ref_counts[page] = 1
        self._group_of_page[page] = group
        self.pages_in_use[group] += 1
        return page

    def _hold(self, page: int, group: int) -> None:
        """One more reference to a page (a prefix hit, a fork)."""
        if self.ref_counts[page] == 0:
            self._evictable.pop(page)
            self._evictable_in_shard[self.shard_of(page)] -= 1
            self._group_of_page[page] = group
            self.pages_in_use[group] += 1
        self.ref_counts[page] += 1

    def _release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.pages_in_use[self._group_of_page[page]] -= 1
            if page in self._key_of_page:
                self._evictable[page] = None  # most recently used end
                self._evictable_in_shard[self.shard_of(page)] += 1
            else:
                self._frees[self.shard_of(page)].append(page)

    # ------------------------------------------------------------------ sequences
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, salt: bytes = b"",
                 max_cached_tokens: int | None = None, lookahead: int | None = None) -> int:
        """Reserve pages for a new sequence's prompt, reusing cached prefix pages (at most
        max_cached_tokens tokens' worth; None: as many as the back-off rule allows). Full groups
        get pages for the whole prompt; sliding groups for the `lookahead` tokens after the cached
        prefix (None: the whole prompt), the first chunk a step will compute (`reserve` the rest).

        Returns num_cached_tokens: the prompt tokens whose K/V are already in the cache (a
        multiple of page_size, always < len(token_ids)); prefill starts there.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r}: empty prompt")
        num_hit, keys = self._lookup(token_ids, salt, max_cached_tokens)  # (blocks of page_size tokens)
        lower = self._lower_walk(keys, num_hit)  # (lower tiers: the pages after the device's hits)
        # pages counted as if every lower-tier fetch failed: a device page after one may then not be reused
        surely_reused = num_hit + next((i for i, (_, fetched) in enumerate(lower) if fetched), len(lower))
        lower_held = [page for page, _ in lower if page is not None and page in self._evictable]
        cached = num_hit * self.page_size
        end = len(token_ids) if lookahead is None else min(len(token_ids), cached + lookahead)
        hits: list[list[tuple[int, int]]] = []  # per group: (page index, page) reused
        num_new = 0
        for g, (w, f) in enumerate(zip(self.windows, self.page_factors)):
            first = self._first_kept(g, cached)
            hits.append([(i, self._page_of_key[(g, keys[(i + 1) * f - 1])]) for i in range(first, num_hit // f)])
            num_new += self.pages_needed(len(token_ids) if w is None else end, g) - num_hit // f
        num_new -= surely_reused - num_hit
        available = self.num_free_pages - sum(1 for row in hits for _, p in row if p in self._evictable) - len(lower_held)
        if num_new > available:
            raise OutOfPagesError(
                f"sequence {seq_id!r}: needs {num_new} new pages for {len(token_ids)} tokens "
                f"({num_hit} pages cached), only {available} available"
            )
        if self.num_state_slots and not self._free_state_slots:
            raise OutOfPagesError(f"sequence {seq_id!r}: every one of the {self.num_state_slots - 1} recurrent-state slots is held")
        # commit (nothing below can fail)
        self.stats.queries += self._num_lookup(len(token_ids), max_cached_tokens)
        self.stats.hits += num_hit
        rows = [[SCRATCH_PAGE] * (num_hit // f) for f in self.page_factors]
        for g, row in enumerate(rows):  # every hit held before any new page is taken (which may evict)
            for i, page in hits[g]:
                self._hold(page, g)
                row[i] = page
        if lower:
            num_hit = self._take_lower_hits(rows[0], keys, lower)
            cached = num_hit * self.page_size
        for g, w in enumerate(self.windows):
            rows[g] += [self._take_page(g, i) for i in range(len(rows[g]), self.pages_needed(len(token_ids) if w is None else end, g))]
        first_held = [self._first_kept(g, cached) for g in range(self.num_groups)]
        seq = SeqPages(rows, len(token_ids), cached, keys[:num_hit], salt, first_held, self._take_state_slot())
        if self.num_prefix_states:
            if num_hit:
                seq.restore_slot = self._saved_state[keys[num_hit - 1]]
                self._saved_state.move_to_end(keys[num_hit - 1])  # most recently used
            ends = {self._cached_pages(keys), len(keys)}  # where shared pages stop; the prompt's last full page
            seq.checkpoints = sorted(n * self.page_size for n in ends if n > num_hit and keys[n - 1] not in self._saved_state)
        self.seqs[seq_id] = seq
        return cached

    def _take_lower_hits(self, row: list[int], keys: list[bytes], lower: list[tuple[int | None, bool]]) -> int:
        """`allocate`'s pages past the device's hits (one full group): fetches the lower tiers'
        pages in order, up to the first fetch that fails; holds the device's pages among them, then
        gives each fetched one a fresh page registered under its key (`pending_loads`). Returns the
        pages now cached in the row."""
        start, fetched = len(row), []  # fetched: per page found, (tier, content), or None: the device's
        for i, (page, lower_tier) in enumerate(lower, start=start):
            hit = self.lower_tiers.fetch(keys[i]) if lower_tier else None
            if lower_tier and hit is None:
                break
            fetched.append(hit)
        for page, _ in lower[: len(fetched)]:  # held before a page is taken (which may evict)
            if page is not None:
                self._hold(page, 0)
        for i, ((page, _), hit) in enumerate(zip(lower, fetched), start=start):
            if hit is not None:
                tier, content = hit
                page = self._take_page(0, i)
                self._page_of_key[(0, keys[i])] = page
                self._key_of_page[page] = (0, keys[i])
                self.pending_loads.append((page, keys[i], content))
                if tier == "host":
                    self.stats.host_hits += 1
                else:
                    self.stats.disk_hits += 1
            else:
                self.stats.hits += 1
            row.append(page)
        return len(row)

    def _take_state_slot(self) -> int:
        return self._free_state_slots.pop() if self.num_state_slots else 0

    def state_slot(self, seq_id: Hashable) -> int:
        """The sequence's recurrent-state slot (0 without a hybrid model)."""
        return self.seqs[seq_id].state_slot

    def restore_slot(self, seq_id: Hashable) -> int:
        """The saved state a newly allocated sequence resumes from (copy it into its slot before
        its first chunk), or 0: it starts from zeros."""
        return self.seqs[seq_id].restore_slot

    def next_checkpoint(self, seq_id: Hashable, after: int | None = None) -> int | None:
        """The next position past `after` (default: what the sequence has computed; the scheduler
        passes its own count, ahead of this one after a swap-in) the sequence saves its state at (a
        chunk must end there), if any."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        after = seq.num_computed if after is None else after
        return next((p for p in seq.checkpoints if p > after), None)

    def save_state(self, seq_id: Hashable, position: int, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """Once a step has computed the sequence up to `position`: if that is one of its checkpoints,
        a saved-state slot (the least recently used one's, if none is free) is registered under the
        key of the page ending there. Returns (its state slot, the saved slot) for the caller to
        copy on the device after the step, or None."""
        seq = self.seqs[seq_id]
        if position not in seq.checkpoints:
            return None
        seq.checkpoints.remove(position)
        key = seq.salt
        for i in range(position // self.page_size):
            key = seq.hashes[i] if i < len(seq.hashes) else page_key(key, token_ids[i * self.page_size : (i + 1) * self.page_size])
        if key in self._saved_state:  # saved meanwhile by a sequence with the same prefix
            return None
        if not self._free_saved_slots:
            self._drop_saved_state(next(iter(self._saved_state)))
        slot = self._free_saved_slots.pop()
        self._saved_state[key] = slot
        self.stats.states_saved += 1
        return seq.state_slot, slot

    def _drop_saved_state(self, key: bytes) -> None:
        slot = self._saved_state.pop(key, None)
        if slot is not None:
            self._free_saved_slots.append(slot)
            self.stats.state_evictions += 1

    def _written_shared(self, seq: SeqPages, end: int) -> list[tuple[int, int]]:
        """(group, page index) of the shared pages a computation of slots num_computed..end-1 writes."""
        if end <= seq.num_computed:
            return []
        return [(g, i) for g, row in enumerate(seq.pages)
                for i in range(seq.num_computed // self.page_sizes[g], min(self.pages_needed(end, g), len(row)))
                if row[i] != SCRATCH_PAGE and self.ref_counts[row[i]] > 1]

    def _reserve_cost(self, seq: SeqPages, end: int) -> int:
        """New pages the sequence needs to compute up to slot end (exclusive)."""
        cost = len(self._written_shared(seq, end))
        for g, row in enumerate(seq.pages):
            cost += max(0, self.pages_needed(max(end, seq.num_tokens if self.windows[g] is None else 0), g) - len(row))
        return cost

    def can_reserve(self, seq_id: Hashable, end: int) -> bool:
        return self._reserve_cost(self.seqs[seq_id], end) <= self.num_free_pages

    def reserve(self, seq_id: Hashable, end: int) -> list[tuple[int, int]]:
        """Make slots num_computed..end-1 writable before a step computes them (reserving more
        slots when end > num_tokens): every group gets its pages up to there.

        Returns the (src_page, dst_page) copies the caller must do on the device first: a shared
        partial page about to be written gets a private copy (one per group at most).
        """
        seq = self.seqs[seq_id]
        cost = self._reserve_cost(seq, end)
        if cost > self.num_free_pages:
            raise OutOfPagesError(
                f"sequence {seq_id!r}: needs {cost} pages to compute up to slot {end}, only {self.num_free_pages} free"
            )
        copies = []
        for g, i in self._written_shared(seq, end):
            src, dst = seq.pages[g][i], self._take_page(g, i)
            self._release(src)  # still held by someone else: ref count stays >= 1
            seq.pages[g][i] = dst
            copies.append((src, dst))
        seq.num_tokens = max(seq.num_tokens, end)
        for g, row in enumerate(seq.pages):
            while len(row) < self.pages_needed(seq.num_tokens if self.windows[g] is None else end, g):
                row.append(self._take_page(g, len(row)))
        return copies

    def can_append(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        return self.can_reserve(seq_id, self.seqs[seq_id].num_tokens + num_new_tokens)

    def prepare_append(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve num_new_tokens more slots (positions num_tokens..) before a step writes them:
        `reserve` up to num_tokens + num_new_tokens."""
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")
        return self.reserve(seq_id, self.seqs[seq_id].num_tokens + num_new_tokens)

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
        for g, row in enumerate(seq.pages):
            keep = self.pages_needed(num_tokens, g)
            for page in reversed(row[keep:]):
                self._release(page)
            del row[keep:]
        seq.num_tokens = num_tokens

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        """Record that the first num_computed_tokens of the sequence hold K/V; pages that became
        full are registered in the prefix cache, then the sliding groups give back the pages their
        window has left behind. token_ids: the sequence's tokens (at least num_computed_tokens)."""
        seq = self.seqs[seq_id]
        if not seq.num_computed <= num_computed_tokens <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(
                f"sequence {seq_id!r}: num_computed_tokens={num_computed_tokens} must lie in "
                f"[{seq.num_computed}, {min(seq.num_tokens, len(token_ids))}]"
            )
        seq.num_computed = num_computed_tokens
        ps = self.page_size
        if self.enable_prefix_caching:
            for i in range(len(seq.hashes), num_computed_tokens // ps):
                key = page_key(seq.hashes[-1] if seq.hashes else seq.salt, token_ids[i * ps : (i + 1) * ps])
                seq.hashes.append(key)
                for g, row in enumerate(seq.pages):
                    f = self.page_factors[g]
                    if (i + 1) % f:  # the group's page ends at a later block
                        continue
                    page = row[(i + 1) // f - 1]
                    # another page may hold the same content already (computed concurrently): keep that one
                    if page != SCRATCH_PAGE and (g, key) not in self._page_of_key and page not in self._key_of_page:
                        self._page_of_key[(g, key)] = page
                        self._key_of_page[page] = (g, key)
        for g, row in enumerate(seq.pages):  # (a full group keeps everything: first_kept is 0)
            first_kept = min(self._first_kept(g, num_computed_tokens), len(row))
            for i in range(max(seq.first_held[g], self._kept_prefix(g)), first_kept):  # (past a kept prefix)
                self._release(row[i])
                row[i] = SCRATCH_PAGE
            seq.first_held[g] = max(seq.first_held[g], first_kept)

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
        if self.num_state_slots and not self._free_state_slots:  # (before any page is held: nothing to undo)
            raise OutOfPagesError(f"sequence {child_id!r}: every recurrent-state slot is held")
        for g, row in enumerate(parent.pages):
            for page in row:
                if page != SCRATCH_PAGE:
                    self._hold(page, g)
        self.seqs[child_id] = dataclasses.replace(parent, pages=[list(row) for row in parent.pages], hashes=list(parent.hashes),
                                                  first_held=list(parent.first_held), state_slot=self._take_state_slot(),
                                                  restore_slot=0, checkpoints=[])

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence's references (finished or aborted). Its pages are released tail
        first, so a prefix's later pages are evicted before its earlier ones."""
        seq = self.seqs.pop(seq_id)
        if seq.state_slot:
            self._free_state_slots.append(seq.state_slot)
        for row in seq.pages:
            for page in reversed(row):
                if page != SCRATCH_PAGE:
                    self._release(page)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached page (pages in use keep their entries) and every saved
        recurrent state."""
        for key in list(self._saved_state):
            self._drop_saved_state(key)
        for page in self._evictable:
            del self._page_of_key[self._key_of_page.pop(page)]
            self._frees[self.shard_of(page)].append(page)
        self._evictable.clear()
        self._evictable_in_shard = [0] * self.kv_shards

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        held = collections.Counter()
        group_of = {}
        ps = self.page_size
        for sid, seq in self.seqs.items():
            assert len(seq.pages) == self.num_groups, f"{sid!r}: {len(seq.pages)} page rows for {self.num_groups} groups"
            assert 0 <= seq.num_computed <= seq.num_tokens
            assert len(seq.hashes) <= seq.num_computed // ps
            for g, row in enumerate(seq.pages):
                live = [p for p in row if p != SCRATCH_PAGE]
                assert len(set(live)) == len(live), f"{sid!r} holds a page twice in group {g}: {row}"
                first = self._first_kept(g, seq.num_computed)
                prefix = self._kept_prefix(g)
                assert all(p == SCRATCH_PAGE for p in row[prefix:first]), f"{sid!r} group {g} keeps pages its window left: {row}"
                assert all(p != SCRATCH_PAGE for p in row[:prefix]), f"{sid!r} group {g} lacks a kept prefix page: {row}"
                assert all(p != SCRATCH_PAGE for p in row[first:]), f"{sid!r} group {g} lacks a page: {row}"
                assert seq.first_held[g] == min(first, len(row)), f"{sid!r} group {g}: first_held {seq.first_held[g]}"
                f = self.page_factors[g]
                if self.windows[g] is None:
                    assert len(row) == self.pages_needed(seq.num_tokens, g), f"{sid!r}: {len(row)} pages for {seq.num_tokens} tokens"
                else:
                    assert len(row) <= self.pages_needed(seq.num_tokens, g), f"{sid!r}: group {g} holds pages past its slots"
                for i in range(min(len(seq.hashes) // f, len(row))):
                    page_key_now = self._key_of_page.get(row[i])
                    assert row[i] == SCRATCH_PAGE or page_key_now in (None, (g, seq.hashes[(i + 1) * f - 1])), \
                        f"{sid!r}: page {row[i]} cached under another key"
                for page in row[len(seq.hashes) // f :]:
                    assert page not in self._key_of_page, f"{sid!r}: page {page} cached before it was computed"
                if seq.num_computed < seq.num_tokens:  # pages still to be written must be private
                    for page in row[seq.num_computed // self.page_sizes[g] :]:
                        assert self.ref_counts[page] == 1, f"{sid!r}: page {page} is shared but will be written"
                for page in live:
                    assert group_of.setdefault(page, g) == g, f"page {page} is used by groups {group_of[page]} and {g}"
                held.update(live)
        if self.num_state_slots:  # every slot but scratch either free or held by exactly one sequence
            held_slots = [seq.state_slot for seq in self.seqs.values()]
            assert sorted(held_slots + self._free_state_slots) == list(range(1, self.num_state_slots)), "state slots leaked"
            saved = sorted(self._free_saved_slots + list(self._saved_state.values()))
            assert saved == list(range(self.num_state_slots, self.num_state_slots + self.num_prefix_states)), "saved states leaked"
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a page twice"
        assert self.ref_counts[SCRATCH_PAGE] == 0 and SCRATCH_PAGE not in free and SCRATCH_PAGE not in self._evictable
        scratch = {j * self.shard_pages for j in range(self.kv_shards)}  # each shard's first page
        assert not scratch & (free | set(self._evictable) | set(held)), "a shard's scratch page is handed out"
        assert self._evictable_in_shard == [sum(self.shard_of(p) == j for p in self._evictable) for j in range(self.kv_shards)]
        for sid, seq in self.seqs.items():  # a sequence's page i lies in shard i % kv_shards
            for row in seq.pages:
                assert all(self.shard_of(p) == i % self.kv_shards for i, p in enumerate(row) if p != SCRATCH_PAGE), \
                    f"{sid!r}: a page outside its shard: {row}"
        for page in range(1, self.num_pages):
            if page in scratch:
                continue
            states = (page in free) + (page in self._evictable) + (held[page] > 0)
            assert states == 1, f"page {page}: free={page in free} evictable={page in self._evictable} held={held[page]}"
            assert self.ref_counts[page] == held[page], f"page {page}: ref count {self.ref_counts[page]}, held by {held[page]}"
            if page in free:
                assert page not in self._key_of_page, f"free page {page} has cached content"
            if page in self._evictable:
                assert page in self._key_of_page, f"evictable page {page} has no cached content"
            if page in self._key_of_page and held[page]:
                assert self._key_of_page[page][0] == group_of[page], f"page {page} cached for another group"
        for g in range(self.num_groups):
            assert self.pages_in_use[g] == sum(1 for p, grp in group_of.items() if grp == g), f"group {g}: pages_in_use"
        assert len(self._key_of_page) == len(self._page_of_key)
        for page, key in self._key_of_page.items():
            assert self._page_of_key[key] == page, f"hash table and page {page} disagree"
        if not self.enable_prefix_caching:
            assert not self._key_of_page and not self._evictable
        for page, key, _ in self.pending_loads:  # registered and held until the caller writes them
            assert self._key_of_page.get(page) == (0, key) and held[page], f"page {page} to load is not held under its key"

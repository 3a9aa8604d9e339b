"""BlockManager: pages, ref counts, prefix cache, LRU eviction, copy-on-write, invariants."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxinfer.engine.block_manager import BlockManager, OutOfPagesError, page_key
from jaxinfer.kv_groups import Chunk

PS = 4


def snapshot(bm):
    return (
        {k: (list(s.pages), s.num_tokens, s.num_computed, list(s.hashes)) for k, s in bm.seqs.items()},
        list(bm._free), list(bm._evictable), dict(bm._page_of_key), list(bm.ref_counts),
        (bm.stats.queries, bm.stats.hits, bm.stats.evictions),
    )


def prefill(bm, sid, tokens):
    """Allocate and 'compute' a whole prompt; returns num_cached_tokens."""
    cached = bm.allocate(sid, tokens)
    bm.mark_computed(sid, len(tokens), tokens)
    bm.check_invariants()
    return cached


# ---------------------------------------------------------------------- basics
def test_allocate_and_free_basics():
    bm = BlockManager(num_pages=8, page_size=PS)
    assert bm.num_free_pages == 7 and bm.usage == 0.0
    assert bm.allocate("a", list(range(10))) == 0  # 3 pages
    pages = bm.page_table("a")[0]
    assert len(pages) == 3 and 0 not in pages and len(set(pages)) == 3
    assert bm.num_free_pages == 4 and bm.usage == pytest.approx(3 / 7)
    assert all(bm.ref_counts[p] == 1 for p in pages)
    bm.check_invariants()
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_pages == 7 and bm.num_cached_pages == 0  # nothing was computed, nothing cached
    with pytest.raises(ValueError):
        bm.allocate("b", [])
    bm.allocate("b", [1])
    with pytest.raises(ValueError):
        bm.allocate("b", [1])


def test_scratch_page_never_handed_out():
    bm = BlockManager(num_pages=5, page_size=1, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3, 4])
    assert sorted(bm.page_table("a")[0]) == [1, 2, 3, 4]
    assert not bm.can_allocate(1)
    with pytest.raises(OutOfPagesError):
        bm.allocate("b", [1])


def test_allocation_failure_is_atomic():
    bm = BlockManager(num_pages=6, page_size=PS)
    prefill(bm, "a", list(range(12)))  # 3 full pages, all registered
    bm.free("a")  # 3 evictable
    bm.allocate("b", [99] * 4)  # 1 page
    before = snapshot(bm)
    assert not bm.can_allocate(20)
    with pytest.raises(OutOfPagesError, match="'c'"):
        bm.allocate("c", list(range(12)) + [7] * 8)  # 3 hits + 2 new > 4 - 3 available
    assert snapshot(bm) == before
    bm.check_invariants()
    with pytest.raises(OutOfPagesError):
        bm.prepare_append("b", 100)
    assert snapshot(bm) == before


# ---------------------------------------------------------------------- prefix cache
def test_shared_prefix_reuses_pages():
    bm = BlockManager(num_pages=16, page_size=PS)
    prefix = list(range(100, 112))  # 3 full pages
    assert prefill(bm, "a", prefix + [1, 2]) == 0
    assert bm.num_cached_pages == 3
    cached = bm.allocate("b", prefix + [5, 6, 7])
    assert cached == 12
    assert bm.page_table("b")[0][:3] == bm.page_table("a")[0][:3]
    assert bm.page_table("b")[0][3] != bm.page_table("a")[0][3]
    assert all(bm.ref_counts[p] == 2 for p in bm.page_table("a")[0][:3])
    assert (bm.stats.queries, bm.stats.hits) == (3 + 3, 3)  # in pages
    bm.check_invariants()
    # a different first page breaks the chain even if later pages match
    assert bm.allocate("c", [0, 0, 0, 0] + prefix[4:] + [1]) == 0
    assert bm.stats.hits == 3
    bm.check_invariants()


def test_fully_cached_prompt_leaves_last_token_to_compute():
    bm = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(12))  # page aligned: 3 full pages, all cached after "a"
    prefill(bm, "a", prompt)
    cached = bm.allocate("b", prompt)
    assert cached == 8 < len(prompt)  # back off one page: the last page is recomputed privately
    assert bm.page_table("b")[0][:2] == bm.page_table("a")[0][:2]
    assert bm.page_table("b")[0][2] != bm.page_table("a")[0][2]
    bm.check_invariants()
    # the recomputed page holds content that is cached already: not registered twice
    bm.mark_computed("b", 12, prompt)
    bm.check_invariants()
    assert bm.num_cached_pages == 3
    # non-aligned prompt: every full page hit, the partial one is computed
    assert bm.allocate("c", prompt + [1]) == 12
    bm.check_invariants()



def test_max_cached_tokens_caps_the_lookup_but_not_the_registration():
    """A sequence that needs some tokens recomputed (prompt logprobs) reuses at most that many
    cached tokens, in whole pages; what it computes is still registered for later sequences."""
    bm = BlockManager(num_pages=32, page_size=PS)
    prompt = list(range(100, 117))  # 4 full pages before the last token
    prefill(bm, "a", prompt)
    queries = bm.stats.queries
    assert bm.num_cached_prefix_pages(prompt, max_cached_tokens=0) == 0
    assert bm.allocate("b", prompt, max_cached_tokens=0) == 0  # no look-up at all, as vLLM
    assert bm.stats.queries == queries and not set(bm.page_table("b")[0]) & set(bm.page_table("a")[0])
    assert bm.num_cached_prefix_pages(prompt, max_cached_tokens=11) == 2
    assert bm.allocate("c", prompt, max_cached_tokens=11) == 8  # whole pages within the cap
    assert bm.allocate("d", prompt, max_cached_tokens=100) == 16  # the back-off rule still holds
    bm.check_invariants()
    bm.free("a")
    bm.mark_computed("b", len(prompt), prompt)  # same content as a's pages: a's stay registered
    bm.check_invariants()
    fresh = list(range(200, 209))
    bm.allocate("e", fresh, max_cached_tokens=0)
    bm.mark_computed("e", len(fresh), fresh)  # new content: registered though it looked nothing up
    assert bm.allocate("f", fresh) == 8
    bm.check_invariants()

def test_mark_computed_registers_pages_as_they_fill():
    bm = BlockManager(num_pages=16, page_size=PS)
    tokens = list(range(6))
    bm.allocate("a", tokens)
    bm.mark_computed("a", 3, tokens)
    assert bm.num_cached_pages == 0
    bm.mark_computed("a", 6, tokens)
    assert bm.num_cached_pages == 1
    for t in (6, 7):  # decode two tokens: the second page fills
        bm.prepare_append("a", 1)
        tokens.append(t)
        bm.mark_computed("a", len(tokens), tokens)
    assert bm.num_cached_pages == 2
    assert bm.allocate("b", list(range(8)) + [9]) == 8
    with pytest.raises(ValueError):
        bm.mark_computed("a", 5, tokens)  # going backwards
    bm.check_invariants()


def test_lru_eviction_order_and_reuse_after_free():
    bm = BlockManager(num_pages=7, page_size=PS)  # 6 usable pages
    a, b = [1] * 8 + [0], [2] * 8 + [0]
    prefill(bm, "a", a)  # 3 pages, 2 cached
    prefill(bm, "b", b)
    pa, pb = bm.page_table("a")[0], bm.page_table("b")[0]
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    # released tail first: a's page 1, a's page 0, then b's
    assert list(bm._evictable) == [pa[1], pa[0], pb[1], pb[0]]
    assert bm.num_cached_pages == 4 and bm.num_free_pages == 6
    # a freed-but-cached prefix is reused by a later identical prompt
    assert bm.allocate("b2", b) == 8 and bm.page_table("b2")[0][:2] == pb[:2]
    bm.check_invariants()
    # 1 free page + 2 evictable (a's); a new 3-page prompt evicts them
    bm.allocate("c", [3] * 12)
    assert bm.stats.evictions == 2
    assert set(bm.page_table("c")[0]) >= {pa[0], pa[1]}
    bm.check_invariants()
    bm.free("c")
    bm.free("b2")
    assert bm.allocate("a2", a) == 0  # evicted: a miss
    bm.check_invariants()


def test_lru_touch_on_hit_moves_to_back():
    bm = BlockManager(num_pages=5, page_size=PS)  # 4 usable
    prefill(bm, "a", [1] * 4 + [0])
    prefill(bm, "b", [2] * 4 + [0])
    pa, pb = bm.page_table("a")[0][0], bm.page_table("b")[0][0]
    bm.free("a")
    bm.free("b")
    assert bm.allocate("a2", [1] * 4 + [5]) == 4  # touch a's cached page
    bm.free("a2")
    bm.allocate("big", [9] * 12)  # 3 pages: 2 free + evicts b's page, not a's (touched later)
    assert bm.stats.evictions == 1
    assert pb in bm.page_table("big")[0] and pa not in bm.page_table("big")[0]
    bm.check_invariants()
    bm.free("big")
    assert bm.allocate("a3", [1] * 4 + [6]) == 4
    bm.free("a3")
    bm.reset_prefix_cache()
    assert bm.num_cached_pages == 0 and bm.num_free_pages == 4
    bm.check_invariants()


# ---------------------------------------------------------------------- copy-on-write
def test_fork_mid_page_copy_on_write():
    bm = BlockManager(num_pages=16, page_size=PS)
    tokens = list(range(10))  # 2 full pages + 2 tokens in the third
    prefill(bm, "p", tokens)
    bm.fork("p", "c")
    bm.check_invariants()
    shared = bm.page_table("p")[0]
    assert bm.page_table("c")[0] == shared and all(bm.ref_counts[p] == 2 for p in shared)

    copies_c = bm.prepare_append("c", 1)
    assert len(copies_c) == 1 and copies_c[0][0] == shared[2]
    new_c = copies_c[0][1]
    assert bm.page_table("c")[0] == shared[:2] + [new_c] and new_c not in shared
    assert bm.ref_counts[shared[2]] == 1 and bm.ref_counts[new_c] == 1
    bm.check_invariants()

    assert bm.prepare_append("p", 1) == []  # the parent's last page is private now
    assert bm.page_table("p")[0] == shared
    assert all(bm.ref_counts[p] == 2 for p in shared[:2])  # full pages stay shared
    bm.check_invariants()

    # appending across a page boundary: copy once, then a fresh page
    bm.mark_computed("c", 11, tokens + [7])
    bm.fork("c", "d")
    copies = bm.prepare_append("d", 3)  # positions 11..13: finishes page 2, opens page 3
    assert len(copies) == 1 and copies[0][0] == new_c
    assert len(bm.page_table("d")[0]) == 4 and bm.page_table("d")[0][:2] == shared[:2]
    bm.check_invariants()
    # page-aligned fork: nothing to copy
    bm.mark_computed("p", 11, tokens + [8])
    bm.prepare_append("p", 1)
    bm.mark_computed("p", 12, tokens + [8, 9])
    bm.fork("p", "q")
    assert bm.prepare_append("q", 1) == [] and bm.prepare_append("p", 1) == []
    assert bm.page_table("q")[0][:3] == bm.page_table("p")[0][:3]
    bm.check_invariants()
    for s in ["p", "c", "d", "q"]:
        bm.free(s)
    bm.check_invariants()
    assert all(r == 0 for r in bm.ref_counts)


def test_fork_requires_computed_slots():
    bm = BlockManager(num_pages=8, page_size=PS)
    bm.allocate("p", list(range(6)))
    with pytest.raises(ValueError, match="uncomputed"):
        bm.fork("p", "c")


# ---------------------------------------------------------------------- caching off
def test_prefix_caching_disabled():
    bm = BlockManager(num_pages=16, page_size=PS, enable_prefix_caching=False)
    prompt = list(range(13))
    assert prefill(bm, "a", prompt) == 0
    assert prefill(bm, "b", prompt) == 0
    assert not set(bm.page_table("a")[0]) & set(bm.page_table("b")[0])
    assert bm.num_cached_pages == 0 and bm.stats.hits == 0 and bm.stats.queries == 0
    bm.free("a")
    assert bm.num_free_pages == 16 - 1 - 4 and not bm._evictable
    assert prefill(bm, "c", prompt) == 0
    bm.check_invariants()


# ---------------------------------------------------------------------- property-based fuzz
BASES = [[7, 7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10], [7, 7, 7, 1, 9, 9, 9, 9, 5, 5], [3] * 12]


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the manager against a simulated device: every page holds token ids in its slots.
    Hits must return pages whose content is the prompt's; writes must only touch private pages.
    `hybrid`: recurrent-state slots and two saved states for the prefix cache, each slot's
    simulated state the tokens it has consumed: a hit must resume the state of exactly its prefix."""

    # (windows, page factors): groups of another shape (Gemma 4) hold f times the tokens per page
    @initialize(num_pages=st.integers(2, 14), page_size=st.integers(1, 4), caching=st.booleans(),
                groups=st.sampled_from([((None,), None), ((None,), None), ((3,), None), ((None, 2), None), ((5, None, 5), None),
                                        ((None, 1), None), ((Chunk(3), None), None), ((Chunk(4), Chunk(4), None), None),
                                        ((5, 5, None), (2, 2, 1)), ((None, 3), (1, 2)), ((None, None), (1, 2))]),
                hybrid=st.booleans())
    def setup(self, num_pages, page_size, caching, groups, hybrid):
        windows, factors = groups
        self.hybrid = hybrid and windows == (None,)
        states = dict(num_state_slots=64, num_prefix_states=2) if self.hybrid else {}
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching, windows=windows, page_factors=factors,
                               **states)
        self.state = {}  # hybrid: slot -> the tokens its state has consumed
        self.ps = page_size
        self.page_sizes = self.bm.page_sizes  # each group's tokens per page
        self.device = {p: [None] * max(self.page_sizes) for p in range(num_pages)}
        self.tokens = {}  # seq id -> its tokens (prompt + appended)
        self.next_id = 0

    def _write(self, sid, start, end):
        seq = self.bm.seqs[sid]
        while start < end:  # (a hybrid's chunks end where it saves its state)
            stop = min(end, self.bm.next_checkpoint(sid) or end)
            for row, ps in zip(seq.pages, self.page_sizes):
                for pos in range(start, stop):
                    page = row[pos // ps]
                    assert page != 0, f"write into the scratch page at position {pos}"
                    assert self.bm.ref_counts[page] == 1, f"write into shared page {page}"
                    self.device[page][pos % ps] = self.tokens[sid][pos]
            self.bm.mark_computed(sid, stop, self.tokens[sid])
            if self.hybrid:
                slot = self.bm.state_slot(sid)
                assert start == 0 or self.state[slot] == tuple(self.tokens[sid][:start]), "a chunk continues another state"
                self.state[slot] = tuple(self.tokens[sid][:stop])
                saved = self.bm.save_state(sid, stop, self.tokens[sid])
                if saved:
                    self.state[saved[1]] = self.state[saved[0]]
            start = stop

    def _held_positions(self, g, seq):
        """Positions whose K/V group g still holds for seq (a sliding group: its window's)."""
        return range(self.bm._first_kept(g, seq.num_computed) * self.page_sizes[g], seq.num_computed)

    def _try(self, fn):
        before = snapshot(self.bm)
        try:
            return fn()
        except OutOfPagesError:
            assert snapshot(self.bm) == before
            return None

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 12),
          tail=st.lists(st.integers(0, 3), max_size=6), chunk=st.integers(0, 8))
    def allocate(self, base, cut, tail, chunk):
        prompt = BASES[base][:cut] + tail
        sid = self.next_id
        self.next_id += 1
        fits = self.bm.can_allocate(len(prompt), lookahead=chunk)
        cached = self._try(lambda: self.bm.allocate(sid, prompt, lookahead=chunk))
        if cached is None:
            assert not fits
            return
        assert cached % max(self.page_sizes) == 0 and cached < len(prompt)
        seq = self.bm.seqs[sid]
        if self.hybrid:  # a hit resumes the state saved at its end, which consumed exactly its prefix
            restore = self.bm.restore_slot(sid)
            assert bool(restore) == bool(cached)
            if restore:
                assert self.state[restore] == tuple(prompt[:cached])
                self.state[seq.state_slot] = self.state[restore]
        for g, row in enumerate(seq.pages):  # a hit really holds this prompt's K/V
            ps = self.page_sizes[g]
            for pos in self._held_positions(g, seq):
                assert self.device[row[pos // ps]][pos % ps] == prompt[pos]
        self.tokens[sid] = list(prompt)
        self._write(sid, cached, min(len(prompt), cached + chunk))  # maybe a partial prefill

    @precondition(lambda self: any(s.num_computed < s.num_tokens for s in self.bm.seqs.values()))
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def continue_prefill(self, data, chunk):
        sid = data.draw(st.sampled_from(sorted(k for k, s in self.bm.seqs.items() if s.num_computed < s.num_tokens)))
        seq = self.bm.seqs[sid]
        end = min(seq.num_tokens, seq.num_computed + chunk)
        fits = self.bm.can_reserve(sid, end)
        copies = self._try(lambda: self.bm.reserve(sid, end))  # a sliding group's pages for this chunk
        if copies is None:
            assert not fits
            return
        assert copies == []  # nothing shared is written mid-prompt
        self._write(sid, seq.num_computed, end)

    def _done(self):
        return sorted(k for k, s in self.bm.seqs.items() if s.num_computed == s.num_tokens)

    @precondition(lambda self: self._done())
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(self._done()))
        fits = self.bm.can_append(sid, len(new))
        copies = self._try(lambda: self.bm.prepare_append(sid, len(new)))
        if copies is None:
            assert not fits
            return
        assert fits
        for src, dst in copies:
            assert self.bm.ref_counts[dst] == 1 and any(dst in row for row in self.bm.seqs[sid].pages)
            self.device[dst] = list(self.device[src])
        start = len(self.tokens[sid])
        self.tokens[sid] += new
        self._write(sid, start, len(self.tokens[sid]))

    @precondition(lambda self: self._done())
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(self._done()))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])
        if self.hybrid:  # the engine copies the parent's state into the child's slot
            self.state[self.bm.state_slot(child)] = self.state[self.bm.state_slot(sid)]

    @precondition(lambda self: self.bm.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.bm.seqs)))
        self.bm.free(sid)
        del self.tokens[sid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for sid, seq in self.bm.seqs.items():  # every computed slot a group holds has the sequence's token
            for g, row in enumerate(seq.pages):
                ps = self.page_sizes[g]
                for pos in self._held_positions(g, seq):
                    assert self.device[row[pos // ps]][pos % ps] == self.tokens[sid][pos]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.bm.seqs):
            self.bm.free(sid)
        self.bm.check_invariants()
        assert all(r == 0 for r in self.bm.ref_counts)
        assert self.bm.num_free_pages == self.bm.num_usable_pages  # no leaks
        assert self.bm.usage == 0.0


TestBlockManagerFuzz = BlockManagerMachine.TestCase
TestBlockManagerFuzz.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_page_key_chains():
    a = page_key(b"", [1, 2])
    assert page_key(b"", [1, 2]) == a and page_key(b"", [2, 1]) != a
    assert page_key(a, [3, 4]) != page_key(page_key(b"", [9, 9]), [3, 4])
    assert page_key(b"lora1", [1, 2]) != a


# ---------------------------------------------------------------------- layer groups (sliding windows)
def test_a_sliding_group_holds_only_what_its_window_still_sees():
    """Windows (None, 6), pages of 4: a 40-token prompt prefilled in chunks of 8. The full group
    keeps every page; the sliding one gives back each page once the next query's window (its
    position - 5 on) has passed it, and takes pages only for the chunk being computed."""
    bm = BlockManager(num_pages=64, page_size=PS, windows=(None, 6))
    tokens = list(range(100, 140))
    assert bm.allocate("a", tokens, lookahead=8) == 0
    assert bm.pages_held("a") == [10, 2]  # the whole prompt; the first chunk
    for end in range(8, 41, 8):
        assert bm.reserve("a", end) == []
        bm.mark_computed("a", end, tokens)
        bm.check_invariants()
        full, sliding = bm.page_table("a")
        first_kept = (end - 6 + 1) // PS  # position end sees keys end-5..end
        assert all(p != 0 for p in full) and len(full) == 10
        assert all(p == 0 for p in sliding[:first_kept]) and all(p != 0 for p in sliding[first_kept:])
        assert bm.pages_held("a")[1] <= (6 + 8 - 2) // PS + 2  # a window and a chunk, whatever the length
    assert bm.pages_in_use == [10, 2]


def test_a_sliding_groups_prefix_hit_needs_only_its_windows_pages_and_backs_off_without_them():
    bm = BlockManager(num_pages=40, page_size=PS, windows=(None, 6))
    tokens = list(range(100, 140))
    bm.allocate("a", tokens, lookahead=8)
    for end in range(8, 41, 8):
        bm.reserve("a", end)
        bm.mark_computed("a", end, tokens)
    bm.free("a")
    # a prompt sharing 32 tokens: the full group's 8 pages and the sliding group's last two are cached
    assert bm.num_cached_prefix_pages(tokens[:32] + [7]) == 8
    assert bm.allocate("b", tokens[:32] + [7], lookahead=8) == 32
    full, sliding = bm.page_table("b")
    assert sliding[:6] == [0] * 6 and 0 not in sliding[6:8]  # window of position 32: keys 27.. (pages 6, 7)
    bm.check_invariants()
    bm.free("b")
    # evict the sliding group's first pages (released first, so least recently used): a 12-token
    # prefix still has its full pages, but not the window's, so nothing is reused
    assert bm.num_cached_prefix_pages(tokens[:12] + [7]) == 3
    bm.allocate("c", list(range(1000, 1000 + PS * (len(bm._free) + 3))), lookahead=0)
    assert bm.num_cached_prefix_pages(tokens[:12] + [7]) == 0
    assert bm.num_cached_prefix_pages(tokens[:32] + [7]) == 8  # later pages are still all there
    bm.check_invariants()


def test_a_chunked_group_gives_back_each_chunk_once_the_next_query_leaves_it():
    """Llama 4's chunks of 8 in pages of 4: once the next query is at position n, the group keeps
    only pages from n's chunk start (n // 8 * 8) on, whatever the sequence's length."""
    bm = BlockManager(num_pages=64, page_size=PS, windows=(Chunk(8), None))
    tokens = list(range(100, 140))
    bm.allocate("a", tokens[:5], lookahead=5)
    bm.mark_computed("a", 5, tokens)
    for end in range(6, 41):  # decoding one token at a time
        bm.reserve("a", end)
        bm.mark_computed("a", end, tokens)
        bm.check_invariants()
        chunked, full = bm.page_table("a")
        first_kept = (end // 8 * 8) // PS
        assert all(p == 0 for p in chunked[:first_kept]) and all(p != 0 for p in chunked[first_kept:])
        assert bm.pages_held("a")[0] <= 8 // PS + 1 and len(full) == -(-end // PS)


def test_groups_of_another_shape_count_their_own_longer_pages_and_hit_on_whole_ones():
    """Gemma 4: a sliding group (window 6) whose K/V rows are half the global group's puts twice
    the tokens in each page (factor 2, pages of 8), the global group pages of 4. Each holds its own
    count of pages; a prefix hit is whole pages of both, so a multiple of 8 tokens."""
    bm = BlockManager(num_pages=64, page_size=PS, windows=(6, None), page_factors=(2, 1))
    tokens = list(range(100, 140))
    assert bm.allocate("a", tokens, lookahead=8) == 0
    assert bm.pages_held("a") == [1, 10]  # the first chunk of 8 in one page of 8; the prompt in pages of 4
    for end in range(8, 41, 8):
        bm.reserve("a", end)
        bm.mark_computed("a", end, tokens)
        bm.check_invariants()
        sliding, full = bm.page_table("a")
        assert all(p == 0 for p in sliding[: (end - 5) // 8]) and len(full) == 10
    bm.free("a")
    # 36 shared tokens: 9 full pages of 4 are cached, but only whole pages of 8 hit in the sliding
    # group: the hit is 32 tokens (the sliding group's page 3 holds the window of position 32)
    assert bm.num_cached_prefix_pages(tokens[:36] + [7]) == 8
    assert bm.allocate("b", tokens[:36] + [7], lookahead=8) == 32
    sliding, full = bm.page_table("b")
    assert sliding[:3] == [0] * 3 and sliding[3] != 0 and 0 not in full
    bm.check_invariants()


# ---------------------------------------------------------------------- saved recurrent states (hybrid models)
def hybrid_manager(num_prefix_states=2, num_pages=32):
    """State slots: 0 scratch, 1-3 sequences, 4.. saved states."""
    return BlockManager(num_pages, PS, num_state_slots=4, num_prefix_states=num_prefix_states)


def compute_in_chunks(bm, sid, tokens, copies):
    """Compute a sequence the way the scheduler chunks it (ending a chunk at each checkpoint),
    saving its state where asked; `copies` collects the (slot, saved slot) copies."""
    seq = bm.seqs[sid]
    while seq.num_computed < len(tokens):
        end = bm.next_checkpoint(sid) or len(tokens)
        bm.mark_computed(sid, end, tokens)
        copies += [c for c in [bm.save_state(sid, end, tokens)] if c]
    bm.check_invariants()


def test_a_hybrid_prefix_hits_only_where_a_state_was_saved_and_resumes_from_it():
    bm, copies = hybrid_manager(), []
    shared = list(range(100, 110))  # two full pages and a half
    a, b, c = (shared + [t] * 5 for t in (1, 2, 3))  # 15 tokens each: 3 full pages before the last token
    assert bm.allocate("a", a) == 0 and bm.seqs["a"].checkpoints == [12]  # the prompt's last full page
    compute_in_chunks(bm, "a", a, copies)
    assert copies == [(bm.state_slot("a"), 4)] and bm.stats.states_saved == 1
    bm.free("a")
    # the same prompt resumes at 12 from the saved state; nothing more to save
    assert bm.allocate("a2", a) == 12 and bm.restore_slot("a2") == 4 and bm.seqs["a2"].checkpoints == []
    bm.free("a2")
    # another prompt sharing two pages: they are cached but no state ends there, so it starts from
    # zeros and saves one where the prompts part (8) as well as at its own last full page (12)
    assert bm.allocate("b", b) == 0 and bm.restore_slot("b") == 0 and bm.seqs["b"].checkpoints == [8, 12]
    compute_in_chunks(bm, "b", b, copies)
    bm.free("b")
    assert bm.stats.states_saved == 3 and bm.stats.state_evictions == 1  # two saved slots: "a"'s went (least recent)
    assert bm.allocate("c", c) == 8 and bm.restore_slot("c") == copies[1][1]  # the third resumes where they part
    assert bm.num_cached_prefix_pages(a) == 2  # "a"'s own state at 12 is gone
    bm.check_invariants()


def test_a_saved_state_goes_with_the_page_its_key_names_and_with_a_reset():
    bm, copies = hybrid_manager(num_pages=5), []  # 4 usable pages: a 15-token prompt takes all of them
    a = list(range(15))
    bm.allocate("a", a)
    compute_in_chunks(bm, "a", a, copies)
    bm.free("a")
    assert bm.num_cached_prefix_pages(a) == 3
    bm.allocate("x", list(range(50, 59)))  # 3 pages: the least recently released ("a"'s last ones) are evicted
    assert bm.num_cached_prefix_pages(a) == 0 and bm.stats.state_evictions == 1
    bm.check_invariants()
    bm.free("x")
    bm.allocate("a", a)
    compute_in_chunks(bm, "a", a, copies)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_prefix_pages(a) == 0 and not bm._saved_state
    bm.check_invariants()


def test_a_fork_inherits_no_checkpoints_and_without_saved_states_a_hybrid_never_hits():
    bm = BlockManager(32, PS, num_state_slots=4)  # prefix caching on, no saved states
    a = list(range(15))
    prefill(bm, "a", a)
    bm.free("a")
    assert bm.allocate("b", a) == 0 and bm.seqs["b"].checkpoints == []
    bm.free("b")
    bm, copies = hybrid_manager(), []
    bm.allocate("a", a)
    bm.mark_computed("a", 8, a)  # mid-prompt: a checkpoint still ahead
    bm.reserve("a", 15)
    bm.mark_computed("a", 15, a)
    bm.fork("a", "child")
    assert bm.seqs["child"].checkpoints == [] and bm.seqs["child"].restore_slot == 0
    with pytest.raises(ValueError, match="saved recurrent states need state slots"):
        BlockManager(32, PS, num_prefix_states=2)

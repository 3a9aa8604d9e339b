"""The KV cache's layer groups: which layers share a page table, and where each layer's pages live.

A sliding-window layer only ever reads the last `window` positions, and a chunked layer (Llama 4)
only its query's own chunk, so neither need keep the rest: their pages can go back to the pool as
the sequence moves on. Layers that keep pages for different spans cannot share one page table, so
the layers are grouped by what they keep (their *cache spec*: a window W, a `Chunk(C)`, or None
for full attention), and each group gets a page-table row per sequence. A sliding or chunked
group's row holds the scratch page (0) where its pages were given back.

All groups draw their pages from one pool, so memory moves to whichever group needs it (a long
prompt's full-attention pages, many short sequences' sliding pages) with no split to tune. That
works because every group has the same number of layers: the pool's arrays have one *slot* per
layer of a group, `[num_slots, P, page_size, ...]`, and a page id owned by group g holds, in slot s,
the K/V of group g's s-th layer. No storage is idle whichever group owns a page.

Equal groups come from the layers' repeating pattern (`layer_period`). In one period, spec w
covers c_w positions; with m = gcd of the c_w, each spec's positions are dealt (in order) into
c_w / m groups of m positions. Layer l = p * period + j (period p, position j) is in the group of
position j, slot p * m + (the index of j among its group's positions). Examples:

    Llama (every layer full)         1 group;  slot = layer
    Gemma 2, GPT-OSS (sliding, full) 2 groups; layers 2p and 2p + 1 share slot p
    Gemma 3 (5 sliding, 1 full)      6 groups; the six layers of period p share slot p
    SmolLM3 (NoPE every 4th layer)   1 group:  RoPE does not change what a layer keeps
    Llama 4 (3 chunked, 1 full)      4 groups; the four layers of period p share slot p

Layers past the last whole period take the next slot, so a group with one layer fewer than
the others leaves that slot unused (Gemma-3-27B: 62 layers, 11 slots, four groups use 10).

**Groups of another shape** (Gemma 4: global layers with head_dim 512 and their own KV heads). A
layer's K/V row per token (KV heads x head dim, on one device) may differ between groups. A page
id holds the same bytes whatever group owns it, so a group whose row is f times narrower than the
widest puts f times the tokens in each of its pages: its *page factor* f
(`jaxinfer.ops.kv_cache.page_factors`: rows on one device, so they depend on the mesh), its
pages `page_size * f` tokens long: on CPU / GPU pools a free reshape of the same bytes
(`[slots * P, page_size * f, Hkv_g, D_g]`), on a TPU's tiled pool f lane blocks of page_size
tokens side by side in each page. Gemma-4-31B: sliding rows 16 x 256, global 4 x 512,
so a global page holds twice the tokens. The block manager counts each group's pages in its own
page size.

**Linear-attention layers** (Gated DeltaNet: Qwen3-Next, Qwen3.5) keep no K/V at all: the groups
are made from the other layers, and a linear layer's slot is its index among the linear layers,
its row of the per-sequence recurrent states (jaxinfer.ops.linear_state).

**KV-shared layers** (Gemma 4's last `kv_shared_layers`) write no K/V: each attends over the
pages of the last earlier layer of its kind (`ModelConfig.kv_source`), so it takes that layer's
group and slot and the groups are made from the other layers.

**KV eviction** (`ModelConfig.kv_eviction`, a `KVEviction`: StreamingLLM's sinks or H2O's heavy
hitters, jaxinfer.ops.kv_eviction) is a spec of its own for the full-attention group: a sliding
window of `window` positions plus the first `keep` positions' pages, which are never given back
(`kept_prefix_pages`). The block manager treats it as a sliding group that also holds those pages.
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.config import KVEviction, LayerKind, ModelConfig
from pallas_kernels.visible_span import span_start


@dataclasses.dataclass(frozen=True)
class Chunk:
    """The cache spec of chunked local attention (Llama 4): a query sees only the keys of its own
    chunk of `size` positions, so keys before the chunk of the next query are never read again."""

    size: int


# What a group keeps: a sliding window of W positions (int), its chunk (Chunk), a window and the first
# positions' pages (KVEviction), or everything (None).
KVSpec = int | Chunk | KVEviction | None


def kv_spec(kind: LayerKind) -> KVSpec:
    """What a layer of this kind keeps (its model's KV eviction aside: `kv_groups`)."""
    return Chunk(kind.chunk) if kind.chunk is not None else kind.window


def first_kept(spec: KVSpec, position: int) -> int:
    """The first position a query at `position` (or any later one) may still read."""
    if isinstance(spec, Chunk):
        return span_start(position, attention_chunk=spec.size)
    if isinstance(spec, KVEviction):  # (the window's start; the first kept_prefix_pages are held as well)
        return span_start(position, sliding_window=spec.window)
    return span_start(position, sliding_window=spec)


def kept_prefix_pages(spec: KVSpec, page_size: int) -> int:
    """Leading pages a group holds whatever its window (KV eviction's sinks / heavy-hitter slots), else 0."""
    return -(-spec.keep // page_size) if isinstance(spec, KVEviction) else 0


def span_tokens(spec: KVSpec) -> int | None:
    """The most keys a query of the group reads (None: all of them)."""
    if isinstance(spec, KVEviction):
        return spec.keep + spec.window
    return spec.size if isinstance(spec, Chunk) else spec


def describe(spec: KVSpec) -> str:
    if isinstance(spec, KVEviction):
        return spec.describe()
    return "full" if spec is None else f"chunk {spec.size}" if isinstance(spec, Chunk) else f"window {spec}"


def layer_period(kinds: tuple[LayerKind, ...]) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for every layer (the layers' repeating pattern)."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i % p] for i in range(n)))


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[KVSpec, ...]  # per group: what its layers keep (a window, a Chunk, None: everything)
    group_of_layer: tuple[int, ...]  # per layer
    slot_of_layer: tuple[int, ...]  # per layer: its slot in the pool's arrays
    num_slots: int
    shapes: tuple[tuple[int, int], ...] = ()  # per group: its layers' (KV heads, head dim)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def pages_held(self, num_tokens: int, page_size: int, chunk: int = 1, factors: tuple[int, ...] | None = None) -> int:
        """The most pages (all groups together) one sequence holds while computing `chunk` tokens
        that end at num_tokens: a full group every page up to there, a sliding group the pages its
        window can still see from the chunk's first token (`window_pages`), each group in its own
        page size (page_size times its factor)."""
        factors = factors or (1,) * self.num_groups
        return sum(window_pages(w, num_tokens, page_size * f, chunk) for w, f in zip(self.windows, factors))


def window_pages(spec: KVSpec, num_tokens: int, page_size: int, chunk: int = 1) -> int:
    """Pages of one group a sequence holds while computing a chunk of `chunk` tokens ending at
    num_tokens: keys from (first query - window + 1) on, through the chunk's last token (a
    Chunk(C) group at most as many as a window of C: its first kept key is within C of the query)."""
    full = -(-num_tokens // page_size)
    if spec is None:
        return full
    if isinstance(spec, KVEviction):  # the kept prefix's pages and the window's
        return min(full, kept_prefix_pages(spec, page_size) + (spec.window + chunk - 2) // page_size + 2)
    window = span_tokens(spec)
    return min(full, (window + chunk - 2) // page_size + 2)


def kv_groups(config: ModelConfig) -> KVGroups:
    """The layer groups of a model (see the module docstring)."""
    c = config
    kinds_all = c.layer_kinds()
    # the layers that write K/V: not Gemma 4's KV-shared ones, not linear-attention ones (a state instead)
    owners = [i for i in range(c.num_layers) if not c.is_kv_shared(i) and not kinds_all[i].linear]
    kinds = tuple(c.layer_kinds()[i] for i in owners)
    period = layer_period(kinds)
    specs = [kv_spec(kinds[j]) for j in range(period)]
    specs = [c.kv_eviction if spec is None and c.kv_eviction is not None else spec for spec in specs]  # (full layers only)
    keys = [(specs[j], c.kind_kv_heads(kinds[j]), c.kind_head_dim(kinds[j])) for j in range(period)]
    counts = {key: keys.count(key) for key in dict.fromkeys(keys)}  # in order of first appearance
    m = math.gcd(*counts.values())
    windows: list[KVSpec] = []
    shapes: list[tuple[int, int]] = []
    group_of_position, offset_of_position = [0] * period, [0] * period
    for key in counts:
        positions = [j for j in range(period) if keys[j] == key]
        for start in range(0, len(positions), m):
            windows.append(key[0])
            shapes.append(key[1:])
            for offset, j in enumerate(positions[start : start + m]):
                group_of_position[j], offset_of_position[j] = len(windows) - 1, offset
    group = {l: group_of_position[n % period] for n, l in enumerate(owners)}
    slot = {l: (n // period) * m + offset_of_position[n % period] for n, l in enumerate(owners)}
    linear = [l for l in range(c.num_layers) if kinds_all[l].linear]
    group.update({l: 0 for l in linear})  # a linear layer's "slot" is its row of the recurrent states
    slot.update({l: n for n, l in enumerate(linear)})
    layers = range(c.num_layers)
    return KVGroups(
        windows=tuple(windows),
        group_of_layer=tuple(group[c.kv_source(l)] for l in layers),
        slot_of_layer=tuple(slot[c.kv_source(l)] for l in layers),
        num_slots=-(-len(owners) // period) * m,
        shapes=tuple(shapes),
    )

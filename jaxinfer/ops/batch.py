"""The ragged batch the step consumes, and the host-side packer that builds it.

A step runs many sequences at once, each contributing a *chunk* of new tokens: a decode
contributes 1, a prefill contributes a slice of its prompt. Their tokens are flattened into one
array; per-sequence arrays say where each sequence's tokens start, how long its cache is after
the step, and which pages hold it. Every array has a fixed padded size taken from a small set of
buckets, so the step compiles once per bucket.

    token_ids       [T]              flattened new tokens (padding: 0)
    positions       [T]              position of each token in its sequence
    cu_q_lens       [S + 1]          sequence s owns tokens cu_q_lens[s] : cu_q_lens[s+1]
    kv_lens         [S]              cache length of sequence s after this step
    page_table      [G, S, pages_per_seq]  page ids of sequence s in KV layer group g (unused
                                     entries: 0, the scratch page; jaxinfer.kv_groups)
    num_seqs        [1]              sequences in use; slots past it are padding with length 0
    logits_indices  [R]              token rows whose logits the step computes (padding: 0)
    token_src       [T]              -1, or the row of the previous step's sampled tokens that is
                                     this token (a token still on the device: see step.py)
    hidden_src      [T]              optional: the row of a stream of hidden states on the device
                                     that is each token's input beside its id (models.deepseek_mtp)
    state_slots     [S]              each sequence's slot of the recurrent states (hybrid models:
                                     jaxinfer.ops.linear_state; 0 = the scratch slot)
    verifies        [S]              the sequence's chunk verifies drafted tokens: a hybrid model
                                     keeps its inputs rather than advancing its states
    rope_positions  [3, T]           optional: each token's (temporal, height, width) RoPE
                                     positions (M-RoPE: Qwen2.5-VL); None: `positions` rotate
    mm_embeds       [T, H]           optional (steps holding image tokens): the input row of each
                                     token whose `mm_mask` is set, in place of its id's embedding
    mm_mask         [T]              optional: the token's input is its `mm_embeds` row
    mm_deepstack    [K, T, H]        optional (Qwen3-VL's deepstack): added to the `mm_mask`
                                     tokens' residual stream after decoder layer j < K (row j)
    span_end        [T]              optional (images attended both ways: Gemma 3): the last
                                     position the token's query sees (its own position, or its
                                     image's last one)
    tree_base       [T]              optional (draft trees: speculative decoding): the first cache
                                     position the token's tree mask covers; tokens outside a tree
                                     and padding: their position + 1 (plain causal)
    tree_bits       [T]              optional, with tree_base: the mask as int32 bits, bit j = the
                                     key at tree_base + j is visible (pallas_kernels.tree_mask);
                                     keys before tree_base always are, at tree_base + 32 or later
                                     never, and none past the token's own position; 0 outside trees
    tree_rope       [T]              optional, with tree_base: each token's RoPE position (a node's
                                     root position + its depth; outside trees its position), read
                                     instead of `positions` for RoPE; K/V go to `positions` as usual
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import jax
import numpy as np

SCRATCH_PAGE = 0  # page 0 of every pool: padded token slots write there, no sequence ever owns it



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RaggedBatch:
    token_ids: jax.Array
    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    token_src: jax.Array
    lora_slots: jax.Array | None = None  # [S] int32: each sequence's LoRA adapter slot (0 = none); None: no LoRA
    hidden_src: jax.Array | None = None  # [T] int32: each token's row of the input stream; None: no hidden input
    state_slots: jax.Array | None = None  # [S] int32: each sequence's recurrent-state slot (hybrid models)
    verifies: jax.Array | None = None  # [S] bool: its chunk verifies drafts (hybrid models: linear_state.DraftInputs)
    rope_positions: jax.Array | None = None  # [3, T] int32: M-RoPE positions (t, h, w) per token; None: positions
    mm_embeds: jax.Array | None = None  # [T, H]: image-token input rows (steps holding image tokens)
    mm_mask: jax.Array | None = None  # [T] bool: the token reads its mm_embeds row
    mm_deepstack: jax.Array | None = None  # [K, T, H]: image tokens' stream += row j after layer j (Qwen3-VL)
    span_end: jax.Array | None = None  # [T] int32: last key position its query sees (bidirectional images)
    tree_base: jax.Array | None = None  # [T] int32: first cache position of its tree mask (draft trees; None: causal)
    tree_bits: jax.Array | None = None  # [T] int32: the tree mask's bits (with tree_base)
    tree_rope: jax.Array | None = None  # [T] int32: RoPE positions (with tree_base; positions elsewhere)


@dataclasses.dataclass
class SequenceChunk:
    """What one sequence contributes to a step (host side)."""

    token_ids: Sequence[int]  # the new tokens
    start_pos: int  # tokens of this sequence already in the cache
    pages: Sequence[Sequence[int]]  # per KV layer group, its page-table row; must cover start_pos + len(token_ids)
    logits_rows: Sequence[int] = ()  # offsets into token_ids whose logits are needed
    # {offset: row}: tokens not known on the host yet, taken on the device from row `row` of the
    # previous step's sampled tokens (their entry in token_ids is ignored)
    device_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    lora_slot: int = 0  # the LoRA adapter slot its tokens use (0 = none)
    # per token, its row of the stream of hidden states the step reads beside the ids (a
    # multi-token-prediction module's input: jaxinfer.engine.mtp); () = none
    hidden_src: Sequence[int] = ()
    state_slot: int = 0  # its slot of the recurrent states (a hybrid model's: jaxinfer.ops.linear_state; 0 = none)
    verifies: bool = False  # it verifies drafted tokens (a hybrid model keeps their inputs, advancing no state)
    # per group, the index in the full row where `pages` starts (the entries before are the scratch
    # page: a sliding group's pages behind its window, given back); () = every row from 0
    page_offsets: Sequence[int] = ()
    # image tokens (jaxinfer.engine.multimodal): (offset, rows [n, H], deepstack [K, n, H] or None) -
    # tokens offset .. offset + n read those rows instead of their ids' embeddings (and, with
    # deepstack, add row j to their stream after decoder layer j: Qwen3-VL)
    mm_rows: Sequence[tuple[int, np.ndarray, np.ndarray | None]] = ()
    # (first offset, end offset, position): those tokens' queries see up to that position (their
    # image's last: images attended both ways)
    span_ends: Sequence[tuple[int, int, int]] = ()
    rope_positions: np.ndarray | None = None  # [3, n]: its tokens' M-RoPE positions (None: its positions, thrice)
    # draft trees (speculative decoding; pallas_kernels.tree_mask): tree_base -1 = an ordinary causal
    # chunk; >= 0 = the first KV position its masks cover (maybe written by an earlier step), and
    # tree_masks gives each token a 32-bit mask: bit j = its query sees the key at tree_base + j
    # (keys before tree_base always, at tree_base + 32 or later never; the causal bound holds too).
    # tree_positions: each token's RoPE position (root position + depth); () = its slot position.
    tree_base: int = -1
    tree_masks: Sequence[int] = ()
    tree_positions: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class BucketKey:
    """The static shape of one compiled step variant."""

    num_tokens: int  # T
    num_seqs: int  # S
    num_logits: int  # R
    query_block: int  # attention query-block size: 1 for decode-only batches
    spec_block: int = 0  # > 0: short chunks (speculative verification) get their own attention pass


# At most this many sequences contribute more than one token (a prefill chunk) to one step. The
# scheduler keeps to it, `pack_batch` checks it, and attention sizes its prefill pass by it.
MAX_PREFILL_CHUNKS = 4


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The fixed set of padded shapes.

    token_buckets: allowed padded token counts T (sorted). Each T comes in up to three kinds, told
    apart by the padded sequence count S and the attention query-block size (how many queries of
    one sequence share a gather of its pages):

    - decode:  every sequence contributes one token; S = T, query blocks of 1;
    - prefill: at most `few_seqs` sequences (a long prompt, maybe with a few decodes); S =
               few_seqs;
    - mixed:   anything else; S = T / 4 (the largest bucket: max_num_seqs, so that every batch
               fits somewhere).

    Prefill and mixed batches hold at most MAX_PREFILL_CHUNKS multi-token chunks; attention
    serves their one-token sequences with query blocks of 1 and their chunks with query blocks
    of `prefill_query_block` (large: few blocks, big matmuls).

    S is capped at max_num_seqs. A batch takes the smallest T that holds its tokens and
    sequences (prefill and mixed batches: at least `min_chunk_tokens`). Logits rows are padded to
    S, unless a batch needs more (prompt logprobs, drafts to verify), then to T: one row per token,
    so each bucket has at most two row counts and warm-up can compile them all.
    """

    token_buckets: tuple[int, ...]
    max_num_seqs: int
    pages_per_seq: int
    few_seqs: int = MAX_PREFILL_CHUNKS
    prefill_query_block: int = 64
    # with speculative decoding: the longest verification chunk (1 + drafted tokens), rounded up to
    # a power of two; non-decode buckets then attend such chunks in a pass of their own
    spec_block: int = 0
    # prefill and mixed batches pad to at least this many tokens (decode batches do not)
    min_chunk_tokens: int = 1
    num_groups: int = 1  # KV layer groups: page-table rows per sequence (jaxinfer.kv_groups)

    @staticmethod
    def default(max_num_batched_tokens: int, max_num_seqs: int, pages_per_seq: int, token_multiple: int = 1,
                spec_block: int = 0, num_groups: int = 1) -> "Buckets":
        """Token buckets 2, 4, 8, ... up to max_num_batched_tokens, each rounded up to a multiple of
        `token_multiple` (sequence parallelism splits a step's tokens evenly over that many devices,
        pipeline parallelism into that many micro-batches).

        There is no 1-token bucket: with one token, XLA:CPU turned the KV scatter into a
        dynamic-update-slice and copied the whole page pool each layer (seen with small
        max_model_len); one padding token avoids that at no measurable cost.

        Without speculative decoding a batch of fewer than 8 tokens that is not all decodes is
        rare (a prompt of a few tokens, once per request), so prefill buckets start at 8 tokens:
        two programs fewer to compile (~3 s of a cold start on 2 cores) for ~10 ms on such a
        step. With it, verification chunks of 2-4 tokens come every step and keep their buckets.
        """
        if max_num_batched_tokens % token_multiple:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be a multiple of {token_multiple} "
                f"(sequence-parallel blocks and pipeline micro-batches split every step's tokens evenly)"
            )
        sizes, t = [], 2
        while t < max_num_batched_tokens:
            sizes.append(-(-t // token_multiple) * token_multiple)
            t *= 2
        sizes.append(max_num_batched_tokens)
        return Buckets(tuple(sorted(set(sizes))), max_num_seqs, pages_per_seq, spec_block=spec_block,
                       min_chunk_tokens=1 if spec_block else 8, num_groups=num_groups)

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    def round_up(self, n: int) -> int:
        i = bisect.bisect_left(self.token_buckets, n)
        if i == len(self.token_buckets):
            raise ValueError(f"{n} tokens exceed the largest bucket ({self.token_buckets[-1]})")
        return self.token_buckets[i]

    def _kind(self, T: int, kind: str) -> tuple[int, int]:
        """(S, query block) of a bucket kind at T tokens."""
        if kind == "decode":
            return min(T, self.max_num_seqs), 1
        if kind == "prefill":
            return min(self.few_seqs, T, self.max_num_seqs), min(self.prefill_query_block, T)
        S = self.max_num_seqs if T == self.max_tokens else max(1, T // 4)
        return min(S, T, self.max_num_seqs), min(self.prefill_query_block, T)

    def key_for(self, num_tokens: int, num_seqs: int, num_logits: int, decode: bool | None = None) -> BucketKey:
        """The smallest bucket for a batch of these sizes. `decode`: every sequence contributes one
        token (default: num_tokens == num_seqs); several replicas' batches share one bucket, so
        the runner passes their largest sizes and whether all of them decode."""
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} sequences exceed max_num_seqs={self.max_num_seqs}")
        decode = num_tokens == num_seqs if decode is None else decode
        kind = "decode" if decode else "prefill" if num_seqs <= self.few_seqs else "mixed"
        T = self.round_up(max(num_tokens, 1 if decode else min(self.min_chunk_tokens, self.max_tokens)))
        while num_seqs > self._kind(T, kind)[0]:
            T = self.round_up(T + 1)
        S, query_block = self._kind(T, kind)
        if num_logits <= S:
            return BucketKey(T, S, S, query_block, 0 if kind == "decode" else self.spec_block)
        T = self.round_up(max(T, num_logits))  # more rows than sequences: a logits row for every token
        S, query_block = self._kind(T, kind)
        return BucketKey(T, S, T, query_block, 0 if kind == "decode" else self.spec_block)

    def all_keys(self) -> list[BucketKey]:
        """Every variant the engine may compile (for warm-up): each bucket with a logits row per
        sequence, and each prefill and mixed bucket also with a logits row per token (prompt
        logprobs, speculative verification)."""
        keys = []
        for T in self.token_buckets:
            # decode batches hold up to max_num_seqs tokens (and a single one pads to the smallest T)
            kinds = (["decode"] if T <= max(self.max_num_seqs, self.token_buckets[0]) else []) + (["prefill", "mixed"] if T > 1 else [])
            for kind in kinds:
                S, qb = self._kind(T, kind)
                if kind != "decode" and T < self.round_up(min(self.min_chunk_tokens, self.max_tokens)):
                    continue
                if kind == "mixed" and S <= self.few_seqs:
                    continue  # key_for sends batches of so few sequences to a prefill bucket
                spec_block = 0 if kind == "decode" else self.spec_block
                for R in (S, T) if kind != "decode" and T > S else (S,):
                    key = BucketKey(T, S, R, qb, spec_block)
                    if key not in keys:
                        keys.append(key)
        return keys


def tree_fields(chunks: Sequence[SequenceChunk], positions: np.ndarray, cu_q_lens: np.ndarray):
    """(tree_base, tree_bits, tree_rope) [T] int32 each for a batch's chunks (RaggedBatch): tree
    chunks' masks and RoPE positions; every other token (padding too) base = position + 1, bits 0,
    RoPE at its position, which the visibility rule makes plain causal."""
    base = positions + 1
    bits = np.zeros_like(positions)
    rope = positions.copy()
    for s, c in enumerate(chunks):
        first, n = int(cu_q_lens[s]), len(c.token_ids)
        if c.tree_base < 0:
            if c.tree_masks or c.tree_positions:
                raise ValueError(f"sequence slot {s}: tree_masks / tree_positions without a tree_base")
            continue
        if len(c.tree_masks) != n:
            raise ValueError(f"sequence slot {s}: {len(c.tree_masks)} tree masks for {n} tokens")
        if c.tree_positions and len(c.tree_positions) != n:
            raise ValueError(f"sequence slot {s}: {len(c.tree_positions)} tree positions for {n} tokens")
        masks = np.asarray(c.tree_masks, np.int64)
        if np.any((masks < 0) | (masks >= 2**32)):
            raise ValueError(f"sequence slot {s}: tree masks must be 32-bit (0 <= mask < 2**32)")
        base[first : first + n] = c.tree_base
        bits[first : first + n] = masks.astype(np.uint32).view(np.int32)
        if c.tree_positions:
            rope[first : first + n] = c.tree_positions
    return base, bits, rope


def fresh_pages(num_groups: int, num_pages: int) -> list[list[int]]:
    """Page-table rows of one sequence alone in a pool: num_pages pages for each of num_groups KV
    layer groups, all distinct, from page 1 on (a pool of num_groups * num_pages + 1 pages)."""
    return [list(range(1 + g * num_pages, 1 + (g + 1) * num_pages)) for g in range(num_groups)]


def shared_key(replica_chunks: Sequence[Sequence[SequenceChunk]], buckets: Buckets) -> BucketKey:
    """The one bucket that holds every replica's chunks (each replica's batch is padded to it)."""
    sizes = [(sum(len(c.token_ids) for c in chunks), len(chunks), sum(len(c.logits_rows) for c in chunks))
             for chunks in replica_chunks]
    decode = all(all(len(c.token_ids) == 1 for c in chunks) for chunks in replica_chunks)
    return buckets.key_for(*(max(size[i] for size in sizes) for i in range(3)), decode=decode)


def stack_replicas(batches: Sequence[RaggedBatch]) -> RaggedBatch:
    """Per-replica batches of one bucket -> one batch whose arrays lead with a [replicas] axis."""
    return jax.tree.map(lambda *a: np.stack(a), *batches)


def pack_batch(
    chunks: Sequence[SequenceChunk], buckets: Buckets, page_size: int | Sequence[int], key: BucketKey | None = None, *,
    with_lora: bool = False, with_hidden: bool | None = None, mm_width: int = 0, mm_deepstack: int = 0,
    with_span_end: bool = False, with_rope_positions: bool = False, with_tree: bool = False,
) -> tuple[BucketKey, RaggedBatch, list[list[int]]]:
    """Flattens chunks into a padded RaggedBatch (numpy arrays), in the bucket `key` (default:
    the smallest that holds them); `with_lora`: with each sequence's LoRA slot (`lora_slots`);
    `with_hidden`: with each token's `hidden_src` (default: when some chunk has them);
    `mm_width` > 0: with image rows of that width (`mm_embeds`, `mm_mask`: chunks' `mm_rows`);
    `mm_deepstack` > 0: with that many deepstack rows per image token (`mm_deepstack`: theirs);
    `with_span_end`: with each query's last visible position (`span_end`: chunks' `span_ends`);
    `with_rope_positions`: with M-RoPE positions (`rope_positions`);
    `with_tree`: with tree masks and RoPE positions (`tree_base`, `tree_bits`, `tree_rope`: chunks'
    `tree_base`, `tree_masks`, `tree_positions`; every other token plain causal at its position).
    page_size: tokens per page, or per KV layer group (groups of another shape: jaxinfer.kv_groups).

    Returns the bucket key, the batch, and for each chunk the indices (into the R logits rows)
    of its requested logits rows, in the order of `chunk.logits_rows`.
    """
    num_tokens = sum(len(c.token_ids) for c in chunks)
    num_logits = sum(len(c.logits_rows) for c in chunks)
    key = key or buckets.key_for(num_tokens, len(chunks), num_logits)
    num_prefill_chunks = sum(len(c.token_ids) > max(1, key.spec_block) for c in chunks)  # short chunks have their own pass
    if num_prefill_chunks > MAX_PREFILL_CHUNKS:
        raise ValueError(f"{num_prefill_chunks} multi-token chunks in one step; at most {MAX_PREFILL_CHUNKS} are allowed")
    T, S, R = key.num_tokens, key.num_seqs, key.num_logits
    if num_tokens > T or len(chunks) > S or num_logits > R or (key.query_block == 1 and num_tokens != len(chunks)):
        raise ValueError(f"{len(chunks)} chunks of {num_tokens} tokens and {num_logits} logits rows do not fit bucket {key}")

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    cu_q_lens = np.zeros(S + 1, np.int32)
    kv_lens = np.zeros(S, np.int32)
    state_slots = np.zeros(S, np.int32)
    verifies = np.zeros(S, bool)
    G = buckets.num_groups
    page_sizes = (page_size,) * G if isinstance(page_size, int) else tuple(page_size)
    page_table = np.full((G, S, buckets.pages_per_seq), SCRATCH_PAGE, np.int32)
    logits_indices = np.zeros(R, np.int32)
    token_src = np.full(T, -1, np.int32)
    with_hidden = any(c.hidden_src for c in chunks) if with_hidden is None else with_hidden
    hidden_src = np.zeros(T, np.int32)
    rows_of_chunk: list[list[int]] = []
    if mm_width:
        mm_embeds = np.zeros((T, mm_width), np.float32)
        mm_mask = np.zeros(T, bool)
        deepstack = np.zeros((mm_deepstack, T, mm_width), np.float32)
    rope_positions = np.zeros((3, T), np.int32) if with_rope_positions else None

    t = r = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start_pos + n
        if len(c.pages) != G:
            raise ValueError(f"sequence slot {s}: {len(c.pages)} page-table rows for {G} KV layer groups")
        for g, row in enumerate(c.pages):
            first = c.page_offsets[g] if c.page_offsets else 0
            if (first + len(row)) * page_sizes[g] < end:
                raise ValueError(f"sequence slot {s}: {first + len(row)} pages of group {g} cannot hold {end} tokens")
            if first + len(row) > buckets.pages_per_seq:
                raise ValueError(f"sequence slot {s}: {first + len(row)} pages exceed pages_per_seq={buckets.pages_per_seq}")
            page_table[g, s, first : first + len(row)] = row
        token_ids[t : t + n] = [max(tok, 0) for tok in c.token_ids]
        for off, row in c.device_tokens.items():
            token_src[t + off] = row
        if with_hidden:
            if len(c.hidden_src) != n:
                raise ValueError(f"sequence slot {s}: {len(c.hidden_src)} hidden-state rows for {n} tokens")
            hidden_src[t : t + n] = c.hidden_src
        positions[t : t + n] = np.arange(c.start_pos, end)
        if with_rope_positions:
            rope_positions[:, t : t + n] = positions[t : t + n] if c.rope_positions is None else c.rope_positions
        if c.mm_rows and not mm_width:
            raise ValueError(f"sequence slot {s}: image rows in a batch packed without them (mm_width=0)")
        for off, rows, rows_deepstack in c.mm_rows:
            mm_embeds[t + off : t + off + len(rows)] = rows
            mm_mask[t + off : t + off + len(rows)] = True
            if (rows_deepstack is None) != (mm_deepstack == 0):
                raise ValueError(f"sequence slot {s}: image rows {'without' if rows_deepstack is None else 'with'} deepstack "
                                 f"rows in a batch packed with mm_deepstack={mm_deepstack}")
            if rows_deepstack is not None:
                deepstack[:, t + off : t + off + len(rows)] = rows_deepstack
        cu_q_lens[s + 1] = t + n
        kv_lens[s] = end
        state_slots[s] = c.state_slot
        verifies[s] = c.verifies
        rows = []
        for off in c.logits_rows:
            logits_indices[r] = t + off
            rows.append(r)
            r += 1
        rows_of_chunk.append(rows)
        t += n
    cu_q_lens[len(chunks) + 1 :] = t
    batch = RaggedBatch(
        token_ids=token_ids,
        positions=positions,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_table=page_table,
        num_seqs=np.array([len(chunks)], np.int32),
        logits_indices=logits_indices,
        token_src=token_src,
        state_slots=state_slots,
        verifies=verifies,
    )
    if with_hidden:
        batch.hidden_src = hidden_src
    batch.rope_positions = rope_positions
    if mm_width:
        batch.mm_embeds, batch.mm_mask = mm_embeds, mm_mask
        if mm_deepstack:
            batch.mm_deepstack = deepstack
    if with_span_end:
        span_end = positions.copy()
        for s, c in enumerate(chunks):
            first = cu_q_lens[s]
            for lo, hi, last in c.span_ends:
                span_end[first + lo : first + hi] = last
        batch.span_end = span_end
    if with_tree:
        batch.tree_base, batch.tree_bits, batch.tree_rope = tree_fields(chunks, positions, cu_q_lens)
    elif any(c.tree_base >= 0 for c in chunks):
        raise ValueError("a chunk has a tree mask (tree_base >= 0) in a batch packed without them (with_tree=False)")
    if with_lora:
        batch.lora_slots = np.zeros(S, np.int32)
        batch.lora_slots[: len(chunks)] = [c.lora_slot for c in chunks]
    return key, batch, rows_of_chunk

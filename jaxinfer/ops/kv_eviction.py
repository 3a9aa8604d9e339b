"""KV eviction for unbounded streams: StreamingLLM's attention sinks, and H2O's heavy hitters.

`LLM(kv_eviction="streaming", kv_eviction_sink_tokens=S, kv_eviction_window=W)` (Xiao et al.
2023, "Efficient Streaming Language Models with Attention Sinks") keeps, per sequence, the first
S tokens (the *sinks*, which a trained model dumps attention on) and the last W (the query's own
token counted, as a sliding window counts it); `kv_eviction="h2o"` with `kv_eviction_heavy_tokens=H`
(Zhang et al. 2023, "H2O: Heavy-Hitter Oracle") keeps H slots of the tokens that received the
most attention so far, and the last W. Both bound the pages a sequence holds: the block manager
treats the group as a sliding window of W that also holds the first ceil(S / page_size) (or
ceil(H / page_size)) pages for good (`jaxinfer.kv_groups.KVEviction`, `kept_prefix_pages`), and
gives every page between them back as the window moves, prompt chunks included. Both change the
outputs: a token past the window and outside the kept set is gone for every later query.

**Positions (StreamingLLM).** The paper assigns positions *within the cache*: with the cache
holding the sinks 0..S-1 and the window, the query sees the sinks at 0..S-1 and the window at
S..S+W-1, itself last, instead of the text's positions (section 3.2: the keys are cached before
RoPE and rotated at each step by their place in the cache). Here the keys stay in the pages
rotated at their text positions (the fused RoPE + KV write is unchanged), and the query is
rotated twice instead. RoPE scores depend on the difference of positions only
(R(a) q . R(b) k = q . R(b - a) k, for every table whose angle is linear in the position:
default, linear, llama3, YaRN), so:

- window keys j (text positions p - W + 1 .. p): cache positions j - delta and query p - delta,
  delta = max(0, p - W + 1 - S) the tokens evicted between the sinks and the window; the
  difference is p - j, the one the pages and the query rotated at p already give;
- sink keys j < S: cache position j, the query's p - delta. The query rotated at p - delta
  (`cache_positions`) scores the sinks, the one rotated at p the window.

That is the paper's attention exactly (a numpy recomputation with cache positions checks it:
tests/test_kv_eviction.py), with no re-rotation of kept keys when the window shifts and no RoPE at
read time: one more rotation of q per layer. Within the cache every distance stays below S + W,
as the paper wants, whatever p. (Precision: the angles are computed from p in float32, as for any
long context; the positions are bounded by max_model_len.) With S = 0 it is plain sliding-window
attention (the paper's "window attention" baseline).

**H2O.** Per layer and per KV head (as the paper: every head keeps its own heavy hitters), each
token's attention received so far, summed over the queries (and the query heads of its KV head),
is kept beside its K/V (`KVCache.evict_score`, float32 [slots, P, page_size, Hkv]; `evict_pos`
the text position a slot holds). The first H positions' slots (the kept prefix pages) are the
heavy-hitter slots: they start with tokens 0..H-1; once the window moves on, each token that
leaves it (the key p - W + 1 of each query p, from position H on) competes with the slots'
occupants, and after the step the slots hold the H best of occupants and leavers by accumulated
score (`select_heavy_hitters`: a top-H per sequence and KV head, ties to the earlier occupant);
a leaver that wins is copied into a loser's slot (K, V, score and position, that head only).
Its key keeps its rotation at its text position: H2O keeps the text positions. Eviction is at
*token* granularity inside a paged cache by compaction into those fixed slots: the pages stay
bounded exactly (ceil(H / page_size) + the window's), which masks alone would not give (a page
with one heavy hitter left would stay), and whole-page eviction would keep or drop 16 tokens on
one score. The choice is made per step: within a prefill chunk the leavers are decided at the
chunk's end with the scores of all its queries (H2O's own prefill keeps the prompt's top-k the
same way); a decode step decides each token as the paper does.

**Attention** (`evicting_attention`, XLA only): query blocks of one sequence (as split-KV), each
gathering its kept-prefix pages and the pages of its window (a static count: the pages held are
bounded), the scores masked to kept positions < S (or the H slots) and the window
max(p - W + 1, S) .. p, one softmax over both; with H2O the normalised probabilities are also
summed per key. The Pallas kernels have no such mask or sums: `kernel_impl` 'pallas' is refused
with kv_eviction (engine/config.py), as are quantized KV pools, sliding / chunked / MLA / linear
attention models, LoRA, speculative decoding and sequence parallelism.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import KVEviction
from jaxinfer.ops.attention import rope_and_write_kv
from jaxinfer.ops.batch import RaggedBatch
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache
from pallas_kernels.rope_kv_write import apply_rope

ATTENTION_SCRATCH_BYTES = 64 << 20  # query blocks are attended this many bytes of scores at a time


def cache_positions(positions, eviction: KVEviction):
    """StreamingLLM: each query's position inside its cache (p - delta, delta = the tokens evicted
    between the sinks and the window: max(0, p - W + 1 - S)); the sinks are scored against a query
    rotated there (module docstring). An int array like `positions`."""
    return positions - jnp.maximum(positions - eviction.window + 1 - eviction.keep, 0)


def write_kv_and_attend(q, k, v, cos, sin, cache_rope, pool: KVCache, layer_page_offset, write_page, write_offset,
                        batch: RaggedBatch, *, eviction: KVEviction, sm_scale: float, query_block: int,
                        soft_cap: float | None = None, kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """One layer's write and attention under KV eviction (the module docstring): RoPE + this
    step's K/V into the pages as usual, then `evicting_attention` over the kept prefix and the
    window; with H2O the written slots' scores restart at 0, the step's attention is added to
    them, and the heavy-hitter slots are chosen (`select_heavy_hitters`).

    q [T, Hq, D], k, v [T, Hkv, D] before RoPE; cos, sin [T, R] at the text positions; cache_rope
    (cos, sin) at `cache_positions` (StreamingLLM), else None; pool folded ([slots * P, ...], one
    separate float pool); the batch's page_table the layer's group's row [S, pages]. (out, pool)."""
    pages = layer_page_offset + write_page
    q_rot, _, pool = rope_and_write_kv(q, k, v, cos, sin, pool, pages, write_offset, kernels)
    q_keep = apply_rope(q, *cache_rope) if cache_rope is not None else q_rot
    h2o = eviction.method == "h2o"
    if h2o:  # a written slot holds a new token: no attention received yet
        Hkv = k.shape[1]
        pool = dataclasses.replace(
            pool, evict_score=pool.evict_score.at[pages, write_offset].set(0.0),
            evict_pos=pool.evict_pos.at[pages, write_offset].set(jnp.broadcast_to(batch.positions[:, None], (q.shape[0], Hkv))))
    page_table = batch.page_table + layer_page_offset
    out = evicting_attention(q_rot, q_keep, pool.k, pool.v, page_table, batch, keep=eviction.keep, window=eviction.window,
                             sm_scale=sm_scale, query_block=query_block, soft_cap=soft_cap, with_mass=h2o)
    if not h2o:
        return out, pool
    out, (mass, key_page, key_offset) = out
    pool = dataclasses.replace(pool, evict_score=pool.evict_score.at[key_page, key_offset].add(mass))
    return out, select_heavy_hitters(pool, page_table, batch, heavy=eviction.keep, window=eviction.window)


def evicting_attention(q, q_keep, k_pages, v_pages, page_table, batch: RaggedBatch, *, keep: int, window: int,
                       sm_scale: float, query_block: int, soft_cap: float | None = None, with_mass: bool = False):
    """Attention of q [T, Hq, D] over each query's kept keys: positions < keep (its sinks / heavy
    slots: scored with q_keep [T, Hq, D]) and its window max(p - window + 1, keep) .. p (scored
    with q), p its position; k_pages, v_pages [N, page_size, Hkv, D], page_table [S, pages] (pool
    page ids). Returns out [T, Hq, D] in q's dtype; with_mass also (mass [NB, K, Hkv] float32: each
    gathered key's attention probability summed over the block's queries and the query heads of
    its KV head, 0 where masked; its page [NB, K] and offset [NB, K]) for scatter-adds."""
    T, Hq, D = q.shape
    page_size, Hkv = k_pages.shape[1], k_pages.shape[2]
    S, width = page_table.shape
    G = Hq // Hkv
    Bq = query_block
    num_keep = -(-keep // page_size) if keep else 0  # pages of the kept prefix
    num_window = min(width, (window + Bq - 2) // page_size + 2)  # pages a block of Bq queries' windows span
    K = (num_keep + num_window) * page_size  # keys gathered per block

    # query blocks: Bq rows of one sequence each (as pallas_kernels.ragged_paged_attention.split_kv)
    cu = batch.cu_q_lens
    q_lens = jnp.where(jnp.arange(S) < batch.num_seqs.reshape(()), cu[1:] - cu[:-1], 0)
    blocks_per_seq = -(-q_lens // Bq)
    cu_blocks = jnp.cumsum(blocks_per_seq)
    NB = min(T, -(-T // Bq) + S)
    b = jnp.arange(NB)
    seq = jnp.minimum(jnp.searchsorted(cu_blocks, b, side="right"), S - 1)  # [NB]
    row_in_seq = ((b - (cu_blocks[seq] - blocks_per_seq[seq])) * Bq)[:, None] + jnp.arange(Bq)  # [NB, Bq]
    row_ok = (b < cu_blocks[-1])[:, None] & (row_in_seq < q_lens[seq][:, None])
    rows = jnp.where(row_ok, cu[seq][:, None] + row_in_seq, T)  # T: none
    pos = batch.kv_lens[seq][:, None] - q_lens[seq][:, None] + row_in_seq  # [NB, Bq]
    # the pages each block reads: the kept prefix's, then num_window from its first query's window start
    window_first = jnp.maximum(pos[:, 0] - window + 1, 0) // page_size
    page_index = jnp.concatenate([jnp.broadcast_to(jnp.arange(num_keep), (NB, num_keep)),
                                  window_first[:, None] + jnp.arange(num_window)], axis=1)  # [NB, num_keep + num_window]
    pages = page_table[seq[:, None], jnp.minimum(page_index, width - 1)]
    key_pos = (page_index[:, :, None] * page_size + jnp.arange(page_size)).reshape(NB, K)
    kept = jnp.arange(K) < num_keep * page_size  # [K]: the key is read as part of the kept prefix

    def attend(block):
        rows, pos, row_ok, pages, key_pos = block  # one block: [Bq], [Bq], [Bq], [pages], [K]
        taken = jnp.minimum(rows, T - 1)
        qb, qk = (x[taken].reshape(Bq, Hkv, G, D) for x in (q, q_keep))
        kb, vb = (x[pages].reshape(K, Hkv, D) for x in (k_pages, v_pages))
        split = num_keep * page_size
        scores = jnp.concatenate([jnp.einsum("bhgd,khd->bhgk", qk, kb[:split], preferred_element_type=jnp.float32),
                                  jnp.einsum("bhgd,khd->bhgk", qb, kb[split:], preferred_element_type=jnp.float32)],
                                 axis=-1) * sm_scale  # [Bq, Hkv, G, K]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        causal = key_pos[None, :] <= pos[:, None]  # [Bq, K]
        in_prefix = kept[None, :] & (key_pos[None, :] < keep)
        in_window = ~kept[None, :] & (key_pos[None, :] >= jnp.maximum(pos - window + 1, keep)[:, None])
        visible = causal & (in_prefix | in_window) & row_ok[:, None]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        m = jnp.max(scores, axis=-1, keepdims=True)
        p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m))  # 0 where masked
        l = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(l == 0.0, 1.0, l)  # a row that sees nothing: all 0
        out = jnp.einsum("bhgk,khd->bhgd", p, vb.astype(jnp.float32)).reshape(Bq, Hq, D)
        return out, jnp.sum(p, axis=(0, 2)).T  # [Bq, Hq, D], mass [K, Hkv]

    per_block = Bq * Hq * K * 4 * 4 + 2 * K * Hkv * D * k_pages.dtype.itemsize  # scores, probabilities, K and V
    batch_size = max(1, min(NB, ATTENTION_SCRATCH_BYTES // per_block))
    out, mass = jax.lax.map(attend, (rows, pos, row_ok, pages, key_pos), batch_size=batch_size)
    result = jnp.zeros((T, Hq, D), q.dtype).at[rows.reshape(-1)].set(out.reshape(-1, Hq, D).astype(q.dtype), mode="drop")
    if not with_mass:
        return result
    key_page = jnp.repeat(pages, page_size, axis=1)  # [NB, K]
    key_offset = jnp.broadcast_to(jnp.tile(jnp.arange(page_size), num_keep + num_window), (NB, K))
    return result, (mass, key_page, key_offset)


def select_heavy_hitters(pool: KVCache, page_table, batch: RaggedBatch, *, heavy: int, window: int) -> KVCache:
    """H2O's choice after a step (module docstring), per sequence and KV head: the heavy-hitter
    slots (positions 0 .. heavy - 1 of its row) keep the `heavy` best by accumulated score of
    their occupants and of the tokens leaving the window with this step (positions
    max(first query - window + 1, heavy) .. last query - window + 1); a leaver that wins is copied
    (K, V, score, position; that head's) into a losing occupant's slot. Ties go to the occupant,
    then to the earlier leaver. page_table [S, pages]: pool page ids; the pool folded."""
    N, page_size, Hkv, D = pool.k.shape
    S, width = page_table.shape
    T = batch.token_ids.shape[0]
    C = T  # leavers per sequence: at most its queries
    in_use = jnp.arange(S) < batch.num_seqs.reshape(())
    q_lens = jnp.where(in_use, batch.cu_q_lens[1:] - batch.cu_q_lens[:-1], 0)
    lo = jnp.maximum(batch.kv_lens - q_lens - window + 1, heavy)
    num_leaving = jnp.where(q_lens > 0, jnp.maximum(batch.kv_lens - window + 1 - lo, 0), 0)  # [S]
    leaver_pos = lo[:, None] + jnp.arange(C)  # [S, C]
    leaving = jnp.arange(C)[None, :] < num_leaving[:, None]
    leaver_page = page_table[jnp.arange(S)[:, None], jnp.clip(leaver_pos // page_size, 0, width - 1)]
    leaver_offset = leaver_pos % page_size
    slot_pos = jnp.arange(heavy)
    slot_page, slot_offset = page_table[:, slot_pos // page_size], jnp.broadcast_to(slot_pos % page_size, (S, heavy))
    slot_score = pool.evict_score[slot_page, slot_offset]  # [S, heavy, Hkv]
    leaver_score = jnp.where(leaving[..., None], pool.evict_score[leaver_page, leaver_offset], -jnp.inf)  # [S, C, Hkv]
    candidates = jnp.concatenate([slot_score, leaver_score], axis=1).transpose(0, 2, 1)  # [S, Hkv, heavy + C]
    _, best = jax.lax.top_k(candidates, heavy)  # (stable: ties to the lower index, occupants first)
    s_idx, h_idx = jnp.arange(S)[:, None, None], jnp.arange(Hkv)[None, :, None]
    won = jnp.zeros(candidates.shape, bool).at[s_idx, h_idx, best].set(True)
    lost = ~won[..., :heavy]  # [S, Hkv, heavy]: occupants that leave their slot
    joins = won[..., heavy:] & leaving[:, None, :]  # [S, Hkv, C]: leavers that take one
    slot_of_rank = jnp.full((S, Hkv, heavy), heavy).at[
        s_idx, h_idx, jnp.where(lost, jnp.cumsum(lost, axis=-1) - 1, heavy)].set(jnp.arange(heavy), mode="drop")
    dest = jnp.take_along_axis(slot_of_rank, jnp.clip(jnp.cumsum(joins, axis=-1) - 1, 0, heavy - 1), axis=-1)  # [S, Hkv, C]
    # the moves, at most one per (leaver, head): compacted to T * Hkv entries
    ms, mh, mc = jnp.nonzero(joins, size=T * Hkv, fill_value=0)
    valid = jnp.arange(T * Hkv) < jnp.sum(joins)
    src_page, src_offset = leaver_page[ms, mc], leaver_offset[ms, mc]
    slot = dest[ms, mh, mc]
    dst_page = jnp.where(valid, slot_page[ms, jnp.minimum(slot, heavy - 1)], N)  # N: dropped
    dst_offset = slot_offset[ms, jnp.minimum(slot, heavy - 1)]

    def move(a):
        return a.at[dst_page, dst_offset, mh].set(a[src_page, src_offset, mh], mode="drop")

    return dataclasses.replace(pool, k=move(pool.k), v=move(pool.v), evict_score=move(pool.evict_score),
                               evict_pos=move(pool.evict_pos))

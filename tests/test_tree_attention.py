"""Tree attention masks (speculative decoding with draft trees: pallas_kernels.tree_mask).

Random draft trees (a parent per node) give each node the mask of its ancestors and itself; a
batch mixes ordinary decodes and prefill chunks with tree chunks, one of which continues a tree
whose first level an earlier step wrote (its mask's base lies before the chunk), and one of 34
nodes whose last two lie past the mask's 32 bits. The truth is a dense numpy attention that
applies the visibility rule as written; the reference, the XLA split-KV path and both Pallas
kernels (interpret mode) are held to it, and each kernel is compiled with tree masks for a real
chip (v6e by libtpu, H100 by the CUDA plugin: no device needed). Last, a tiny Llama's step over
a tree chunk gives every node the logits of the plain causal forward over its root-to-node path:
masks and RoPE positions together.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.aot import kernel_check
from jaxinfer.aot.targets import compile_target
from jaxinfer.config import ModelConfig
from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.runtime.loading import abstract_model
from jaxinfer.runtime.step import StepFunction
from pallas_kernels.ragged_paged_attention import combined, gpu, reference, split_kv, tpu
from pallas_kernels.ragged_paged_attention.combined import row_width
from pallas_kernels.tree_mask import TREE_WIDTH
from test_ragged_attention_reference import make_case

SM_SCALE = 0.125


def random_parents(rng, n: int) -> np.ndarray:
    """A random tree of n nodes in topological order: node 0 the root, node i's parent before it."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def ancestor_masks(parents) -> list[int]:
    """Bit j of node i's mask: node j is i itself or one of its ancestors."""
    masks = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return masks


def as_int32(masks) -> np.ndarray:
    """32-bit masks (Python ints < 2**32) as int32 bits."""
    return np.asarray(masks, np.uint64).astype(np.uint32).view(np.int32)


# ----------------------------------------------------------------------------- one batch, several trees
# (q_len, kv_len, tree): tree None = an ordinary causal chunk; else (tree start, node of the chunk's
# first token, parents of all the tree's nodes), the chunk holding nodes first .. first + q_len - 1
def batch_layout(rng):
    return [
        (1, 21, None),  # a decode
        (10, 23, (13, 0, random_parents(rng, 10))),  # a fresh tree on a 13-token prefix
        (6, 41, (30, 5, random_parents(rng, 11))),  # level 2 of a tree: its first 5 nodes written before
        (9, 9, None),  # a prefill chunk
        (34, 40, (6, 0, random_parents(rng, 34))),  # 34 nodes: the last two past the mask's 32 bits
    ]


def tree_case(seed: int = 0, *, Hq=4, Hkv=2, D=32, page_size=8, pad_tokens=3, dtype=np.float32):
    """(case, tree_base [T], tree_bits [T]): make_case's arrays for batch_layout, the tree fields as
    pack_batch builds them (non-tree and padding rows: base = position + 1, bits 0)."""
    rng = np.random.default_rng(seed)
    layout = batch_layout(rng)
    q_lens, kv_lens = [q for q, _, _ in layout], [kv for _, kv, _ in layout]
    case = make_case(rng, q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=D, page_size=page_size, pad_seqs=1, pad_tokens=pad_tokens,
                     dtype=dtype)
    base, bits = [], []
    for q_len, kv_len, tree in layout:
        positions = np.arange(kv_len - q_len, kv_len)
        if tree is None:
            base += list(positions + 1)
            bits += [0] * q_len
        else:
            start, first, parents = tree
            base += [start] * q_len
            bits += list(as_int32([m & (2**TREE_WIDTH - 1) for m in ancestor_masks(parents)[first : first + q_len]]))
    base += [1] * pad_tokens
    bits += [0] * pad_tokens
    return case, np.asarray(base, np.int32), np.asarray(bits, np.int32)


def dense_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, tree_base, tree_bits, sm_scale,
                    sinks=None, sliding_window=None):
    """Every real row against its sequence's keys, visible by the rule as written (float64)."""
    T, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    out = np.zeros((T, Hq, D))
    for s in range(int(num_seqs[0])):
        kv_len, q_len = kv_lens[s], cu_q_lens[s + 1] - cu_q_lens[s]
        k = k_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)
        v = v_pages[page_indices[s]].reshape(-1, Hkv, D)[:kv_len].astype(np.float64)
        for i in range(q_len):
            t, pos = cu_q_lens[s] + i, kv_len - q_len + i
            base, bits = int(tree_base[t]), int(tree_bits[t]) & 0xFFFFFFFF
            visible = np.array([kp <= pos and (kp < base or (kp - base < 32 and (bits >> (kp - base)) & 1 == 1))
                                for kp in range(kv_len)])
            if sliding_window is not None:
                visible &= np.arange(kv_len) > pos - sliding_window
            for h in range(Hq):
                scores = np.where(visible, k[:, h // (Hq // Hkv)] @ q[t, h].astype(np.float64) * sm_scale, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(scores.max(), sink)
                p = np.exp(scores - top)
                out[t, h] = p @ v[:, h // (Hq // Hkv)] / (p.sum() + np.exp(sink - top))
    return out


def assert_close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * max(1.0, np.abs(want).max()), rtol=0)


@pytest.fixture(scope="module")
def case():
    return tree_case()


@pytest.fixture(scope="module")
def truth(case):
    (args, base, bits) = case
    return reference.ragged_paged_attention(*map(jnp.asarray, args), sm_scale=SM_SCALE, num_queries_per_block=4,
                                            tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits))


def test_the_cases_trees_are_what_they_claim(case):
    _, base, bits = case
    assert (bits < 0).any()  # a mask using bit 31 (the 34-node tree's node 31 and its descendants)
    assert base[1] == 13 and base[11] == 30  # the level-2 chunk's mask starts 5 positions before its first token


def test_reference_matches_a_dense_attention_and_trees_change_the_result(case, truth):
    args, base, bits = case
    want = dense_attention(*args, base, bits, SM_SCALE)
    assert_close(truth, want)
    causal = reference.ragged_paged_attention(*map(jnp.asarray, args), sm_scale=SM_SCALE, num_queries_per_block=4)
    assert np.abs(np.asarray(causal) - want).max() > 0.1  # the masks matter in this case
    assert np.all(np.asarray(truth)[-3:] == 0)  # padding rows


@pytest.mark.parametrize("contraction", ["dot", "reduce"])
def test_split_kv_matches_the_reference(case, truth, contraction):
    args, base, bits = case
    got = split_kv.ragged_paged_attention(*map(jnp.asarray, args), sm_scale=SM_SCALE, num_queries_per_block=4,
                                          num_kv_pages_per_block=2, items_per_step=8, contraction=contraction,
                                          tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits))
    assert_close(got, np.asarray(truth, np.float64))


def test_reference_with_sinks_and_a_window_matches_a_dense_attention(case):
    args, base, bits = case
    sinks = np.random.default_rng(3).normal(size=4).astype(np.float32)
    got = reference.ragged_paged_attention(*map(jnp.asarray, args), sm_scale=SM_SCALE, sliding_window=12,
                                           sinks=jnp.asarray(sinks), tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits))
    assert_close(got, dense_attention(*args, base, bits, SM_SCALE, sinks=sinks, sliding_window=12))


def test_tpu_kernel_in_interpret_mode_matches_a_dense_attention_with_sinks_and_a_window(case):
    """Combined pages, query blocks of 8 (a tree's rows span blocks), 2 pages per KV block."""
    args, base, bits = case
    q, k_pages, v_pages, *rest = args
    sinks = np.random.default_rng(3).normal(size=4).astype(np.float32)
    kv_pages = combined.combine_kv(jnp.asarray(k_pages), jnp.asarray(v_pages))
    got = tpu.ragged_paged_attention(jnp.asarray(q), kv_pages, *map(jnp.asarray, rest), sinks=jnp.asarray(sinks),
                                     sm_scale=SM_SCALE, sliding_window=12, num_queries_per_block=8,
                                     num_kv_pages_per_block=2, interpret=True,
                                     tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits))
    assert_close(got, dense_attention(*args, base, bits, SM_SCALE, sinks=sinks, sliding_window=12))


def test_gpu_kernel_in_interpret_mode_matches_the_reference(case, truth):
    args, base, bits = case
    got = gpu.ragged_paged_attention(*map(jnp.asarray, args), sm_scale=SM_SCALE, num_queries_per_block=8,
                                     num_kv_pages_per_block=2, num_kv_splits=2, interpret=True,
                                     tree_base=jnp.asarray(base), tree_bits=jnp.asarray(bits))
    assert_close(got, np.asarray(truth, np.float64))


def test_one_of_the_two_tree_fields_alone_is_refused(case):
    args, base, _ = case
    with pytest.raises(ValueError, match="tree_base and tree_bits"):
        reference.ragged_paged_attention(*map(jnp.asarray, args), tree_base=jnp.asarray(base))


# ----------------------------------------------------------------------------- a tiny Llama over a tree
PAGE_SIZE = 4
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


class TinyLlama:
    """A random 2-layer Llama behind the paged step, with fresh pages for every sequence."""

    def __init__(self):
        self.config = ModelConfig.from_hf_dict(TINY_LLAMA, source="test")
        graphdef, state = abstract_model(self.config, jnp.float32, jnp.float32)
        rng = np.random.default_rng(0)
        self.params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), a.dtype), state)
        self.step = StepFunction(graphdef, num_top_logprobs=0)
        self.kv = KVCache.create(self.config, 96, PAGE_SIZE)
        self.buckets = Buckets((8, 64), max_num_seqs=4, pages_per_seq=8)
        self.next_page = 1

    def pages(self, num_tokens: int) -> list[list[int]]:
        n = -(-num_tokens // PAGE_SIZE)
        self.next_page += n
        return [list(range(self.next_page - n, self.next_page))]

    def run(self, chunks, **pack) -> list[np.ndarray]:
        """One step; per chunk its requested rows' logits [rows, V]."""
        key, batch, rows = pack_batch(chunks, self.buckets, PAGE_SIZE, **pack)
        logits, self.kv = self.step.forward(self.params, self.kv, self.step.place_inputs(stack_replicas([batch])),
                                            query_block=key.query_block)
        logits = np.asarray(logits[0], np.float64)
        return [logits[r] for r in rows]


def test_a_tree_chunks_logits_are_each_root_to_node_paths_causal_logits():
    """A prompt, then a draft tree of 8 nodes below it written in two steps (nodes 0-2, then 3-7,
    whose masks start at the tree's root, written the step before); each node's logits equal those
    of the prompt + its path run as a plain causal chunk. Node i's RoPE position is prompt + depth,
    its K/V at slot prompt + i."""
    model = TinyLlama()
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 128, size=5)]
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 5])  # depths 0 1 1 2 2 2 3 3
    tokens = [int(t) for t in rng.integers(3, 128, size=len(parents))]
    masks = ancestor_masks(parents)
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    P, n = len(prompt), len(parents)
    pages = model.pages(P + n)
    model.run([SequenceChunk(prompt, 0, pages)])
    tree_logits = []
    for lo, hi in ((0, 3), (3, n)):  # level by level: the second chunk's masks cover the first's nodes
        chunk = SequenceChunk(tokens[lo:hi], P + lo, pages, logits_rows=list(range(hi - lo)), tree_base=P,
                              tree_masks=masks[lo:hi], tree_positions=[P + d for d in depth[lo:hi]])
        tree_logits += list(model.run([chunk], with_tree=True)[0])

    def path(i):
        return path(parents[i]) + [tokens[i]] if i >= 0 else []

    path_logits = []
    for first in range(0, n, 4):  # plain causal prefills of prompt + path, 4 sequences a step
        chunks = [SequenceChunk(prompt + path(i), 0, model.pages(P + len(path(i))), logits_rows=[P + len(path(i)) - 1])
                  for i in range(first, min(first + 4, n))]
        path_logits += [rows[0] for rows in model.run(chunks)]
    # (node 2 sits after node 1 in the cache but must not see it, and rotates at depth 1, not slot 2)
    np.testing.assert_allclose(np.array(tree_logits), np.array(path_logits), atol=1e-4 * np.abs(path_logits).max(), rtol=0)


def test_pack_batch_lays_out_tree_fields_and_refuses_trees_it_was_not_asked_for():
    buckets = Buckets((8,), max_num_seqs=4, pages_per_seq=4)
    chunks = [SequenceChunk([5], 3, [[1]]),
              SequenceChunk([7, 8, 9], 4, [[2, 3]], tree_base=4, tree_masks=[1, 3, 2**31 + 5], tree_positions=[4, 5, 5])]
    _, batch, _ = pack_batch(chunks, buckets, 4, with_tree=True)
    assert list(batch.tree_base) == [4, 4, 4, 4, 1, 1, 1, 1]  # decode: its position + 1; padding: 0 + 1
    assert list(batch.tree_bits[:4]) == [0, 1, 3, -(2**31) + 5] and not batch.tree_bits[4:].any()
    assert list(batch.tree_rope[:4]) == [3, 4, 5, 5] and list(batch.positions[:4]) == [3, 4, 5, 6]
    _, plain, _ = pack_batch(chunks[:1], buckets, 4)
    assert plain.tree_base is None and plain.tree_bits is None and plain.tree_rope is None  # no tree: no fields
    with pytest.raises(ValueError, match="with_tree=False"):
        pack_batch(chunks, buckets, 4)
    with pytest.raises(ValueError, match="2 tree masks for 3 tokens"):
        pack_batch([dataclasses.replace(chunks[1], tree_masks=[1, 3])], buckets, 4, with_tree=True)


# ----------------------------------------------------------------------------- compiled for the real chips
# (last in the module: the fixture keeps these executables out of the persistent cache until its end)
@pytest.fixture(scope="module")
def tree_spec():
    """Abstract arguments of a mixed bucket with tree masks: T=64 rows, 8 sequences, 8 query heads of
    128 over 2 KV heads, 8 pages per sequence; (q, kv_lens, page table, cu_q_lens, num_seqs,
    tree_base, tree_bits) less the pages."""
    spec, i32 = jax.ShapeDtypeStruct, jnp.int32
    T, S, Hq, Hkv, D = 64, 8, 8, 2, 128
    return dict(q=spec((T, Hq, D), jnp.bfloat16), Hkv=Hkv, D=D, sinks=jnp.zeros(Hq, jnp.float32),
                meta=(spec((S,), i32), spec((S, 8), i32), spec((S + 1,), i32), spec((1,), i32)),
                tree=(spec((T,), i32), spec((T,), i32)))


@pytest.mark.usefixtures("no_persistent_compilation_cache")
def test_the_tpu_kernel_compiles_with_tree_masks_for_a_v6e(tree_spec):
    """Combined bf16 pages with attention sinks, and an int8 pool with its scale pool (pages of 128)."""
    v6e = compile_target("v6e:2x2")
    s, spec = tree_spec, jax.ShapeDtypeStruct
    width = row_width(s["Hkv"], s["D"])

    def attend(q, kv_pages, kv_lens, table, cu_q_lens, num_seqs, base, bits, kv_scale=None):
        return tpu.ragged_paged_attention(q, kv_pages, kv_lens, table, cu_q_lens, num_seqs, kv_scale, s["sinks"],
                                          tree_base=base, tree_bits=bits, sm_scale=0.1, num_queries_per_block=8)

    bf16 = (spec((64, 16, width), jnp.bfloat16),)
    int8 = (spec((8, 128, width), jnp.int8),)
    int8_scales = (spec((8, s["Hkv"] * 2 * 128), jnp.float32),)
    for pages, scales in ((bf16, ()), (int8, int8_scales)):
        hlo = kernel_check.compile_for(v6e, attend, (s["q"], *pages, *s["meta"], *s["tree"], *scales)).as_text()
        assert "ragged_paged_attention" in hlo  # the Mosaic kernel, compiled by libtpu


@pytest.mark.usefixtures("no_persistent_compilation_cache")
def test_the_gpu_kernel_compiles_with_tree_masks_for_an_h100(tree_spec):
    h100 = compile_target("h100")
    s, spec = tree_spec, jax.ShapeDtypeStruct
    pages = spec((64, 16, s["Hkv"], s["D"]), jnp.bfloat16)

    def attend(q, k_pages, v_pages, kv_lens, table, cu_q_lens, num_seqs, base, bits):
        return gpu.ragged_paged_attention(q, k_pages, v_pages, kv_lens, table, cu_q_lens, num_seqs, sinks=s["sinks"],
                                          tree_base=base, tree_bits=bits, sm_scale=0.1)

    hlo = kernel_check.compile_for(h100, attend, (s["q"], pages, pages, *s["meta"], *s["tree"])).as_text()
    assert "triton" in hlo  # the Triton kernel, compiled for the H100

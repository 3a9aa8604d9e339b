"""Logit parity with Hugging Face transformers (torch, float32) for every supported family.

Each tiny random model is saved with `save_pretrained`, loaded through `checkpoints_conv`, and run
through the paged step in the ways the engine uses it. The truth is HF's log-softmax over the
whole sequence in one forward; every position we compute must match it to 1e-4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.kv_groups import kv_groups
from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kv_cache import KVCache, page_factors
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.runtime.step import StepFunction
from tiny_models import FAMILIES, LAYER_KIND_FAMILIES, MOE_FAMILIES, VOCAB, save_hf_model

TOL = 1e-4


class PagedModel:
    """Our model behind the paged step, with a tiny page allocator (pages handed out shuffled)."""

    def __init__(self, model_dir, page_size: int, num_pages: int = 160, max_len: int = 96):
        source = resolve_model(model_dir)
        self.config = read_config(source)
        graphdef, self.params = load_params(source, self.config, jnp.float32, jnp.float32, progress=False)
        self.kv = KVCache.create(self.config, num_pages, page_size, state_slots=16)  # (the states: hybrid models')
        self.step = StepFunction(graphdef, num_top_logprobs=0)
        self.page_size = page_size
        groups = kv_groups(self.config)
        self.num_groups = groups.num_groups
        self.page_sizes = [page_size * f for f in page_factors(groups)]  # each group's tokens per page
        self.buckets = Buckets((4, 64), max_num_seqs=8, pages_per_seq=-(-max_len // page_size), num_groups=self.num_groups)
        self.free_pages = list(np.random.default_rng(0).permutation(np.arange(1, num_pages)))
        self.owned: set[int] = set()

    def allocate(self, num_tokens: int) -> list[list[int]]:
        """Fresh pages for num_tokens in every KV layer group (a page-table row each)."""
        rows = []
        for page_size in self.page_sizes:
            n = -(-num_tokens // page_size)
            assert n <= len(self.free_pages), "test page pool too small"
            pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
            self.owned.update(int(p) for p in pages)
            rows.append([int(p) for p in pages])
        return rows

    def run(self, chunks: list[SequenceChunk]) -> list[np.ndarray]:
        """One step; returns per chunk the log-softmax [rows, V] of its requested rows."""
        key, batch, rows = pack_batch(chunks, self.buckets, self.page_sizes)
        batch = self.step.place_inputs(stack_replicas([batch]))
        logits, self.kv = self.step.forward(self.params, self.kv, batch, query_block=key.query_block)
        logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)
        return [logprobs[r] for r in rows]

    def unowned_pages_untouched(self) -> bool:
        """Pages never handed out (other than the scratch page 0) must still be all zeros."""
        unowned = np.array(sorted(set(range(1, self.kv.num_pages)) - self.owned))
        return not any(np.any(np.asarray(pages)[:, unowned]) for pages in jax.tree.leaves(self.kv.page_arrays()))  # K and V, or latent rows


def hf_logprobs(hf_model, tokens: list[int], chunks: list[int]) -> np.ndarray:
    """HF's log-softmax at every position of one sequence [len, V], fed through HF's own KV cache
    in the given chunk sizes (dynamic NTK RoPE depends on how far the sequence has grown, so HF
    must see the tokens in the same chunks as we do; for the other families chunking is moot)."""
    from transformers import DynamicCache

    # sparse attention's indexer and linear attention keep their keys / states in cache layers of
    # their own, made from the config
    own_layers = getattr(hf_model.config, "index_topk", None) or "linear_attention" in (getattr(hf_model.config, "layer_types", None) or [])
    cache = DynamicCache(config=hf_model.config) if own_layers else DynamicCache()
    out, start = [], 0
    with torch.no_grad():
        for n in chunks:
            piece = torch.tensor([tokens[start : start + n]])
            positions = torch.arange(start, start + n)[None]
            logits = hf_model(piece, past_key_values=cache, use_cache=True, position_ids=positions).logits[0]
            out.append(torch.log_softmax(logits.double(), dim=-1).numpy())
            start += n
    return np.concatenate(out)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    # one family goes through the sharded (model.safetensors.index.json) path
    hf = save_hf_model(family, directory, max_shard_size="20KB" if family == "qwen2" else None)
    return family, directory, hf


def sequences(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in lengths]


@pytest.mark.parametrize("page_size", [1, 16])
def test_parity(family_model, page_size):
    family, directory, hf = family_model
    if page_size == 1 and family in MOE_FAMILIES + LAYER_KIND_FAMILIES:
        pytest.skip("one-token pages are the Llama families' test (a MoE model differs only in its MLP)")
    model = PagedModel(directory, page_size)
    # lengths cross page boundaries (16, 33) and, for llama-dynamic, max_position_embeddings (24)
    seqs = sequences(1, [5, 17, 33, 1])
    prompt_lens = [len(s) - 4 if len(s) > 4 else len(s) for s in seqs]
    truth = [hf_logprobs(hf, s, [n] + [1] * (len(s) - n)) for s, n in zip(seqs, prompt_lens)]

    # (a) a ragged batch prefilling four prompts of different lengths in one step; every row checked
    pages = [model.allocate(len(s) + 8) for s in seqs]
    # (a hybrid model's sequence i continues its recurrent state in slot i + 1)
    outs = model.run([SequenceChunk(s[:n], 0, p, list(range(n)), state_slot=i + 1)
                      for i, (s, n, p) in enumerate(zip(seqs, prompt_lens, pages))])
    for out, t, n in zip(outs, truth, prompt_lens):
        np.testing.assert_array_less(np.abs(out - t[:n]).max(), TOL)

    # (b) token-by-token decode through the paged cache, all sequences in one decode batch
    pos = list(prompt_lens)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        live = [i for i, (p, s) in enumerate(zip(pos, seqs)) if p < len(s)]
        outs = model.run([SequenceChunk([seqs[i][pos[i]]], pos[i], pages[i], [0], state_slot=i + 1) for i in live])
        for i, out in zip(live, outs):
            np.testing.assert_array_less(np.abs(out[0] - truth[i][pos[i]]).max(), TOL)
            pos[i] += 1

    # (c) one prompt prefilled in chunks of 5, 3, 11, 14, with one-token steps of other sequences
    # riding along: one rider (a "prefill" bucket), then four (a "mixed" bucket). A rider recomputes
    # position 0 of sequence i, rewriting the same K/V, and its logits are checked too.
    long_seq = seqs[2]
    chunk_pages = model.allocate(len(long_seq))
    chunk_truth = hf_logprobs(hf, long_seq, [5, 3, 11, 14])
    start = 0
    for n, num_riders in zip((5, 3, 11, 14), (1, 4, 1, 4)):
        piece = long_seq[start : start + n]
        riders = [SequenceChunk([seqs[i][0]], 0, [row[:1] for row in pages[i]], [0], state_slot=i + 1) for i in range(num_riders)]
        out, *rider_outs = model.run([SequenceChunk(piece, start, chunk_pages, list(range(n)), state_slot=10)] + riders)
        np.testing.assert_array_less(np.abs(out - chunk_truth[start : start + n]).max(), TOL)
        for i, rider_out in enumerate(rider_outs):
            np.testing.assert_array_less(np.abs(rider_out[0] - truth[i][0]).max(), TOL)
        start += n

    # (e) padded slots (the 4- and 64-token buckets were mostly padding) wrote nothing outside scratch
    assert model.unowned_pages_untouched()


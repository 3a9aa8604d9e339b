"""Prefill/decode disaggregation, the engine's side: a prompt's KV pages handed from one engine
to another.

A *prefill* instance runs a request whose `Request.export_kv` is set as usual (its prompt, one
sampled token); when it finishes, before its pages are freed, the core gathers the pages holding
the K/V of its first len(prompt) - 1 tokens into new device arrays (`ModelRunner.gather_pages`:
every head, [L, n, page_size, ...] per page array), the request's `KVHandoff`. The pool's pages
are freed at once; the handoff's arrays live on their own until the transport has sent them
(jaxinfer.server.kv_transfer).

A *decode* instance receives those arrays into its own device and starts the same request with
them as if it had been swapped out (`Sequence.swapped`): admission gives it pages, the swap-in
path writes the arrays into them (resharded to this instance's mesh by the write's sharding), and
the last prompt token is computed here, sampling the first output token. So the decode side's
text comes from its own sampler and output processor, exactly as a co-located run's; the prefill
side's sampled token is never used.

`page_geometry` describes a pool's pages independently of its mesh (global shapes, all heads):
two instances can hand pages over iff their geometries are equal, whatever their tensor-parallel
degrees.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.engine.request import SwappedKV
from jaxinfer.ops.kv_cache import KVCache


@dataclasses.dataclass(eq=False)
class KVHandoff:
    """The K/V of a prompt's first num_tokens tokens: `pages`, a KVCache of arrays [L, n, ...]
    (n = the pages holding them; None when num_tokens is 0)."""

    pages: KVCache | None
    num_tokens: int
    prompt_token_ids: list[int] | None = None  # (received: the prompt the sender computed, to check against)

    @property
    def num_pages(self) -> int:
        return 0 if self.pages is None else jax.tree.leaves(self.pages)[0].shape[1]

    @property
    def num_bytes(self) -> int:
        return 0 if self.pages is None else sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.pages))


def page_geometry(runner, model_type: str) -> dict:
    """What must match for pages to move between two instances: the model type, tokens per page
    and each page array's per-page shape ([L, page_size, ...], all heads) and dtype, in the
    pool's tree order."""
    leaves = jax.tree.leaves(runner.kv.page_arrays())
    return {"model_type": model_type, "page_size": runner.page_size,
            "arrays": [{"shape": [a.shape[0], *a.shape[2:]], "dtype": np.dtype(a.dtype).name} for a in leaves]}


def handoff_specs(runner, num_pages: int, device) -> KVCache:
    """ShapeDtypeStructs of a handoff of num_pages pages for this runner's pool, on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    pool = runner.kv.page_arrays()
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], num_pages, *a.shape[2:]), a.dtype, sharding=sharding),
                        pool)


def prepare_handoff(request, export_kv: bool, handoff: KVHandoff | None, *, recurrent_states: bool = False) -> None:
    """A newly made request (before it is queued): with `export_kv` it hands its prompt's pages
    off when done; with `handoff` its sequence restores another instance's pages on admission, as
    a swapped-out one would. ValueError for what a handoff cannot do (several completions, prompt
    logprobs: rows of tokens it would not compute) or pages that do not hold the prompt but its
    last token."""
    if not (export_kv or handoff is not None):
        return
    if recurrent_states:
        raise ValueError("a hybrid model's recurrent states are not handed off (prefill/decode disaggregation moves pages)")
    if request.params.n != 1 or request.params.prompt_logprobs is not None:
        raise ValueError("n > 1 and prompt_logprobs are not supported with prefill/decode disaggregation")
    if request.images:
        raise ValueError("prompts with images are not supported with prefill/decode disaggregation")
    request.export_kv = export_kv
    if handoff is None:
        return
    if handoff.prompt_token_ids is not None and list(handoff.prompt_token_ids) != list(request.prompt_token_ids):
        raise ValueError("the handed-off K/V is another prompt's (the prefill instance tokenized it differently)")
    if handoff.num_tokens != len(request.prompt_token_ids) - 1:
        raise ValueError(f"the handed-off K/V holds {handoff.num_tokens} tokens, the prompt has "
                         f"{len(request.prompt_token_ids)} (expected all but the last)")
    if handoff.num_tokens:
        request.seqs[0].swapped = SwappedKV(handoff.pages, handoff.num_tokens)

"""Scoring a text with a model: per-position log-probabilities and perplexity.

One ragged prefill step over the whole text on a private KV cache (nothing shared with a
running engine), so it works on any (graphdef, params) pair, e.g. before and after quantization.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.kv_groups import kv_groups
from jaxinfer.ops.batch import Buckets, SequenceChunk, fresh_pages, pack_batch, stack_replicas
from jaxinfer.config import ModelConfig
from jaxinfer.ops.kv_cache import KVCache
from jaxinfer.runtime.step import StepFunction


def prompt_log_softmax(
    config: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, token_ids: list[int], page_size: int = 16,
    kv_dtype=jnp.float32, kv_outliers: int = 0,
) -> np.ndarray:
    """log-softmax [n, V] (float64) of the next-token distribution at every position of token_ids
    (the text's K/V stored in a KV cache of `kv_dtype`, int8 / e4m3 included, with `kv_outliers`
    residual slots per page (kv_cache_outliers), and read back)."""
    n = len(token_ids)
    if not 0 < n <= config.max_position_embeddings:
        raise ValueError(f"token_ids has {n} tokens; need 1..{config.max_position_embeddings} (max_position_embeddings)")
    num_pages = -(-n // page_size)
    bucket = 1 << max(4, (n - 1).bit_length())  # one power-of-two token bucket that holds the text
    G = kv_groups(config).num_groups
    key, batch, rows = pack_batch(
        [SequenceChunk(list(token_ids), 0, fresh_pages(G, num_pages), list(range(n)))],
        Buckets((bucket,), max_num_seqs=1, pages_per_seq=num_pages, num_groups=G),
        page_size,
    )
    kv = KVCache.create(config, G * num_pages + 1, page_size, kv_dtype, outliers=kv_outliers)  # page 0 is the scratch page
    step = StepFunction(graphdef, num_top_logprobs=0)
    logits, _ = step.forward(params, kv, step.place_inputs(stack_replicas([batch])), query_block=key.query_block)
    return np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)[rows[0]]


def _whole_text(config: ModelConfig, token_ids: list[int], page_size: int):
    """The batch of one prefill over the whole text (its bucket key, batch, logits rows) and a
    fresh KV cache for it, shared by the calls that read hidden states or streams: the pool has
    room for the longest text the model takes and lengths round up to powers of two (>= 16), so
    calls for many texts share compiled steps."""
    n = len(token_ids)
    if not 0 < n <= config.max_position_embeddings:
        raise ValueError(f"token_ids has {n} tokens; need 1..{config.max_position_embeddings} (max_position_embeddings)")
    pages_per_seq = -(-config.max_position_embeddings // page_size)
    bucket = 1 << max(4, (n - 1).bit_length())
    G = kv_groups(config).num_groups
    key, batch, rows = pack_batch(
        [SequenceChunk(list(token_ids), 0, fresh_pages(G, pages_per_seq), list(range(n)))],
        Buckets((bucket,), max_num_seqs=1, pages_per_seq=pages_per_seq, num_groups=G),
        page_size,
    )
    return key, batch, rows, KVCache.create(config, G * pages_per_seq + 1, page_size)


def hidden_states(config: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, token_ids: list[int],
                  page_size: int = 16) -> np.ndarray:
    """The final-normed hidden state [n, H] (float32) at every position of token_ids: what the LM
    head reads (draft heads train on them). Calls for many texts share compiled steps: the page
    pool has room for the longest text the model takes, and lengths round up to powers of two."""
    key, batch, rows, kv = _whole_text(config, token_ids, page_size)
    step = _hidden_step(graphdef)
    _, _, hidden = step.forward(params, kv, step.place_inputs(stack_replicas([batch])), query_block=key.query_block)
    return np.asarray(hidden[0], np.float32)[rows[0]]


@functools.lru_cache(maxsize=4)
def _hidden_step(graphdef: nnx.GraphDef) -> StepFunction:
    return StepFunction(graphdef, num_top_logprobs=0, return_hidden=True)


def stream_states(config: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, token_ids: list[int],
                  layers: tuple[int, ...], page_size: int = 16) -> np.ndarray:
    """The residual streams at the input of `layers`, side by side, [n, len(layers) * H] (float32),
    at every position of token_ids (an EAGLE-3 head trains on them: jaxinfer.training.eagle3); the
    target's own model program with `return_stream=layers`, compiled once per power-of-two length."""
    key, batch, rows, kv = _whole_text(config, token_ids, page_size)
    step = _stream_step(graphdef, tuple(layers), key.num_tokens)
    prev_tokens = jnp.zeros((1, key.num_tokens), jnp.int32)
    _, _, stream = step._model(params, kv, step.place_inputs(stack_replicas([batch])), prev_tokens,
                               query_block=key.query_block)
    return np.asarray(stream[0], np.float32)[: len(token_ids)]  # (the text is the batch's first n token rows)


@functools.lru_cache(maxsize=8)
def _stream_step(graphdef: nnx.GraphDef, layers: tuple[int, ...], rows: int) -> StepFunction:
    return StepFunction(graphdef, num_top_logprobs=0, max_rows=rows, return_stream=layers)


def perplexity(config: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State, token_ids: list[int],
               kv_dtype=jnp.float32, kv_outliers: int = 0) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given their prefixes."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    logprobs = prompt_log_softmax(config, graphdef, params, token_ids, kv_dtype=kv_dtype, kv_outliers=kv_outliers)
    return float(np.exp(-np.mean(logprobs[np.arange(len(token_ids) - 1), token_ids[1:]])))

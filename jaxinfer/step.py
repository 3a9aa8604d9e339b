"""The jitted step: forward over a ragged batch, then sampling. Pure, with the KV cache donated.

    step(params, kv, batch, sampling, prev_tokens, query_block=...) -> (SampleOutput, token_buffer, kv)

Sampled tokens stay on the device: the step also returns them padded into a fixed-size
`token_buffer` [max_rows], and the next step takes that buffer as `prev_tokens`, reading the
tokens its batch marks in `batch.token_src`. So the host can dispatch step N+1 before it has
read step N's tokens.

`params` is the model's nnx.State (a pytree of arrays); the model's structure (its graphdef) is
closed over. One compiled variant exists per bucket (the padded shapes of `batch` plus the static
attention query-block size); `StepFunction.num_compiles` counts them, so tests can assert that
steady-state serving compiles nothing new.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.batch import RaggedBatch
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SampleOutput, SamplingTensors, sample


class StepFunction:
    def __init__(self, graphdef: nnx.GraphDef, num_top_logprobs: int, max_rows: int = 1):
        self.num_compiles = 0
        self.max_rows = max_rows  # size of the token buffer handed from one step to the next

        def step(params, kv: KVCache, batch: RaggedBatch, sampling: SamplingTensors, prev_tokens, *, query_block: int):
            self.num_compiles += 1  # runs only while tracing, i.e. once per compiled variant
            from_device = prev_tokens[jnp.maximum(batch.token_src, 0)]
            batch = dataclasses.replace(batch, token_ids=jnp.where(batch.token_src >= 0, from_device, batch.token_ids))
            model = nnx.merge(graphdef, params)
            logits, kv = model(kv, batch, query_block=query_block)
            out = sample(logits, sampling, num_top_logprobs)
            token_buffer = jnp.zeros(max_rows, jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
            return out, token_buffer, kv

        def forward(params, kv: KVCache, batch: RaggedBatch, *, query_block: int):
            """The raw logits [R, V] (for tests and scoring); not the serving path."""
            model = nnx.merge(graphdef, params)
            return model(kv, batch, query_block=query_block)

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("query_block",))
        self.forward = jax.jit(forward, donate_argnums=(1,), static_argnames=("query_block",))

    def __call__(self, params, kv, batch, sampling, prev_tokens, *, query_block: int) -> tuple[SampleOutput, jax.Array, KVCache]:
        return self._step(params, kv, batch, sampling, prev_tokens, query_block=query_block)

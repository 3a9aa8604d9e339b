"""The jitted step: forward over a ragged batch, then sampling. Pure, with the KV cache donated.

    step(params, kv, batch, sampling, query_block=...) -> (SampleOutput, kv)

`params` is the model's nnx.State (a pytree of arrays); the model's structure (its graphdef) is
closed over. One compiled variant exists per bucket (the padded shapes of `batch` plus the static
attention query-block size); `StepFunction.num_compiles` counts them, so tests can assert that
steady-state serving compiles nothing new.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxinfer.batch import RaggedBatch
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SampleOutput, SamplingTensors, sample


class StepFunction:
    def __init__(self, graphdef: nnx.GraphDef, num_top_logprobs: int):
        self.num_compiles = 0

        def step(params, kv: KVCache, batch: RaggedBatch, sampling: SamplingTensors, *, query_block: int):
            self.num_compiles += 1  # runs only while tracing, i.e. once per compiled variant
            model = nnx.merge(graphdef, params)
            logits, kv = model(kv, batch, query_block=query_block)
            return sample(logits, sampling, num_top_logprobs), kv

        def forward(params, kv: KVCache, batch: RaggedBatch, *, query_block: int):
            """The raw logits [R, V] (for tests and scoring); not the serving path."""
            model = nnx.merge(graphdef, params)
            return model(kv, batch, query_block=query_block)

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("query_block",))
        self.forward = jax.jit(forward, donate_argnums=(1,), static_argnames=("query_block",))

    def __call__(self, params, kv, batch, sampling, *, query_block: int) -> tuple[SampleOutput, KVCache]:
        return self._step(params, kv, batch, sampling, query_block=query_block)

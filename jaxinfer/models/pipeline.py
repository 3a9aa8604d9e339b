"""Pipeline parallelism inside the step: the layers split into stages, micro-batches passed stage to stage.

With `pipeline_parallel_size` = pp the mesh axis "pipeline" splits every stacked layer weight and the
KV cache's layer slots into pp contiguous runs (sharding.rules "layers"): stage s holds layers
s * Ls .. (s + 1) * Ls - 1 (Ls = L / pp) and their pages, and nothing of the others. All stages run
one program (shard_map over the mesh), so each stage's layers must look alike to the code: the
same attention kinds, KV groups and weight stacks in the same order (`check_pipeline`).

A step's T tokens are cut into M = pp micro-batches of T / M contiguous rows (GPipe inside one
jitted step, no host round trip). At iteration i = 0 .. M + pp - 2 stage s runs its layers on
micro-batch m = i - s (when 0 <= m < M), then hands its output (hidden and residual, [T / M, H]
each) to stage s + 1 with one `ppermute`; stage 0 reads micro-batch i's embeddings instead. So at
every iteration up to pp stages work at once, each on another micro-batch, and the bubble is
(pp - 1) / (M + pp - 1) of the iterations:

    iteration   0    1    2    3    4          (pp = 3, M = 3)
    stage 0     m0   m1   m2   .    .
    stage 1     .    m0   m1   m2   .
    stage 2     .    .    m0   m1   m2

Micro-batch m of a step sees the K/V that micro-batches < m wrote: it reaches each stage one
iteration after m - 1 did, and the rows of one sequence are contiguous and in position order, so
a sequence cut between two micro-batches is attended exactly like a prompt prefilled in two chunks
(each micro-batch is the rows' `ops.attention.local_view` of the batch). A stage idle at an
iteration computes on padding and writes its K/V to the scratch page.

The last stage holds every token's output; it applies the final norm to the logits rows and
broadcasts them over the axis (one [R, H] psum in the compute dtype, 1/tp of it per tensor shard), so the LM head and the
sampler see the same rows on every stage. Traffic per step between neighbouring stages: (M + pp - 1)
permutes of 2 x [T / M, H], each tensor shard sending 1/tp of the columns (`hand_on`): what
crosses DCN when the stages are slices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.kv_groups import KVGroups
from jaxinfer.models.param_layout import base_name, stack_of, stack_slots
from jaxinfer.ops.attention import local_view
from jaxinfer.ops.batch import SCRATCH_PAGE
from sharding.mesh import ParallelConfig

AXIS = "pipeline"


def check_pipeline(config: ModelConfig, parallel: ParallelConfig, groups: KVGroups, stack_names) -> None:
    """ConfigError unless `config`'s layers split into parallel.pp stages that run one program:
    pp divides the layers, and every stage's layers have the same attention kinds, KV groups, KV
    slots and weight stacks as the first stage's (shifted by a stage's share)."""
    pp, c = parallel.pp, config
    what = f"pipeline_parallel_size={pp} with {c.model_type}"
    if c.num_layers % pp:
        raise ConfigError(f"{what}: pp must divide the model's {c.num_layers} layers")
    refused = [(parallel.sp > 1, "sequence parallelism"), (c.is_mla, "multi-head latent attention"),
               (c.has_linear_layers, "linear-attention (recurrent) layers"), (c.kv_eviction is not None, "KV eviction"),
               (bool(c.kv_shared_layers), "layers sharing K/V"), (bool(c.per_layer_input_size), "per-layer inputs"),
               (c.is_moe and c.first_dense_layers > 0, "dense layers before the MoE ones")]
    for at_fault, setting in refused:
        if at_fault:
            raise ConfigError(f"{what}: {setting} in a pipeline is not supported")
    per_stage = c.num_layers // pp
    kinds = c.layer_kinds()
    stacks = {name: stack_slots(c, f"layers.{name}") for name in stack_names}
    for i in range(per_stage, c.num_layers):
        j, stage = i % per_stage, i // per_stage
        alike = (kinds[i] == kinds[j] and groups.group_of_layer[i] == groups.group_of_layer[j]
                 and all(stack_of(c, base_name(f"layers.{n}"), i) == stack_of(c, base_name(f"layers.{n}"), j)
                         for n in stack_names)
                 and all(s[i] == (stage * per_stage + s[j] if s[j] >= 0 else -1) for s in stacks.values()))
        if not alike:
            raise ConfigError(f"{what}: layer {i} differs from layer {j} of the first stage (attention kind, KV group or "
                              f"weights); every stage of {per_stage} layers must be alike")
    slots_per_stage = groups.num_slots // pp
    if groups.num_slots % pp or any(groups.slot_of_layer[i] != i // per_stage * slots_per_stage + groups.slot_of_layer[i % per_stage]
                                    for i in range(c.num_layers)):
        raise ConfigError(f"{what}: its layers' {groups.num_slots} KV slots do not split into {pp} stages alike "
                          f"(jaxinfer.kv_groups)")


def micro_step(step, first_row, num_rows: int, active):
    """The StepInputs of rows first_row : first_row + num_rows (a micro-batch) of a step's `step`;
    an inactive one (`active` False: a stage idle at this iteration) writes to the scratch page."""
    rows = lambda a, axis=0: jax.lax.dynamic_slice_in_dim(a, first_row, num_rows, axis)  # noqa: E731
    write_page = jnp.where(active, rows(step.write_page, 1), SCRATCH_PAGE)
    return dataclasses.replace(
        step, batch=local_view(step.batch, first_row, num_rows), write_page=write_page,
        write_offset=rows(step.write_offset, 1),
        rope={kind: (rows(cos), rows(sin)) for kind, (cos, sin) in step.rope.items()},
        lora_slot=None if step.lora_slot is None else rows(step.lora_slot),
        nope_query_scale=None if step.nope_query_scale is None else rows(step.nope_query_scale))


def hand_on(a, num_stages: int, tp: int):
    """a [rows, H] from each stage to the next (stage 0 receives zeros). With tensor parallelism each
    of a stage's tp devices holds the same rows, so each sends only its 1/tp of the columns and the
    receiving stage all-gathers them over "tensor" (its fast links): the link between stages (DCN
    between slices) carries the activations once, not tp times."""
    forward = [(s, s + 1) for s in range(num_stages - 1)]
    if tp == 1:
        return jax.lax.ppermute(a, AXIS, forward)
    width = a.shape[1] // tp
    part = jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index("tensor") * width, width, axis=1)
    return jax.lax.all_gather(jax.lax.ppermute(part, AXIS, forward), "tensor", axis=1, tiled=True)


def run_pipeline(run_stage, step, x, pool, num_stages: int, tp: int = 1):
    """Every token's (stream, residual) [T, H] after the last layer, on the last stage (zeros on the
    others), and this stage's pool: the schedule of the module docstring. x [T, H]: the embedded
    tokens; run_stage(step, carry) runs this stage's layers on carry = (hidden, residual, pool); tp:
    the tensor-parallel size (`hand_on`)."""
    T, H = x.shape
    M = num_stages  # micro-batches
    if T % M:
        raise ValueError(f"a step of {T} tokens does not split into {M} micro-batches (token buckets are multiples of pp)")
    rows = T // M
    stage = jax.lax.axis_index(AXIS)

    def iteration(i, carry):
        hidden, residual, pool, out_hidden, out_residual = carry
        m = i - stage
        active = (m >= 0) & (m < M)
        first_row = jnp.clip(m, 0, M - 1) * rows
        embedded = jax.lax.dynamic_slice_in_dim(x, first_row, rows)
        hidden = jnp.where(stage == 0, embedded, hidden)
        residual = jnp.where(stage == 0, jnp.zeros_like(residual), residual)
        hidden, residual, pool = run_stage(micro_step(step, first_row, rows, active), (hidden, residual, pool))
        keep = active & (stage == num_stages - 1)
        out_hidden = jnp.where(keep, jax.lax.dynamic_update_slice_in_dim(out_hidden, hidden, first_row, 0), out_hidden)
        out_residual = jnp.where(keep, jax.lax.dynamic_update_slice_in_dim(out_residual, residual, first_row, 0), out_residual)
        hidden, residual = hand_on(hidden, num_stages, tp), hand_on(residual, num_stages, tp)  # to the next stage
        return hidden, residual, pool, out_hidden, out_residual

    zeros = jnp.zeros((rows, H), x.dtype)
    carry = (zeros, zeros, pool, jnp.zeros_like(x), jnp.zeros_like(x))
    _, _, pool, stream, residual = jax.lax.fori_loop(0, M + num_stages - 1, iteration, carry)
    return stream, residual, pool


def from_last_stage(a, num_stages: int, tp: int = 1):
    """a [R, H] as the last stage holds it, on every stage: a psum over the axis of it and zeros,
    exact in any dtype (x + 0 = x); with tensor parallelism of 1/tp of the columns per device,
    all-gathered over "tensor" after (as `hand_on`)."""
    last = jax.lax.axis_index(AXIS) == num_stages - 1
    if tp > 1:
        width = a.shape[1] // tp
        a = jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index("tensor") * width, width, axis=1)
    a = jax.lax.psum(jnp.where(last, a, jnp.zeros_like(a)), AXIS)
    return jax.lax.all_gather(a, "tensor", axis=1, tiled=True) if tp > 1 else a

"""sharding.expert_parallel: the experts of an MoE layer, on one device and expert-parallel.

Every path is compared with `reference_moe` (every expert on every token, masked by the routing).
The expert-parallel tests run `moe_experts` inside `jax.shard_map` over meshes of the 8 CPU
devices that conftest.py provides; each device along the expert axis gets different tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from sharding.expert_parallel import grouped_expert_mlp, moe_experts, reference_moe

E, K, T, H, I = 8, 2, 13, 16, 24  # experts, slots per token, tokens (per device), hidden, MLP width
RTOL, ATOL = 1e-5, 1e-5


def make_weights(seed=0, num_experts=E):
    """Stacked expert weights: w_gate_up [E, H, 2I] (= [gate | up]), w_down [E, I, H]."""
    rng = np.random.default_rng(seed)
    w_gate_up = rng.normal(0, 0.3, (num_experts, H, 2 * I)).astype(np.float32)
    w_down = rng.normal(0, 0.3, (num_experts, I, H)).astype(np.float32)
    return w_gate_up, w_down


def make_tokens(num_tokens, seed=1, num_experts=E):
    """x [T, H], expert_ids [T, K] (K distinct experts per token), expert_weights [T, K]."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (num_tokens, H)).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, K, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (num_tokens, K)).astype(np.float32)
    return x, ids, weights


def numpy_expert(x, w_gate_up, w_down):
    """One SwiGLU expert in float64 numpy."""
    gate, up = x @ w_gate_up[:, :I], x @ w_gate_up[:, I:]
    return (gate / (1 + np.exp(-gate)) * up) @ w_down


def expert_mesh(ep, tp=1):
    devices = np.array(jax.devices()[: ep * tp]).reshape(ep, tp)
    return Mesh(devices, ("expert", "tensor"), axis_types=(AxisType.Auto,) * 2)


def expert_parallel_fn(mesh, tensor_parallel=False):
    """jit(shard_map(moe_experts)) over `mesh`: tokens split over "expert" (each device its own
    batch), experts split over "expert"; with tensor_parallel, I is split over "tensor" and the
    partial sums are added with psum."""
    if tensor_parallel:
        gate_up_spec, down_spec = P("expert", None, "tensor"), P("expert", "tensor", None)
    else:
        gate_up_spec, down_spec = P("expert"), P("expert")

    def per_device(x, ids, weights, w_gate_up, w_down):
        out = moe_experts(x, ids, weights, w_gate_up, w_down, expert_axis="expert", num_experts=E)
        return jax.lax.psum(out, "tensor") if tensor_parallel else out

    return jax.jit(jax.shard_map(per_device, mesh=mesh,
                                 in_specs=(P("expert"), P("expert"), P("expert"), gate_up_spec, down_spec),
                                 out_specs=P("expert"), check_vma=False))


def per_device_batches(ep, seed=1):
    """ep different token batches of T tokens, stacked along the token axis: x [ep*T, H], ..."""
    batches = [make_tokens(T, seed=seed + d) for d in range(ep)]
    return tuple(np.concatenate(parts) for parts in zip(*batches))


def assert_each_device_matches_reference(out, x, ids, weights, w_gate_up, w_down, ep):
    """Device d's T output rows equal reference_moe of device d's own T tokens."""
    out = np.asarray(out)
    for d in range(ep):
        rows = slice(d * T, (d + 1) * T)
        expected = reference_moe(x[rows], ids[rows], weights[rows], w_gate_up, w_down)
        np.testing.assert_allclose(out[rows], expected, rtol=RTOL, atol=ATOL, err_msg=f"device {d}")


# --- the reference itself ------------------------------------------------------------------------


def test_reference_moe_is_the_weighted_sum_of_the_chosen_experts():
    w_gate_up, w_down = make_weights()
    x, ids, weights = make_tokens(5)
    expected = np.zeros((5, H))
    for t in range(5):
        for j in range(K):
            e = ids[t, j]
            expected[t] += weights[t, j] * numpy_expert(x[t:t + 1].astype(np.float64), w_gate_up[e], w_down[e])[0]
    np.testing.assert_allclose(reference_moe(x, ids, weights, w_gate_up, w_down), expected, rtol=RTOL, atol=ATOL)


# --- grouped matmul ------------------------------------------------------------------------------


def test_grouped_expert_mlp_equals_a_loop_over_groups_with_empty_groups_and_padding():
    w_gate_up, w_down = make_weights(num_experts=5)
    group_sizes = np.array([3, 0, 4, 0, 2], np.int32)  # experts 1 and 3 get no rows
    num_rows = 12  # 9 grouped rows, then 3 padding rows
    x_sorted = np.random.default_rng(2).normal(0, 1, (num_rows, H)).astype(np.float32)

    out = np.asarray(grouped_expert_mlp(x_sorted, group_sizes, w_gate_up, w_down))

    expected = np.zeros((num_rows, H))
    start = 0
    for e, size in enumerate(group_sizes):
        rows = slice(start, start + size)
        expected[rows] = numpy_expert(x_sorted[rows].astype(np.float64), w_gate_up[e], w_down[e])
        start += size
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    assert np.all(out[group_sizes.sum():] == 0), "padding rows must come out exactly 0"


# --- one device ----------------------------------------------------------------------------------


def test_local_moe_equals_reference():
    w_gate_up, w_down = make_weights()
    x, ids, weights = make_tokens(T)
    out = jax.jit(functools.partial(moe_experts, num_experts=E))(x, ids, weights, w_gate_up, w_down)
    assert out.shape == (T, H) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference_moe(x, ids, weights, w_gate_up, w_down), rtol=RTOL, atol=ATOL)


def test_local_moe_rejects_a_wrong_expert_count():
    w_gate_up, w_down = make_weights()
    x, ids, weights = make_tokens(T)
    with pytest.raises(ValueError, match="num_experts=4"):
        moe_experts(x, ids, weights, w_gate_up, w_down, num_experts=4)


# --- expert parallel -----------------------------------------------------------------------------


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_equals_reference_for_each_devices_own_tokens(ep):
    w_gate_up, w_down = make_weights()
    x, ids, weights = per_device_batches(ep)
    out = expert_parallel_fn(expert_mesh(ep))(x, ids, weights, w_gate_up, w_down)
    assert out.shape == (ep * T, H)
    assert_each_device_matches_reference(out, x, ids, weights, w_gate_up, w_down, ep)


def test_expert_parallel_drops_nothing_when_every_token_picks_the_same_expert():
    ep = 4
    w_gate_up, w_down = make_weights()
    x, _, weights = per_device_batches(ep)
    # Worst case: all ep*T*K pairs go to the device holding experts 6 and 7.
    ids = np.tile(np.array([[7, 6]], np.int32), (ep * T, 1))
    out = expert_parallel_fn(expert_mesh(ep))(x, ids, weights, w_gate_up, w_down)
    assert_each_device_matches_reference(out, x, ids, weights, w_gate_up, w_down, ep)
    # Also with both slots on one expert (one group receives every pair).
    ids = np.full((ep * T, K), 7, np.int32)
    out = expert_parallel_fn(expert_mesh(ep))(x, ids, weights, w_gate_up, w_down)
    assert_each_device_matches_reference(out, x, ids, weights, w_gate_up, w_down, ep)


def tensor_parallel_layout(w_gate_up, tp):
    """Reorder the last axis of w_gate_up [E, H, 2I] so that its tp equal column blocks are
    [gate_0 | up_0], [gate_1 | up_1], ...: P(..., "tensor") then gives device t its own gate and
    up columns (I/tp of each), matching its rows of w_down."""
    gate, up = w_gate_up[..., :I], w_gate_up[..., I:]
    blocks = [np.concatenate([g, u], axis=-1) for g, u in zip(np.split(gate, tp, -1), np.split(up, tp, -1))]
    return np.concatenate(blocks, axis=-1)


@pytest.mark.parametrize("ep, tp", [(2, 2), (4, 2)])
def test_expert_parallel_with_tensor_parallel_experts_psum_equals_reference(ep, tp):
    w_gate_up, w_down = make_weights()
    x, ids, weights = per_device_batches(ep)
    fn = expert_parallel_fn(expert_mesh(ep, tp), tensor_parallel=True)
    out = fn(x, ids, weights, tensor_parallel_layout(w_gate_up, tp), w_down)
    assert_each_device_matches_reference(out, x, ids, weights, w_gate_up, w_down, ep)


def test_pairs_travel_by_ragged_all_to_all_except_on_the_cpu():
    """Lowered for a TPU or GPU: three ragged all-to-alls (rows and their expert ids out, results
    back), each sending this device's T*K rows; for the CPU, which lacks the collective, padded
    all-to-alls of T*K rows per destination instead (the sizes' all-gather in both)."""
    ep = 4
    w_gate_up, w_down = make_weights()
    x, ids, weights = per_device_batches(ep)
    traced = expert_parallel_fn(expert_mesh(ep)).trace(x, ids, weights, w_gate_up, w_down)
    for platform in ("tpu", "cuda"):
        hlo = traced.lower(lowering_platforms=(platform,)).as_text()
        exchanges = [line for line in hlo.splitlines() if "custom_call @ragged_all_to_all" in line]
        assert len(exchanges) == 3 and "stablehlo.all_to_all" not in hlo
        assert f": (tensor<{T * K}x{H}xf32>, tensor<{ep * T * K}x{H}xf32>" in exchanges[0]  # sends T*K rows
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "ragged_all_to_all" not in cpu and cpu.count("stablehlo.all_to_all") == 3 + 3  # blocks, and where they land


def test_the_cpus_padded_exchange_delivers_what_ragged_all_to_all_does():
    """Device s sends (s + d) % 3 rows to device d (none at all for some), numbered by sender:
    device d receives sender s's rows at sum_{s' < s} sizes[s', d], and keeps `output` elsewhere."""
    from sharding.expert_parallel import padded_ragged_all_to_all

    ep, n = 4, 8
    mesh = expert_mesh(ep)
    sizes = np.array([[(s + d) % 3 for d in range(ep)] for s in range(ep)], np.int32)  # [sender, receiver]
    rows = np.stack([100 * s + np.arange(n) for s in range(ep)]).astype(np.float32)  # [ep, n]: sender s's rows

    def exchange(rows, me):
        me = me[0]
        send = jnp.asarray(sizes)[me]
        recv = jnp.asarray(sizes)[:, me]
        lands_at = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < me, jnp.asarray(sizes), 0), axis=0)
        return padded_ragged_all_to_all(rows[0], jnp.full((ep * n,), -1.0), jnp.cumsum(send) - send, send, lands_at, recv,
                                        axis="expert", max_send=2)[None]

    fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=P("expert")))
    got = np.asarray(fn(rows, np.arange(ep, dtype=np.int32)))
    for d in range(ep):
        want = np.concatenate([rows[s, sizes[s, :d].sum():][: sizes[s, d]] for s in range(ep)])
        assert np.array_equal(got[d, : len(want)], want) and np.all(got[d, len(want):] == -1)

"""The expert computation of a mixture-of-experts (MoE) layer, on one device or expert-parallel.

The router has already chosen, for each token t, k experts `expert_ids[t, :]` and their mixing
weights `expert_weights[t, :]`. Every expert is a SwiGLU MLP,

    expert_e(x) = (silu(x @ Wg[e]) * (x @ Wu[e])) @ Wd[e],

with the weights of all E experts stacked: `w_gate_up [E, H, 2I]` (last axis = [gate | up]) and
`w_down [E, I, H]`. The layer output is

    out[t] = sum_j expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t]).

Three ways to compute it:

    reference_moe(x, ids, weights, w_gate_up, w_down)        # every expert on every token: the truth
    moe_experts(x, ids, weights, w_gate_up, w_down, num_experts=E)   # one device, grouped matmul
    moe_experts(..., expert_axis="expert", num_experts=E)    # inside jax.shard_map: expert-parallel

Expert-parallel (EP) layout: the mesh axis `expert` has size ep; device e holds experts
[e * E/ep, (e + 1) * E/ep) and its OWN tokens. Each (token, slot) pair travels to the device that
owns its expert by a ragged all-to-all (`jax.lax.ragged_all_to_all`: each destination gets only
the rows meant for it), is computed there with one grouped matmul per weight, and travels back
the same way (P = T*k pairs of this device's T tokens):

    send     [P, H]        this device's pairs sorted by destination: rows of device d at
                           input_offsets[d] : + send_sizes[d]
    sizes    [ep, ep]      every device's send_sizes (an all_gather of ep ints): sizes[s, d] pairs s -> d
      -- ragged_all_to_all --> recv [ep*P, H]: sender s's rows at sum_{s' < s} sizes[s', me], the rest
                           empty (expert id E/ep: no group)
    grouped_expert_mlp over the received rows
      -- ragged_all_to_all --> back [P, H]: each result where its pair was in `send`; unsorted

What crosses the links is P rows each way; a padded all_to_all (every destination's block as long
as the most it could get, P rows) sends ep * P (`scripts/comm_model.py` counts both from the
programs). The receive buffer still holds ep*P rows, the case where every device sends every pair
here, so no pair is ever dropped.

XLA:CPU has no ragged_all_to_all (jax 0.10.2: "UNIMPLEMENTED"), so on the CPU (`ragged_exchange`,
chosen when the program is lowered: `jax.lax.platform_dependent`) the same result comes from a
padded all_to_all of P-row blocks per destination (ep * P rows each way) and a scatter: the CPU
is the one platform that sends padding.

Memory per device (f32 words):
    weights      3 * (E/ep) * H * I
    buffers      P*H sent and returned, ep*P*H received and computed (and on the CPU ep*P*H blocks)
    MLP          3 * ep*P*I (gate/up product [ep*P, 2I] and hidden [ep*P, I])

Tensor parallelism composes without code here: if I is split over another mesh axis (each device's
w_gate_up = [its gate columns | its up columns], w_down = its rows), `moe_experts` returns that
device's partial sum and the caller adds the partials with `jax.lax.psum(out, "tensor")`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _swiglu_expert(x, w_gate_up, w_down):
    """One expert's SwiGLU MLP on rows x [N, H]: (silu(x @ Wg) * (x @ Wu)) @ Wd. [N, H]."""
    gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)  # [N, I] each
    return (jax.nn.silu(gate) * up) @ w_down  # [N, H]


def reference_moe(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Every expert on every token, masked by the routing: the readable truth (O(T*E) work). [T, H] float32."""
    x = x.astype(jnp.float32)  # [T, H]
    num_experts = w_gate_up.shape[0]
    # mix[t, e] = total weight token t gives expert e (0 where not routed).
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [T, k, E]
    mix = jnp.einsum("tk,tke->te", expert_weights.astype(jnp.float32), one_hot)  # [T, E]
    out = jnp.zeros_like(x)  # [T, H]
    for e in range(num_experts):
        out = out + mix[:, e:e + 1] * _swiglu_expert(x, w_gate_up[e], w_down[e])
    return out


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def grouped_expert_mlp(x_sorted, group_sizes, w_gate_up, w_down, b_gate_up=None, activation=swiglu):
    """x_sorted [N, H]: rows grouped by expert (group_sizes [E_loc] rows for each local expert, in order;
    rows past sum(group_sizes) are padding and come out 0). One jax.lax.ragged_dot for gate/up and one for
    down (a grouped matmul; no per-expert Python loop). Inputs go in the weights' dtype, products
    accumulate in float32 (as the dense matmuls do). b_gate_up [E_loc, 2I]: the experts' gate/up
    biases (GPT-OSS); activation(gate, up) -> hidden (default SwiGLU). Returns [N, H] float32."""
    group_sizes = group_sizes.astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(x_sorted.astype(w_gate_up.dtype), w_gate_up, group_sizes,
                                 preferred_element_type=jnp.float32)  # [N, 2I]
    row = jnp.arange(x_sorted.shape[0])
    real = row < group_sizes.sum()  # [N]: padding rows past the groups stay 0
    if b_gate_up is not None:
        expert_of_row = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), row, side="right"), group_sizes.shape[0] - 1)
        gate_up = gate_up + jnp.where(real[:, None], b_gate_up[expert_of_row].astype(jnp.float32), 0.0)
    gate, up = jnp.split(gate_up, 2, axis=-1)  # [N, I] each
    hidden = activation(gate, up)  # [N, I]; padding rows (gate = up = 0): 0 for SwiGLU and the clamped one
    # ragged_dot leaves rows past sum(group_sizes) at 0, so padding rows come out 0.
    return jax.lax.ragged_dot(hidden.astype(w_down.dtype), w_down, group_sizes, preferred_element_type=jnp.float32)  # [N, H]


def grouped_expert_mlp_by_row(rows, group_of_row, w_gate_up, w_down, grouped_matmul, b_gate_up=None, activation=swiglu):
    """The experts' MLP on rows [N, H] in any order, each through its own expert's matrices with
    `grouped_matmul(x [N, K], group_of_row [N], w) -> float32 [N, out]` (a quantized stack: the
    kernel lays the rows out by expert itself, so nothing is sorted here); group_of_row = E_loc
    marks an empty row, which comes out 0. Inputs to each matmul in the rows' dtype. [N, H] float32."""
    num_local = w_gate_up.shape[0]
    gate_up = grouped_matmul(rows, group_of_row, w_gate_up)  # [N, 2I] f32
    if b_gate_up is not None:
        real = group_of_row < num_local
        gate_up = gate_up + jnp.where(real[:, None], b_gate_up[jnp.minimum(group_of_row, num_local - 1)].astype(jnp.float32), 0.0)
    gate, up = jnp.split(gate_up, 2, axis=-1)  # [N, I] each
    hidden = activation(gate, up)  # empty rows: gate = up = 0 -> 0
    return grouped_matmul(hidden.astype(rows.dtype), group_of_row, w_down)  # [N, H]


def _sort_by_group(group_of_row, num_groups):
    """Order that groups rows by group id (stable), and the size of each group.

    group_of_row [N] int32 in [0, num_groups]; the value num_groups marks an empty row, which sorts
    last and counts in no group (padding for grouped_expert_mlp).
    Returns (order [N]: row indices in grouped order, group_sizes [num_groups] int32)."""
    order = jnp.argsort(group_of_row, stable=True)  # [N]
    one_hot = jax.nn.one_hot(group_of_row, num_groups, dtype=jnp.int32)  # [N, G]; empty rows all 0
    return order, one_hot.sum(axis=0)  # [N], [G]


def _grouped_mlp_unsorted(rows, group_of_row, w_gate_up, w_down, grouped_matmul=None, **mlp):
    """grouped_expert_mlp on rows [N, H] in any order, group_of_row [N] (E_loc = empty row).
    Returns [N, H] in the input order; empty rows give 0. With `grouped_matmul` (quantized
    experts): grouped_expert_mlp_by_row, which needs no sort."""
    if grouped_matmul is not None:
        return grouped_expert_mlp_by_row(rows, group_of_row.astype(jnp.int32), w_gate_up, w_down, grouped_matmul, **mlp)
    order, group_sizes = _sort_by_group(group_of_row, w_gate_up.shape[0])
    out_sorted = grouped_expert_mlp(rows[order], group_sizes, w_gate_up, w_down, **mlp)  # [N, H]
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # undo the sort


def _combine_slots(pair_out, expert_weights):
    """Weighted sum over the k slots: pair_out [T*k, H] (pair t*k + j), weights [T, k] -> [T, H]."""
    num_tokens, k = expert_weights.shape
    pair_out = pair_out.reshape(num_tokens, k, -1)  # [T, k, H]
    return jnp.einsum("tk,tkh->th", expert_weights.astype(jnp.float32), pair_out)


def _local_moe(x, expert_ids, expert_weights, w_gate_up, w_down, **mlp):
    """All experts on this device: group the T*k pairs by expert, one grouped matmul, combine. [T, H]."""
    k = expert_ids.shape[1]
    pair_rows = jnp.repeat(x, k, axis=0)  # [T*k, H]; pair t*k + j is token t, slot j
    pair_out = _grouped_mlp_unsorted(pair_rows, expert_ids.reshape(-1), w_gate_up, w_down, **mlp)  # [T*k, H]
    return _combine_slots(pair_out, expert_weights)


def ragged_exchange(rows, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis, max_send: int):
    """`jax.lax.ragged_all_to_all` over `axis` (its arguments, [ep] each): rows
    [input_offsets[d], + send_sizes[d]) of `rows` go to device d, at output_offsets[d] of its
    `output`; what is not written keeps `output`'s values. XLA:CPU lacks the collective, so a
    program lowered for the CPU runs `padded_ragged_all_to_all` instead (the module docstring),
    with blocks of `max_send` rows: no device sends any one device more."""
    operands = (rows, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    ragged = lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axis)  # noqa: E731
    padded = lambda *a: padded_ragged_all_to_all(*a, axis=axis, max_send=max_send)  # noqa: E731
    return jax.lax.platform_dependent(*operands, cpu=padded, default=ragged)


def padded_ragged_all_to_all(rows, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis, max_send: int):
    """ragged_all_to_all's result by a padded all_to_all: every destination's block padded to
    max_send rows (the most any device sends one device), then each received block scattered to
    where its sender put it."""
    n = rows.shape[0]
    j = jnp.arange(max_send)
    take = input_offsets[:, None] + j[None, :]  # [ep, max_send]: row j of the block for device d
    sent = j[None, :] < send_sizes[:, None]
    blocks = jnp.where(sent.reshape(sent.shape + (1,) * (rows.ndim - 1)), rows[jnp.minimum(take, n - 1)], 0)  # [ep, max_send, ...]
    received = jax.lax.all_to_all(blocks, axis, split_axis=0, concat_axis=0)  # block s: what device s sent here
    lands_at = jax.lax.all_to_all(output_offsets, axis, split_axis=0, concat_axis=0, tiled=True)  # [ep]: sender s's offset here
    place = jnp.where(j[None, :] < recv_sizes[:, None], lands_at[:, None] + j[None, :], output.shape[0])  # past the end: dropped
    return output.at[place.reshape(-1)].set(received.reshape((-1,) + rows.shape[1:]).astype(output.dtype), mode="drop")


def _exclusive_cumsum(sizes, axis=-1):
    return jnp.cumsum(sizes, axis=axis) - sizes


def _expert_parallel_moe(x, expert_ids, expert_weights, w_gate_up, w_down, expert_axis, num_experts, **mlp):
    """Expert-parallel MoE on this device's tokens (see the module docstring for the layout). [T, H]."""
    ep = jax.lax.axis_size(expert_axis)
    experts_per_device = w_gate_up.shape[0]  # E_loc
    if experts_per_device * ep != num_experts:
        raise ValueError(f"num_experts={num_experts} but the expert axis has {ep} devices holding "
                         f"{experts_per_device} experts each")
    num_tokens, k = expert_ids.shape
    num_pairs = num_tokens * k  # P = T*k

    # 1. Where each pair goes (destination device, its expert's local id there); pairs sorted by destination.
    pair_expert = expert_ids.reshape(-1).astype(jnp.int32)  # [P]
    destination = pair_expert // experts_per_device  # [P]
    order = jnp.argsort(destination, stable=True)  # [P]
    send_rows = jnp.repeat(x, k, axis=0)[order]  # [P, H], in x's dtype: what travels is what the experts take in
    send_ids = (pair_expert % experts_per_device)[order]  # [P]

    # 2. Who sends how much to whom: sizes[s, d] pairs from device s to device d.
    send_sizes = jax.nn.one_hot(destination, ep, dtype=jnp.int32).sum(axis=0)  # [ep]
    sizes = jax.lax.all_gather(send_sizes, expert_axis)  # [ep (sender), ep (receiver)]
    me = jax.lax.axis_index(expert_axis)
    recv_sizes = sizes[:, me]  # [ep]: from each sender
    lands_at = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < me, sizes, 0), axis=0)  # [ep]: my block's offset at each receiver

    # 3. Out: each receiver's rows from sender s at sum_{s' < s} sizes[s', receiver]; the rest empty (id E_loc).
    # (no device sends another more than P rows: its own pairs out, the pairs that device sent it back)
    exchange = lambda rows, output, *offsets_and_sizes: ragged_exchange(rows, output, *offsets_and_sizes, expert_axis,  # noqa: E731
                                                                        max_send=num_pairs)
    out_trip = (_exclusive_cumsum(send_sizes), send_sizes, lands_at, recv_sizes)
    recv_x = exchange(send_rows, jnp.zeros((ep * num_pairs, x.shape[-1]), x.dtype), *out_trip)  # [ep*P, H]
    recv_ids = exchange(send_ids, jnp.full((ep * num_pairs,), experts_per_device, jnp.int32), *out_trip)  # [ep*P]

    # 4. This device's experts on every received row (empty rows give 0).
    recv_out = _grouped_mlp_unsorted(recv_x, recv_ids, w_gate_up, w_down, **mlp).astype(x.dtype)  # [ep*P, H]

    # 5. Back: sender s's results from where they arrived to where s sent them from.
    sent_from = _exclusive_cumsum(sizes, axis=1)[:, me]  # [ep]: sender s's offset of its rows for me
    back = exchange(recv_out, jnp.zeros((num_pairs, x.shape[-1]), x.dtype),
                    _exclusive_cumsum(recv_sizes), recv_sizes, sent_from, send_sizes)  # [P, H], sorted by destination
    pair_out = jnp.zeros((num_pairs, x.shape[-1]), jnp.float32).at[order].set(back.astype(jnp.float32))  # [P, H]
    return _combine_slots(pair_out, expert_weights)


def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, expert_axis=None, num_experts, b_gate_up=None,
                activation=swiglu, grouped_matmul=None):
    """The routed experts' contribution [T, H] float32.
    expert_axis=None: every expert is local (w_gate_up [E, H, 2I]): sort the (token, slot) pairs by expert,
    grouped_expert_mlp, unsort, weighted sum over the k slots.
    expert_axis='expert' (call inside jax.shard_map over a mesh with that axis, size ep): this device holds
    experts [e * E/ep, (e + 1) * E/ep) (w_gate_up [E/ep, H, 2I]) and its own tokens x (each device along the
    expert axis has DIFFERENT tokens). Send every (token, slot) pair to the device owning its expert with a
    ragged all-to-all (`ragged_exchange`), compute there with grouped_expert_mlp, send the results back the
    same way, combine with the weights. NO token is dropped: the receive buffer holds ep*T*k pairs (worst
    case: every device's pairs to one device); its empty rows get no group.
    b_gate_up [E(_loc), 2I] and activation(gate, up): see grouped_expert_mlp (GPT-OSS).
    grouped_matmul(x, group_of_row, w): the matmul of quantized stacks (grouped_expert_mlp_by_row);
    None: the weights are arrays, multiplied with jax.lax.ragged_dot."""
    mlp = dict(b_gate_up=b_gate_up, activation=activation, grouped_matmul=grouped_matmul)
    if expert_axis is None:
        if w_gate_up.shape[0] != num_experts:
            raise ValueError(f"num_experts={num_experts} but w_gate_up stacks {w_gate_up.shape[0]} experts")
        return _local_moe(x, expert_ids.astype(jnp.int32), expert_weights, w_gate_up, w_down, **mlp)
    return _expert_parallel_moe(x, expert_ids, expert_weights, w_gate_up, w_down, expert_axis, num_experts, **mlp)

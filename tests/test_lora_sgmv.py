"""The LoRA delta of a batch mixing adapters: the grouped layout the SGMV kernels read, the XLA
path (by shape: the gather or dense over slots) and the grouped blocks in jnp it measured, and the TPU (Mosaic) and GPU (Triton) kernels in interpret mode, each against the
per-token reference.

Read as a specification: every token adds (x A[slot]) B[slot] to each module's columns and a
token of slot 0 adds exactly nothing, whatever the mix of slots (none, one, all of them, a slot
used by one token), the rank (8, 16), the modules sharing an input (one, or three of different
widths) and the dtype; blocks are small enough that the TPU kernels take several K and O steps
and the GPU kernels' K loop and column tiles end in masked partial tiles. That the real compilers
take the kernels is `tests/test_aot.py`'s part.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora_sgmv import (
    common,
    lora_delta_gpu,
    lora_delta_reference,
    lora_delta_tpu,
    lora_delta_xla,
    xla,
)

KERNELS = {
    "xla (by shape)": lora_delta_xla,
    "xla dense over slots": xla.dense_over_slots,
    "xla grouped blocks": functools.partial(xla.grouped_blocks, block=8),
    "tpu": functools.partial(lora_delta_tpu, block_k=128, block_n=128, interpret=True),
    "gpu": functools.partial(lora_delta_gpu, block_k=64, block_n=64, interpret=True),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # largest error, relative to the largest |value| expected
CASES = {  # name: (T, N slots, K, rank, module widths, dtype, slots of the tokens: "mix" | "none" | "one" | list)
    "decode mix, qkv-like": (13, 5, 256, 16, (256, 64, 64), jnp.float32, "mix"),
    "one token": (1, 3, 256, 8, (384,), jnp.float32, "one"),
    "fewer tokens than slots": (2, 9, 256, 16, (256, 64, 64), jnp.float32, [3, 7]),  # the XLA path gathers
    "no token has an adapter": (9, 3, 256, 8, (384,), jnp.float32, "none"),
    "prefill, every slot": (64, 9, 576, 16, (384,), jnp.float32, list(range(9)) * 7 + [8]),
    "a long step": (300, 5, 128, 8, (128, 64), jnp.float32, "mix"),
    "bf16 gate/up-like": (40, 5, 256, 16, (192, 192), jnp.bfloat16, "mix"),
}


def make_case(T, N, K, R, widths, dtype, slots, seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((N, K, len(widths) * R)) / np.sqrt(K), dtype).at[0].set(0.0)  # slot 0: zeros
    bs = tuple(jnp.asarray(rng.standard_normal((N, R, O)), dtype).at[0].set(0.0) for O in widths)
    x = jnp.asarray(rng.standard_normal((T, K)), dtype)
    if slots == "mix":
        slots = rng.integers(0, N, T)
    elif slots == "none":
        slots = np.zeros(T)
    elif slots == "one":
        slots = np.full(T, N - 1)
    return x, a, bs, jnp.asarray(slots, jnp.int32)


# ----------------------------------------------------------------------------- the grouped layout
def test_the_grouped_layout_of_the_docstring_example():
    g = common.group_by_slot(jnp.asarray([2, 0, 1, 2, 2, 1], jnp.int32), num_slots=3, block=2)
    assert g.rows.tolist() == [2, 5, 0, 3, 4, 6, 6, 6]
    assert g.block_slot.tolist() == [1, 2, 2, 0]
    assert [int(g.position[t]) for t in (0, 2, 3, 4, 5)] == [2, 0, 3, 4, 1]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [1, 8, 16])
def test_every_block_holds_one_slots_tokens_and_every_adapter_token_has_one_row(seed, block):
    rng = np.random.default_rng(seed)
    T, N = int(rng.integers(1, 70)), int(rng.integers(2, 10))
    slot = rng.integers(0, N, T) * (rng.random(T) < 0.8)
    g = common.group_by_slot(jnp.asarray(slot, jnp.int32), N, block)
    rows, block_slot, position = np.asarray(g.rows), np.asarray(g.block_slot), np.asarray(g.position)
    assert g.num_blocks == common.num_blocks(T, N, block) and rows.shape == (g.num_blocks * block,)
    for t in range(T):
        if slot[t]:
            assert rows[position[t]] == t and block_slot[position[t] // block] == slot[t]
    real = rows[rows < T]
    assert sorted(real.tolist()) == [t for t in range(T) if slot[t]]  # each adapter token exactly once
    for b in range(g.num_blocks):  # a block is one slot's tokens (and padding), or unused
        tokens = rows[b * block : (b + 1) * block]
        tokens = tokens[tokens < T]
        assert all(slot[t] == block_slot[b] for t in tokens)
        if block_slot[b] == 0:
            assert tokens.size == 0


# ----------------------------------------------------------------------------- the delta
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(KERNELS))
def test_the_delta_equals_the_per_token_reference(impl, case):
    x, a, bs, slot = make_case(*CASES[case])
    expected = np.asarray(lora_delta_reference(x, a, bs, slot))
    got = np.asarray(KERNELS[impl](x, a, bs, slot))
    assert got.shape == (x.shape[0], sum(b.shape[2] for b in bs)) and got.dtype == np.float32
    scale = max(np.abs(expected).max(), 1.0)
    assert np.abs(got - expected).max() <= TOLERANCE[jnp.dtype(a.dtype).name] * scale
    assert not got[np.asarray(slot) == 0].any()  # slot 0: exactly zeros


def test_the_reference_is_x_a_b_of_each_tokens_adapter():
    x, a, bs, slot = make_case(*CASES["decode mix, qkv-like"])
    x, a, bs, slot = np.asarray(x, np.float64), np.asarray(a, np.float64), [np.asarray(b, np.float64) for b in bs], np.asarray(slot)
    R = bs[0].shape[1]
    expected = np.stack([
        np.concatenate([x[t] @ a[slot[t]][:, p * R : (p + 1) * R] @ b[slot[t]] for p, b in enumerate(bs)]) for t in range(len(x))
    ])
    got = lora_delta_reference(*(jnp.asarray(v, jnp.float32) for v in (x, a)), tuple(jnp.asarray(b, jnp.float32) for b in bs),
                               jnp.asarray(slot))
    assert np.abs(np.asarray(got) - expected).max() < 1e-4


def test_shapes_that_do_not_fit_are_refused():
    x, a, bs, slot = make_case(*CASES["one token"])
    for impl in KERNELS.values():
        with pytest.raises(ValueError, match="rank"):
            impl(x, a[:, :, :4], bs, slot)  # A's columns are not P blocks of B's rank
        with pytest.raises(ValueError, match="slot"):
            impl(x, a, bs, jnp.zeros(3, jnp.int32))

"""RoPE + KV write: the reference against a float64 numpy formula, and the GPU (Triton) Pallas
kernel against the reference in interpret mode on the CPU (a TPU's combined pool is written by
jaxinfer.ops.attention: tests/test_kv_layout.py).

What must hold for every kernel: q_rot and k_rot equal the reference's, each real token's rotated
key and value sit at its (page, offset), and every other page slot keeps its old bits. Padding
tokens may all go to scratch page 0, whose content is unspecified, so page 0 is not compared.
Shapes are tiny and few: each distinct one is an interpreted compile.
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rope_kv_write import gpu_supports, rope_kv_write_gpu, rope_kv_write_reference

KERNELS = {"gpu": functools.partial(rope_kv_write_gpu, block_tokens=4, interpret=True)}
TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-2}  # relative to max |expected|


def make_case(seed, T, Hq, Hkv, D, page_size, num_pages, dtype, *, num_padding=0):
    """Inputs of one call: T tokens, the last `num_padding` of them sent to scratch page 0 (all to
    slot 0, as colliding as padding can be); the real ones to distinct random slots of pages >= 1."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((T, H, D)), dtype) for H in (Hq, Hkv, Hkv))
    angles = np.outer(rng.integers(0, 500, T), 1.0 / 10000 ** (np.arange(D // 2) / (D // 2)))  # [T, D/2]
    angles = np.concatenate([angles, angles], axis=1)
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    real = T - num_padding
    slots = rng.permutation(np.arange(page_size, num_pages * page_size))[:real]
    page = np.concatenate([slots // page_size, np.zeros(num_padding, np.int64)]).astype(np.int32)
    offset = np.concatenate([slots % page_size, np.zeros(num_padding, np.int64)]).astype(np.int32)
    pools = [jnp.asarray(rng.standard_normal((num_pages, page_size, Hkv, D)), dtype) for _ in range(2)]
    return (q, k, v, cos, sin, *pools, jnp.asarray(page), jnp.asarray(offset))


def numpy_rope_kv_write(q, k, v, cos, sin, k_pages, v_pages, page, offset):
    """The operation in float64 numpy, written independently of the jnp reference."""
    q, k, v, cos, sin = (np.asarray(a, np.float64) for a in (q, k, v, cos, sin))
    half = q.shape[-1] // 2

    def rope(x):  # x [T, H, D]
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]], -1)

    k_pages, v_pages = np.array(k_pages, np.float64), np.array(v_pages, np.float64)
    k_rot = rope(k)
    for t, (p, o) in enumerate(zip(np.asarray(page), np.asarray(offset))):
        k_pages[p, o], v_pages[p, o] = k_rot[t], v[t]
    return rope(q), k_rot, k_pages, v_pages


def assert_matches(got, want, dtype, *, page_0_too=False):
    """got / want: (q_rot, k_rot, k_pages, v_pages); pools compared from page 1 on (page 0: padding)."""
    tol = TOLERANCE[jnp.dtype(dtype).name]
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if i >= 2 and not page_0_too:
            g, w = g[1:], w[1:]
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=tol * max(1.0, np.abs(w).max()))


# ----------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reference_matches_the_float64_formula(dtype):
    case = make_case(0, T=9, Hq=4, Hkv=2, D=16, page_size=4, num_pages=6, dtype=dtype)
    got = rope_kv_write_reference(*case)
    assert [a.dtype for a in got] == [dtype] * 4
    assert_matches(got, numpy_rope_kv_write(*case), dtype, page_0_too=True)


def test_reference_leaves_every_other_slot_bit_identical():
    case = make_case(1, T=5, Hq=2, Hkv=1, D=8, page_size=4, num_pages=5, dtype=jnp.float32)
    _, _, k_pages, v_pages = rope_kv_write_reference(*case)
    written = np.zeros(k_pages.shape[:2], bool)
    written[np.asarray(case[7]), np.asarray(case[8])] = True
    for new, old in ((k_pages, case[5]), (v_pages, case[6])):
        np.testing.assert_array_equal(np.asarray(new)[~written], np.asarray(old)[~written])


# ----------------------------------------------------------------------------- the GPU kernel
# (Hq, Hkv, D, page_size, dtype): GQA 1 / 4 / 8, head_dim 64 and 128, pages of 1, 4 and 16 slots
CASES = [
    (4, 4, 64, 4, jnp.float32),
    (8, 2, 128, 16, jnp.float32),
    (8, 1, 64, 1, jnp.bfloat16),
    (8, 2, 128, 4, jnp.bfloat16),
]


@pytest.mark.parametrize("backend", ["gpu"])
@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype", CASES, ids=[f"G{hq // hkv}-D{d}-page{p}-{jnp.dtype(dt).name}" for hq, hkv, d, p, dt in CASES])
def test_kernel_matches_reference(backend, Hq, Hkv, D, page_size, dtype):
    # 13 tokens (not a multiple of either kernel's token block), the last 3 of them padding
    case = make_case(2, T=13, Hq=Hq, Hkv=Hkv, D=D, page_size=page_size, num_pages=24 // page_size + 2, dtype=dtype, num_padding=3)
    got = KERNELS[backend](*case)
    assert [a.dtype for a in got] == [dtype] * 4 and [a.shape for a in got] == [a.shape for a in (*case[:2], *case[5:7])]
    assert_matches(got, rope_kv_write_reference(*case), dtype)


@pytest.mark.parametrize("backend", ["gpu"])
@hypothesis.settings(max_examples=6, deadline=None, database=None)
@hypothesis.given(T=st.integers(1, 20), num_padding=st.integers(0, 4), page_size=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference_for_random_slots(backend, T, num_padding, page_size, seed):
    num_padding = min(num_padding, T - 1)
    case = make_case(seed, T=T, Hq=4, Hkv=2, D=64, page_size=page_size, num_pages=24 // page_size + 1, dtype=jnp.float32,
                     num_padding=num_padding)
    assert_matches(KERNELS[backend](*case), rope_kv_write_reference(*case), jnp.float32)


@pytest.mark.parametrize("backend", ["gpu"])
def test_unwritten_slots_keep_their_bits_and_odd_head_counts_work(backend):
    # SmolLM2's 9 query / 3 KV heads (not powers of two: the GPU kernel pads and masks them), bf16
    case = make_case(7, T=13, Hq=9, Hkv=3, D=64, page_size=4, num_pages=8, dtype=jnp.bfloat16, num_padding=3)
    got = KERNELS[backend](*case)
    assert_matches(got, rope_kv_write_reference(*case), jnp.bfloat16)
    written = np.zeros(case[5].shape[:2], bool)
    written[np.asarray(case[7]), np.asarray(case[8])] = True
    written[0] = True  # the padding tokens' scratch page
    for new, old in ((got[2], case[5]), (got[3], case[6])):
        new, old = np.asarray(new).view(np.uint16), np.asarray(old).view(np.uint16)
        np.testing.assert_array_equal(new[~written], old[~written])


@pytest.mark.parametrize("kernel", [rope_kv_write_gpu], ids=["gpu"])
def test_kernel_with_its_default_block_matches_reference_on_fewer_tokens_than_a_block(kernel):
    # 3 tokens, none of them padding (page 0 is compared too), head_dim 16
    case = make_case(4, T=3, Hq=2, Hkv=1, D=16, page_size=4, num_pages=3, dtype=jnp.float32)
    assert_matches(kernel(*case, interpret=True), rope_kv_write_reference(*case), jnp.float32, page_0_too=True)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: (c[0][:, :, :15], *c[1:]), "head_dim must be even|k and v must be"),
        (lambda c: (*c[:2], c[2][:, :1], *c[3:]), "k and v must be"),
        (lambda c: (*c[:3], c[3][:, :8], *c[4:]), "cos and sin must be"),
        (lambda c: (*c[:6], c[6][:2], *c[7:]), "k_pages and v_pages must be"),
        (lambda c: (*c[:7], c[7][:2], c[8]), "write_page and write_offset must be"),
    ],
    ids=["odd-or-mismatched-D", "v-heads", "cos", "pools", "write-locations"],
)
@pytest.mark.parametrize("fn", [rope_kv_write_reference, KERNELS["gpu"]], ids=["reference", "gpu"])
def test_inconsistent_inputs_are_rejected(fn, change, message):
    case = make_case(5, T=4, Hq=2, Hkv=2, D=16, page_size=4, num_pages=3, dtype=jnp.float32)
    with pytest.raises(ValueError, match=message):
        fn(*change(case))


def test_gpu_kernel_names_the_head_dims_it_cannot_tile():
    assert gpu_supports(64) and gpu_supports(128) and not gpu_supports(96)
    case = make_case(6, T=2, Hq=2, Hkv=1, D=24, page_size=4, num_pages=3, dtype=jnp.float32)
    with pytest.raises(ValueError, match="head_dim 24"):
        KERNELS["gpu"](*case)


# ----------------------------------------------------------------------------- lowering for the real hardware
def _abstract_args(D, dtype=jnp.bfloat16, T=64, Hq=8, Hkv=2, page_size=16, num_pages=100):
    s = jax.ShapeDtypeStruct
    pool = s((num_pages, page_size, Hkv, D), dtype)
    return (s((T, Hq, D), dtype), s((T, Hkv, D), dtype), s((T, Hkv, D), dtype), s((T, D), jnp.float32), s((T, D), jnp.float32),
            pool, pool, s((T,), jnp.int32), s((T,), jnp.int32))


def test_gpu_kernel_lowers_to_triton():
    lowered = jax.jit(rope_kv_write_gpu).trace(*_abstract_args(128)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()

"""The 2:4 sparse matmul kernels (Pallas TPU and Pallas Triton) that read weights compressed.

Read as a specification: the layout round-trips (dense 2:4 <-> values + bitmask <-> compressed-
tensors' sparse-24-bitmask tensors); each kernel returns what `reference.sparse24_matmul` returns
in interpret mode, at decode (M = 1..8) and prefill tiles, bf16 and f32, shapes that are not
multiples of the blocks and several K steps; no dense weight is built outside the kernel; the
model's matmul routes a Sparse24Weight to the table's kernel (densified on the CPU); and both
kernels compile with the real compilers (libtpu for v6e / v5e, the CUDA plugin for an H100) at
Llama-3.1-8B's projection shapes, in a decode and a prefill tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import matmul
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.sparsity import Sparse24Weight, from_compressed_tensors, from_dense_24, sparsify_params
from pallas_kernels.sparse24_matmul import gpu, reference, tpu

KERNELS = {"tpu": tpu.sparse24_matmul, "gpu": gpu.sparse24_matmul}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max |error| relative to max |reference|


def pruned(K, N, dtype=jnp.float32, seed=0) -> np.ndarray:
    """A Gaussian [K, N] magnitude-pruned 2:4 (as float32 numpy, its entries `dtype` numbers), with
    some groups holding fewer than two nonzeros (a stored zero among the kept)."""
    rng = np.random.default_rng(seed)
    w = np.array(jnp.asarray(rng.normal(0.0, 0.02, (K, N)), dtype).astype(jnp.float32))
    groups = w.reshape(K // 4, 4, N)
    order = np.argsort(-np.abs(groups), axis=1, kind="stable")
    np.put_along_axis(groups, order[:, 2:], 0.0, axis=1)
    groups *= (rng.random((K // 4, 1, N)) >= 0.05)  # whole groups zero
    return groups.reshape(K, N)


def check(backend, M, K, N, dtype, seed=0, **blocks):
    w = pruned(K, N, dtype, seed)
    values, mask = reference.from_dense_24(jnp.asarray(w, dtype))
    x = jnp.asarray(np.random.default_rng(seed + 1).normal(0.0, 1.0, (M, K)), dtype)
    got = KERNELS[backend](x, values, mask, interpret=True, **blocks)
    want = reference.sparse24_matmul(x, values, mask)
    assert got.shape == (M, N) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(x, np.float32) @ w, rtol=2e-2, atol=2e-2)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


# ----------------------------------------------------------------------------- the layout
def test_the_layout_round_trips_and_is_compressed_tensors_bitmask():
    """dense -> (values, mask) -> dense is exact; the mask is sparse-24-bitmask's bitmask
    transposed, the values its `compressed` tensor re-laid out, both ways; 9 bytes of bf16 for 16."""
    w = pruned(64, 24)
    values, mask = reference.from_dense_24(jnp.asarray(w))
    assert values.shape == (4, 8, 24) and mask.shape == (8, 24) and mask.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(reference.densify(values, mask)), w)
    assert np.all(np.unpackbits(np.asarray(mask), axis=0, bitorder="little").reshape(16, 4, 24).sum(axis=1) == 2)
    assert np.all(np.asarray(reference.kept_bits(mask)) | (w == 0))  # every nonzero is kept

    # compressed-tensors (torch [N, K]): Sparse24BitMaskTensor's compressed [N, K/2] and packbits(..., "little")
    keep = np.asarray(reference.kept_bits(mask)).T
    ct = reference.to_compressed_tensors(values, mask)
    np.testing.assert_array_equal(ct["bitmask"], np.packbits(keep, axis=-1, bitorder="little"))
    np.testing.assert_array_equal(ct["compressed"], w.T[keep].reshape(24, 32))
    np.testing.assert_array_equal(ct["shape"].reshape(-1), [24, 64])
    back = from_compressed_tensors(ct["compressed"], ct["bitmask"], ct["shape"])
    np.testing.assert_array_equal(np.asarray(back.values), np.asarray(values))
    np.testing.assert_array_equal(np.asarray(back.mask), np.asarray(mask))
    assert back.shape == (64, 24)

    # stacked layers, and the bytes a bf16 weight keeps
    w = pruned(64, 24, jnp.bfloat16, seed=1)
    stacked = from_dense_24(jnp.asarray(np.stack([w, 2 * w]), jnp.bfloat16))
    assert stacked.values.shape == (2, 4, 8, 24) and stacked.shape == (2, 64, 24) and stacked.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(stacked.dense(jnp.float32)[1]), 2 * w)
    assert stacked.nbytes / (2 * 64 * 24 * 2) == 9 / 16


def test_the_converters_refuse_what_is_not_2_4():
    dense = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="not 2:4 sparse: 32 groups"):
        reference.from_dense_24(jnp.asarray(dense))
    values, mask = reference.from_dense_24(jnp.asarray(dense), prune=True)  # magnitude: the two largest of each four
    kept = np.argsort(-np.abs(dense.reshape(4, 4, 8)), axis=1, kind="stable")[:, :2]
    want = np.zeros((4, 4, 8), np.float32)
    np.put_along_axis(want, kept, np.take_along_axis(dense.reshape(4, 4, 8), kept, 1), 1)
    np.testing.assert_array_equal(np.asarray(reference.densify(values, mask)), want.reshape(16, 8))
    with pytest.raises(ValueError, match="K a multiple of 8"):
        reference.from_dense_24(jnp.zeros((12, 8)))
    ct = reference.to_compressed_tensors(values, mask)
    ct["bitmask"][0, 0] |= 0x0F  # four kept in one group
    with pytest.raises(ValueError, match="other than two"):
        reference.from_compressed_tensors(ct["compressed"], ct["bitmask"], ct["shape"])
    for x, values, mask, message in [
        (jnp.zeros((1, 64)), jnp.zeros((4, 8, 8)), jnp.zeros((8, 8), jnp.int8), "mask must be uint8"),
        (jnp.zeros((1, 64)), jnp.zeros((8, 8, 8)), jnp.zeros((8, 8), jnp.uint8), r"values must have shape \(4, 8, 8\)"),
        (jnp.zeros((1, 32)), jnp.zeros((4, 8, 8)), jnp.zeros((8, 8), jnp.uint8), "x has K = 32"),
        (jnp.zeros((1, 64), jnp.int32), jnp.zeros((4, 8, 8)), jnp.zeros((8, 8), jnp.uint8), "x must be float32"),
    ]:
        for fn in (reference.sparse24_matmul, *KERNELS.values()):
            with pytest.raises(ValueError, match=message):
                fn(x, values, mask) if fn is reference.sparse24_matmul else fn(x, values, mask, interpret=True)


# ----------------------------------------------------------------------------- agreement with the reference
# (M, K, N, dtype, TPU blocks, GPU blocks): decode at SmolLM2's 576 inputs (72 mask rows: one K step
# of the whole), decode with several K steps and a partial last N block, a prefill tile over two M blocks.
CASES = [
    (1, 576, 136, jnp.bfloat16, {}, dict(block_k=256)),
    (5, 2048, 200, jnp.float32, dict(block_n=128, block_k=1024), dict(block_n=64, block_k=512)),
    (64, 1024, 256, jnp.bfloat16, dict(block_m=32, block_k=1024), dict(block_m=32, block_k=256)),
]


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("M, K, N, dtype, tpu_blocks, gpu_blocks", CASES,
                         ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-{c[3].__name__}" for c in CASES])
def test_kernel_matches_reference(backend, M, K, N, dtype, tpu_blocks, gpu_blocks):
    check(backend, M, K, N, dtype, seed=M + K, **(tpu_blocks if backend == "tpu" else gpu_blocks))


def _eqns_outside_kernels(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns_outside_kernels(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns_outside_kernels(sub)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_no_dense_weight_is_built_outside_the_kernel(backend):
    K, N = 512, 256
    values, mask = reference.from_dense_24(jnp.asarray(pruned(K, N), jnp.bfloat16))
    x = jnp.zeros((4, K), jnp.bfloat16)
    eqns = list(_eqns_outside_kernels(jax.make_jaxpr(functools.partial(KERNELS[backend], interpret=True))(x, values, mask).jaxpr))
    assert any(e.primitive.name == "pallas_call" for e in eqns)
    for eqn in eqns:
        for var in eqn.outvars:
            assert getattr(var.aval, "size", 0) < K * N // 2, f"{eqn.primitive.name} builds {var.aval} outside the kernel"


# ----------------------------------------------------------------------------- the model's matmul
@pytest.mark.parametrize("table", ["reference", "tpu", "gpu"])
def test_the_models_matmul_runs_a_sparse24_weight_through_the_kernel_table(table):
    """layers.matmul: the XLA path (the CPU's: densified) or a platform's kernel (interpret mode),
    the same numbers as the dense pruned weight; stacked weights index by layer as pytrees."""
    w = pruned(256, 128, seed=3)
    sparse = sparsify_params({"layers.o_proj": jnp.asarray(np.stack([w, -w])), "final_norm": jnp.ones(8)})
    assert isinstance(sparse["layers.o_proj"], Sparse24Weight) and not isinstance(sparse["final_norm"], Sparse24Weight)
    layer1 = jax.tree.map(lambda a: a[1], sparse["layers.o_proj"])
    kernels = Kernels() if table == "reference" else Kernels(table, interpret=True)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 256)), jnp.float32)
    y = matmul(x, layer1, kernels)
    assert y.shape == (2, 3, 128) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ -w, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the real compilers
@pytest.fixture(scope="module")
def compile_targets():
    """v6e, v5e and an H100 described (no chip): skipped when libtpu or the CUDA plugin is absent."""
    from jaxinfer.aot.targets import TargetError, compile_target

    targets = {}
    for name in ("v6e:2x2", "v5e:2x2", "h100"):
        try:
            targets[name] = compile_target(name)
        except TargetError as e:
            targets[name] = e
    return targets


LLAMA_8B = [(4096, 6144), (14336, 4096)]  # qkv_proj (4096 -> 4096 + 2 x 1024) and down_proj (14336 -> 4096)


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@pytest.mark.parametrize("target", ["v6e:2x2", "v5e:2x2", "h100"])
def test_kernels_compile_for_tpu_and_gpu_at_llama_8b_shapes(compile_targets, target):
    """Mosaic (v6e / v5e) and Triton (H100) take the kernels at Llama-3.1-8B's shapes, bf16: qkv_proj
    in a decode tile (8 rows) and down_proj (K = 14336, 7 K steps on a TPU) in a prefill tile (256
    rows; Triton's 2-stage pipeline); the kernel is in the program. (`jaxinfer aot --sparsity 2:4`
    compiles every projection in the whole step.)"""
    from jaxinfer.aot.kernel_check import compile_for

    t = compile_targets[target]
    if isinstance(t, Exception):
        pytest.skip(f"cannot compile for {target} here: {t}")
    jax.clear_caches()  # the TPU kernel reads the chip while tracing (its block_n)
    kernel = KERNELS[t.platform]
    marker = {"tpu": "tpu_custom_call", "gpu": "xla.gpu.triton"}[t.platform]
    for M, K, N in [(8, *LLAMA_8B[0]), (256, *LLAMA_8B[1])][: 1 if target == "v5e:2x2" else 2]:  # (v5e: Mosaic again, 256-wide blocks)
        args = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((4, K // 8, N), jnp.bfloat16),
                jax.ShapeDtypeStruct((K // 8, N), jnp.uint8)]
        hlo = compile_for(t, kernel, args).as_text()
        assert marker in hlo and "sparse24_matmul" in hlo, (target, M, K, N)

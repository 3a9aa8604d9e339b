"""The TPU KV pool stores exactly the model's K/V bytes per token per chip, as the real compiler
lays it out (libtpu, no TPU: jaxinfer.aot.targets), and the per-token write updates it in place.

Each case compiles a donated update of one chip's pool (a few tenths of a second) and reads
`memory_analysis()`: the bytes the chip holds for the argument, after the compiler's tiling, and
the layout it chose. The page rows must also stay row-major (pages, then tokens, then lanes): the
attention kernel DMAs whole pages, which a layout with the page axis in the tiles would scatter.
Separate K and V pools, the layout every other back end uses, are measured beside it for
head_dim 64: a TPU either pads each 64-lane row to 128 or moves the page axis into the tiles.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.aot.targets import compile_target
from jaxinfer.config import ModelConfig
from jaxinfer.ops.attention import rope_and_write_kv, write_page_rows
from jaxinfer.ops.kernels import Kernels
from jaxinfer.ops.kv_cache import KVCache
from pallas_kernels.ragged_paged_attention.combined import combine_kv, row_width, split_kv
from pallas_kernels.ragged_paged_attention.reference import storage_dtype
from pallas_kernels.rope_kv_write import rope_kv_write_reference
from sharding.hlo import pool_sized_copies
from test_rope_kv_write import make_case

LAYERS, PAGES, PAGE_SIZE = 2, 2048, 16
KV_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


pytestmark = pytest.mark.usefixtures("no_persistent_compilation_cache")  # executables for described chips: conftest


@pytest.fixture(scope="module")
def v6e():
    return compile_target("v6e:2x2")


def one_chip_config(heads: int, head_dim: int) -> ModelConfig:
    """A model whose every KV head lands on one chip (tp=1): `heads` KV heads of `head_dim`."""
    return ModelConfig(model_type="llama", vocab_size=256, hidden_size=heads * head_dim, intermediate_size=256, num_layers=LAYERS,
                       num_heads=heads, num_kv_heads=heads, head_dim=head_dim)


def chip_layout(target, array) -> tuple[int, tuple[int, ...]]:
    """(bytes the chip holds for one array, its dimensions from major to minor) as the compiler
    lays it out."""
    mesh = target.mesh(("x",), (1,))
    arg = jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda a: a.at[0, 0].set(jnp.zeros(a.shape[2:], a.dtype)), donate_argnums=0).lower(arg).compile()
    return compiled.memory_analysis().argument_size_in_bytes, tuple(compiled.input_formats[0][0].layout.major_to_minor)


def chip_bytes(target, pool: KVCache) -> int:
    """Bytes the chip holds for the pool's arrays."""
    return sum(chip_layout(target, array)[0] for array in jax.tree.leaves(pool))


def abstract_pool(config: ModelConfig, dtype, kernels: Kernels) -> KVCache:
    return jax.eval_shape(lambda: KVCache.create(config, PAGES, PAGE_SIZE, dtype, kernels=kernels))


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
def test_combined_pages_hold_exactly_the_models_kv_bytes_per_token_per_chip(v6e, dtype):
    """head_dim 64 / 128 / 256 x 1 / 2 / 8 KV heads per chip: entries 2 x heads x head_dim bytes of
    the dtype per token, and a quantized pool's scales 2 x heads x 4 bytes, nothing more."""
    kv_dtype = KV_DTYPES[dtype]
    itemsize = jnp.dtype(kv_dtype).itemsize
    quantized = dtype != "bf16"
    for heads, head_dim in itertools.product((1, 2, 8), (64, 128, 256)):
        pool = abstract_pool(one_chip_config(heads, head_dim), kv_dtype, Kernels("tpu"))
        assert pool.combined and pool.kv.dtype == storage_dtype(kv_dtype) and pool.quantized == quantized
        per_token = 2 * heads * head_dim * itemsize + (2 * heads * 4 if quantized else 0)
        got = chip_bytes(v6e, pool) / (LAYERS * PAGES * PAGE_SIZE)
        assert got == per_token, (dtype, heads, head_dim, got, per_token)
        assert chip_layout(v6e, pool.kv)[1] == (0, 1, 2, 3), "whole pages, as the kernel DMAs them"
        assert KVCache.page_bytes(one_chip_config(heads, head_dim), PAGE_SIZE, kv_dtype, kernels=Kernels("tpu")) \
            == LAYERS * PAGE_SIZE * per_token


def test_a_quantized_pool_in_pages_of_128_keeps_its_scales_row_major_for_the_kernel(v6e):
    """Pages of 128 tokens: each head's scales of a page are whole 128-lane rows, stored exactly
    and page-major, so the attention kernel DMAs them with the page (smaller pages: the compiler
    puts the page axis in the lanes, and the XLA attention reads them)."""
    config = one_chip_config(1, 128)
    pool = jax.eval_shape(lambda: KVCache.create(config, PAGES, 128, jnp.int8, kernels=Kernels("tpu")))
    size, layout = chip_layout(v6e, pool.kv_scale)
    assert layout == (0, 1, 2) and size == pool.kv_scale.size * 4
    small = abstract_pool(config, jnp.int8, Kernels("tpu"))  # pages of 16: 32 scales a page
    assert chip_layout(v6e, small.kv_scale)[1] != (0, 1, 2)


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_separate_pools_of_head_dim_64_are_padded_or_not_row_major_on_a_tpu(v6e, heads):
    """What the combined layout removes: a K pool [.., heads, 64] in bf16 either takes twice its
    bytes or puts another axis than head_dim in the lanes, which a page DMA cannot take."""
    k_pool = abstract_pool(one_chip_config(heads, 64), jnp.bfloat16, Kernels()).k
    exact = k_pool.size * 2
    size, layout = chip_layout(v6e, k_pool)
    assert size == 2 * exact or layout[-1] != 4, (size, exact, layout)


def rope_and_write_combined(q, k, v, cos, sin, kv_pages, write_page, write_offset):
    """(q_rot, k_rot, kv_pages) of the step's RoPE and KV write into a combined pool."""
    q, k, pool = rope_and_write_kv(q, k, v, cos, sin, KVCache(kv=kv_pages), write_page, write_offset, Kernels("tpu"))
    return q, k, pool.kv


@pytest.mark.parametrize("Hkv,D", [(1, 64), (3, 64), (2, 128), (1, 16)])
def test_combined_write_puts_each_token_row_where_the_separate_write_puts_its_k_and_v(Hkv, D):
    """The combined pool's row of a written slot is K_0 V_0 K_1 V_1 ... of the separate write (zero
    lanes past D); every other slot keeps its bits."""
    case = make_case(8, T=9, Hq=2 * Hkv, Hkv=Hkv, D=D, page_size=4, num_pages=5, dtype=jnp.bfloat16)
    q, k, v, cos, sin, k_pages, v_pages, page, offset = case
    kv_pages = combine_kv(k_pages, v_pages)
    assert kv_pages.shape == (5, 4, row_width(Hkv, D))
    q_rot, k_rot, kv_new = rope_and_write_combined(q, k, v, cos, sin, kv_pages, page, offset)
    want = rope_kv_write_reference(*case)
    np.testing.assert_array_equal(np.asarray(q_rot, np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(k_rot, np.float32), np.asarray(want[1], np.float32))
    k_got, v_got = split_kv(kv_new, D)
    np.testing.assert_array_equal(np.asarray(k_got, np.float32), np.asarray(want[2], np.float32))
    np.testing.assert_array_equal(np.asarray(v_got, np.float32), np.asarray(want[3], np.float32))
    np.testing.assert_array_equal(np.asarray(kv_new, np.float32), np.asarray(combine_kv(want[2], want[3]), np.float32))


@pytest.mark.parametrize("chip", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"])
@pytest.mark.parametrize("heads,head_dim,dtype", [(1, 64, jnp.bfloat16), (8, 128, jnp.bfloat16), (2, 256, jnp.int8)])
def test_the_combined_write_updates_the_pool_in_place(chip, heads, head_dim, dtype):
    """RoPE and the scatter of 256 tokens' rows into a donated pool, for each chip: no pool-sized
    copy, the pool aliased to the output, no scratch the size of the pool."""
    mesh = compile_target(chip).mesh(("x",), (1,))
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))  # noqa: E731
    T = 256
    kv = abstract_pool(one_chip_config(heads, head_dim), dtype, Kernels("tpu")).kv
    pool = jax.ShapeDtypeStruct((kv.shape[0] * kv.shape[1],) + kv.shape[2:], kv.dtype)  # layers folded into pages, as the step holds it
    args = (spec((T, 4 * heads, head_dim), jnp.bfloat16), spec((T, heads, head_dim), jnp.bfloat16), spec((T, heads, head_dim), jnp.bfloat16),
            spec((T, head_dim), jnp.float32), spec((T, head_dim), jnp.float32), spec(pool.shape, pool.dtype),
            spec((T,), jnp.int32), spec((T,), jnp.int32))
    with jax.set_mesh(mesh):
        compiled = jax.jit(rope_and_write_combined, donate_argnums=5).lower(*args).compile()
    memory = compiled.memory_analysis()
    pool_bytes = pool.size * pool.dtype.itemsize
    assert pool_sized_copies(compiled.as_text(), pool.size) == 0
    assert memory.alias_size_in_bytes >= pool_bytes and memory.temp_size_in_bytes < pool_bytes // 16


@pytest.mark.parametrize("chip", ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"])
def test_8bit_rows_in_pages_of_32_or_more_are_written_in_place(chip):
    """A TPU tiles 8-bit pages of 32+ tokens in (32, 128) tiles, which XLA's scatter would copy to
    (8, 128) ones and back: the rows go in one dynamic_update_slice each (ops.attention)."""
    mesh = compile_target(chip).mesh(("x",), (1,))
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))  # noqa: E731
    N, T, W = 20000, 256, 512
    with jax.set_mesh(mesh):
        compiled = jax.jit(write_page_rows, donate_argnums=0).lower(
            spec((N, 128, W), jnp.int8), spec((T,), jnp.int32), spec((T,), jnp.int32), spec((T, W), jnp.int8)).compile()
    assert pool_sized_copies(compiled.as_text(), N * 128 * W) == 0

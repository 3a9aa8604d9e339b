"""Weight quantization: the quantizers in `jaxinfer.ops.quantization` and the reference quantized matmul.

Read as a specification: what each mode promises about its rounding error, how int4 is packed,
what `quantized_matmul` computes, and which parameters `quantize_params` touches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import quantization as qz
from pallas_kernels.quantized_matmul import dequantize, quantized_matmul, unpack_int4


def weight(shape, seed=0, dtype=jnp.float32):
    """Gaussian weights with a few large outliers, as real checkpoints have."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.02, shape)
    w.flat[rng.integers(0, w.size, 4)] *= 20
    return jnp.asarray(w, dtype)


# ----------------------------------------------------------------------------- round trips
def test_int8_round_trip_error_is_at_most_half_a_step_per_column():
    w = weight((64, 48))
    qw = qz.quantize(w, "int8")
    q, scales = qw.qweight, qw.scales
    assert q.dtype == jnp.int8 and q.shape == (64, 48) and qw.offsets is None
    assert scales.dtype == jnp.float32 and scales.shape == (48,)
    np.testing.assert_allclose(scales, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
    assert np.all(err <= np.asarray(scales)[None, :] / 2 * (1 + 1e-5))
    assert np.abs(np.asarray(q)).max() == 127  # each column's absmax lands on the end of the range


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step_per_group(group_size):
    K, N = 256, 24
    w = weight((K, N), seed=group_size)
    qw = qz.quantize(w, "int4", group_size)
    packed, scales = qw.qweight, qw.scales
    assert packed.dtype == jnp.uint8 and packed.shape == (K // 2, N)
    assert scales.dtype == jnp.bfloat16 and scales.shape == (K // group_size, N)  # 16-bit scales, as GPTQ/AWQ
    groups = np.asarray(w).reshape(K // group_size, group_size, N)
    np.testing.assert_allclose(np.asarray(scales, np.float32), np.abs(groups).max(axis=1) / 7, rtol=2**-8)
    err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
    step = np.repeat(np.asarray(scales, np.float32), group_size, axis=0)  # [K, N]: the scale of each element's group
    assert np.all(err <= step / 2 * (1 + 1e-5))


@pytest.mark.parametrize("mode, group_size", [("int4", 32), ("int4", 128), ("int8", 16), ("int8", 64)])
def test_asymmetric_groups_fit_min_to_max_within_half_a_step(mode, group_size):
    K, N = 256, 24
    w = weight((K, N), seed=5) + 0.03  # off-centre groups: where a zero point pays
    sym = qz.quantize(w, mode, group_size)
    asym = qz.quantize(w, mode, group_size, symmetric=False)
    assert asym.offsets.shape == asym.scales.shape == (K // group_size, N) and asym.offsets.dtype == jnp.float32
    # offsets are whole numbers of scales (-zero point * scale): no bias shared by a group
    zero_points = -np.asarray(asym.offsets) / np.asarray(asym.scales, np.float32)
    np.testing.assert_allclose(zero_points, np.round(zero_points), atol=1e-4)
    groups = np.asarray(w).reshape(K // group_size, group_size, N)
    levels = 15 if mode == "int4" else 255
    span = np.maximum(groups.max(axis=1), 0) - np.minimum(groups.min(axis=1), 0)  # the range holds 0
    np.testing.assert_allclose(np.asarray(asym.scales, np.float32), span / levels, rtol=2**-8)
    err = np.abs(np.asarray(asym.dequantize()) - np.asarray(w))
    step = np.repeat(np.asarray(asym.scales, np.float32), group_size, axis=0)
    assert np.all(err <= step * (0.5 + 0.05) + 1e-7)  # half a step, plus the bf16 scale's rounding over 15 levels
    assert np.abs(np.asarray(asym.dequantize() - w)).mean() < np.abs(np.asarray(sym.dequantize() - w)).mean()


def test_int8_per_group_is_closer_than_per_column():
    w = weight((256, 16), seed=6)
    per_column, per_group = qz.quantize(w, "int8"), qz.quantize(w, "int8", 32)
    assert per_group.scales.shape == (8, 16) and per_group.qweight.shape == (256, 16)
    assert np.abs(np.asarray(per_group.dequantize() - w)).max() < np.abs(np.asarray(per_column.dequantize() - w)).max()


def test_fp8_round_trip_keeps_three_mantissa_bits():
    w = weight((64, 40))
    qw = qz.quantize(w, "fp8")
    q, scales = qw.qweight, qw.scales
    assert q.dtype == jnp.float8_e4m3fn and scales.shape == (40,)
    np.testing.assert_allclose(scales, np.abs(w).max(axis=0) / 448, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(q, np.float32)))
    w_np, back = np.asarray(w), np.asarray(qw.dequantize())
    # Normal numbers: relative error <= 2^-4 (3 mantissa bits, round to nearest). Near zero the
    # subnormal spacing 2^-9 (times the scale) bounds the absolute error instead.
    bound = np.maximum(np.abs(w_np) * 2.0**-4, np.asarray(scales)[None, :] * 2.0**-10)
    assert np.all(np.abs(back - w_np) <= bound * (1 + 1e-5))
    assert np.median(np.abs(back - w_np) / np.abs(w_np)) < 0.03


@pytest.mark.parametrize("mode", qz.MODES)
def test_an_all_zero_column_quantizes_to_zero(mode):
    w = weight((64, 8)).at[:, 3].set(0.0)
    for symmetric in (True, False) if mode != "fp8" else (True,):
        qw = qz.quantize(w, mode, group_size=None if mode == "fp8" else 32, symmetric=symmetric)
        back = np.asarray(qw.dequantize())
        assert np.all(back[:, 3] == 0) and np.all(np.isfinite(back))


def test_bf16_weights_quantize_like_their_f32_values():
    w = weight((64, 16), dtype=jnp.bfloat16)
    q_bf16, s_bf16, _ = qz.quantize_int8(w)
    q_f32, s_f32, _ = qz.quantize_int8(w.astype(jnp.float32))
    np.testing.assert_array_equal(q_bf16, q_f32)
    np.testing.assert_array_equal(s_bf16, s_f32)


# ----------------------------------------------------------------------------- int4 packing layout
def test_int4_packing_puts_even_k_in_the_low_nibble_stored_as_value_plus_8():
    # K = 4, N = 2. Column 0 holds k = 0..3 -> -8, 7, 0, -1; column 1 holds 1, 2, -3, 5.
    q = jnp.array([[-8, 1], [7, 2], [0, -3], [-1, 5]], jnp.int8)
    packed = qz.pack_int4(q)
    # Row i = (value(2i+1) + 8) << 4 | (value(2i) + 8)
    expected = np.array(
        [
            [(7 + 8) << 4 | (-8 + 8), (2 + 8) << 4 | (1 + 8)],   # 0xF0, 0xA9
            [(-1 + 8) << 4 | (0 + 8), (5 + 8) << 4 | (-3 + 8)],  # 0x78, 0xD5
        ],
        np.uint8,
    )
    assert expected.tolist() == [[0xF0, 0xA9], [0x78, 0xD5]]
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_int4_dequantize_applies_the_scale_of_each_k_group():
    # K = 64 with group 32: rows 0..31 use scales[0], rows 32..63 use scales[1].
    q = jnp.ones((64, 1), jnp.int8)
    scales = jnp.array([[2.0], [3.0]], jnp.bfloat16)
    w = dequantize(qz.pack_int4(q), scales, mode="int4", group_size=32)
    np.testing.assert_array_equal(w[:32], 2.0)
    np.testing.assert_array_equal(w[32:], 3.0)


# ----------------------------------------------------------------------------- quantized matmul
MATMUL_CASES = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128), ("fp8", None)]


@pytest.mark.parametrize("mode,group_size", MATMUL_CASES)
@pytest.mark.parametrize("x_dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantized_matmul_is_x_times_the_dequantized_weight(mode, group_size, x_dtype, rtol, symmetric):
    if not symmetric and group_size is None:
        pytest.skip("offsets need groups")
    M, K, N = 8, 256, 32
    qw = qz.quantize(weight((K, N), seed=1), mode, group_size, symmetric)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(M, K)), x_dtype)
    y = quantized_matmul(x, qw.qweight, qw.scales, qw.offsets, mode=mode, group_size=group_size)
    assert y.shape == (M, N) and y.dtype == x_dtype
    expected = np.asarray(x, np.float64) @ np.asarray(qw.dequantize(), np.float64)
    # f32: accumulation order only. bf16: the f32 result rounded once to bf16 (8 mantissa bits).
    atol = rtol * np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=rtol, atol=atol)


def test_quantized_matmul_is_close_to_the_unquantized_matmul():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 128)), jnp.float32)
    w = weight((128, 16), seed=3)
    exact = np.asarray(x @ w)
    for mode, group_size, tol in [("int8", None, 0.02), ("fp8", None, 0.05), ("int4", 32, 0.2)]:
        qw = qz.quantize(w, mode, group_size)
        y = np.asarray(quantized_matmul(x, qw.qweight, qw.scales, mode=mode, group_size=group_size))
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < tol, mode


# ----------------------------------------------------------------------------- w8a8: int8 activations too
@pytest.mark.parametrize("K", [576, 1536, 96])
def test_the_rotation_is_an_orthogonal_kronecker_product_that_mixes_every_entry(K):
    b = qz.rotation_block(K)
    assert b == {576: 64, 1536: 512, 96: 32}[K]
    R = np.kron(qz.block_mixing(K // b), qz.hadamard(b))  # Q (x) H
    np.testing.assert_allclose(R @ R.T, np.eye(K), atol=1e-5)
    assert np.all(R != 0)  # one large entry of x spreads over the whole row
    x = np.random.default_rng(0).normal(size=(3, K)).astype(np.float32)
    np.testing.assert_allclose(qz.rotate_rows(jnp.asarray(x), axis=-1), x @ R, atol=1e-5)
    np.testing.assert_allclose(qz.rotate_rows(jnp.asarray(x.T), axis=0), (x @ R).T, atol=1e-5)
    np.testing.assert_allclose(qz.rotate_rows(qz.rotate_rows(jnp.asarray(x), axis=-1), axis=-1, inverse=True), x, atol=1e-5)


def test_w8a8_multiplies_int8_rows_of_the_turned_x_by_the_int8_turned_weight():
    from jaxinfer.models.layers import matmul

    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 576)), jnp.float32)
    w = weight((576, 48), seed=1)
    qw = qz.quantize(w, "w8a8")
    assert (qw.mode, qw.group_size, qw.activations, qw.qweight.dtype) == ("int8", None, "int8", jnp.int8)
    # the weight stored is R^T w quantized per column: dequantized and turned back, it is w
    back = np.asarray(qz.rotate_rows(qw.dequantize(), axis=0, inverse=True))
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.01
    xr = np.asarray(x, np.float64) @ np.kron(qz.block_mixing(9), qz.hadamard(64))
    x_scales = np.abs(xr).max(axis=1, keepdims=True) / 127
    xq = np.clip(np.round(xr / x_scales), -127, 127)
    expected = (xq @ np.asarray(qw.qweight, np.float64)) * x_scales * np.asarray(qw.scales, np.float64)
    y = np.asarray(matmul(x, qw))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    exact = np.asarray(x @ w)
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.02


def test_w8a8_quantizes_a_tied_embedding_as_the_lm_head_and_looks_tokens_up_from_it():
    from jaxinfer.models.layers import embed_lookup, tied_logits

    table = weight((200, 64), seed=2)  # [V, H]
    tied = qz.quantize_params({"embed": table, "layers.o_proj": weight((2, 64, 64))}, "w8a8")
    assert tied["embed"].shape == (64, 200) and tied["embed"].activations == "int8"
    rows = embed_lookup(tied["embed"], jnp.asarray([3, 0, 199]))
    np.testing.assert_allclose(rows, table[jnp.asarray([3, 0, 199])], atol=float(tied["embed"].scales.max()))
    h = jnp.asarray(np.random.default_rng(2).normal(size=(2, 64)), jnp.float32)
    exact = np.asarray(h @ table.T)
    assert np.linalg.norm(tied_logits(h, tied["embed"]) - exact) / np.linalg.norm(exact) < 0.02
    untied = qz.quantize_params({"embed": table, "lm_head": weight((64, 200))}, "w8a8")
    assert not isinstance(untied["embed"], qz.QuantizedWeight) and untied["lm_head"].activations == "int8"


@pytest.mark.parametrize("kwargs", [dict(group_size=32), dict(symmetric=False)])
def test_w8a8_is_per_column_and_symmetric_only(kwargs):
    with pytest.raises(ValueError, match="w8a8"):
        qz.quantize(weight((64, 8)), "w8a8", **kwargs)
    qw = qz.quantize(weight((64, 8)), "int8", 32)
    with pytest.raises(ValueError, match="int8 activations"):
        qz.QuantizedWeight(qw.qweight, qw.scales, mode="int8", group_size=32, activations="int8")


# ----------------------------------------------------------------------------- stacked [L, K, N]
@pytest.mark.parametrize("mode,group_size", MATMUL_CASES)
def test_stacked_weights_are_quantized_layer_by_layer(mode, group_size):
    L, K, N = 3, 128, 16
    w = weight((L, K, N), seed=4) * jnp.array([1.0, 10.0, 0.1])[:, None, None]  # very different layers
    qw = qz.quantize(w, mode, group_size)
    assert qw.shape == (L, K, N)
    assert qw.scales.shape == ((L, K // group_size, N) if group_size else (L, N))
    for i in range(L):
        layer = jax.tree.map(lambda a: a[i], qw)  # how a loop over layers takes one
        alone = qz.quantize(w[i], mode, group_size)
        assert layer.mode == mode and layer.group_size == group_size
        np.testing.assert_array_equal(np.asarray(layer.qweight, np.float32), np.asarray(alone.qweight, np.float32))
        np.testing.assert_array_equal(layer.scales, alone.scales)
    np.testing.assert_array_equal(qw.dequantize()[1], qz.quantize(w[1], mode, group_size).dequantize())


def test_quantized_weight_is_a_pytree_with_static_mode():
    qw = qz.quantize(weight((64, 8)), "int4", group_size=32)
    leaves, treedef = jax.tree.flatten(qw)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.bfloat16]  # no offsets: symmetric
    asym = jax.tree.leaves(qz.quantize(weight((64, 8)), "int4", group_size=32, symmetric=False))
    assert [leaf.dtype for leaf in asym] == [jnp.uint8, jnp.bfloat16, jnp.float32]
    back = jax.tree.unflatten(treedef, leaves)
    assert (back.mode, back.group_size) == ("int4", 32) and back.qweight is qw.qweight

    @jax.jit
    def f(x, w: qz.QuantizedWeight):
        return quantized_matmul(x, w.qweight, w.scales, mode=w.mode, group_size=w.group_size)

    x = jnp.ones((2, 64), jnp.float32)
    np.testing.assert_allclose(f(x, qw), x @ qw.dequantize(), rtol=1e-5)


# ----------------------------------------------------------------------------- whole parameter dicts
def llama_like_params(L=2, H=64, I=128, V=32, dtype=jnp.bfloat16):
    shapes = {
        "embed": (V, H),
        "final_norm": (H,),
        "layers.attn_norm": (L, H),
        "layers.qkv_proj": (L, H, 2 * H),
        "layers.qkv_bias": (L, 2 * H),
        "layers.o_proj": (L, H, H),
        "layers.mlp_norm": (L, H),
        "layers.gate_up_proj": (L, H, 2 * I),
        "layers.down_proj": (L, I, H),
        "lm_head": (H, V),
    }
    return {name: weight(shape, seed=i, dtype=dtype) for i, (name, shape) in enumerate(shapes.items())}


@pytest.mark.parametrize("mode", qz.MODES)
def test_quantize_params_replaces_only_the_matmul_weights(mode):
    params = llama_like_params()
    out = qz.quantize_params(params, mode, group_size=None if mode == "fp8" else 64)
    quantized = {name for name, v in out.items() if isinstance(v, qz.QuantizedWeight)}
    assert quantized == {"layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj", "lm_head"}
    for name in params.keys() - quantized:  # embed, norms, biases: the very same arrays
        assert out[name] is params[name]
    for name in quantized:
        assert out[name].mode == mode and out[name].shape == params[name].shape
    assert all(not isinstance(v, qz.QuantizedWeight) for v in params.values())  # input untouched


def test_quantize_params_skip_keeps_named_weights():
    params = llama_like_params()
    out = qz.quantize_params(params, "int8", skip=("lm_head",))
    assert out["lm_head"] is params["lm_head"]
    assert isinstance(out["layers.qkv_proj"], qz.QuantizedWeight)


def test_int4_g128_stores_a_big_weight_in_under_a_3_5th_of_its_bf16_bytes():
    w = jnp.zeros((2048, 1024), jnp.bfloat16)
    params = {"layers.gate_up_proj": w, "final_norm": jnp.ones((1024,), jnp.bfloat16)}
    quantized = qz.quantize_params(params, "int4", group_size=128)
    # K*N/2 bytes of nibbles + K/128*N*4 bytes of scales = 0.53 bytes per weight vs 2.
    assert quantized["layers.gate_up_proj"].nbytes < w.nbytes / 3.5
    assert qz.param_bytes(quantized) == quantized["layers.gate_up_proj"].nbytes + 1024 * 2
    assert qz.param_bytes(params) == w.nbytes + 1024 * 2
    assert qz.param_bytes(qz.quantize_params(params, "int8")) < qz.param_bytes(params) / 1.9


# ----------------------------------------------------------------------------- errors
def test_unknown_mode_raises_naming_mode():
    w = weight((64, 8))
    with pytest.raises(ValueError, match="mode"):
        qz.quantize(w, "int3")
    with pytest.raises(ValueError, match="mode"):
        qz.quantize_params({"lm_head": w}, "nf4")
    with pytest.raises(ValueError, match="mode"):
        quantized_matmul(jnp.ones((1, 64)), *qz.quantize_int8(w)[:2], mode="int2")


@pytest.mark.parametrize("group_size", [16, 48, 256])
def test_unsupported_int4_group_size_raises_naming_group_size(group_size):
    w = weight((256, 8))
    with pytest.raises(ValueError, match="group_size"):
        qz.quantize_int4(w, group_size)
    with pytest.raises(ValueError, match="group_size"):
        qz.quantize_params({"lm_head": w}, "int4", group_size=group_size)
    packed, scales, _ = qz.quantize_int4(w, 32)
    with pytest.raises(ValueError, match="group_size"):
        quantized_matmul(jnp.ones((1, 256)), packed, scales, mode="int4", group_size=group_size)


def test_int4_pads_k_with_zero_rows_up_to_a_whole_group():
    # SmolLM2-135M's hidden size 576 is 4.5 groups of 128: stored as 640 rows, the last 64 zero.
    w = weight((576, 8), seed=7)
    qw = qz.quantize(w, "int4", group_size=128)
    assert qw.qweight.shape == (320, 8) and qw.scales.shape == (5, 8) and qw.shape == (576, 8)
    np.testing.assert_array_equal(np.asarray(dequantize(qw.qweight, qw.scales, mode="int4", group_size=128))[576:], 0.0)
    assert np.abs(np.asarray(qw.dequantize() - w)).max() <= np.asarray(qw.scales).max() / 2 + 1e-7
    x = jnp.asarray(np.random.default_rng(8).normal(size=(3, 576)), jnp.float32)
    y = quantized_matmul(x, qw.qweight, qw.scales, mode="int4", group_size=128)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(qw.dequantize()), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="K = 500"):  # short by more than the padding
        quantized_matmul(x[:, :500], qw.qweight, qw.scales, mode="int4", group_size=128)


def test_group_size_with_a_per_channel_mode_raises_in_the_matmul():
    q, scales, _ = qz.quantize_int8(weight((64, 8)))
    with pytest.raises(ValueError, match="group_size"):
        quantized_matmul(jnp.ones((1, 64)), q, scales, mode="fp8", group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        quantized_matmul(jnp.ones((1, 64)), q, scales, mode="int8", group_size=48)
    with pytest.raises(ValueError, match="scales must have shape"):  # per-column scales for a grouped layout
        quantized_matmul(jnp.ones((1, 64)), q, scales, mode="int8", group_size=32)


def test_mismatched_layout_raises():
    q, scales, _ = qz.quantize_int8(weight((64, 8)))
    with pytest.raises(ValueError, match="qweight"):
        quantized_matmul(jnp.ones((1, 64)), q.astype(jnp.float32), scales, mode="int8")
    with pytest.raises(ValueError, match="scales"):
        quantized_matmul(jnp.ones((1, 64)), q, scales[:4], mode="int8")
    packed, group_scales, _ = qz.quantize_int4(weight((64, 8)), 32)
    with pytest.raises(ValueError, match="scales must be float32, bfloat16 or float16"):
        quantized_matmul(jnp.ones((1, 64)), packed, group_scales.astype(jnp.int32), mode="int4", group_size=32)
    with pytest.raises(ValueError, match="offsets must have shape"):
        quantized_matmul(jnp.ones((1, 64)), packed, group_scales, group_scales[:1], mode="int4", group_size=32)
    with pytest.raises(ValueError, match="offsets need groups"):
        quantized_matmul(jnp.ones((1, 64)), q, scales, scales, mode="int8")

"""checkpoints_conv.orbax_io: bit-exact save/restore of a nested param dict, and its checks."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from checkpoints_conv import CheckpointError, restore_params, save_params, saved_param_shapes

RNG = np.random.default_rng(3)


def _params():
    return {
        "embed": RNG.standard_normal((16, 8)).astype(np.float32),
        "final_norm": RNG.standard_normal(8).astype(ml_dtypes.bfloat16),
        "layers": {
            "q_proj": RNG.standard_normal((2, 8, 8)).astype(ml_dtypes.bfloat16),
            "attn_norm": RNG.standard_normal((2, 8)).astype(np.float32),
        },
    }


def _abstract(params, sharding=None):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params)


def _assert_bit_exact(restored, params):
    flat_r, flat_p = jax.tree.leaves_with_path(restored), jax.tree.leaves_with_path(params)
    assert [p for p, _ in flat_r] == [p for p, _ in flat_p]
    for (path, r), (_, p) in zip(flat_r, flat_p):
        r = np.asarray(r)
        assert r.dtype == p.dtype and r.shape == p.shape, path
        assert r.tobytes() == p.tobytes(), path


def test_round_trip_is_bit_exact(tmp_path):
    params = _params()
    path = save_params(tmp_path / "ckpt", params)
    assert path.is_absolute()
    _assert_bit_exact(restore_params(tmp_path / "ckpt", _abstract(params)), params)
    assert saved_param_shapes(path)["layers.q_proj"] == ((2, 8, 8), np.dtype(ml_dtypes.bfloat16))


def test_restore_places_with_the_target_sharding(tmp_path):
    params = _params()
    save_params(tmp_path / "ckpt", jax.tree.map(jnp.asarray, params))
    sharding = SingleDeviceSharding(jax.devices()[0])
    restored = restore_params(tmp_path / "ckpt", _abstract(params, sharding))
    assert all(isinstance(a, jax.Array) and a.sharding == sharding for a in jax.tree.leaves(restored))
    _assert_bit_exact(restored, params)


def test_shape_mismatch_names_param_and_both_shapes(tmp_path):
    params = _params()
    save_params(tmp_path / "ckpt", params)
    abstract = _abstract(params)
    abstract["layers"]["q_proj"] = jax.ShapeDtypeStruct((2, 8, 16), jnp.bfloat16)
    with pytest.raises(CheckpointError, match=r"'layers\.q_proj' is saved with shape \(2, 8, 8\), the target wants \(2, 8, 16\)"):
        restore_params(tmp_path / "ckpt", abstract)


def test_dtype_mismatch_needs_allow_cast(tmp_path):
    params = _params()
    save_params(tmp_path / "ckpt", params)
    abstract = _abstract(params)
    abstract["embed"] = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16)
    with pytest.raises(CheckpointError, match=r"'embed' is saved as float32, the target wants bfloat16"):
        restore_params(tmp_path / "ckpt", abstract)
    restored = restore_params(tmp_path / "ckpt", abstract, allow_cast=True)
    np.testing.assert_array_equal(restored["embed"], params["embed"].astype(ml_dtypes.bfloat16))


def test_missing_param_and_existing_destination(tmp_path):
    params = _params()
    save_params(tmp_path / "ckpt", params)
    abstract = _abstract(params) | {"lm_head": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['lm_head'\]"):
        restore_params(tmp_path / "ckpt", abstract)
    with pytest.raises(CheckpointError, match="already exists"):
        save_params(tmp_path / "ckpt", params)
    save_params(tmp_path / "ckpt", params, overwrite=True)
    with pytest.raises(CheckpointError, match="no orbax checkpoint"):
        restore_params(tmp_path / "nothing", _abstract(params))

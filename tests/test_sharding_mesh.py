"""sharding.mesh: parallel sizes, the mesh over the devices, model fit checks, and the multi-process
start's errors (each within seconds). The test process has 8 CPU devices (tests/conftest.py)."""

from __future__ import annotations

import socket
import time

import jax
import pytest

from sharding.mesh import (
    MESH_AXES,
    ParallelConfig,
    ShardingError,
    check_model_fits,
    initialize_distributed,
    kv_heads_per_shard,
    make_mesh,
)

@pytest.mark.parametrize("bad", [dict(tp=0), dict(dp=-1), dict(ep=1.5), dict(sp=True)])
def test_parallel_sizes_must_be_positive_integers(bad):
    with pytest.raises(ShardingError, match=f"{next(iter(bad))}="):
        ParallelConfig(**bad)


def test_a_mesh_larger_than_the_devices_is_named():
    with pytest.raises(ShardingError, match=r"dp=4 x sp=1 x ep=1 x tp=4 needs 16 devices, but only 8 are available"):
        make_mesh(ParallelConfig(dp=4, tp=4))
    with pytest.raises(ShardingError, match=r"needs 2 devices, but only 1 is available"):
        make_mesh(ParallelConfig(tp=2), jax.devices()[:1])


def test_mesh_axes_over_eight_devices():
    mesh = make_mesh(ParallelConfig(dp=2, tp=4))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"pipeline": 1, "data": 2, "sequence": 1, "expert": 1, "tensor": 4}
    assert [d.id for d in mesh.devices[0, 1, 0, 0, :]] == [4, 5, 6, 7]  # a tensor group: neighbouring devices
    assert dict(make_mesh(ParallelConfig(tp=2)).shape) == {"pipeline": 1, "data": 1, "sequence": 1, "expert": 1, "tensor": 2}  # the first 2 of 8
    stages = make_mesh(ParallelConfig(pp=2, tp=2, dp=2))  # pipeline outermost: a stage is a block of neighbours
    assert [d.id for d in stages.devices[1].flat] == [4, 5, 6, 7]


def test_kv_heads_split_or_replicate():
    assert kv_heads_per_shard(8, 4) == 2
    assert kv_heads_per_shard(2, 8) == 1  # each KV head on 4 shards
    with pytest.raises(ShardingError, match="tensor_parallel_size=4 and the model's 3 KV heads"):
        kv_heads_per_shard(3, 4)


@pytest.mark.parametrize(
    "parallel,dims,message",
    [
        (ParallelConfig(tp=4), dict(num_heads=9, num_kv_heads=3, intermediate_size=1536), "does not divide the model's 9 attention heads"),
        (ParallelConfig(tp=2), dict(num_heads=4, num_kv_heads=3, intermediate_size=64), "3 KV heads"),
        (ParallelConfig(tp=2), dict(num_heads=4, num_kv_heads=2, intermediate_size=63), "intermediate size 63"),
        (ParallelConfig(ep=2), dict(num_heads=4, num_kv_heads=2, intermediate_size=64), "needs a mixture-of-experts model"),
        (ParallelConfig(ep=4), dict(num_heads=4, num_kv_heads=2, intermediate_size=64, num_experts=6), "does not divide the model's 6 experts"),
    ],
)
def test_model_dimensions_the_sizes_cannot_split_are_named(parallel, dims, message):
    with pytest.raises(ShardingError, match=message):
        check_model_fits(parallel, **dims)
    check_model_fits(ParallelConfig(), **dims)  # one device fits anything


@pytest.mark.parametrize(
    "args,message",
    [
        (dict(coordinator="127.0.0.1:1234", num_processes=2), "needs the coordinator address, the number of processes"),
        (dict(coordinator="localhost", num_processes=2, process_id=1), "expected HOST:PORT"),
        (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), r"process_id=2: must be in \[0, 2\)"),
    ],
)
def test_bad_multi_process_flags_fail_at_once(args, message):
    with pytest.raises(ShardingError, match=message):
        initialize_distributed(**args)


def test_an_unreachable_coordinator_fails_within_seconds():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ShardingError, match=f"coordinator 127.0.0.1:{port} did not answer within 2 s"):
        initialize_distributed(f"127.0.0.1:{port}", 2, 1, timeout_s=2)
    assert time.monotonic() - start < 10

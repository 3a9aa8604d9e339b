"""Device meshes for pipeline, data, tensor, sequence and expert parallelism, and the multi-host start.

    parallel = ParallelConfig(dp=2, tp=4)                 # sizes of the five mesh axes
    check_model_fits(parallel, num_heads=32, num_kv_heads=8, intermediate_size=14336)
    mesh = make_mesh(parallel)                            # jax.sharding.Mesh over jax.devices()

The mesh has the five axes `MESH_AXES` = ("pipeline", "data", "sequence", "expert", "tensor") in
that order, tensor innermost: the devices of one tensor-parallel group are neighbours in
`jax.devices()`, which on TPU slices and GPU hosts are the ones joined by the fastest links, and
pipeline outermost: its stages are the farthest apart (other hosts, other slices over DCN), where
only one activation block per micro-batch crosses. Axes of size 1 cost
nothing. The axes are `Auto` (GSPMD): arrays carry NamedShardings and XLA inserts the collectives;
code that wants explicit collectives uses `jax.shard_map` over the same mesh.

Multi-host: every process calls `initialize_distributed(...)` before anything touches a device;
`jax.devices()` then lists the devices of all processes and `make_mesh` spans them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("pipeline", "data", "sequence", "expert", "tensor")

# Environment variables read by `initialize_distributed` when an argument is not given.
ENV_COORDINATOR = "JAXINFER_COORDINATOR"  # HOST:PORT of process 0's coordinator service
ENV_NUM_PROCESSES = "JAXINFER_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXINFER_PROCESS_ID"


class ShardingError(ValueError):
    """A parallel configuration that cannot run: the message names the size at fault."""


SP_ATTENTION_MODES = ("allgather", "ring", "context")  # context: the KV pool sharded too (ops.attention.attend_context_parallel)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the mesh axes: pipeline (stages of layers), data (replicas), tensor (Megatron TP),
    sequence (long-prefill SP), expert (MoE EP). Their product is the number of devices the mesh uses. `sp_attention` picks how
    sequence-parallel attention sees the other devices' keys and values: "allgather" or "ring"
    (see jaxinfer.ops.attention.attend_sequence_parallel)."""

    dp: int = 1
    tp: int = 1
    sp: int = 1
    ep: int = 1
    sp_attention: str = "allgather"
    pp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "sp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ShardingError(f"{name}={value!r}: every parallel size must be a positive integer")
        if self.sp_attention not in SP_ATTENTION_MODES:
            raise ShardingError(f"sp_attention={self.sp_attention!r}: expected one of {SP_ATTENTION_MODES}")

    @property
    def num_replicas(self) -> int:
        """Attention replicas: data x expert (outside its MoE layers the expert axis is data parallel)."""
        return self.dp * self.ep

    @property
    def kv_shards(self) -> int:
        """How many devices share each replica's KV pages: sp with context parallelism (the pool split
        over the sequence axis, sp_attention "context"), else 1."""
        return self.sp if self.sp > 1 and self.sp_attention == "context" else 1

    @property
    def token_multiple(self) -> int:
        """What every step's token count is a multiple of: sp blocks (sequence parallelism), each
        of pp micro-batches (pipeline parallelism: jaxinfer.models.pipeline)."""
        return self.sp * self.pp

    @property
    def num_devices(self) -> int:
        return self.pp * self.dp * self.sp * self.ep * self.tp

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """Sizes in MESH_AXES order."""
        return (self.pp, self.dp, self.sp, self.ep, self.tp)

    def describe(self) -> str:
        sizes = " x ".join(f"{name}={size}" for name, size in zip(("pp", "dp", "sp", "ep", "tp"), self.axis_sizes)
                           if name != "pp" or size > 1)
        return sizes + (f" ({self.sp_attention})" if self.sp > 1 and self.sp_attention != "allgather" else "")

    def check_model(self, config) -> None:
        """check_model_fits for a jaxinfer ModelConfig."""
        check_model_fits(
            self, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size if config.is_moe else config.intermediate_size,
            num_experts=config.num_experts or None, shared_expert_size=config.shared_expert_intermediate_size or None,
        )


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A Mesh with MESH_AXES over `devices` (default: all of jax.devices(), every process's).

    Uses the first `parallel.num_devices` devices when there are more; ShardingError when there
    are fewer. Devices of several TPU slices (a `slice_index` each) are ordered slice by slice, so
    the outermost axes (pipeline, then data) are the ones that cross slices over DCN.
    """
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: getattr(d, "slice_index", None) or 0)  # (stable: each slice's own order kept)
    if parallel.num_devices > len(devices):
        raise ShardingError(
            f"the mesh {parallel.describe()} needs {parallel.num_devices} devices, but only {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} available ({devices[0].platform}; on a CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    grid = np.array(devices[: parallel.num_devices], dtype=object).reshape(parallel.axis_sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def kv_heads_per_shard(num_kv_heads: int, tp: int) -> int:
    """KV heads each tensor-parallel shard holds: num_kv_heads / tp, or 1 when there are fewer KV
    heads than shards (each KV head is then replicated on tp / num_kv_heads shards)."""
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ShardingError(
        f"tensor_parallel_size={tp} and the model's {num_kv_heads} KV heads: one must divide the other "
        f"(KV heads are split across shards, or replicated when there are fewer of them)"
    )


def check_model_fits(
    parallel: ParallelConfig,
    *,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    hidden_size: int | None = None,
    num_experts: int | None = None,
    shared_expert_size: int | None = None,
) -> None:
    """ShardingError naming the first model dimension the parallel sizes cannot split.
    For a MoE model `intermediate_size` is each expert's width."""
    tp, ep = parallel.tp, parallel.ep
    if num_heads % tp:
        raise ShardingError(f"tensor_parallel_size={tp} does not divide the model's {num_heads} attention heads")
    kv_heads_per_shard(num_kv_heads, tp)
    if intermediate_size % tp:
        raise ShardingError(f"tensor_parallel_size={tp} does not divide the MLP's intermediate size {intermediate_size}")
    if shared_expert_size and shared_expert_size % tp:
        raise ShardingError(f"tensor_parallel_size={tp} does not divide the shared expert's size {shared_expert_size}")
    if hidden_size is not None and hidden_size % tp:
        raise ShardingError(f"tensor_parallel_size={tp} does not divide the hidden size {hidden_size} (the embedding is split on it)")
    if ep > 1 and not num_experts:
        raise ShardingError(f"expert_parallel_size={ep} needs a mixture-of-experts model; this one has no experts")
    if num_experts and num_experts % ep:
        raise ShardingError(f"expert_parallel_size={ep} does not divide the model's {num_experts} experts")


# ----------------------------------------------------------------------------- multi-host
def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardingError(f"coordinator address {address!r}: expected HOST:PORT")
    return host, int(port)


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 60,
) -> None:
    """Join this process to a multi-process JAX run (`jax.distributed.initialize`).

    Arguments left out come from JAXINFER_COORDINATOR (HOST:PORT), JAXINFER_NUM_PROCESSES and
    JAXINFER_PROCESS_ID. Process 0 serves the coordinator at that address; the others connect to
    it. The checks run first, so a bad flag fails at once; a coordinator that never answers fails
    after `timeout_s` seconds (JAX's own initialization timeout), with the address in the error.
    On TPU VMs with all three left unset, JAX discovers the slice itself.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator is None and num_processes is None and process_id is None:
        jax.distributed.initialize()  # cloud TPU / SLURM / ... auto-detection
        return
    if coordinator is None or num_processes is None or process_id is None:
        raise ShardingError(
            "multi-process start needs the coordinator address, the number of processes and this process's id "
            f"(--coordinator/--num-processes/--process-id or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}); "
            f"got coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}"
        )
    host, port = _parse_address(coordinator)
    if num_processes < 1:
        raise ShardingError(f"num_processes={num_processes}: must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ShardingError(f"process_id={process_id}: must be in [0, {num_processes})")
    if process_id != 0:
        _wait_for_coordinator(host, port, timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=timeout_s,
        )
    except Exception as e:  # noqa: BLE001  (JAX raises runtime errors of several types here)
        raise ShardingError(
            f"process {process_id} of {num_processes} could not join the coordinator at {coordinator} "
            f"within {timeout_s} s: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def _wait_for_coordinator(host: str, port: int, timeout_s: float) -> None:
    """Return once HOST:PORT accepts a TCP connection; ShardingError after timeout_s seconds.

    JAX aborts the whole process (a fatal log, not an exception) when its coordinator never
    answers, so the other processes check for it themselves first and fail with a message.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ShardingError(
                    f"coordinator {host}:{port} did not answer within {timeout_s} s ({e}); start process 0 first, "
                    f"or check the address"
                ) from None
            time.sleep(0.2)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ShardingError(f"{name}={value!r}: expected an integer") from None

"""Chips to compile for, with no chip present: TPU topologies through libtpu, NVIDIA GPUs through
the CUDA plugin with a target description (see ../shared/notes/tpu-aot.md for the recipes).

    target = compile_target("v6e:2x4")   # 8 TPU v6e chips; "v5e:2x2", "v5p:2x2x1", "v6e:1" ...
    target = compile_target("h100")      # one NVIDIA H100 SXM (also "h200")
    target = compile_target("v5e:4x4", num_slices=2)   # two v5e-16 slices joined by DCN (multi-slice)
    with jax.set_mesh(target.mesh(("x",), (1,))):
        jax.jit(f).lower(*abstract_args).compile()

Needs `jax[tpu]` (libtpu) or `jax-cuda12-plugin` + `jax-cuda12-pjrt` at the jax pin, installed
with `pip install -e '.[aot]'`; run with JAX_PLATFORMS=cpu so neither plugin looks for a chip.
`Target.chip` gives the facts the capacity and speed estimates use (HBM bytes and bandwidth).

Several slices (`num_slices`, `jaxinfer aot --num-slices`): libtpu describes N copies of the slice
joined by the data-center network (`get_topology_desc(..., num_slices=N)`); each device carries its
`slice_index`, and a program compiled over them sends what crosses slices as DCN transfers
(sharding.hlo.dcn_transfers). `Target.mesh_devices` lays a mesh over the slices with its outer
axes across them: the pipeline stages (stage i on slice i), else data-parallel replicas, so the
tensor, expert and sequence groups stay inside a slice on ICI.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

import jax
import numpy as np

# libtpu describes multi-chip slices only ("v6e:1x1" is refused): a smaller count takes the first
# chips of the smallest slice it knows.
_TPU_SLICES = {"v5e": "2x2", "v6e": "2x2", "v5p": "2x2x1"}
_TPU_NAMES = {"v5e": "v5e", "v5litepod": "v5e", "v6e": "v6e", "v5p": "v5p"}
_GPU_CONFIGS = {"h100": "h100_sxm.txtpb", "h200": "h100_sxm.txtpb"}
# The H200 is an H100 (same SM count and clocks) with 141 GB of HBM3e at 4.8 TB/s.
_H200 = {"device_memory_size": 141 * 10**9, "memory_bandwidth": 4_800_000_000_000, "name": '"NVIDIA H200"'}


class TargetError(ValueError):
    """A topology this machine cannot compile for (unknown name, plugin missing)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    kind: str  # "TPU v6 lite", "NVIDIA H100 80GB HBM3"
    hbm_bytes: int  # memory of one chip
    hbm_bytes_per_second: int


@dataclasses.dataclass
class Target:
    platform: str  # "tpu" | "gpu"
    name: str  # as given: "v6e:2x4", "h100"
    devices: list  # the target's devices (not usable to run anything), slice by slice
    chip: Chip
    num_slices: int = 1  # TPU slices joined by DCN (a multi-slice topology)

    @property
    def num_chips(self) -> int:
        return len(self.devices)

    @property
    def chips_per_slice(self) -> int:
        return len(self.devices) // self.num_slices

    def describe(self) -> str:
        """"v5e:4x4 x 2 slices over DCN (32 chips)" / "v6e:2x2"."""
        return self.name if self.num_slices == 1 else f"{self.name} x {self.num_slices} slices over DCN ({self.num_chips} chips)"

    def mesh_devices(self, parallel) -> list:
        """The devices a mesh of `parallel` (sharding.mesh.ParallelConfig, axes outermost first)
        takes, in make_mesh's order. One slice: the first chips. Several: as many chips of each
        slice, slice after slice, so that the outermost axes cross the slices: the pipeline stages
        (pp a multiple of the slices: stage i on slice i, or pp / slices stages per slice), then
        the data replicas; the tensor, expert and sequence groups stay inside a slice. TargetError
        when the mesh cannot be laid out so."""
        n, slices = parallel.num_devices, self.num_slices
        if n > len(self.devices):
            raise TargetError(f"{parallel.describe()} needs {n} chips; {self.describe()} has {len(self.devices)}")
        if slices == 1:
            return self.devices[:n]
        pp, dp = parallel.pp, parallel.dp
        where = f"{parallel.describe()} over {slices} slices ({self.describe()})"
        if pp > 1 and pp % slices and slices % pp:
            raise TargetError(f"{where}: the pipeline stages go across the slices (stage i on slice i), so "
                              f"pipeline_parallel_size={pp} must be a multiple of the {slices} slices or divide them")
        if (pp * dp) % slices:
            inner = n // (pp * dp)
            raise TargetError(f"{where}: only the pipeline and data axes may cross slices (DCN), and pp x dp = {pp * dp} "
                              f"does not split into {slices} slices: each group of the inner axes (sp x ep x tp = {inner} "
                              f"chips) must lie in one slice. Use -pp {slices} (a stage per slice) or -dp a multiple of "
                              f"{slices // math.gcd(pp, slices)}")
        per_slice = n // slices
        return [d for i in range(slices) for d in self.devices[i * self.chips_per_slice:][:per_slice]]

    def mesh(self, axis_names: tuple[str, ...], shape: tuple[int, ...]) -> jax.sharding.Mesh:
        """A mesh over the first prod(shape) chips."""
        n = math.prod(shape)
        if n > len(self.devices):
            raise TargetError(f"a mesh of {n} chips does not fit {self.name} ({len(self.devices)} chips)")
        return jax.sharding.Mesh(np.array(self.devices[:n]).reshape(shape), axis_names)


def _tpu_target(generation: str, shape: str | None, count: int | None, name: str, num_slices: int = 1) -> Target:
    from jax.experimental import topologies

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{generation}-4")  # quiets libtpu's start-up warnings
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip to guard: let several processes compile
    topology = f"{generation}:{shape or _TPU_SLICES[generation]}"
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                            **({"num_slices": num_slices} if num_slices > 1 else {}))
    except Exception as e:  # noqa: BLE001  (libtpu missing, or a shape it refuses)
        raise TargetError(f"cannot describe TPU topology {topology!r}{f' x {num_slices} slices' if num_slices > 1 else ''}: "
                          f"{e}. Compiling for TPUs needs libtpu: pip install -e '.[aot]' (jax[tpu] at the jax pin)") from e
    # slice by slice (each device's slice_index on a multi-slice topology), in libtpu's order inside a slice
    devices = sorted(desc.devices, key=lambda d: getattr(d, "slice_index", 0)) if num_slices > 1 else list(desc.devices)
    if num_slices > 1 and len({d.slice_index for d in devices}) != num_slices:
        raise TargetError(f"libtpu described {topology!r} x {num_slices} slices with slice indices "
                          f"{sorted({d.slice_index for d in devices})}")
    if count is not None:  # the first chips of each slice
        per_slice = len(devices) // num_slices
        devices = [d for i in range(num_slices) for d in devices[i * per_slice:i * per_slice + count]]
    from jax.experimental.pallas import tpu as pltpu

    with jax.set_mesh(jax.sharding.Mesh(np.array(devices[:1]), ("x",))):
        info = pltpu.get_tpu_info()
    # get_tpu_info is per TensorCore; a v5p (or v4) device is a megacore of two, with both cores' HBM and bandwidth
    cores = info.num_cores
    return Target("tpu", name, devices, Chip(devices[0].device_kind, info.hbm_capacity_bytes * cores,
                                             info.mem_bw_bytes_per_second * cores), num_slices)


def gpu_target_config(model: str) -> str:
    """XLA's GPU target description (text proto) for "h100" or "h200"."""
    text = (Path(__file__).with_name(_GPU_CONFIGS[model])).read_text()
    if model == "h200":
        for field, value in _H200.items():
            text = re.sub(rf"(\b{field}: ).*", rf"\g<1>{value}", text, count=1)
    return text


def _gpu_target(model: str, name: str) -> Target:
    from jax.experimental import topologies

    config = gpu_target_config(model)
    try:
        desc = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"cannot describe GPU target {name!r}: {e}. Compiling for GPUs needs the CUDA plugin: "
                          f"pip install -e '.[aot]' (jax-cuda12-plugin and jax-cuda12-pjrt at the jax pin)") from e
    memory = int(re.search(r"device_memory_size: (\d+)", config).group(1))
    bandwidth = int(re.search(r"memory_bandwidth: (\d+)", config).group(1))
    devices = list(desc.devices)[:1]
    return Target("gpu", name, devices, Chip(devices[0].device_kind, memory, bandwidth))


def compile_target(name: str, num_slices: int = 1) -> Target:
    """"v6e:2x4" / "v5e:2x2" / "v5p:2x2x1" (a TPU slice), "v6e:1" / "v5e-8" (that many chips), or
    "h100" / "h200" (one NVIDIA GPU). `num_slices` > 1: that many such TPU slices joined by DCN."""
    text = name.strip().lower()
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise TargetError(f"num_slices={num_slices!r}: expected a positive integer")
    if text in _GPU_CONFIGS:
        if num_slices > 1:
            raise TargetError(f"{name!r} x {num_slices} slices: several slices over DCN are a TPU topology; "
                              f"a GPU target is one chip")
        return _gpu_target(text, name)
    m = re.fullmatch(r"(v5e|v5litepod|v6e|v5p)(?::(\d+(?:x\d+){1,2})|[:-](\d+))?", text)
    if m is None:
        raise TargetError(f"unknown target {name!r}: expected a TPU topology such as v6e:2x4, v5e:2x2, v5p:2x2x1 or v6e:1, "
                          f"or a GPU: {', '.join(_GPU_CONFIGS)}")
    generation = _TPU_NAMES[m.group(1)]
    shape, count = m.group(2), m.group(3)
    if count is not None:
        count = int(count)
        if count < 1:
            raise TargetError(f"{name!r}: a chip count must be at least 1")
        if count > 4:  # more chips than the smallest slice: the 2-row slice that holds them
            if count % 2:
                raise TargetError(f"{name!r}: give an even chip count above 4, or a topology such as v6e:2x4")
            shape, count = f"2x{count // 2}" + ("x1" if generation == "v5p" else ""), None
    return _tpu_target(generation, shape, count, name, num_slices)

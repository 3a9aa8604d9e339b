"""Chips to compile for, with no chip present: TPU topologies through libtpu, NVIDIA GPUs through
the CUDA plugin with a target description (see ../shared/notes/tpu-aot.md for the recipes).

    target = compile_target("v6e:2x4")   # 8 TPU v6e chips; "v5e:2x2", "v5p:2x2x1", "v6e:1" ...
    target = compile_target("h100")      # one NVIDIA H100 SXM (also "h200")
    with jax.set_mesh(target.mesh(("x",), (1,))):
        jax.jit(f).lower(*abstract_args).compile()

Needs `jax[tpu]` (libtpu) or `jax-cuda12-plugin` + `jax-cuda12-pjrt` at the jax pin, installed
with `pip install -e '.[aot]'`; run with JAX_PLATFORMS=cpu so neither plugin looks for a chip.
`Target.chip` gives the facts the capacity and speed estimates use (HBM bytes and bandwidth).
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
    devices: list  # the target's devices (not usable to run anything)
    chip: Chip

    @property
    def num_chips(self) -> int:
        return len(self.devices)

    def mesh(self, axis_names: tuple[str, ...], shape: tuple[int, ...]) -> jax.sharding.Mesh:
        """A mesh over the first prod(shape) chips."""
        n = math.prod(shape)
        if n > len(self.devices):
            raise TargetError(f"a mesh of {n} chips does not fit {self.name} ({len(self.devices)} chips)")
        return jax.sharding.Mesh(np.array(self.devices[:n]).reshape(shape), axis_names)


def _tpu_target(generation: str, shape: str | None, count: int | None, name: str) -> Target:
    from jax.experimental import topologies

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{generation}-4")  # quiets libtpu's start-up warnings
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip to guard: let several processes compile
    topology = f"{generation}:{shape or _TPU_SLICES[generation]}"
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001  (libtpu missing, or a shape it refuses)
        raise TargetError(f"cannot describe TPU topology {topology!r}: {e}. Compiling for TPUs needs libtpu: "
                          f"pip install -e '.[aot]' (jax[tpu] at the jax pin)") from e
    devices = list(desc.devices)
    if count is not None:
        devices = devices[:count]
    from jax.experimental.pallas import tpu as pltpu

    with jax.set_mesh(jax.sharding.Mesh(np.array(devices[:1]), ("x",))):
        info = pltpu.get_tpu_info()
    # get_tpu_info is per TensorCore; a v5p (or v4) device is a megacore of two, with both cores' HBM and bandwidth
    cores = info.num_cores
    return Target("tpu", name, devices, Chip(devices[0].device_kind, info.hbm_capacity_bytes * cores,
                                             info.mem_bw_bytes_per_second * cores))


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


def compile_target(name: str) -> Target:
    """"v6e:2x4" / "v5e:2x2" / "v5p:2x2x1" (a TPU slice), "v6e:1" / "v5e-8" (that many chips), or
    "h100" / "h200" (one NVIDIA GPU)."""
    text = name.strip().lower()
    if text in _GPU_CONFIGS:
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
    return _tpu_target(generation, shape, count, name)

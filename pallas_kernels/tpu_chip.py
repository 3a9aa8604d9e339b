"""What a Pallas TPU kernel asks of the chip it is compiled for: VMEM and MXU width to plan blocks with.

Under a TPU mesh (a real TPU, or a described topology when compiling ahead of time, see
`jaxinfer.aot`), `pltpu.get_tpu_info()` describes the target chip. Anywhere else (interpret mode
on the CPU) there is no chip to ask, and kernels plan for the smallest scoped VMEM of the
supported generations.
"""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

FALLBACK_VMEM_LIMIT_BYTES = 16 * 1024 * 1024  # v5e's default scoped VMEM
MAX_VMEM_LIMIT_BYTES = 64 * 1024 * 1024


def target_tpu_info():
    """The target chip's pltpu.TpuInfo, or None when JAX is not compiling for a TPU."""
    try:
        return pltpu.get_tpu_info()
    except Exception:  # no TPU in sight: "Unsupported TPU device kind: cpu"
        return None


def vmem_limit_bytes() -> int:
    """Scoped VMEM a kernel may plan for: half the chip's VMEM (64 MiB on v5e / v6e, 32 MiB on
    v5p), capped at 64 MiB; 16 MiB when there is no chip to ask."""
    info = target_tpu_info()
    if info is None:
        return FALLBACK_VMEM_LIMIT_BYTES
    return min(info.vmem_capacity_bytes // 2, MAX_VMEM_LIMIT_BYTES)


FALLBACK_SMEM_BYTES = 1024 * 1024  # v5e's, v6e's and v5p's scalar memory


def smem_capacity_bytes() -> int:
    """The target chip's scalar memory (SMEM), where a kernel's prefetched scalars live; 1 MiB
    when there is no chip to ask."""
    info = target_tpu_info()
    return FALLBACK_SMEM_BYTES if info is None or not info.smem_capacity_bytes else info.smem_capacity_bytes


def compiler_params(*dimension_semantics: str) -> pltpu.CompilerParams:
    """Mosaic compiler parameters with the target chip's VMEM limit (`vmem_limit_bytes`)."""
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics, vmem_limit_bytes=vmem_limit_bytes())


def mxu_columns() -> int:
    """Width of the target chip's matrix unit (128 on v5e / v5p, 256 on v6e); 128 with no chip."""
    info = target_tpu_info()
    return info.mxu_column_size if info is not None else 128

"""Which implementation of the hot operations a model runs: the XLA (plain jnp) path or a Pallas kernel.

    LLM(..., attention_impl="auto" | "reference" | "pallas" | "pallas-tpu" | "pallas-gpu")

- "reference": the plain-jnp paths (split-KV ragged attention, dequantize-then-dot quantized
  matmul), compiled by XLA; what the CPU runs by default.
- "pallas": the Pallas kernels of the current platform: Mosaic TPU kernels on a TPU, Triton GPU
  kernels on a GPU. On the CPU, where neither compiles, it runs the TPU kernels in interpret mode
  (slow: for tests and checks, not for serving).
- "pallas-tpu" / "pallas-gpu": that platform's kernels, in interpret mode unless on that platform,
  so the GPU kernels can be checked on a CPU too.
- "auto": "pallas" on TPU and GPU, "reference" on the CPU.

The choice covers ragged paged attention, flash attention (prefill-only steps) and the quantized
matmul. It is static: part of the model's structure, so one compiled step per choice.
"""

from __future__ import annotations

import dataclasses

import jax

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas-tpu", "pallas-gpu")


@dataclasses.dataclass(frozen=True)
class Kernels:
    platform: str = "reference"  # "reference" | "tpu" | "gpu": whose kernels run
    interpret: bool = False  # run the Pallas kernels in interpret mode (on a platform that cannot compile them)

    @property
    def pallas(self) -> bool:
        return self.platform != "reference"


def resolve_kernels(attention_impl: str, backend: str | None = None) -> Kernels:
    """attention_impl (see the module docstring) on `backend` (default: JAX's default backend) -> Kernels."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r}: expected one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    backend = backend or jax.default_backend()
    if backend in ("cuda", "rocm"):
        backend = "gpu"
    if attention_impl == "auto":
        attention_impl = "reference" if backend == "cpu" else "pallas"
    if attention_impl == "reference":
        return Kernels()
    if attention_impl == "pallas":
        platform = backend if backend in ("tpu", "gpu") else "tpu"
    else:
        platform = attention_impl.removeprefix("pallas-")
    return Kernels(platform=platform, interpret=platform != backend)

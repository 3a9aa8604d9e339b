"""Residual add + RMSNorm in one pass (vLLM's fused_add_rms_norm).

`add_rms_norm(x [T,H], residual [T,H] | None, weight [H], *, eps) -> (normed [T,H], new_residual [T,H])`:
new_residual = x + residual (x when residual is None) and normed = rms_norm(new_residual), computed
in float32 as `jaxinfer.models.layers.rms_norm` does; both outputs in x's dtype. See `reference.py`.

- `add_rms_norm_reference`: plain jnp, the truth the kernels match.
- `add_rms_norm_tpu`: Pallas Mosaic TPU kernel (tuning: block_rows, interpret).
- `add_rms_norm_gpu`: Pallas Triton GPU kernel (tuning: block_rows, num_warps, interpret); verified
  in interpret mode only.

The model picks one of them through its kernel table, `jaxinfer.ops.kernels`.
"""

from __future__ import annotations

from pallas_kernels.fused_rms_norm.gpu import add_rms_norm as add_rms_norm_gpu
from pallas_kernels.fused_rms_norm.reference import add_rms_norm as add_rms_norm_reference
from pallas_kernels.fused_rms_norm.tpu import add_rms_norm as add_rms_norm_tpu

__all__ = ["add_rms_norm_gpu", "add_rms_norm_reference", "add_rms_norm_tpu"]

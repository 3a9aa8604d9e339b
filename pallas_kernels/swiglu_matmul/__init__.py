"""Gated-MLP input projection with the SwiGLU activation fused in (the first half of a Llama MLP).

`swiglu_matmul(x [M, K], w_gate_up [K, 2N]) -> [M, N]`: with g = x @ w_gate_up[:, :N] and
u = x @ w_gate_up[:, N:] (f32 accumulation, x cast to the weight's dtype as
`jaxinfer.models.layers.matmul` does), the result is silu(g) * u computed in float32 and returned
in x's dtype. See `reference.py`.

- `swiglu_matmul_reference`: plain jnp, the truth the kernels match.
- `swiglu_matmul_tpu`: Pallas Mosaic TPU kernel (tuning: block_m, block_n, block_k, interpret);
  needs N to be a multiple of 128 and raises ValueError otherwise (use the unfused path then).
- `swiglu_matmul_gpu`: Pallas Triton GPU kernel (tuning: block_m, block_n, block_k, num_warps,
  num_stages, interpret); any shape.
Both kernels are verified in interpret mode on the CPU only.

The model picks one of them through its kernel table, `jaxinfer.ops.kernels`.
"""

from __future__ import annotations

from pallas_kernels.swiglu_matmul.gpu import swiglu_matmul as swiglu_matmul_gpu
from pallas_kernels.swiglu_matmul.reference import check_inputs
from pallas_kernels.swiglu_matmul.reference import swiglu_matmul as swiglu_matmul_reference
from pallas_kernels.swiglu_matmul.tpu import swiglu_matmul as swiglu_matmul_tpu

__all__ = ["check_inputs", "swiglu_matmul_gpu", "swiglu_matmul_reference", "swiglu_matmul_tpu"]

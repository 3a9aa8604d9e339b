"""Matmul of rows against a stack of quantized matrices, each row against its own (a mixture of
experts' layer, GPT-OSS's MXFP4 experts kept 4-bit), dequantized inside the call.

- `reference.py`: plain jnp (dequantize the stack, `jax.lax.ragged_dot`): the truth;
- `tpu.py`: Pallas Mosaic TPU kernel; `gpu.py`: Pallas Triton GPU kernel. Both lay the rows out in
  blocks of one matrix each (`pallas_kernels.row_groups`) and run `quantized_matmul`'s bodies on
  the block's matrix. The model picks one through `jaxinfer.ops.kernels`.
"""
from pallas_kernels.grouped_matmul.reference import check_grouped_inputs, grouped_quantized_matmul

__all__ = ["check_grouped_inputs", "grouped_quantized_matmul"]

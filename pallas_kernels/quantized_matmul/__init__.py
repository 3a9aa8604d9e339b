"""Matmul against quantized weights (int8, packed int4, fp8; per column or per group, symmetric or
with offsets), dequantized inside the call.

- `reference.py`: plain jnp, the truth, and the storage layout of each mode;
- `tpu.py`: Pallas Mosaic TPU kernel; `gpu.py`: Pallas Triton GPU kernel (both verified in
  interpret mode on the CPU). The model picks one through `jaxinfer.ops.kernels`.
"""
from pallas_kernels.quantized_matmul.reference import (
    GROUP_SIZES,
    INT4_GROUP_SIZES,
    SCALE_DTYPES,
    MODES,
    check_layout,
    check_matmul_inputs,
    check_mode,
    dequantize,
    quantized_matmul,
    stored_rows,
    unpack_int4,
)

__all__ = ["GROUP_SIZES", "INT4_GROUP_SIZES", "SCALE_DTYPES", "stored_rows", "MODES", "check_layout", "check_matmul_inputs", "check_mode", "dequantize", "quantized_matmul", "unpack_int4"]

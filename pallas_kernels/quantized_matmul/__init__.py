"""Matmul against quantized weights (int8, packed int4, fp8), dequantized inside the call.

Only the plain-jnp reference exists so far; the fused Pallas kernels come with the kernels issue
and are checked against it.
"""
from pallas_kernels.quantized_matmul.reference import (
    INT4_GROUP_SIZES,
    MODES,
    check_mode,
    dequantize,
    quantized_matmul,
    unpack_int4,
)

__all__ = ["INT4_GROUP_SIZES", "MODES", "check_mode", "dequantize", "quantized_matmul", "unpack_int4"]

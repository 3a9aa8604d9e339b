"""Matmul against 2:4 semi-structured sparse weights read in their compressed form (the kept
values and a bitmask of where they sit: about 56 % of a bfloat16 weight's bytes), expanded tile by
tile inside the kernel.

- `reference.py`: plain jnp, the truth; the storage layout, the converters from a dense 2:4
  weight (`from_dense_24`) and from / to compressed-tensors' "sparse-24-bitmask" tensors;
- `tpu.py`: Pallas Mosaic TPU kernel; `gpu.py`: Pallas Triton GPU kernel (both verified in
  interpret mode on the CPU, compiled by the real compilers with no chip). The model picks one
  through `jaxinfer.ops.kernels`.
"""
from pallas_kernels.sparse24_matmul.reference import (
    ROWS_PER_BYTE,
    check_layout,
    check_matmul_inputs,
    densify,
    from_compressed_tensors,
    from_dense_24,
    kept_bits,
    sparse24_matmul,
    to_compressed_tensors,
    violating_groups,
    x_planes,
)

__all__ = ["ROWS_PER_BYTE", "check_layout", "check_matmul_inputs", "densify", "from_compressed_tensors", "from_dense_24",
           "kept_bits", "sparse24_matmul", "to_compressed_tensors", "violating_groups", "x_planes"]

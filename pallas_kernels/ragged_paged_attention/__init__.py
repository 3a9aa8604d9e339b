"""Ragged paged attention: mixed prefill chunks and decodes, read through the page table.

- `reference.py`: plain jnp, written for reading: the truth every version is held to;
- `split_kv.py`: the same function as a work list of (query block, KV block) items, the XLA path
  the model runs on the CPU;
- `tpu.py`: Pallas Mosaic TPU kernel (scalar prefetch, double-buffered page DMAs);
- `gpu.py`: Pallas Triton GPU kernel (split-KV with a merge of the partial results).

All four take the same arguments; the model picks one through `jaxinfer.ops.kernels`.
"""
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]

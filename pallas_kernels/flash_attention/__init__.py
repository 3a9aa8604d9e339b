"""Flash attention for long prefill over variable-length segments packed in one array.

`flash_attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], cu_seq_lens [S+1], num_seqs [1], *, sm_scale,
causal=True, sliding_window=None, soft_cap=None, ...) -> [T, Hq, D]`: each segment attends within
itself only, every segment starting at position 0 (no cached prefix). See `reference.py` for the
exact semantics.

- `flash_attention_reference`: plain jnp (dense, O(T^2) memory), the truth the kernels match.
- `flash_attention_tpu`: Pallas Mosaic TPU kernel (tuning: block_q, block_k, interpret).
- `flash_attention_gpu`: Pallas Triton GPU kernel (tuning: block_q, block_k, num_warps, num_stages,
  interpret); verified in interpret mode only.

The model picks one of them through its kernel table, `jaxinfer.ops.kernels`.
"""

from __future__ import annotations

from pallas_kernels.flash_attention.gpu import flash_attention as flash_attention_gpu
from pallas_kernels.flash_attention.reference import flash_attention as flash_attention_reference
from pallas_kernels.flash_attention.tpu import flash_attention as flash_attention_tpu

__all__ = ["flash_attention_gpu", "flash_attention_reference", "flash_attention_tpu"]

"""Flash attention for long prefill over variable-length segments packed in one array.

`flash_attention(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], cu_seq_lens [S+1], num_seqs [1], *, sm_scale,
causal=True, sliding_window=None, soft_cap=None, ...) -> [T, Hq, D]`: each segment attends within
itself only, every segment starting at position 0 (no cached prefix). See `reference.py` for the
exact semantics.

- `flash_attention_reference`: plain jnp (dense, O(T^2) memory), the truth the kernels match.
- `flash_attention_tpu`: Pallas Mosaic TPU kernel (tuning: block_q, block_k, interpret).
- `flash_attention_gpu`: Pallas Triton GPU kernel (tuning: block_q, block_k, num_warps, num_stages,
  interpret); verified in interpret mode only.
- `flash_attention`: picks one of them for the default backend (CPU -> reference).
"""

from __future__ import annotations

import jax

from pallas_kernels.flash_attention.gpu import flash_attention as flash_attention_gpu
from pallas_kernels.flash_attention.reference import flash_attention as flash_attention_reference
from pallas_kernels.flash_attention.tpu import flash_attention as flash_attention_tpu


def flash_attention(q, k, v, cu_seq_lens, num_seqs, *, sm_scale, causal=True, sliding_window=None, soft_cap=None,
                    backend: str | None = None, **tuning):
    """Dispatch on `backend` (default: jax.default_backend()): "tpu" and "gpu" run their kernel with
    the `tuning` keywords; anything else runs the reference, which takes no tuning keywords."""
    backend = backend or jax.default_backend()
    options = dict(sm_scale=sm_scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "tpu":
        return flash_attention_tpu(q, k, v, cu_seq_lens, num_seqs, **options, **tuning)
    if backend in ("gpu", "cuda", "rocm"):
        return flash_attention_gpu(q, k, v, cu_seq_lens, num_seqs, **options, **tuning)
    if tuning:
        raise TypeError(f"the reference takes no tuning keywords: {sorted(tuning)}")
    return flash_attention_reference(q, k, v, cu_seq_lens, num_seqs, **options)


__all__ = ["flash_attention", "flash_attention_gpu", "flash_attention_reference", "flash_attention_tpu"]

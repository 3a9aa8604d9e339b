"""RoPE on q and k plus the KV-cache write, in one pass (what vLLM's rotary embedding and
reshape_and_cache do as two kernels).

`rope_kv_write(q, k, v, cos, sin, k_pages, v_pages, write_page, write_offset)
 -> (q_rot, k_rot, k_pages, v_pages)`: see `reference.py` for shapes and semantics.

- `rope_kv_write_reference`: plain jnp (rotate, then an XLA scatter), the truth the kernels match.
- No TPU kernel: a TPU's pool is combined (one row of K and V per token,
  pallas_kernels.ragged_paged_attention.combined) and stores a token-major page with its tokens
  packed two (bf16) or four (int8) to a 32-bit word, so one token's row cannot be DMA'd alone
  (measured: Mosaic refuses the offset). The step rotates in XLA and writes the rows in place
  (jaxinfer.ops.attention.write_rows; tests/test_kv_layout.py).
- `rope_kv_write_gpu`: Pallas Triton GPU kernel; one program per few tokens (tuning:
  block_tokens, num_warps, interpret); needs head_dim / 2 to be a power of two (`gpu_supports`).

The model picks one of them through its kernel table, `jaxinfer.ops.kernels`.
"""

from __future__ import annotations

from pallas_kernels.rope_kv_write.gpu import rope_kv_write as rope_kv_write_gpu
from pallas_kernels.rope_kv_write.gpu import supports as gpu_supports
from pallas_kernels.rope_kv_write.reference import apply_rope
from pallas_kernels.rope_kv_write.reference import rope_kv_write as rope_kv_write_reference

__all__ = [
    "apply_rope",
    "gpu_supports",
    "rope_kv_write_gpu",
    "rope_kv_write_reference",
]

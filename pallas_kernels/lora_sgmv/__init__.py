"""The LoRA delta of a batch mixing adapters (multi-LoRA serving), after punica's SGMV.

`lora_delta(x [T, K], a [N, K, P R], bs (P arrays [N, R, O_p]), slot [T]) -> float32 [T, sum O_p]`:
token t adds (x[t] @ A_p[slot[t]]) @ B_p[slot[t]] to module p's columns; slot 0 adds nothing.
See `reference.py`.

- `lora_delta_reference`: per-token gather, plain jnp: the truth.
- `lora_delta_xla`: what the CPU runs: a per-token gather below N - 1 tokens, else every slot
  at once, masked to each token's own (`xla.py` says what else was measured).
- `lora_delta_tpu`: grouped shrink / expand Pallas Mosaic TPU kernels (tokens in blocks of one slot).
- `lora_delta_gpu`: the same as Pallas Triton GPU kernels.
Both kernels are verified in interpret mode on the CPU and compiled ahead of time for their chips.

The model picks one of them through its kernel table, `jaxinfer.ops.kernels`.
"""

from __future__ import annotations

from pallas_kernels.lora_sgmv.gpu import lora_delta as lora_delta_gpu
from pallas_kernels.lora_sgmv.reference import lora_delta as lora_delta_reference
from pallas_kernels.lora_sgmv.tpu import lora_delta as lora_delta_tpu
from pallas_kernels.lora_sgmv.xla import lora_delta as lora_delta_xla

__all__ = ["lora_delta_gpu", "lora_delta_reference", "lora_delta_tpu", "lora_delta_xla"]

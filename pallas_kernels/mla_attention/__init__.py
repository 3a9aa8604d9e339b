"""Ragged paged multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), run absorbed.

Every query head attends over ONE row per cached token, the layer's latent row
[c (value_dim r) | k_rope (the rest)], which serves as the keys of all heads and, its first r
entries, as their values (jaxinfer.models.deepseek derives this). So the cache holds one row per
token and layer, and a kernel reads each row once for all heads. The layout (int arrays int32):

    q             [T, Hq, D]            queries in the row's order: [q_latent (r) | q_rope]
    latent_pages  [P, page_size, W]     one row per token, W >= D (a TPU pads it to 128 lanes)
    kv_lens, page_indices, cu_q_lens, num_seqs: as `ragged_paged_attention`
    ->            [T, Hq, r]            sum_s p(t, s) c(s) per head

- `reference.py`: the jnp truth: ragged paged attention with the rows as both K and V;
- `tpu.py`: the Mosaic ragged paged attention kernel in its latent mode (`value_dim`): one DMA per
  page of rows, values the row's first r lanes;
- `gpu.py`: a Triton split-KV kernel whose programs take a block of heads (all 128 of DeepSeek-V3
  do not fit one program) and read the row as its latent and rope parts, each a power of two.
"""
from pallas_kernels.mla_attention.reference import mla_attention

__all__ = ["mla_attention"]

"""MLA attention on a TPU: the Mosaic ragged paged attention kernel reading latent pages
(`pallas_kernels.ragged_paged_attention.tpu`, its `value_dim` mode): Hkv = 1, G = Hq query rows per
query of a block, each page one DMA of rows W lanes wide (the head padded to whole 128-lane rows,
zero past D), K the row, V its first value_dim lanes (a multiple of 128: DeepSeek's 512).

All Hq heads of a query are rows of one program, so a prefill's query block of Bq queries is
Bq x Hq rows (64 x 128 at DeepSeek-V3 on one chip: ~78 MiB of VMEM); the block shrinks by halves
until the working set fits the chip's limit (a tuning: any block size gives the same result)."""

from __future__ import annotations

from pallas_kernels.ragged_paged_attention import tpu
from pallas_kernels.tpu_chip import vmem_limit_bytes as chip_vmem_limit_bytes


def mla_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, value_dim: int, sm_scale: float = 1.0,
                  num_queries_per_block: int = 8, num_kv_pages_per_block: int | None = None, vmem_limit_bytes=None,
                  interpret=False):
    """[T, Hq, value_dim] (the package docstring)."""
    Hq, width = q.shape[1], latent_pages.shape[-1]
    kv_tokens = min(num_kv_pages_per_block or max(1, tpu.DEFAULT_KV_TOKENS_PER_BLOCK // latent_pages.shape[1]),
                    page_indices.shape[1]) * latent_pages.shape[1]
    limit = vmem_limit_bytes or chip_vmem_limit_bytes()
    need = lambda Bq: tpu.vmem_working_set_bytes(rows=Bq * Hq, num_kv_heads=1, row_width=width, lanes=width,  # noqa: E731
                                                 kv_tokens=kv_tokens, q_itemsize=q.dtype.itemsize,
                                                 kv_itemsize=latent_pages.dtype.itemsize)
    while num_queries_per_block > 1 and need(num_queries_per_block) > limit:
        num_queries_per_block //= 2
    return tpu.ragged_paged_attention(q, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                      num_queries_per_block=num_queries_per_block,
                                      num_kv_pages_per_block=num_kv_pages_per_block, vmem_limit_bytes=vmem_limit_bytes,
                                      value_dim=value_dim, interpret=interpret)


def padded_row(head_dim: int) -> int:
    """Lanes of a latent row on a TPU: head_dim rounded up to whole 128-lane rows (576 -> 640)."""
    return -(-head_dim // 128) * 128

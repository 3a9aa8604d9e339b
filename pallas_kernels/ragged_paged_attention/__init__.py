"""Ragged paged attention: mixed prefill chunks and decodes, read through the page table.

Only the plain-jnp reference exists so far; the Pallas TPU/GPU kernels come with the kernels issue.
"""
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]

"""The masked tile load the Triton (GPU) kernels share: they take whole arrays (no BlockSpec) and
read every tile through a mask, so no dimension has to divide its tile and nothing is padded.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def masked_tile(ref, rows, cols, row_start, col_start, n_rows: int, n_cols: int, *, lead=None):
    """[n_rows, n_cols] tile of a 2-D ref from (row_start, col_start), 0 at rows >= `rows` or
    columns >= `cols`; of ref[lead] for a 3-D ref (one indexer: the Triton lowering takes no
    `.at[...]` chains)."""
    row_ids = row_start + jnp.arange(n_rows)
    col_ids = col_start + jnp.arange(n_cols)
    mask = (row_ids < rows)[:, None] & (col_ids < cols)[None, :]
    index = (pl.ds(row_start, n_rows), pl.ds(col_start, n_cols))
    return plt.load(ref.at[index if lead is None else (lead, *index)], mask=mask, other=jnp.zeros((), ref.dtype))

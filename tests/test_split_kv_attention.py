"""The work-list (split-KV) attention: partials of one query block merged across loop steps."""

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import split_kv
from test_ragged_attention_reference import check, make_case


@pytest.mark.parametrize("items_per_step", [1, 3])
def test_work_items_spread_over_many_loop_steps(items_per_step):
    rng = np.random.default_rng(5)
    case = make_case(rng, [9, 1, 1, 4], [40, 23, 1, 13], Hq=4, Hkv=2, D=32, page_size=4, pad_seqs=2, pad_tokens=3)
    attn = split_kv.ragged_paged_attention
    check(attn, case, num_queries_per_block=4, num_kv_pages_per_block=2, items_per_step=items_per_step)
    check(attn, case, sliding_window=6, num_queries_per_block=1, num_kv_pages_per_block=1, items_per_step=items_per_step)

"""The GPU MLA kernel's tunings timed on the hardware: DeepSeek-V3 decode (128 heads, latent 512 +
rope 64, bf16) over 64 sequences of 4096 tokens, each setting checked against the reference first.

    python scripts/mla_gpu_sweep.py            # on a GPU machine; prints a table, best first
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from gpu_check import _mla_case, _relative_error, _time  # noqa: E402

from pallas_kernels.mla_attention import gpu as mla_gpu  # noqa: E402
from pallas_kernels.mla_attention import reference as mla_ref  # noqa: E402


def main() -> int:
    interpret = jax.devices()[0].platform != "gpu"
    seqs, context = (2, 64) if interpret else (64, 4096)
    args, kw, nbytes = _mla_case(np.random.default_rng(0), seqs=seqs, context=context, q_len=1, Hq=128)
    want = mla_ref.mla_attention(*args, **kw)
    rows = []
    grid = itertools.product((64, 128), (1, 2), (2, 4, 8), (8, 16), (2,))  # rows, pages, splits, warps, stages
    for max_rows, pages, splits, warps, stages in grid:
        fn = jax.jit(functools.partial(mla_gpu.mla_attention, num_queries_per_block=1, max_rows=max_rows,
                                       num_kv_pages_per_block=pages, num_kv_splits=splits, num_warps=warps,
                                       num_stages=stages, interpret=interpret, **kw))
        setting = f"rows={max_rows} tile={pages * 16} splits={splits} warps={warps} stages={stages}"
        try:
            error = _relative_error(fn(*args), want)
            ms = _time(fn, *args, iters=10) * 1e3
        except Exception as e:  # noqa: BLE001  (a refused compile is a result)
            print(f"| {setting} | refused: {str(e).splitlines()[0][:120]} |", flush=True)
            continue
        rows.append((ms, setting, error))
        print(f"| {setting} | {ms:.3f} ms | {nbytes / ms / 1e6:.0f} GB/s | error {error:.1e} |", flush=True)
    print("\nbest first:")
    for ms, setting, error in sorted(rows)[:8]:
        print(f"| {setting} | {ms:.3f} ms | {nbytes / ms / 1e6:.0f} GB/s | error {error:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Random access to a checkpoint's tensors by HF name: what the loader reads from.

    source.listing()           -> [(hf_name, shape)], the tensor directory (no data read)
    source.read(name, index)   -> np.ndarray, rows/columns `index` (a tuple of slices) of one
                                  tensor in HF layout, in its stored dtype (GGUF: float32)
    source.quantized()         -> {hf_name: QuantLayout} of the tensors stored quantized
    source.read_grid(name)     -> one of them as a Grid of integers and scales (checkpoints_conv.quantized)
    source.input_order(name)   -> the order its grid holds the input rows in (act-order), or None
    source.close()

Readers: `hf.SafetensorsSource` (slices straight from the memory-mapped files),
`gguf_io.GgufSource` (dequantizes a whole tensor, keeps the last few), and `ArraySource` below
(tensors already in memory: tests, small conversions).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np


class TensorSource:
    """Base class of the readers; see the module docstring."""

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        raise NotImplementedError

    def quantized(self) -> dict:
        """HF name -> QuantLayout of each tensor this checkpoint stores quantized (none by default)."""
        return {}

    def read_grid(self, name: str):
        """A tensor of `quantized()` as a checkpoints_conv.quantized.Grid."""
        raise KeyError(f"tensor {name!r} is not stored quantized")

    def input_order(self, name: str):
        """For a tensor of `quantized()` whose grid holds its input rows reordered (GPTQ's
        act-order): that order (int32 [K]: grid row i is input row order[i]); None otherwise."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ArraySource(TensorSource):
    """Tensors given as a dict or as (hf_name, array) pairs. Pairs may repeat a name; the
    listing keeps every entry, so the loader can report the repeat (reads take the last)."""

    def __init__(self, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]):
        pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        self._listing = [(name, tuple(np.shape(array))) for name, array in pairs]
        self._arrays = dict(pairs)

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._listing)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        array = np.asarray(self._arrays[name])
        return array if index is None else array[index]

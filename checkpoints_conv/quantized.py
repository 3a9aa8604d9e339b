"""Checkpoints whose matrices are stored quantized (GGUF blocks, AWQ, GPTQ, compressed-tensors):
read as integers and per-group numbers, never as a float matrix.

A reader that knows its tensors are quantized says so (`TensorSource.quantized()`: HF name ->
`QuantLayout`) and hands out each one as a `Grid` (`TensorSource.read_grid(name)`): the integers
v [rows, cols] (rows = output features, the tensor's HF orientation), and per group of
`group_size` consecutive columns a scale and maybe an offset, so that the weight is
v * scale + offset, the layout jaxinfer's quantized matmul runs
(`pallas_kernels.quantized_matmul.reference`).

The loader fuses and stacks tensors into one parameter (q, k and v of every layer into
`layers.qkv_proj`), so they must share a layout: `param_layouts` joins the layouts of a
parameter's tensors into the narrowest one each widens to without loss (`Grid.widen`: more bits,
smaller groups, an offset, float32 scales). `QuantizedSource` then presents every quantized
tensor to the loader as three plain arrays in the HF orientation, named
`<hf name>:qweight` ([rows, cols / 2] uint8, two nibbles per byte, or [rows, cols] int8),
`<hf name>:scales` and `<hf name>:offsets` ([rows, cols / group_size]), which the loader fuses,
stacks, shards and transposes like any weight into `<param>:qweight`, `<param>:scales` and
`<param>:offsets` ([..., K / 2 or K, N] and [..., K / g, N]).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import ml_dtypes
import numpy as np

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.tensor_source import TensorSource

FIELDS = ("qweight", "scales", "offsets")
# The 16 values of an E2M1 (FP4) nibble.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# The group sizes jaxinfer's quantized matmul runs, per bit width (pallas_kernels.quantized_matmul.reference.GROUP_SIZES).
RUNNABLE_GROUP_SIZES = {4: (128, 64, 32), 8: (128, 64, 32, 16)}


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """How a quantized matrix is stored: `bits` 4 (int4) or 8 (int8) per value, groups of
    `group_size` input columns, an offset per group or not, scales (and offsets) in
    `scale_dtype` (float16 or float32; bfloat16 for jaxinfer's own quantizer). `fp4`: the 4-bit
    values are E2M1 floats and the scales E8M0 exponent bytes (MXFP4, groups of 32, scale_dtype
    uint8: GPT-OSS's experts); `fp8`: the 8-bit values are e4m3 floats (float32 scales per group
    of 128: DeepSeek-V3's block-scaled weights). Float layouts widen to or from no other.
    `activations="int8"`: a W8A8 matrix (compressed-tensors' int-quantized, input activations
    int8 per token, dynamic), which the int8 x int8 matmul runs: symmetric int8, one scale per
    output row (group_size = cols, kept so: `runnable` does not split it into groups), joined only
    with its like."""

    bits: int
    group_size: int
    has_offsets: bool
    scale_dtype: np.dtype
    fp4: bool = False
    fp8: bool = False
    activations: str | None = None

    @property
    def mode(self) -> str:
        """The mode of jaxinfer's QuantizedWeight: "int4", "int8", "mxfp4" or "fp8"."""
        return "mxfp4" if self.fp4 else "fp8" if self.fp8 else "int4" if self.bits == 4 else "int8"

    @property
    def floats(self) -> bool:
        """Whether the values are floats (mxfp4, fp8): no integer layout widens to or from these."""
        return self.fp4 or self.fp8

    def join(self, other: "QuantLayout") -> "QuantLayout":
        """The narrowest layout both widen to without loss."""
        if self.floats or other.floats:
            if self != other:
                raise CheckpointError(f"tensors stored as {self.mode} and {other.mode} fill one parameter: no layout holds both")
            return self
        same = np.dtype(self.scale_dtype) == np.dtype(other.scale_dtype)
        dtype = np.dtype(self.scale_dtype) if same else np.dtype(np.float32)
        if self.activations or other.activations:
            if dataclasses.replace(self, scale_dtype=dtype) != dataclasses.replace(other, scale_dtype=dtype):
                raise CheckpointError(f"tensors stored with {self.activations or 'float'} and {other.activations or 'float'} "
                                      f"activations (or different inputs) fill one parameter: no layout holds both")
            return dataclasses.replace(self, scale_dtype=dtype)
        return QuantLayout(max(self.bits, other.bits), min(self.group_size, other.group_size),
                           self.has_offsets or other.has_offsets, dtype)

    def runnable(self, cols: int) -> "QuantLayout":
        """This layout with its groups split into the largest size the kernels run (a grid with
        one group per row of `cols` columns, or groups of 256, widens to 128); CheckpointError
        when no such size divides the group (`cols`: the matrix's, for the message)."""
        if self.floats or self.activations:
            return self  # mxfp4's groups of 32, fp8's of 128, W8A8's rows: as the kernels run them
        for size in RUNNABLE_GROUP_SIZES[self.bits]:
            if self.group_size % size == 0:
                return dataclasses.replace(self, group_size=size)
        raise CheckpointError(f"groups of {self.group_size} (of {cols} columns) split into none of the sizes "
                              f"{RUNNABLE_GROUP_SIZES[self.bits]} that {self.bits}-bit weights run with")

    def field_shapes(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, int], np.dtype]]:
        """The stored arrays of a [rows, cols] matrix: field -> (HF-oriented shape, dtype). When the
        group size does not divide cols, the last group is partial and the stored integers are
        padded with zero columns to whole groups (the model reads zero inputs there)."""
        num_groups = -(-cols // self.group_size)
        padded = num_groups * self.group_size
        groups = (rows, num_groups)
        values = np.dtype(ml_dtypes.float8_e4m3fn) if self.fp8 else np.dtype(np.int8)
        shapes = {"qweight": ((rows, padded // 2), np.dtype(np.uint8)) if self.bits == 4 else ((rows, padded), values),
                  "scales": (groups, np.dtype(self.scale_dtype))}
        if self.has_offsets:
            shapes["offsets"] = (groups, np.dtype(self.scale_dtype))
        return shapes


@dataclasses.dataclass
class Grid:
    """One matrix: values int8 [rows, cols], scales [rows, cols / g], offsets [rows, cols / g] or
    None, in `layout` (int4 values: in [-8, 7] without offsets, in [0, 15] with them, as
    pallas_kernels.quantized_matmul.reference reads nibbles; mxfp4: the E2M1 codes 0..15 and
    the exponent bytes; fp8: the e4m3 values as float8_e4m3fn)."""

    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    layout: QuantLayout

    def per_column(self, a: np.ndarray) -> np.ndarray:
        """Per-group numbers [rows, G] -> [rows, cols] (each column's group's)."""
        return np.repeat(a, self.layout.group_size, axis=-1)[:, : self.values.shape[1]]

    def widen(self, layout: QuantLayout) -> "Grid":
        """The same numbers in `layout` (at least as wide in every respect as this one's)."""
        if layout == self.layout:
            return self
        if layout.floats or self.layout.floats:
            raise ValueError(f"cannot widen {self.layout} to {layout}")
        if layout.bits < self.layout.bits or self.layout.group_size % layout.group_size or (
                self.layout.has_offsets and not layout.has_offsets):
            raise ValueError(f"cannot narrow {self.layout} to {layout}")
        values, scales = self.values, self.scales.astype(np.float32)
        offsets = None if self.offsets is None else self.offsets.astype(np.float32)
        if layout.has_offsets and offsets is None:
            offsets = np.zeros_like(scales)
            if layout.bits == 4:  # int4 with offsets reads the nibble unshifted: v + 8, offset -8 scale
                values, offsets = values + np.int8(8), -8 * scales
        repeat = self.layout.group_size // layout.group_size  # each group split into `repeat` smaller ones
        num_groups = -(-values.shape[1] // layout.group_size)  # (a partial last group may need fewer)
        scales = np.repeat(scales, repeat, axis=-1)[:, :num_groups]
        offsets = None if offsets is None else np.repeat(offsets, repeat, axis=-1)[:, :num_groups]
        return Grid(values, scales.astype(layout.scale_dtype), None if offsets is None else offsets.astype(layout.scale_dtype),
                    layout)

    def stored(self) -> dict[str, np.ndarray]:
        """field -> array as `QuantLayout.field_shapes` describes (int4: nibbles packed in pairs of
        columns; a partial last group padded with zeros)."""
        rows, cols = self.values.shape
        if self.layout.fp8:  # e4m3 values as they are, zero columns up to whole groups
            qweight = np.zeros((rows, self.scales.shape[1] * self.layout.group_size), self.values.dtype)
            qweight[:, :cols] = self.values
            return {"qweight": qweight, "scales": self.scales}
        values = np.zeros((rows, self.scales.shape[1] * self.layout.group_size), np.int16)
        values[:, :cols] = self.values
        if self.layout.bits == 4:
            u = (values + (0 if self.layout.has_offsets or self.layout.fp4 else 8)).astype(np.uint8)  # (E2M1 codes as they are)
            qweight = u[:, 0::2] | (u[:, 1::2] << 4)  # column 2i in the low nibble, 2i + 1 in the high
        else:
            qweight = values.astype(np.int8)
        out = {"qweight": qweight, "scales": self.scales}
        if self.offsets is not None:
            out["offsets"] = self.offsets
        return out

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: for tests and for a float load."""
        if self.layout.fp4:
            return np.ldexp(FP4_VALUES[self.values], self.per_column(self.scales).astype(np.int32) - 127)
        w = self.values.astype(np.float32) * self.per_column(self.scales.astype(np.float32))
        if self.offsets is not None:
            w = w + self.per_column(self.offsets.astype(np.float32))
        return w


def param_layouts(layouts: Mapping[str, QuantLayout], param_of: Mapping[str, str]) -> dict[str, QuantLayout]:
    """param -> the join of the layouts of the quantized tensors that fill it. `param_of` maps
    each HF name to its param; a param some of whose tensors are not quantized is left out (it
    loads as floats)."""
    joined: dict[str, QuantLayout] = {}
    float_params = {param for name, param in param_of.items() if name not in layouts}
    for name, layout in layouts.items():
        param = param_of.get(name)
        if param is None or param in float_params:
            continue
        joined[param] = joined[param].join(layout) if param in joined else layout
    return joined


class QuantizedSource(TensorSource):
    """`source` with each tensor of `layouts` (HF name -> the layout its param stores) listed as
    its three stored arrays `<name>:<field>` instead of a float matrix; every other tensor as it is."""

    def __init__(self, source: TensorSource, layouts: Mapping[str, QuantLayout]):
        self.source = source
        self.layouts = dict(layouts)
        self._grid: tuple[str, dict[str, np.ndarray]] | None = None  # the last tensor read, all fields

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        out = []
        for name, shape in self.source.listing():
            layout = self.layouts.get(name)
            if layout is None:
                out.append((name, shape))
                continue
            if len(shape) != 2:
                raise CheckpointError(f"quantized tensor {name!r} of shape {shape}: expected [rows, cols]")
            out += [(f"{name}:{field}", s) for field, (s, _) in layout.field_shapes(*shape).items()]
        return out

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        base, sep, field = name.rpartition(":")
        if not sep or base not in self.layouts:
            return self.source.read(name, index)
        if self._grid is None or self._grid[0] != base:
            self._grid = (base, self.source.read_grid(base).widen(self.layouts[base]).stored())
        array = self._grid[1][field]
        return array if index is None else array[index]

    def input_order(self, name: str):
        return self.source.input_order(name)

    def close(self) -> None:
        self._grid = None
        self.source.close()

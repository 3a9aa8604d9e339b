"""GGUF quantized blocks as integers and per-group affine numbers, without a float copy.

llama.cpp stores a matrix [rows, cols] (rows = output features) in blocks along each row. Every
block type read here is, per group of `group_size` consecutive columns, an integer v times a
scale plus an offset, and that is the layout jaxinfer's quantized matmul runs
(`pallas_kernels.quantized_matmul.reference`: w = v * scale + offset):

    type   group  v (stored integer)             scale         offset      bits per weight here (file)
    Q4_0   32     q - 8, q the nibble            d (f16)       -           4.5 (4.5)
    Q4_1   32     q                              d (f16)       m (f16)     5.0 (5.0)
    Q4_K   32     q                              d * sc (f32)  -dmin * m   6.0 (4.5)
    Q8_0   32     q (int8)                       d (f16)       -           8.5 (8.5)
    Q5_K   32     q in [0, 31] (int8)            d * sc (f32)  -dmin * m   10.0 (5.5)
    Q6_K   16     q - 32 in [-32, 31] (int8)     d * sc (f32)  -           10.0 (6.56)

(Q4_K's super-block of 256 holds 8 sub-blocks of 32 with 6-bit scales sc and minimums m under a
float16 d and dmin: the products are exact in float32, so nothing is lost, at 1 bit per weight more
than the file. Q5_K and Q6_K have no 4-bit form; kept as int8 they cost what the table says.)
Exact means: v * scale + offset in float32 is llama.cpp's own dequantized value (gguf's
dequantize computes the same products in float32).

Each tensor is read into a `checkpoints_conv.quantized.Grid` in its type's layout (TYPE_LAYOUTS).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from checkpoints_conv.quantized import Grid, QuantLayout

Q = GGMLQuantizationType
GRID_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q6_K})
QK_K = 256  # elements of a K-quant super-block


# the layout each block type is read into
TYPE_LAYOUTS = {
    Q.Q4_0: QuantLayout(4, 32, False, np.dtype(np.float16)),
    Q.Q4_1: QuantLayout(4, 32, True, np.dtype(np.float16)),
    Q.Q4_K: QuantLayout(4, 32, True, np.dtype(np.float32)),
    Q.Q8_0: QuantLayout(8, 32, False, np.dtype(np.float16)),
    Q.Q5_K: QuantLayout(8, 32, True, np.dtype(np.float32)),
    Q.Q6_K: QuantLayout(8, 16, False, np.dtype(np.float32)),
}


def read_grid(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, int]) -> Grid:
    """The blocks of one [rows, cols] tensor (raw: its bytes, uint8) as a Grid in TYPE_LAYOUTS[type]."""
    rows, cols = shape
    if ggml_type not in GRID_TYPES:
        raise ValueError(f"GGUF type {ggml_type.name} has no integer grid here")
    block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
    blocks = np.asarray(raw, np.uint8).reshape(rows, -1)
    if cols % block_elems or blocks.shape[1] != cols // block_elems * block_bytes:
        raise ValueError(f"{ggml_type.name} tensor of shape {shape}: {blocks.shape[1]} bytes per row, expected "
                         f"{cols // block_elems * block_bytes}")
    blocks = blocks.reshape(rows, cols // block_elems, block_bytes)  # [rows, blocks, bytes]
    values, scales, offsets = _READERS[ggml_type](blocks)
    layout = TYPE_LAYOUTS[ggml_type]
    return Grid(values.reshape(rows, cols), scales.reshape(rows, -1).astype(layout.scale_dtype),
                None if offsets is None else offsets.reshape(rows, -1).astype(layout.scale_dtype), layout)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry on the last axis -> float16 [..., n]."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-element block -> [..., 32] nibbles: elements 0..15 in the low
    nibbles, 16..31 in the high ones (ggml's Q4_0 / Q4_1 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):  # [rows, n, 18]: d, 16 bytes
    d = _f16(b[..., :2])                                                   # [rows, n, 1]
    return (_nibbles_32(b[..., 2:]).astype(np.int8) - 8), d, None


def _q4_1(b):  # [rows, n, 20]: d, m, 16 bytes
    return _nibbles_32(b[..., 4:]).astype(np.int8), _f16(b[..., :2]), _f16(b[..., 2:4])


def _q8_0(b):  # [rows, n, 34]: d, 32 int8
    return np.ascontiguousarray(b[..., 2:]).view(np.int8), _f16(b[..., :2]), None


def _k_scales(b):
    """d, dmin (f32 [rows, n, 1]) and the 8 sub-block scales and minimums ([rows, n, 8]) of Q4_K / Q5_K."""
    rows, n, _ = b.shape
    d, dmin = _f16(b[..., :2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(rows * n, 12))
    return d, dmin, sc.reshape(rows, n, 8).astype(np.float32), m.reshape(rows, n, 8).astype(np.float32)


def _q4_k(b):  # [rows, n, 144]: d, dmin, 12 bytes of scales, 128 bytes
    rows, n, _ = b.shape
    d, dmin, sc, m = _k_scales(b)
    qs = b[..., 16:].reshape(rows, n, 4, 32)                               # 4 chunks of 64 elements
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n, 8, 32)     # sub-block 2c: low, 2c + 1: high
    return q.astype(np.int8), d * sc, -(dmin * m)                          # scales, offsets [rows, n, 8]


def _q5_k(b):  # [rows, n, 176]: d, dmin, 12 bytes of scales, 32 bytes of high bits, 128 bytes
    rows, n, _ = b.shape
    d, dmin, sc, m = _k_scales(b)
    qh = b[..., 16:48]                                                     # bit j of byte i: element i of sub-block j
    qs = b[..., 48:].reshape(rows, n, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n, 8, 32)
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [rows, n, 8, 32]
    return (low | (high << 4)).astype(np.int8), d * sc, -(dmin * m)


def _q6_k(b):  # [rows, n, 210]: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d
    rows, n, _ = b.shape
    ql = b[..., :128].reshape(rows, n, 2, 64)                              # two halves of 128 elements
    qh = b[..., 128:192].reshape(rows, n, 2, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)   # [rows, n, 16]: one per 16
    d = _f16(b[..., 208:210]).astype(np.float32)                           # [rows, n, 1]
    high = (qh[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3    # [rows, n, 2, 4, 32]: bits 2j of quarter j
    q = (_q6_low(ql) | (high << 4)).astype(np.int8) - 32                  # [rows, n, 2, 4, 32]
    return q.reshape(rows, n, QK_K), d * sc, None


def _q6_low(ql: np.ndarray) -> np.ndarray:
    """Q6_K's low 4 bits [rows, n, 2, 4, 32]: in each half of 128 elements, quarter j (elements
    32 j .. 32 j + 31) takes the low nibbles of bytes 0..31 (j = 0), 32..63 (j = 1), then the high
    nibbles of bytes 0..31 (j = 2) and 32..63 (j = 3)."""
    pairs = ql.reshape(*ql.shape[:-1], 2, 32)                              # [rows, n, 2, (bytes 0..31, 32..63), 32]
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=-2)            # quarters 0, 1 (low), 2, 3 (high)


_READERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}

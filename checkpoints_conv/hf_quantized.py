"""Hugging Face checkpoints quantized by GPTQ, AWQ or compressed-tensors, read as integer grids.

`config.json` carries a `quantization_config`; each quantized linear layer `<m>` stores packed
int32 tensors instead of `<m>.weight` [N, K] (N = output features, K = input features):

    GPTQ (quant_method "gptq"; GPTQModel / AutoGPTQ)
      <m>.qweight  int32 [K * bits / 32, N]   K packed: value k at bits (k % p) * bits of row k // p (p = 32 / bits)
      <m>.qzeros   int32 [G, N * bits / 32]   N packed the same way along a row; checkpoint_format "gptq"
                                              (v1, the default) stores each zero minus 1, "gptq_v2" as it is
      <m>.scales   float16 [G, N]
      <m>.g_idx    int32 [K]                  the group of input row k (k // group_size unless act-order)
      w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    AWQ (quant_method "awq", version "gemm"; AutoAWQ)
      <m>.qweight  int32 [K, N / 8]           N packed, 4 bits: nibble i of word c holds column 8 c + ORDER[i],
      <m>.qzeros   int32 [G, N / 8]           ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
      <m>.scales   float16 [G, N]             w = (q - z) * s, g = k // group_size
    compressed-tensors (quant_method "compressed-tensors", format "pack-quantized"; llm-compressor)
      <m>.weight_packed      int32 [N, K * bits / 32]   K packed, each value stored as v + 2^(bits-1)
      <m>.weight_scale       [N, G] (float16 / bfloat16)
      <m>.weight_zero_point  int32 [N * bits / 32, G]   asymmetric only: N packed, stored as zp + 2^(bits-1)
      <m>.weight_shape       int [2] = (N, K)
      <m>.weight_g_idx       int32 [K]                  act-order only
      w = (v - zp) * s
    compressed-tensors, format "int-quantized" (llm-compressor's W8A8 int8, SmoothQuant's checkpoints)
      <m>.weight             int8 [N, K]                v as it is, symmetric (no zero point)
      <m>.weight_scale       [N, 1]                     per output channel ("channel")
      w = v * s; input_activations int8 per token, dynamic (or none: int8 weights only)

`QuantizedHFSource` lists each such layer as `<m>.weight` [N, K] (so a float load dequantizes it)
and hands it out as a `Grid` (checkpoints_conv.quantized): values v and per-group scales and
offsets with w = v * scale + offset, exactly: a symmetric grid (every zero point at the middle of
the range) keeps v = q - 2^(bits-1) and its scales as stored; otherwise v = q (int4) or
q - 128 (int8) with offsets (2^(bits-1)... - z) * s in float32, where the products are exact.

Act-order (GPTQ's desc_act, compressed-tensors' g_idx): a group's rows are scattered over K. The
grid holds the rows sorted by group (`input_order(name)` is that order, `perm`), so groups are
contiguous again, and the model reads x's columns in the same order: x @ w = x[:, perm] @ w[perm].

Per-column grids (group_size -1, strategy "channel") are one group of K, split into groups the
kernels run (QuantLayout.runnable), except a W8A8 one (int-quantized with int8 activations per
token): its layout says activations="int8" and keeps one scale per row, for the int8 x int8
matmul, which quantizes each token's activations as it runs. Only 4- and 8-bit integer weights
are read; anything else is a CheckpointError naming what it found. The writers at the end (`pack_gptq`, `pack_awq`,
`pack_compressed`, `pack_int_quantized`) are what `jaxinfer quantize` writes with.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.quantized import Grid, QuantLayout
from checkpoints_conv.tensor_source import TensorSource

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8 c + AWQ_ORDER[i]
FORMATS = ("gptq", "awq", "compressed-tensors")
SUFFIXES = {  # the tensors of one quantized layer, by format (the first one marks the layer)
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
    "int-quantized": ("weight_scale", "weight"),  # (compressed-tensors' unpacked int8: the scale marks the layer)
}
W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """What `quantization_config` says: the method, bits, group size (None: one per output
    column), and for GPTQ whether zeros are stored minus one (checkpoint_format "gptq")."""

    method: str
    bits: int
    group_size: int | None
    zeros_minus_one: bool = False
    unpacked: bool = False  # compressed-tensors' "int-quantized": int8 `weight` and `weight_scale` as they are
    activations: str | None = None  # "int8": W8A8 (int-quantized, activations int8 per token)

    @property
    def layout_method(self) -> str:
        """The tensors' layout (SUFFIXES): the method, or compressed-tensors' int-quantized."""
        return "int-quantized" if self.unpacked else self.method


def read_quantization_config(config: dict, source: str = "config.json") -> QuantFormat | None:
    """The `quantization_config` of an HF config dict, or None; CheckpointError for a method,
    format or bit width that is not read here."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in FORMATS:
        raise CheckpointError(f"{source}: quantization_config.quant_method={method!r} is not supported "
                              f"(supported: {', '.join(FORMATS)})")
    if method == "compressed-tensors" and qc.get("format") == "int-quantized":
        return _int_quantized(qc, source)
    if method == "compressed-tensors":
        if qc.get("format") != "pack-quantized":
            raise CheckpointError(f"{source}: compressed-tensors format {qc.get('format')!r} is not supported "
                                  f"(supported: 'pack-quantized', 'int-quantized')")
        groups = list((qc.get("config_groups") or {}).values())
        schemes = {json_key(g.get("weights") or {}) for g in groups}
        if len(schemes) != 1:
            raise CheckpointError(f"{source}: compressed-tensors with {len(schemes)} weight schemes; one is supported")
        weights = groups[0]["weights"]
        if weights.get("type", "int") != "int" or weights.get("strategy") not in ("group", "channel"):
            raise CheckpointError(f"{source}: compressed-tensors weights {weights}: only integer weights per group "
                                  f"or per channel are supported")
        bits, group = weights.get("num_bits"), weights.get("group_size") if weights.get("strategy") == "group" else None
    else:
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise CheckpointError(f"{source}: AWQ version {qc.get('version')!r} is not supported (supported: 'gemm')")
        if method == "awq" and qc.get("zero_point") is False:
            raise CheckpointError(f"{source}: AWQ without zero points is not supported")
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise CheckpointError(f"{source}: {method} with {bits}-bit weights is not supported (4 or 8 bits; AWQ 4)")
    if group is not None and group != -1 and (not isinstance(group, int) or group < 1):
        raise CheckpointError(f"{source}: {method} group size {group!r} is not a positive integer (or -1)")
    zeros_minus_one = method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq"
    return QuantFormat(method, bits, None if group in (None, -1) else group, zeros_minus_one)


def _int_quantized(qc: dict, source: str) -> QuantFormat:
    """compressed-tensors' "int-quantized" format: int8 weights per channel, symmetric, unpacked,
    with input activations int8 per token (dynamic; W8A8) or none."""
    groups = list((qc.get("config_groups") or {}).values())
    schemes = {json_key({**(g.get("weights") or {}), "input_activations": json_key(g.get("input_activations") or {})})
               for g in groups}
    if len(schemes) != 1:
        raise CheckpointError(f"{source}: compressed-tensors with {len(schemes)} schemes; one is supported")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if (weights.get("type", "int"), weights.get("num_bits"), weights.get("strategy"), weights.get("symmetric", True)) != (
            "int", 8, "channel", True):
        raise CheckpointError(f"{source}: int-quantized weights {weights}: only symmetric int8 weights per channel are "
                              f"supported")
    if acts is not None and any(acts.get(k, v) != v for k, v in W8A8_ACTIVATIONS.items()):
        raise CheckpointError(f"{source}: int-quantized input_activations {acts}: only int8 per token, symmetric and "
                              f"dynamic (W8A8) are supported")
    return QuantFormat("compressed-tensors", 8, None, unpacked=True, activations=None if acts is None else "int8")


def json_key(d: dict) -> str:
    return repr(sorted(d.items()))


# ----------------------------------------------------------------------------- int32 (un)packing
def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per word along axis 0 -> uint8 [R * 32 / bits, C];
    value j of word r (bits j * bits ..) is row r * 32 / bits + j."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    values = (packed.view(np.uint32)[:, None, :] >> shifts) & ((1 << bits) - 1)    # [R, per, C]
    return values.reshape(-1, packed.shape[1]).astype(np.uint8)


def unpack_cols(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per word along axis 1 -> uint8 [R, C * 32 / bits]."""
    return np.ascontiguousarray(unpack_rows(np.ascontiguousarray(packed.T), bits).T)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [R, C] (R a multiple of 32 / bits) -> int32 [R * bits / 32, C]: the inverse of unpack_rows."""
    per = 32 // bits
    v = np.ascontiguousarray(values, np.uint32).reshape(-1, per, values.shape[1])  # [R / per, per, C]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    return np.ascontiguousarray(np.bitwise_or.reduce(v << shifts, axis=1)).view(np.int32)


def pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """uint [R, C] -> int32 [R, C * bits / 32]: the inverse of unpack_cols."""
    return np.ascontiguousarray(pack_rows(np.ascontiguousarray(values.T), bits).T)


# ----------------------------------------------------------------------------- one layer
def grid_from_zeros(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, group_size: int) -> Grid:
    """The grid of w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g] (q, zeros unsigned in
    [0, 2^bits); g = k // group_size), in the narrowest exact layout."""
    mid = 1 << (bits - 1)
    if np.all(zeros == mid):  # symmetric: v = q - mid, no offsets
        return Grid((q.astype(np.int16) - mid).astype(np.int8), scales, None,
                    QuantLayout(bits, group_size, False, np.dtype(scales.dtype)))
    shift = 0 if bits == 4 else 128  # int4 with offsets keeps the nibble; int8 stores q - 128
    offsets = (shift - zeros.astype(np.float32)) * scales.astype(np.float32)
    return Grid((q.astype(np.int16) - shift).astype(np.int8), scales.astype(np.float32), offsets,
                QuantLayout(bits, group_size, True, np.dtype(np.float32)))


def sort_groups(g_idx: np.ndarray, group_size: int, name: str) -> np.ndarray | None:
    """The order that makes the groups of `g_idx` contiguous (None when they already are);
    CheckpointError if its groups are not all `group_size` rows (the last one: what is left)."""
    K = len(g_idx)
    if np.array_equal(g_idx, np.arange(K) // group_size):
        return None
    order = np.argsort(g_idx, kind="stable").astype(np.int32)
    if not np.array_equal(g_idx[order], np.arange(K) // group_size):
        raise CheckpointError(f"{name}: g_idx does not put {group_size} input rows in every group")
    return order


class QuantizedHFSource(TensorSource):
    """An HF checkpoint quantized by `fmt.method`: its quantized layers listed as `<m>.weight`
    [N, K], `quantized()` and `read_grid()` for them (module docstring); everything else as is."""

    def __init__(self, source: TensorSource, fmt: QuantFormat, path: str = "checkpoint"):
        self.source, self.fmt, self.path = source, fmt, path
        listing = dict(source.listing())
        marker = SUFFIXES[fmt.layout_method][0]
        self.layers: dict[str, tuple[int, int]] = {}  # "<m>.weight" -> (N, K)
        for name, shape in listing.items():
            if name.endswith("." + marker):
                module = name[: -len(marker) - 1]
                self.layers[f"{module}.weight"] = self._logical_shape(module, shape, listing)
        self._hidden = {f"{w[:-len('.weight')]}.{s}" for w in self.layers for s in SUFFIXES[fmt.layout_method]}
        self._listing = [(n, tuple(s)) for n, s in source.listing() if n not in self._hidden]
        self._listing += [(w, shape) for w, shape in self.layers.items()]

    def _logical_shape(self, module: str, shape: tuple, listing: dict) -> tuple[int, int]:
        bits, per = self.fmt.bits, 32 // self.fmt.bits
        if self.fmt.unpacked:
            if f"{module}.weight" not in listing or len(listing[f"{module}.weight"]) != 2:
                raise CheckpointError(f"{self.path}: {module}.weight_scale without a 2-D {module}.weight (int-quantized)")
            return tuple(listing[f"{module}.weight"])
        if self.fmt.method == "gptq":
            return shape[1], shape[0] * per
        if self.fmt.method == "awq":
            return shape[1] * per, shape[0]
        n, k = (int(x) for x in self.source.read(f"{module}.weight_shape"))
        if (n, k) != (shape[0], shape[1] * per):
            raise CheckpointError(f"{self.path}: {module}.weight_shape says {(n, k)} but weight_packed {shape} holds "
                                  f"[{shape[0]}, {shape[1] * per}] ({bits}-bit values)")
        return n, k

    # ------------------------------------------------------------------ TensorSource
    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._listing)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if name not in self.layers:
            return self.source.read(name, index)
        w = self.read_grid(name).dequantize()
        order = self.input_order(name)
        if order is not None:  # back to the checkpoint's row order
            w = w[:, np.argsort(order)]
        return w if index is None else w[index]

    def quantized(self) -> dict[str, QuantLayout]:
        out = {}
        for name, (N, K) in self.layers.items():
            out[name] = self._layout(name[: -len(".weight")], N, K)
        return out

    def _layout(self, module: str, N: int, K: int) -> QuantLayout:
        """The layout read_grid will return, from the zero points alone (no weight data)."""
        if self.fmt.unpacked:  # symmetric int8 per row (read_quantization_config checked)
            scale_dtype = np.dtype(self.source.read(f"{module}.weight_scale").dtype)
            layout = QuantLayout(8, K, False, scale_dtype, activations=self.fmt.activations)
            return layout.runnable(K)
        zeros = self._zeros(module, N, K)
        group = self.fmt.group_size or K
        mid = 1 << (self.fmt.bits - 1)
        scale_dtype = np.dtype(self.source.read(f"{module}.{'weight_scale' if self.fmt.method == 'compressed-tensors' else 'scales'}",
                                                (slice(0, 1), slice(0, 1))).dtype)
        if np.all(zeros == mid):
            return QuantLayout(self.fmt.bits, group, False, scale_dtype).runnable(K)
        return QuantLayout(self.fmt.bits, group, True, np.dtype(np.float32)).runnable(K)

    def _zeros(self, module: str, N: int, K: int) -> np.ndarray:
        """Zero points unsigned, [N, G]."""
        bits, fmt = self.fmt.bits, self.fmt
        G = -(-K // (fmt.group_size or K))
        if fmt.method == "gptq":
            zeros = unpack_cols(self.source.read(f"{module}.qzeros"), bits)[:, :N].T.astype(np.int16)
            return zeros + (1 if fmt.zeros_minus_one else 0)
        if fmt.method == "awq":
            return _awq_columns(unpack_cols(self.source.read(f"{module}.qzeros"), bits))[:, :N].T.astype(np.int16)
        names = dict(self.source.listing())
        if f"{module}.weight_zero_point" not in names:
            return np.full((N, G), 1 << (bits - 1), np.int16)
        return unpack_rows(self.source.read(f"{module}.weight_zero_point"), bits)[:N].astype(np.int16)

    def read_grid(self, name: str) -> Grid:
        module = name[: -len(".weight")]
        N, K = self.layers[name]
        fmt, bits = self.fmt, self.fmt.bits
        group = fmt.group_size or K
        if fmt.unpacked:
            return self._int_grid(module, N, K)
        if fmt.method == "gptq":
            q = unpack_rows(self.source.read(f"{module}.qweight"), bits)[:K].T                 # [N, K]
            scales = self.source.read(f"{module}.scales").T                                     # [N, G]
        elif fmt.method == "awq":
            q = _awq_columns(unpack_cols(self.source.read(f"{module}.qweight"), bits)).T        # [N, K]
            scales = self.source.read(f"{module}.scales").T
        else:
            q = unpack_cols(self.source.read(f"{module}.weight_packed"), bits)[:, :K]           # [N, K]
            scales = self.source.read(f"{module}.weight_scale")                                 # [N, G]
        zeros = self._zeros(module, N, K)
        order = self.input_order(name)
        if order is not None:
            q = q[:, order]
        grid = grid_from_zeros(np.ascontiguousarray(q), zeros, np.ascontiguousarray(scales), bits, group)
        return grid.widen(grid.layout.runnable(K))

    def input_order(self, name: str) -> np.ndarray | None:
        """The order of the input rows the grid holds (act-order), or None for their own order."""
        module = name[: -len(".weight")]
        if self.fmt.unpacked:
            return None
        g_name = f"{module}.{'weight_g_idx' if self.fmt.method == 'compressed-tensors' else 'g_idx'}"
        if self.fmt.method == "awq" or g_name not in dict(self.source.listing()):
            return None
        N, K = self.layers[name]
        return sort_groups(self.source.read(g_name).astype(np.int64), self.fmt.group_size or K, f"{self.path}: {g_name}")

    def _int_grid(self, module: str, N: int, K: int) -> Grid:
        """An int-quantized layer: int8 `weight` [N, K] and `weight_scale` [N, 1], w = v * s."""
        v = self.source.read(f"{module}.weight")
        scales = self.source.read(f"{module}.weight_scale")
        if v.dtype != np.int8:
            raise CheckpointError(f"{self.path}: {module}.weight is {v.dtype}; int-quantized stores int8")
        if scales.size != N:
            raise CheckpointError(f"{self.path}: {module}.weight_scale has shape {scales.shape}; expected [{N}, 1] "
                                  f"(one scale per output channel)")
        layout = QuantLayout(8, K, False, np.dtype(scales.dtype), activations=self.fmt.activations)
        grid = Grid(np.ascontiguousarray(v), np.ascontiguousarray(scales.reshape(N, 1)), None, layout)
        return grid.widen(layout.runnable(K))

    def close(self) -> None:
        self.source.close()


def _awq_columns(unpacked: np.ndarray) -> np.ndarray:
    """AWQ's unpacked words [R, 8 C] -> columns in order: nibble i of word c is column 8 c + AWQ_ORDER[i]."""
    R, C8 = unpacked.shape
    out = np.empty_like(unpacked)
    words = unpacked.reshape(R, C8 // 8, 8)
    out.reshape(R, C8 // 8, 8)[:, :, list(AWQ_ORDER)] = words
    return out


# ----------------------------------------------------------------------------- writers
def pack_gptq(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int, g_idx: np.ndarray,
              zeros_minus_one: bool = True) -> dict[str, np.ndarray]:
    """One layer in GPTQ's tensors: q [K, N] and zeros [G, N] unsigned, scales [G, N], g_idx [K]."""
    stored = zeros.astype(np.int64) - (1 if zeros_minus_one else 0)
    return _contiguous({"qweight": pack_rows(q, bits), "qzeros": pack_cols((stored & ((1 << bits) - 1)).astype(np.uint32), bits),
                        "scales": scales.astype(np.float16), "g_idx": g_idx.astype(np.int32)})


def pack_awq(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """One layer in AWQ's (GEMM) tensors: q [K, N] and zeros [G, N] unsigned 4-bit, scales [G, N]."""
    def packed(a):
        R, N = a.shape
        words = a.reshape(R, N // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble i <- column 8 c + AWQ_ORDER[i]
        return pack_cols(words.reshape(R, N), 4)
    return _contiguous({"qweight": packed(q), "qzeros": packed(zeros), "scales": scales.astype(np.float16)})


def pack_compressed(v: np.ndarray, scales: np.ndarray, bits: int, zero_points: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One layer in compressed-tensors' pack-quantized tensors: v [N, K] and zero_points [N, G]
    signed (in [-2^(bits-1), 2^(bits-1))), scales [N, G]."""
    mid = 1 << (bits - 1)
    out = {"weight_packed": pack_cols((v.astype(np.int32) + mid).astype(np.uint32), bits),
           "weight_scale": scales, "weight_shape": np.array(v.shape, np.int64)}
    if zero_points is not None:
        N = zero_points.shape[0]
        padded = np.zeros((-(-N // (32 // bits)) * (32 // bits), zero_points.shape[1]), np.uint32)
        padded[:N] = zero_points.astype(np.int32) + mid
        out["weight_zero_point"] = pack_rows(padded, bits)
    return _contiguous(out)


def pack_int_quantized(v: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """One layer in compressed-tensors' int-quantized tensors: v [N, K] int8 (symmetric), scales
    [N] or [N, 1] (one per output channel)."""
    return _contiguous({"weight": v.astype(np.int8), "weight_scale": scales.reshape(-1, 1)})


def _contiguous(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """safetensors writes an array's buffer as it lies: every tensor C-contiguous."""
    return {name: np.ascontiguousarray(a) for name, a in tensors.items()}

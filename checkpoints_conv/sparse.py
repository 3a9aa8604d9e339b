"""Pruned checkpoints in compressed-tensors' sparse formats, read back as dense float matrices.

    config.json  quantization_config = {"quant_method": "compressed-tensors", "version": ...,
                     "sparsity_config": {"format": "sparse-bitmask" | "sparse-24-bitmask" | "dense",
                                         "sparsity_structure": "unstructured" | "2:4",
                                         "global_sparsity": 0.5, "targets": ["Linear"], "ignore": ["lm_head", ...]},
                     ...the quantization scheme's keys (config_groups, format), when the weights are quantized too}

A compressed linear layer `<m>` stores, instead of `<m>.weight` [N, K] (N outputs, K inputs):

    sparse-bitmask (compressed-tensors' BitmaskCompressor)
      <m>.shape        int64 [2]             (N, K)
      <m>.compressed   [nnz] (weight dtype)  the non-zero entries, row after row
      <m>.bitmask      uint8 [N, ceil(K/8)]  entry (n, k) at bit k % 8 of byte k // 8 of row n
                                             (numpy.packbits(..., bitorder="little"))
      <m>.row_offsets  int64 [N]             where row n's entries start in `compressed`
    sparse-24-bitmask (Sparse24BitMaskCompressor; two of every four consecutive inputs are zero)
      <m>.shape        int64 [2, 1]          (N, K)
      <m>.compressed   [N, K/2]              the two kept entries of each group of four, in order
      <m>.bitmask      uint8 [N, ceil(K/8)]  as above, two bits set in every group of four

(the layout of compressed-tensors <= 0.14, whose compressors wrote and read these; later releases
keep the configs and `pack_bitmasks` / `unpack_bitmasks` but dropped the compressors). The
sparse-bitmask mask is "w != 0"; the 2:4 one keeps each group's two largest |w| (a group with
more zeros stores zeros). Format "dense" (written with quantized weights, e.g. int4
pack-quantized, whose pruned entries are grid zeros) only records the sparsity: nothing to do.

`SparseHFSource` lists each compressed layer as `<m>.weight` [N, K] and reads it as a dense matrix
(rows sliced without expanding the rest: `row_offsets` says where they start), which is how the
CPU runs them. `read_24(checkpoint, name)` gives a 2:4 matrix in its compressed form instead
(`Sparse24`: the kept values [N, K/2] and each one's 2-bit position in its group), the entry point
for kernels that read 2:4 weights compressed (the Pallas 2:4 matmul). The writers
(`compress_bitmask`, `compress_24`) are what `jaxinfer prune` writes with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.hf import SafetensorsSource, read_hf_config
from checkpoints_conv.tensor_source import TensorSource

FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask")
FIELDS = ("shape", "compressed", "bitmask", "row_offsets")


@dataclasses.dataclass(frozen=True)
class SparsityFormat:
    """What `quantization_config.sparsity_config` says; `quantized`: the weights are quantized too
    (a quantization scheme beside it)."""

    format: str
    structure: str  # "unstructured" or "2:4"
    global_sparsity: float | None
    quantized: bool


def read_sparsity_config(config: dict, source: str = "config.json") -> SparsityFormat | None:
    """The sparsity of an HF config dict (None: none recorded); CheckpointError for a format not
    read here (marlin-24, a sparse-bitmask over quantized weights)."""
    qc = config.get("quantization_config") or {}
    sc = qc.get("sparsity_config") if qc.get("quant_method") == "compressed-tensors" else None
    if not sc:
        return None
    fmt = sc.get("format")
    if fmt not in FORMATS:
        raise CheckpointError(f"{source}: compressed-tensors sparsity format {fmt!r} is not supported "
                              f"(supported: {', '.join(FORMATS)})")
    structure = str(sc.get("sparsity_structure") or "unstructured").lower()
    if fmt == "sparse-24-bitmask" and structure != "2:4":
        raise CheckpointError(f"{source}: sparse-24-bitmask with sparsity_structure {structure!r} (expected '2:4')")
    quantized = bool(qc.get("config_groups"))
    if quantized and fmt != "dense":
        raise CheckpointError(f"{source}: compressed-tensors {fmt} over quantized weights is not supported "
                              f"(sparsity with quantized weights: format 'dense', the zeros in the grids)")
    return SparsityFormat(fmt, structure, sc.get("global_sparsity"), quantized)


# ----------------------------------------------------------------------------- (de)compression
def pack_bitmask(mask: np.ndarray) -> np.ndarray:
    """bool [N, K] -> uint8 [N, ceil(K/8)], entry k at bit k % 8 of byte k // 8."""
    return np.packbits(np.asarray(mask, bool), axis=-1, bitorder="little")


def unpack_bitmask(bitmask: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [N, ceil(K/8)] -> bool [N, K]: the inverse of pack_bitmask."""
    return np.unpackbits(np.asarray(bitmask, np.uint8), axis=-1, count=cols, bitorder="little").astype(bool)


def compress_bitmask(w: np.ndarray) -> dict[str, np.ndarray]:
    """A pruned matrix w [N, K] (HF orientation) in sparse-bitmask's tensors (module docstring)."""
    mask = w != 0
    counts = mask.sum(axis=1, dtype=np.int64)
    return {"shape": np.array(w.shape, np.int64), "compressed": np.ascontiguousarray(w[mask]),
            "bitmask": pack_bitmask(mask), "row_offsets": np.cumsum(counts) - counts}


def mask_24(w: np.ndarray) -> np.ndarray:
    """keep [N, K]: the two largest |w| of every four consecutive entries of a row (ties: the
    later ones); ValueError when a group has more than two non-zero entries or K % 4."""
    N, K = w.shape
    if K % 4:
        raise ValueError(f"a 2:4 matrix needs a multiple of 4 inputs (got {K})")
    groups = np.abs(w).reshape(N, K // 4, 4)
    if np.any((groups != 0).sum(axis=-1) > 2):
        raise ValueError("not 2:4 sparse: a group of four consecutive inputs has more than two non-zero weights")
    rank = np.argsort(np.argsort(groups, axis=-1, kind="stable"), axis=-1, kind="stable")
    return (rank >= 2).reshape(N, K)


def compress_24(w: np.ndarray) -> dict[str, np.ndarray]:
    """A 2:4 pruned matrix w [N, K] in sparse-24-bitmask's tensors (module docstring)."""
    N, K = w.shape
    keep = mask_24(w)
    return {"shape": np.array(w.shape, np.int64).reshape(-1, 1), "compressed": np.ascontiguousarray(w[keep].reshape(N, K // 2)),
            "bitmask": pack_bitmask(keep)}


def decompress(compressed: np.ndarray, bitmask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The dense [N, K] matrix of `compressed` values at the set bits of `bitmask`, row after row."""
    mask = unpack_bitmask(bitmask, shape[1])
    out = np.zeros(shape, compressed.dtype)
    out[mask] = np.asarray(compressed).reshape(-1)
    return out


@dataclasses.dataclass
class Sparse24:
    """One 2:4 matrix as stored, HF orientation (N outputs, K inputs): in every group of four
    consecutive inputs of a row, two values and their positions (0..3) in the group, in order.
    For jaxinfer's [K, N] orientation transpose both: values.T [K/2, N]."""

    values: np.ndarray     # [N, K/2], the stored dtype
    positions: np.ndarray  # uint8 [N, K/2], 0..3
    shape: tuple[int, int]

    def packed_positions(self) -> np.ndarray:
        """uint8 [N, K/8]: each group's two positions in a nibble (first | second << 2), group 2j
        in the low nibble of byte j, group 2j + 1 in the high one (int4's nibble order): 2 bits
        per kept value, 0.125 byte per weight, as the bitmask."""
        N, half = self.positions.shape
        nib = (self.positions[:, 0::2] | (self.positions[:, 1::2] << 2)).astype(np.uint8)  # [N, K/4]
        if nib.shape[1] % 2:
            nib = np.concatenate([nib, np.zeros((N, 1), np.uint8)], axis=1)
        return nib[:, 0::2] | (nib[:, 1::2] << 4)

    def bitmask(self) -> np.ndarray:
        """uint8 [N, ceil(K/8)] as sparse-24-bitmask stores it."""
        N, K = self.shape
        mask = np.zeros((N, K // 4, 4), bool)
        np.put_along_axis(mask, self.positions.reshape(N, K // 4, 2).astype(np.int64), True, axis=-1)
        return pack_bitmask(mask.reshape(N, K))

    def dense(self) -> np.ndarray:
        N, K = self.shape
        out = np.zeros((N, K // 4, 4), self.values.dtype)
        np.put_along_axis(out, self.positions.reshape(N, K // 4, 2).astype(np.int64), self.values.reshape(N, K // 4, 2), axis=-1)
        return out.reshape(N, K)


# ----------------------------------------------------------------------------- reading
class SparseHFSource(TensorSource):
    """An HF checkpoint whose linear layers compressed-tensors stored sparse: each listed as
    `<m>.weight` [N, K] and read dense (module docstring); everything else as is."""

    def __init__(self, source: TensorSource, fmt: SparsityFormat, path: str = "checkpoint"):
        self.source, self.fmt, self.path = source, fmt, path
        listing = self._stored = {n: tuple(s) for n, s in source.listing()}
        self.layers: dict[str, tuple[int, int]] = {}  # "<m>.weight" -> (N, K)
        for name in listing:
            if not name.endswith(".bitmask"):
                continue
            module = name[: -len(".bitmask")]
            for field in ("shape", "compressed"):
                if f"{module}.{field}" not in listing:
                    raise CheckpointError(f"{path}: {module}.bitmask without {module}.{field}")
            N, K = (int(v) for v in np.asarray(source.read(f"{module}.shape")).reshape(-1))
            if tuple(listing[name]) != (N, -(-K // 8)):
                raise CheckpointError(f"{path}: {module}.bitmask is {tuple(listing[name])}; shape {(N, K)} needs "
                                      f"{(N, -(-K // 8))}")
            if self._two_of_four(module) and tuple(listing[f"{module}.compressed"]) != (N, K // 2):
                raise CheckpointError(f"{path}: {module}.compressed is {tuple(listing[f'{module}.compressed'])}; a 2:4 "
                                      f"matrix of shape {(N, K)} stores {(N, K // 2)}")
            self.layers[f"{module}.weight"] = (N, K)
        hidden = {f"{w[: -len('.weight')]}.{f}" for w in self.layers for f in FIELDS}
        self._listing = [(n, tuple(s)) for n, s in source.listing() if n not in hidden]
        self._listing += [(w, shape) for w, shape in self.layers.items()]

    def _two_of_four(self, module: str) -> bool:
        """Whether `module` is stored sparse-24-bitmask ([N, K/2] values, no row offsets)."""
        return len(self._stored[f"{module}.compressed"]) == 2 and f"{module}.row_offsets" not in self._stored

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._listing)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if name not in self.layers:
            return self.source.read(name, index)
        N, K = self.layers[name]
        module = name[: -len(".weight")]
        rows = index[0] if index else slice(None)
        r = range(N)[rows]
        if r.step != 1 or len(r) == 0:
            w = self._rows(module, N, K, 0, N)
            return w if index is None else w[index]
        w = self._rows(module, N, K, r.start, r.stop)
        return w if index is None or len(index) < 2 else w[(slice(None),) + tuple(index[1:])]

    def _rows(self, module: str, N: int, K: int, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the dense matrix, reading only their entries."""
        bitmask = self.source.read(f"{module}.bitmask", (slice(start, stop), slice(None)))
        listing = self._stored
        if self._two_of_four(module):
            values = self.source.read(f"{module}.compressed", (slice(start, stop), slice(None)))
        else:
            if f"{module}.row_offsets" in listing:
                offsets = np.asarray(self.source.read(f"{module}.row_offsets")).astype(np.int64)
            else:  # (the offsets from the bitmask's counts)
                counts = unpack_bitmask(self.source.read(f"{module}.bitmask"), K).sum(axis=1)
                offsets = np.cumsum(counts) - counts
            nnz = listing[f"{module}.compressed"][0]
            first, last = int(offsets[start]), int(offsets[stop]) if stop < N else nnz
            values = self.source.read(f"{module}.compressed", (slice(first, last),))
        return decompress(values, bitmask, (stop - start, K))

    def read_24(self, name: str) -> Sparse24:
        """The 2:4 matrix `<m>.weight` in its compressed form (KeyError for a matrix not stored 2:4)."""
        module = name[: -len(".weight")]
        if name not in self.layers or not self._two_of_four(module):
            raise KeyError(f"{self.path}: {name!r} is not stored as a 2:4 (sparse-24-bitmask) matrix")
        N, K = self.layers[name]
        mask = unpack_bitmask(self.source.read(f"{module}.bitmask"), K).reshape(N, K // 4, 4)
        if np.any(mask.sum(axis=-1) != 2):
            raise CheckpointError(f"{self.path}: {module}.bitmask does not set two of every four entries")
        positions = np.nonzero(mask)[2].reshape(N, K // 2).astype(np.uint8)  # row-major: each group's two, in order
        return Sparse24(np.asarray(self.source.read(f"{module}.compressed")), positions, (N, K))

    def sparse_24(self) -> list[str]:
        """The `<m>.weight` names stored 2:4."""
        return [w for w in self.layers if self._two_of_four(w[: -len(".weight")])]

    def close(self) -> None:
        self.source.close()


def read_24(checkpoint: str | Path | TensorSource, name: str) -> Sparse24:
    """The 2:4 matrix `name` (its HF name, `<m>.weight`) of a sparse-24-bitmask checkpoint in its
    compressed form: values [N, K/2] and 2-bit positions (`Sparse24`). `checkpoint`: the model
    folder, or a source from `open_checkpoint` (the sparse reader under its views / quantized
    reader is found). The entry point for kernels that read 2:4 weights compressed."""
    if isinstance(checkpoint, (str, Path)):
        config = read_hf_config(checkpoint)
        fmt = read_sparsity_config(config, str(Path(checkpoint) / "config.json"))
        if fmt is None or fmt.format != "sparse-24-bitmask":
            raise CheckpointError(f"{checkpoint}: not a sparse-24-bitmask checkpoint")
        with SparseHFSource(SafetensorsSource(checkpoint), fmt, str(checkpoint)) as source:
            return source.read_24(name)
    source = checkpoint
    while not isinstance(source, SparseHFSource):
        source = getattr(source, "source", None)
        if source is None:
            raise CheckpointError(f"{checkpoint!r} holds no sparse checkpoint")
    return source.read_24(name)

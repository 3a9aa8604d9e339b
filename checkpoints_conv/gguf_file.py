"""Parse a GGUF file's header (metadata and tensor directory) and read one tensor's raw bytes.

Written here instead of using `gguf.GGUFReader` because that reader builds a numpy view per
metadata element: a 50k-token vocabulary takes ~4 s to open, a 150k one ~10 s. This parser reads
the same header in a fraction of a second. Only the type constants and block sizes come from the
`gguf` package.

Layout (GGUF v2/v3, little-endian): b"GGUF", u32 version, u64 tensor_count, u64 kv_count,
kv_count x (string key, u32 value type, value), tensor_count x (string name, u32 n_dims,
n_dims x u64 dims, u32 ggml type, u64 offset), padding to `general.alignment` (default 32),
then the tensor data; each tensor's offset is relative to the start of that data.
A string is u64 length + UTF-8 bytes; an array is u32 element type + u64 count + elements.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from checkpoints_conv.errors import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: code -> struct format (scalars) or a name (compound types).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensorInfo:
    """One entry of the tensor directory.

    `shape` is in numpy order (GGUF dims reversed): a linear weight with GGUF dims (in, out) has
    shape (out, in). `ggml_type` is a GGMLQuantizationType, or the raw int for a type this `gguf`
    package does not know. `offset` is absolute in the file; `n_bytes` is the stored size.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType | int
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        t = self.ggml_type
        return t.name if isinstance(t, GGMLQuantizationType) else f"<unknown ggml type {t}>"


@dataclass(frozen=True)
class GgufHeader:
    """The parsed header: `metadata` (key -> int/float/bool/str/list) and the tensor directory."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo]


class _Cursor:
    """Sequential little-endian reads from a buffer; running past the end raises struct.error."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise struct.error(f"string of {n} bytes runs past the end of the file")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            (n,) = length_at(buf, pos)
            pos += 8
            if pos + n > end:
                raise struct.error(f"string of {n} bytes runs past the end of the file")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype in _SCALAR_FORMATS and etype != 7:
                dtype = np.dtype("<" + _SCALAR_FORMATS[etype])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise struct.error(f"array of {count} elements runs past the end of the file")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            if etype == _STRING:  # vocabularies: tens of thousands of strings, read in one tight loop
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Parse the header of the GGUF file at `path`.

    The last few headers parsed are kept (keyed by the file's path, size and modification time):
    the config, the tokenizer and the weights of one model all read the same header.
    CheckpointError naming the file when it is missing, not GGUF, an unsupported version,
    truncated (also when a tensor's data would run past the end of the file) or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    st = path.stat()
    return _read_header_cached(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header_cached(path: Path, size: int, mtime_ns: int) -> GgufHeader:
    if size < 24:
        raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, shorter than the fixed header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            header = _parse(path, buf, size)
        except (struct.error, ValueError, OverflowError) as e:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({e})") from e
    return header


def _parse(path: Path, buf, size: int) -> GgufHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: unsupported GGUF version {version} (big-endian or v1 files are not read)")
    tensor_count, kv_count = cur.unpack("Q"), cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    raw = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = [cur.unpack("Q") for _ in range(n_dims)]
        raw.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: invalid general.alignment {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_tensor_info(path, name, dims, t, data_start + off, size) for name, dims, t, off in raw]
    return GgufHeader(path, version, metadata, tensors)


def _tensor_info(path: Path, name: str, dims: list[int], raw_type: int, offset: int, size: int) -> GgufTensorInfo:
    try:
        ggml_type: GGMLQuantizationType | int = GGMLQuantizationType(raw_type)
    except ValueError:
        ggml_type = raw_type
    n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
    block, type_size = GGML_QUANT_SIZES.get(ggml_type, (1, 0))  # unknown type: size unknown, 0
    n_bytes = n_elems // block * type_size
    info = GgufTensorInfo(name, tuple(reversed(dims)), ggml_type, offset, n_bytes)
    if offset + n_bytes > size:
        raise CheckpointError(
            f"{path}: truncated GGUF file: tensor {name!r} ({info.type_name}, shape {info.shape}) needs bytes "
            f"[{offset}, {offset + n_bytes}) but the file has {size}"
        )
    return info


def read_tensor_bytes(path: str | Path, info: GgufTensorInfo) -> np.ndarray:
    """The stored bytes of one tensor as uint8 [rows..., bytes per row] (the layout
    `gguf.quants.dequantize` takes). Reads only this tensor from the file."""
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]
    row = info.shape[-1] if info.shape else 1
    if row % block:
        raise CheckpointError(
            f"{path}: tensor {info.name!r}: row length {row} is not a multiple of the {info.type_name} block size {block}"
        )
    data = np.empty(info.n_bytes, dtype=np.uint8)
    with open(path, "rb") as f:
        f.seek(info.offset)
        if f.readinto(memoryview(data)) != info.n_bytes:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {info.name!r} data is cut short")
    return data.reshape(*info.shape[:-1], row // block * type_size)

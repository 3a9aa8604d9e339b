"""Read a Hugging Face model directory: config.json and safetensors weights, tensor by tensor.

Only safetensors is read (never pickle: no pytorch_model.bin). Tensors come back as numpy arrays
in their stored dtype; bf16 comes back as `ml_dtypes.bfloat16`, bit-exact (safetensors' numpy
framework uses ml_dtypes for it), so nothing here needs torch or a JAX device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import ml_dtypes  # registers bfloat16 with numpy: safetensors returns bf16 tensors as it
import numpy as np
from safetensors import SafetensorError, safe_open

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.tensor_source import TensorSource

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str | Path) -> dict:
    """The parsed `config.json` of `model_dir`; CheckpointError if it is missing or not a JSON object."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found in model directory {model_dir}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def safetensors_shards(model_dir: str | Path) -> dict[Path, set[str] | None]:
    """The safetensors files of `model_dir`, in order, each with the tensor names the index assigns
    to it (None for a single unindexed `model.safetensors`).

    Prefers `model.safetensors.index.json` (sharded) and falls back to `model.safetensors`.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: invalid safetensors index ({type(e).__name__}: {e})") from e
        shards: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(model_dir / file, set()).add(name)
        for file in shards:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard listed in {index_path} does not exist")
        return dict(shards)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(p.name for p in model_dir.glob("*")) if model_dir.is_dir() else []
    raise CheckpointError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (pickle checkpoints are not read); found {found[:20]}"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, array)` for every tensor of `model_dir`, one tensor in memory at a time.

    Arrays keep their stored shape (HF layout, linear weights [out, in]) and dtype (bf16 as
    `ml_dtypes.bfloat16`). Each shard is opened once. A truncated or corrupt file, or an index
    that names a tensor its shard lacks, raises CheckpointError naming the file.
    """
    for file, indexed_names in safetensors_shards(model_dir).items():
        try:
            with safe_open(str(file), framework="numpy") as f:
                names = list(f.keys())
                if indexed_names is not None:
                    absent = sorted(indexed_names - set(names))
                    if absent:
                        raise CheckpointError(
                            f"{file}: the index assigns tensor(s) {absent[:5]} to this shard but it lacks them"
                        )
                for name in names:
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file: {e}") from e
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read safetensors file: {e}") from e


class SafetensorsSource(TensorSource):
    """The tensors of an HF model directory, read as slices of the memory-mapped safetensors
    files: a device's shard of a tensor costs only its own bytes. Files open on first use."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        self._listing: list[tuple[str, tuple[int, ...]]] = []
        self._open: dict[Path, object] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}  # F8 files read from their bytes: (data start, JSON header)
        for file, indexed_names in safetensors_shards(self.model_dir).items():
            f = self._handle(file)
            names = list(f.keys())
            if indexed_names is not None:
                absent = sorted(indexed_names - set(names))
                if absent:
                    raise CheckpointError(f"{file}: the index assigns tensor(s) {absent[:5]} to this shard but it lacks them")
            for name in names:
                if indexed_names is not None and name not in indexed_names:
                    continue  # the index assigns it to another shard
                self._file_of[name] = file
                self._listing.append((name, tuple(f.get_slice(name).get_shape())))

    def _handle(self, file: Path):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(file), framework="numpy")
            except SafetensorError as e:
                raise CheckpointError(f"{file}: truncated or corrupt safetensors file: {e}") from e
            except OSError as e:
                raise CheckpointError(f"{file}: cannot read safetensors file: {e}") from e
        return self._open[file]

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._listing)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        file = self._file_of[name]
        try:
            tensor = self._handle(file).get_slice(name)
            if tensor.get_dtype() in RAW_DTYPES:  # a dtype safetensors' numpy reader does not name
                array = self._read_raw(file, name, RAW_DTYPES[tensor.get_dtype()])
                return array[index] if index else array
            return np.asarray(tensor[index] if index else tensor[:])
        except SafetensorError as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from e

    def _read_raw(self, file: Path, name: str, dtype: np.dtype) -> np.ndarray:
        """Tensor `name` of a safetensors file, read from its bytes: an 8-byte little-endian header
        length, the JSON header (each tensor's shape and data_offsets; parsed once per file), the data."""
        if file not in self._headers:
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + header_len, json.loads(f.read(header_len)))
        data_start, header = self._headers[file]
        start, end = header[name]["data_offsets"]
        with open(file, "rb") as f:
            f.seek(data_start + start)
            data = f.read(end - start)
        return np.frombuffer(data, dtype).reshape(header[name]["shape"])

    def close(self) -> None:
        self._open.clear()
        self._headers.clear()


# Stored dtypes the numpy reader of safetensors 0.8 cannot return (it asks numpy for
# np.float8_e4m3fn): read from the file's bytes instead (fp8 checkpoints: DeepSeek-V3, the FP8 releases).
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


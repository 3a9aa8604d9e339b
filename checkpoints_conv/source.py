"""Pick the reader for a checkpoint path: a `.gguf` file, or an HF model directory (safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.gguf_io import GgufSource, iter_gguf_tensors, read_gguf_config
from checkpoints_conv.hf import SafetensorsSource, iter_safetensors, read_hf_config
from checkpoints_conv.hf_fp8 import Fp8HFSource, read_fp8_config
from checkpoints_conv.hf_quantized import QuantizedHFSource, read_quantization_config
from checkpoints_conv.sparse import SparseHFSource, read_sparsity_config
from checkpoints_conv.tensor_source import TensorSource
from checkpoints_conv.views import QK_ROWS_REORDERED, mtp_views, with_views


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a GGUF file (by its `.gguf` suffix)."""
    return Path(path).suffix.lower() == ".gguf"


def read_checkpoint_config(path: str | Path) -> dict:
    """The HF-style config dict of a GGUF file or an HF model directory."""
    path = Path(path)
    if is_gguf(path):
        return read_gguf_config(path)
    if path.is_dir():
        return read_hf_config(path)
    raise CheckpointError(f"{path}: neither a .gguf file nor a model directory")


def iter_checkpoint_tensors(path: str | Path, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """`(hf_name, array)` pairs of a GGUF file (float32) or an HF model directory (stored dtype)."""
    return iter_gguf_tensors(path, config) if is_gguf(path) else iter_safetensors(path)


def open_checkpoint(path: str | Path, config: dict, *, mtp_layer: int | None = None) -> TensorSource:
    """Random access to the tensors of a GGUF file or an HF model directory (see tensor_source);
    a directory quantized by GPTQ, AWQ or compressed-tensors through `QuantizedHFSource`, one pruned
    into compressed-tensors' sparse-bitmask / sparse-24-bitmask through `SparseHFSource`, one with
    block-scaled fp8 weights (quant_method "fp8") through `Fp8HFSource`; the
    stacked or fused tensors of some architectures through their views (checkpoints_conv.views:
    GPT-OSS's experts, MXFP4 ones dequantized as they are read). `mtp_layer`: DeepSeek-V3's
    multi-token-prediction layer of that index instead, as a model of its own (views.mtp_views)."""
    if mtp_layer is not None:
        if is_gguf(path):
            raise CheckpointError(f"{path}: the multi-token-prediction layer is read from HF safetensors, not GGUF")
        def views(source, config):
            return mtp_views(source, config, mtp_layer)
    else:
        views = with_views
    if is_gguf(path):  # (the views see HF names: GLM-4.5's MoE layers renumbered, its MTP layer hidden)
        return with_views(GgufSource(path, config), config)
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4" and config.get("model_type") == "gpt_oss":
        config = {k: v for k, v in config.items() if k != "quantization_config"}  # GPT-OSS's experts: views.py reads them
    fp8 = qc.get("quant_method") == "fp8"
    sparse = read_sparsity_config(config, str(Path(path) / "config.json"))  # compressed-tensors' sparsity (checkpoints_conv.sparse)
    if sparse is not None and not sparse.quantized:
        config = {k: v for k, v in config.items() if k != "quantization_config"}  # pruned floats: nothing quantized
    fmt = None if fp8 else read_quantization_config(config, str(Path(path) / "config.json"))
    if (fmt is not None or fp8) and config.get("model_type") in QK_ROWS_REORDERED:
        raise CheckpointError(f"{path}: a {config['model_type']} checkpoint quantized by {config['quantization_config'].get('quant_method')} "
                              "is not supported (Llama 4's q/k rows are reordered at load, which its packed integers are "
                              "not); load the bfloat16 release and quantize in flight (quantization=...)")
    if fp8:  # (the views outside: a fused tensor's row ranges read dequantized)
        block = read_fp8_config(config, str(Path(path) / "config.json"))
        return views(Fp8HFSource(SafetensorsSource(path), block, str(path)), config)
    tensors = SafetensorsSource(path)
    if sparse is not None and sparse.format != "dense":  # sparse-bitmask / sparse-24-bitmask: read dense
        tensors = SparseHFSource(tensors, sparse, str(path))
    source = views(tensors, config)
    return source if fmt is None else QuantizedHFSource(source, fmt, str(path))

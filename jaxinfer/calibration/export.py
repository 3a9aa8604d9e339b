"""Write a calibrated model as a Hugging Face folder in the layout its method's tools write:

    method   format (quantization_config.quant_method)          tensors per linear layer
    gptq     GPTQ, checkpoint_format "gptq" (zeros stored - 1)  qweight, qzeros, scales, g_idx
    awq      AWQ, version "gemm"                                qweight, qzeros, scales
    rtn      compressed-tensors, format "pack-quantized"        weight_packed, weight_scale(, weight_zero_point), weight_shape
    smoothquant  compressed-tensors, format "int-quantized"     weight (int8), weight_scale [N, 1]
                 (W8A8: weights per channel, input activations int8 per token, dynamic; the
                 smoothing folded into the float norms and v / up projections written beside)

so that `LLM(folder)` (and other tools that read those formats) load it. The fused parameters are
split back into the model's HF tensors (q | k | v, gate | up: their columns), the other
parameters written in float32 under their HF names, with config.json (the source's, plus the
quantization_config) and the tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
import safetensors.numpy

import checkpoints_conv
from checkpoints_conv import hf_quantized
from jaxinfer.calibration.calibrate import Calibrated
from jaxinfer.calibration.grid import ZeroPointGrid
from jaxinfer.config import ModelConfig
from jaxinfer.models.param_layout import param_columns

FORMAT_OF = {"gptq": "gptq", "awq": "awq", "rtn": "compressed-tensors", "smoothquant": "int-quantized"}
# compressed-tensors' W8A8 int8 scheme (its preset "W8A8"), as llm-compressor writes SmoothQuant models
W8A8_SCHEME = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
               "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}


def quantization_config(cal: Calibrated) -> dict:
    fmt = FORMAT_OF[cal.method]
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": cal.bits, "group_size": cal.group_size, "desc_act": cal.act_order,
                "sym": cal.symmetric, "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": cal.bits, "group_size": cal.group_size, "zero_point": True, "version": "gemm"}
    if fmt == "int-quantized":
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], **W8A8_SCHEME}}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": cal.bits, "type": "int", "symmetric": cal.symmetric,
                                                       "strategy": "group", "group_size": cal.group_size}}}}


def layer_tensors(fmt: str, grid: ZeroPointGrid, symmetric: bool) -> dict[str, np.ndarray]:
    """One linear layer's tensors in `fmt` (grid [K, N], jaxinfer's orientation)."""
    if fmt == "gptq":
        return hf_quantized.pack_gptq(grid.q, grid.zeros, grid.scales, grid.bits, grid.g_idx)
    if fmt == "awq":
        return hf_quantized.pack_awq(grid.q, grid.zeros, grid.scales)
    if fmt == "int-quantized":  # symmetric int8, one group of all rows: v = q - 128
        return hf_quantized.pack_int_quantized((grid.q - 128).T, grid.scales.T)
    mid = 1 << (grid.bits - 1)
    return hf_quantized.pack_compressed((grid.q - mid).T, grid.scales.T, grid.bits, None if symmetric else (grid.zeros - mid).T)


def _columns(grid: ZeroPointGrid, cols: slice) -> ZeroPointGrid:
    return ZeroPointGrid(grid.q[:, cols], grid.zeros[:, cols], grid.scales[:, cols], grid.g_idx, grid.bits, grid.group_size)


def skip_modules(qc: dict, modules: list[str]) -> dict:
    """`qc` with the HF modules `modules` (layers kept in floats: `--keep-sensitive`) added to what
    its format leaves unquantized: GPTQ's `dynamic` ("-:<regex>" skips a module, GPTQModel's
    rule), AWQ's `modules_to_not_convert`, compressed-tensors' `ignore` (and its sparsity_config's)."""
    qc = json.loads(json.dumps(qc))
    if not modules:
        return qc
    if qc.get("quant_method") == "gptq":
        qc["dynamic"] = {**(qc.get("dynamic") or {}), **{f"-:{re.escape(m)}$": {} for m in modules}}
    elif qc.get("quant_method") == "awq":
        qc["modules_to_not_convert"] = [*(qc.get("modules_to_not_convert") or []), *modules]
    else:
        if "config_groups" in qc:
            qc["ignore"] = [*(qc.get("ignore") or []), *modules]
        if qc.get("sparsity_config"):
            qc["sparsity_config"]["ignore"] = [*(qc["sparsity_config"].get("ignore") or []), *modules]
    return qc


def write_checkpoint(dst: str | Path, config: ModelConfig, hf_config: dict, cal: Calibrated, tokenizer, *,
                     fmt: str | None = None, quant_config: dict | None = None, kept_layers=(),
                     float_matrix: Callable[[str, np.ndarray], dict[str, np.ndarray]] | None = None,
                     extra_config: dict | None = None) -> Path:
    """The folder `dst` (created) holding the calibrated model; see the module docstring.

    A layer's entry of `cal.grids` may be a float array [K, N] instead of a grid: for the layers
    `kept_layers` (kept in floats, `sensitivity`) it is written as a dense `.weight` and its
    modules are added to the config's skip lists (`skip_modules`); for any other layer (pruned,
    not quantized: `pruning.write_pruned`) `float_matrix(hf_name, [N, K] array)` gives its tensors
    (default: the dense `.weight`). `fmt` / `quant_config`: the grids' format and the
    quantization_config (default: the method's); `extra_config`: keys added to config.json."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=False)
    names = checkpoints_conv.arch_names(config.model_type)
    fmt = fmt or FORMAT_OF[cal.method]
    kept_modules: list[str] = []
    columns = param_columns(config)
    tensors: dict[str, np.ndarray] = {}

    def hf(param: str, layer: int | None, part: str | None) -> str:
        return names.hf_name(param, () if layer is None else (layer,), part)

    def pieces(param: str, array_or_grid, layer):
        """(HF name, this part's columns) of a param's slot, each fused part on its own."""
        if param not in columns:
            return [(hf(param, layer, None), array_or_grid)]
        out, start = [], 0
        for part, _, width in columns[param]:
            cols = slice(start, start + width)
            piece = _columns(array_or_grid, cols) if isinstance(array_or_grid, ZeroPointGrid) else array_or_grid[..., cols]
            out.append((hf(param, layer, part), piece))
            start += width
        return out

    for param, grids in cal.grids.items():
        for layer, grid in enumerate(grids):
            for name, piece in pieces(param, grid, layer):
                module = name.removesuffix(".weight")
                if not isinstance(piece, ZeroPointGrid):  # floats: a kept layer, or a pruned one (see the docstring)
                    piece = np.asarray(piece, np.float32)
                    dense = np.ascontiguousarray(piece.T if names.target(name).transpose else piece)  # HF's [N, K]
                    as_is = layer in kept_layers or float_matrix is None
                    tensors.update({name: dense} if as_is else float_matrix(name, dense))
                    if layer in kept_layers:
                        kept_modules.append(module)
                    continue
                for field, array in layer_tensors(fmt, piece, cal.symmetric).items():
                    tensors[f"{module}.{field}"] = array
    for param, array in cal.floats.items():
        stacked = param.startswith("layers.")
        for layer in range(array.shape[0]) if stacked else [None]:
            for name, piece in pieces(param, array[layer] if stacked else array, layer):
                target = names.target(name)
                tensors[name] = np.ascontiguousarray((piece.T if target.transpose else piece).astype(np.float32))
    safetensors.numpy.save_file(tensors, dst / "model.safetensors")
    out_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    out_config.setdefault("architectures", [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(config.model_type, "")])
    out_config["quantization_config"] = skip_modules(quant_config or quantization_config(cal), kept_modules)
    out_config.update(extra_config or {})
    (dst / "config.json").write_text(json.dumps(out_config, indent=2))
    tokenizer.save_pretrained(dst)
    return dst

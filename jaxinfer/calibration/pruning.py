"""Pruning from calibration text: magnitude, Wanda and SparseGPT, unstructured or 2:4, written as
compressed-tensors sparse checkpoints that `LLM` loads.

    jaxinfer prune MODEL OUT --method sparsegpt --sparsity 0.5     # --pattern 2:4; --bits 4 quantizes too
    prune("./Llama-3.2-1B", "./llama-2of4", method="wanda", pattern="2:4")    # the same from Python
    LLM("./llama-2of4")                                                       # read back as dense floats

What is pruned: every matmul of every decoder layer (q, k, v, o, gate, up, down; jaxinfer's
[K, N] weights, K inputs, N outputs); embeddings, norms and the LM head stay dense. A fused
parameter (q | k | v, gate | up) is pruned as its HF matrices, each on its own. The score of an
entry and the entries it competes with:

    method     score of w[k, n]                     unstructured: the `sparsity` of each group pruned
    magnitude  |w|                                  the whole matrix (layer-wise, the papers' baseline)
    wanda      |w| * ||X_k||_2 (Sun et al., 2023)   each output (an HF row): Wanda's comparison groups
    sparsegpt  w² / [H⁻¹ pivot]² (Frantar &         each block of 128 inputs of the matrix, chosen as the
               Alistarh, 2023), then the error      OBS sweep reaches it, the block's weights already
               pushed onto the inputs not yet       updated by the blocks before (adaptive mask selection)
               pruned (obs.sweep, GPTQ's loop)

`pattern="2:4"`: in every group of four consecutive inputs of an output (along K; along the input
dim of HF's [out, in]), the two lowest scores are pruned (sparsity 1/2); SparseGPT chooses each
group when its sweep reaches it, the paper's semi-structured variant. X: the activations that
reach the matmul, and H = 2 XᵀX / n from them (`obs.hessian`, shrunk toward its diagonal as for
GPTQ); layers go in order, each seeing the earlier layers already pruned (`forward.layer_by_layer`).
A matrix's unstructured count is round(sparsity * entries) per comparison group.

`bits` (4 or 8) prunes then quantizes: `quant_method="gptq"` runs GPTQ on the pruned weights with
the mask kept (a pruned entry takes its group's zero point, so it stays exactly 0), for SparseGPT
in the same sweep as the pruning (the paper's joint mode); "rtn" rounds the pruned weights to
nearest (0 is a level of every grid). Written as compressed-tensors (`write_pruned`):

    pruned, floats:   format "sparse-bitmask" (unstructured) / "sparse-24-bitmask" (2:4) for every
                      pruned matrix (checkpoints_conv.sparse), sparsity_config records it
    pruned + bits:    format "pack-quantized" (int4 / int8 per group, as `quantize --method rtn`),
                      sparsity_config {"format": "dense", "sparsity_structure": ...}: the zeros
                      live in the grids, the config says where they are (what compressed-tensors
                      describes and other tools read as a plain quantized model)

Layers kept in floats by `keep_sensitive` (jaxinfer.calibration.sensitivity) are listed in the
configs' `ignore` lists and written dense.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_conv import sparse
from jaxinfer.calibration.calibrate import Calibrated
from jaxinfer.calibration.export import quantization_config, write_checkpoint
from jaxinfer.calibration.forward import MATMULS, check_supported, layer_by_layer
from jaxinfer.calibration.gptq import gptq
from jaxinfer.calibration.grid import ZeroPointGrid, round_to_nearest
from jaxinfer.calibration.obs import fast_jit, hessian, prepare, sweep
from jaxinfer.config import ModelConfig
from jaxinfer.models.param_layout import param_columns

METHODS = ("magnitude", "wanda", "sparsegpt")
PATTERNS = ("unstructured", "2:4")
QUANT_METHODS = ("gptq", "rtn")


@dataclasses.dataclass
class Pruned:
    """A pruned model: `floats` every parameter but the layers' matmuls (stacked, float32),
    `weights` each matmul per layer as the model computes with it ([K, N] float32: pruned, and
    dequantized with `bits`), `keep` its mask (None for a layer kept in floats), `grids` with
    `bits` its grid (None for a kept layer)."""

    floats: dict[str, np.ndarray]
    weights: dict[str, list[np.ndarray]]
    keep: dict[str, list[np.ndarray | None]]
    grids: dict[str, list[ZeroPointGrid | None]] | None
    method: str
    sparsity: float
    pattern: str
    bits: int | None = None
    group_size: int = 128
    symmetric: bool = False
    quant_method: str | None = None
    kept_layers: tuple[int, ...] = ()

    def layer(self, i: int) -> dict:
        """Layer i's parameters as the pruned model computes with them (name -> array)."""
        w = {name.split(".", 1)[1]: a[i] for name, a in self.floats.items() if name.startswith("layers.")}
        w.update({name.split(".", 1)[1]: ws[i] for name, ws in self.weights.items()})
        return w

    def flat(self) -> dict:
        """Every parameter (flat names, stacked), the matmuls as the pruned model computes with them."""
        return {**self.floats, **{name: np.stack(ws) for name, ws in self.weights.items()}}


def check_options(method: str, sparsity: float | None, pattern: str | None, bits: int | None, quant_method: str | None) -> tuple[float, str]:
    """(sparsity, pattern) after the defaults (0.5, unstructured); ValueError naming a bad option."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    pattern = pattern or "unstructured"
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r}: expected one of {PATTERNS}")
    if pattern == "2:4":
        if sparsity not in (None, 0.5):
            raise ValueError(f"pattern 2:4 prunes half of every group of four: sparsity={sparsity} (leave it out, or 0.5)")
        sparsity = 0.5
    sparsity = 0.5 if sparsity is None else float(sparsity)
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity={sparsity}: expected a fraction in [0, 1)")
    if bits not in (None, 4, 8):
        raise ValueError(f"bits={bits}: expected 4 or 8 (or None: no quantization)")
    if quant_method is not None and quant_method not in QUANT_METHODS:
        raise ValueError(f"quant_method={quant_method!r}: expected one of {QUANT_METHODS}")
    return sparsity, pattern


def parts_of(config: ModelConfig, name: str, N: int) -> tuple[tuple[int, int], ...]:
    """(first column, width) of each HF matrix in the fused matmul `name` ("qkv_proj" ...)."""
    segments = param_columns(config).get(f"layers.{name}")
    if not segments:
        return ((0, N),)
    out, start = [], 0
    for _, _, width in segments:
        out.append((start, width))
        start += width
    return tuple(out)


def smallest(score: np.ndarray, count: int) -> np.ndarray:
    """bool [R, C]: the `count` smallest entries of each column of score [R, C]."""
    R, C = score.shape
    out = np.zeros((R, C), bool)
    if count >= R:
        out[:] = True
    elif count > 0:
        np.put_along_axis(out, np.argpartition(score, count - 1, axis=0)[:count], True, axis=0)
    return out


def two_of_four(score: np.ndarray) -> np.ndarray:
    """keep [K, N]: in each group of four consecutive rows and each column, the two largest scores."""
    K, N = score.shape
    rank = np.argsort(np.argsort(score.reshape(K // 4, 4, N), axis=1, kind="stable"), axis=1, kind="stable")
    return (rank >= 2).reshape(K, N)


def magnitude_keep(w, sparsity: float, pattern: str, parts) -> np.ndarray:
    """keep [K, N]: the largest |w|, per HF matrix (layer-wise), or two of every four inputs.
    (numpy: masks chosen once need no compiling)"""
    score = np.abs(np.asarray(w, np.float32))
    if pattern == "2:4":
        return two_of_four(score)
    keep = np.ones(score.shape, bool)
    for start, width in parts:
        part = score[:, start:start + width]
        keep[:, start:start + width] = ~smallest(part.reshape(-1, 1), int(np.floor(sparsity * part.size + 0.5))).reshape(part.shape)
    return keep


def wanda_keep(w, norms, sparsity: float, pattern: str) -> np.ndarray:
    """keep [K, N]: the largest |w| * ||X_k|| (norms [K]) per output column, or two of every four
    inputs of it."""
    score = np.abs(np.asarray(w, np.float32)) * np.asarray(norms, np.float32)[:, None]
    if pattern == "2:4":
        return two_of_four(score)
    return ~smallest(score, int(np.floor(sparsity * score.shape[0] + 0.5)))


@fast_jit
def input_norms(inputs: list[jax.Array]) -> jax.Array:
    """||X_k||_2 [K] over every calibration row of every input [T, K]."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=0) for x in inputs))


def sparsegpt(w, H, *, sparsity: float, pattern: str, parts=None, bits: int | None = None, group_size: int = 128,
              symmetric: bool = False):
    """SparseGPT on w [K, N] with its input Hessian H: obs.Swept (values, keep; with `bits` the
    grid levels too: pruning and GPTQ in one sweep)."""
    prep = prepare(w, H, group_size=group_size if bits else 1)
    return sweep(prep, bits=bits, group_size=group_size, symmetric=symmetric,
                 select="2:4" if pattern == "2:4" else "unstructured", sparsity=sparsity, parts=parts)


def grid_of(swept, bits: int, group_size: int) -> ZeroPointGrid:
    K = swept.q.shape[0]
    G = -(-K // group_size)
    return ZeroPointGrid(swept.q.astype(np.int64), swept.zeros.astype(np.int64)[:G], swept.scales.astype(np.float16)[:G],
                         np.arange(K) // group_size, bits, group_size)


def prune_layers(config: ModelConfig, flat: dict, sequences: list[list[int]], *, method: str, sparsity: float | None = None,
                 pattern: str | None = None, bits: int | None = None, quant_method: str | None = None, group_size: int = 128,
                 symmetric: bool = False, log: Callable[[str], None] | None = None) -> Pruned:
    """Prune (and with `bits` quantize) `flat`'s decoder matmuls layer by layer (module docstring);
    `sequences`: calibration token ids (magnitude with RTN reads none)."""
    check_supported(config)
    sparsity, pattern = check_options(method, sparsity, pattern, bits, quant_method)
    quant_method = (quant_method or "gptq") if bits else None
    if pattern == "2:4":
        for name in MATMULS:
            if flat[f"layers.{name}"].shape[-2] % 4:
                raise ValueError(f"2:4 needs a multiple of 4 inputs: layers.{name} has {flat[f'layers.{name}'].shape[-2]}")
    weights = {f"layers.{name}": [] for name in MATMULS}
    keeps = {f"layers.{name}": [] for name in MATMULS}
    grids = {f"layers.{name}": [] for name in MATMULS} if bits else None

    def compress(i: int, w: dict, inputs: dict) -> dict:
        w = dict(w)
        for name in MATMULS:
            W = w[name]
            parts = parts_of(config, name, W.shape[-1])
            grid = None
            if method == "sparsegpt":
                joint = bits is not None and quant_method == "gptq"
                out = sparsegpt(W, hessian(inputs[name]), sparsity=sparsity, pattern=pattern, parts=parts,
                                bits=bits if joint else None, group_size=group_size, symmetric=symmetric)
                keep, values = out.keep, out.values
                if joint:
                    grid = grid_of(out, bits, group_size)
            else:
                keep = (magnitude_keep(W, sparsity, pattern, parts) if method == "magnitude"
                        else wanda_keep(W, input_norms(inputs[name]), sparsity, pattern))
                values = np.where(keep, np.asarray(W, np.float32), 0.0).astype(np.float32)
            if bits is not None and grid is None:
                grid = (gptq(values, hessian(inputs[name]), bits=bits, group_size=group_size, symmetric=symmetric, keep=keep)
                        if quant_method == "gptq" else round_to_nearest(values, bits, group_size, symmetric))
            if grid is not None:
                values = grid.dequantize()
                grids[f"layers.{name}"].append(grid)
            values = np.where(keep, values, 0.0).astype(np.float32)  # (exact zeros: a grid's zero level is 0 already)
            weights[f"layers.{name}"].append(values)
            keeps[f"layers.{name}"].append(np.asarray(keep, bool))
            w[name] = jnp.asarray(values)
        return w

    reads_inputs = method != "magnitude" or quant_method == "gptq"
    layer_by_layer(config, flat, sequences if reads_inputs else [], compress, log=log)
    floats = {name: np.asarray(a, np.float32) for name, a in flat.items() if name.split(".", 1)[-1] not in MATMULS}
    return Pruned(floats, weights, keeps, grids, method, sparsity, pattern, bits, group_size, symmetric, quant_method)


def keep_layers_float(pruned: Pruned, flat: dict, layers) -> Pruned:
    """`pruned` with the decoder layers `layers` back to their float weights `flat` (unpruned)."""
    layers = tuple(sorted(set(int(i) for i in layers)))
    weights = {name: list(ws) for name, ws in pruned.weights.items()}
    keep = {name: list(ks) for name, ks in pruned.keep.items()}
    grids = None if pruned.grids is None else {name: list(gs) for name, gs in pruned.grids.items()}
    for i in layers:
        for name in weights:
            weights[name][i] = np.asarray(flat[name][i], np.float32)
            keep[name][i] = None
            if grids is not None:
                grids[name][i] = None
    return dataclasses.replace(pruned, weights=weights, keep=keep, grids=grids, kept_layers=layers)


def global_sparsity(pruned: Pruned) -> float:
    """The fraction of zeros over every pruned matmul weight (kept layers excluded)."""
    zeros = total = 0
    for name, ks in pruned.keep.items():
        for k in ks:
            if k is not None:
                zeros += int(k.size - np.count_nonzero(k))
                total += k.size
    return zeros / max(total, 1)


def sparsity_config(pruned: Pruned, ignore: list[str]) -> dict:
    """compressed-tensors' sparsity_config for `pruned` (module docstring)."""
    fmt = "dense" if pruned.bits else "sparse-24-bitmask" if pruned.pattern == "2:4" else "sparse-bitmask"
    return {"format": fmt, "sparsity_structure": pruned.pattern, "global_sparsity": round(global_sparsity(pruned), 6),
            "targets": ["Linear"], "ignore": ["lm_head", *ignore], "registry_requires_subclass": False}


def write_pruned(dst: str | Path, config: ModelConfig, hf_config: dict, pruned: Pruned, tokenizer, *,
                 extra_config: dict | None = None) -> Path:
    """The folder `dst` (created) holding `pruned` in compressed-tensors' layout (module docstring)."""
    kept = set(pruned.kept_layers)
    entries = {name: [pruned.grids[name][i] if pruned.grids is not None and i not in kept else ws[i] for i in range(len(ws))]
               for name, ws in pruned.weights.items()}
    cal = Calibrated(pruned.floats, entries, "rtn", pruned.bits or 16, pruned.group_size, pruned.symmetric, False)
    qc = {"quant_method": "compressed-tensors"}
    if pruned.bits:
        qc = quantization_config(cal)
    qc["sparsity_config"] = sparsity_config(pruned, [])
    compress = sparse.compress_24 if pruned.pattern == "2:4" else sparse.compress_bitmask

    def float_matrix(name: str, hf_array: np.ndarray) -> dict[str, np.ndarray]:  # a pruned matrix (not a kept one)
        module = name.removesuffix(".weight")
        return {f"{module}.{field}": array for field, array in compress(hf_array).items()}

    return write_checkpoint(dst, config, hf_config, cal, tokenizer, fmt="compressed-tensors", quant_config=qc,
                            kept_layers=pruned.kept_layers, float_matrix=None if pruned.bits else float_matrix,
                            extra_config=extra_config)

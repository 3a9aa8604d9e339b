"""Quantize a model's matmul weights layer by layer from calibration text: RTN, GPTQ, AWQ or
SmoothQuant (W8A8: int8 weights per column, int8 activations per token; `smoothquant`).

    result = calibrate(config, flat_params, sequences, method="gptq", bits=4, group_size=128)

Layers go in order; each layer's matmul inputs come from the layers before it already quantized
(`forward.layer_forward` with their dequantized grids), as GPTQ and AWQ do (SmoothQuant's come
from the float model's layers, as its reference implementation collects them). The result holds one
`ZeroPointGrid` per matmul parameter and layer (the fused [K, N] columns: q | k | v, gate | up)
and the float parameters, which AWQ changes (the scales it divides out of the norms and the v /
up projections): `export.write_checkpoint` turns it into a checkpoint `LLM` loads.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration import awq, smoothquant
from jaxinfer.calibration.forward import MATMULS, check_supported, embed, layer_forward, layer_weights
from jaxinfer.calibration.gptq import gptq, hessian
from jaxinfer.calibration.grid import ZeroPointGrid, round_to_nearest
from jaxinfer.config import ModelConfig

METHODS = ("rtn", "gptq", "awq", "smoothquant")


@dataclasses.dataclass
class Calibrated:
    floats: dict[str, np.ndarray]  # flat name -> float32 array: every parameter but the matmul weights
    grids: dict[str, list[ZeroPointGrid]]  # "layers.qkv_proj" ... -> one grid per layer, [K, N]
    method: str
    bits: int
    group_size: int
    symmetric: bool
    act_order: bool
    alpha: float | None = None  # SmoothQuant's migration strength (None: no smoothing)


def calibrate(config: ModelConfig, flat: dict, sequences: list[list[int]], *, method: str, bits: int = 4,
              group_size: int = 128, symmetric: bool = False, act_order: bool = False,
              log: Callable[[str], None] | None = None, alpha: float | None = 0.5) -> Calibrated:
    """`flat`: the float parameters (name -> array, stacked [L, ...]); `sequences`: calibration
    token ids (RTN reads none). See the module docstring. `alpha`: SmoothQuant's (None: W8A8
    without smoothing); the other methods ignore it."""
    check_supported(config)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    if act_order and method != "gptq":
        raise ValueError("act_order is GPTQ's (desc_act)")
    if method == "awq" and symmetric:
        raise ValueError("AWQ checkpoints store zero points: symmetric=False")
    if method == "smoothquant" and bits != 8:
        raise ValueError(f"smoothquant is W8A8: bits=8 (got {bits})")
    if method == "smoothquant" and alpha is not None and not 0 <= alpha <= 1:
        raise ValueError(f"smoothquant alpha={alpha}: expected a number in [0, 1]")
    flat = {name: jnp.asarray(a, jnp.float32) for name, a in flat.items()}
    grids = {f"layers.{name}": [] for name in MATMULS}
    reads_inputs = method not in ("rtn", "smoothquant") or (method == "smoothquant" and alpha is not None)
    xs = [embed(flat, ids) for ids in sequences] if reads_inputs else []
    for i in range(config.num_layers):
        t0 = time.perf_counter()
        w = layer_weights(flat, i)
        outs = [layer_forward(config, w, x) for x in xs]
        inputs = {name: [taps[name] for _, taps in outs] for name in MATMULS}
        if method == "awq":
            w, inputs = scale_layer(config, w, inputs, bits=bits, group_size=group_size)
        if method == "smoothquant":
            w = smoothquant.smooth_layer(config, w, inputs, alpha)
        for name in MATMULS:
            if method == "gptq":
                grid = gptq(np.asarray(w[name]), hessian(inputs[name]), bits=bits, group_size=group_size,
                            symmetric=symmetric, act_order=act_order)
            elif method == "awq":
                clip = awq.search_clip(w[name], awq.sample_rows(inputs[name]), bits=bits, group_size=group_size, symmetric=False)
                grid = awq.quantize_clipped(np.asarray(w[name]), clip, bits=bits, group_size=group_size, symmetric=False)
            elif method == "smoothquant":
                grid = smoothquant.quantize_columns(w[name])
            else:
                grid = round_to_nearest(np.asarray(w[name]), bits, group_size, symmetric)
            grids[f"layers.{name}"].append(grid)
            if method != "smoothquant":  # (whose next layer reads the float model's output)
                w[name] = jnp.asarray(grid.dequantize())
        for name, value in w.items():  # AWQ's / SmoothQuant's folded scales (norms, biases) back into the stacked floats
            if name not in MATMULS:
                flat[f"layers.{name}"] = flat[f"layers.{name}"].at[i].set(value)
        # SmoothQuant's statistics come from the float model, as its reference implementation takes
        # them (one pass); GPTQ / AWQ see the layers before already quantized (a second pass)
        xs = [x for x, _ in outs] if method == "smoothquant" else [layer_forward(config, w, x)[0] for x in xs]
        del outs
        if log:
            log(f"layer {i + 1}/{config.num_layers}: {time.perf_counter() - t0:.1f} s")
    floats = {name: np.asarray(a) for name, a in flat.items() if name.split(".", 1)[-1] not in MATMULS}
    return Calibrated(floats, grids, method, bits, group_size, symmetric, act_order,
                      alpha if method == "smoothquant" else None)


def scale_layer(config: ModelConfig, w: dict, inputs: dict, *, bits: int, group_size: int):
    """AWQ's scales for each matmul input of one layer, multiplied into the weights' rows and
    divided out of the operation feeding them (awq's docstring). Returns (w, inputs / scales)."""
    w, inputs = dict(w), dict(inputs)
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def scale(name: str):
        s = awq.search_scales(w[name], awq.sample_rows(inputs[name]), bits=bits, group_size=group_size, symmetric=False)
        w[name] = w[name] * s[:, None]
        inputs[name] = [x / s for x in inputs[name]]
        return s

    s = scale("qkv_proj")
    w["attn_norm"] = w["attn_norm"] / s
    if q_dim == kv_dim:  # as many KV heads as query heads: attention's output channel c is v's column c
        s = scale("o_proj")
        v_cols = slice(q_dim + kv_dim, q_dim + 2 * kv_dim)
        w["qkv_proj"] = w["qkv_proj"].at[:, v_cols].divide(s[None, :])
        if "qkv_bias" in w:
            w["qkv_bias"] = w["qkv_bias"].at[v_cols].divide(s)
    s = scale("gate_up_proj")
    w["mlp_norm"] = w["mlp_norm"] / s
    s = scale("down_proj")  # silu(gate) * up is linear in up: its columns take 1 / s
    I = c.intermediate_size
    w["gate_up_proj"] = w["gate_up_proj"].at[:, I:].divide(s[None, :])
    if "gate_up_bias" in w:
        w["gate_up_bias"] = w["gate_up_bias"].at[I:].divide(s)
    return w, inputs

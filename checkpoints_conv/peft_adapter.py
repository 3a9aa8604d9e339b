"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

    adapter = read_lora_adapter("./my-adapter", num_layers=16, max_rank=16)
    adapter.weights[(layer, "q_proj")]  # (A [r, in], B [out, r]) as PEFT stores them (torch's [out, in])
    adapter.scale                        # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora

The delta of a targeted projection is x @ A^T @ B^T * scale. Refused, with a message naming the
adapter and the feature: DoRA, adapters on the embeddings or the LM head (or any module outside
q/k/v/o/gate/up/down, or outside q/k/v/o on a MoE model, whose experts take no adapter),
`modules_to_save`, per-module rank or alpha patterns, LoRA biases, `layers_to_transform`, a rank
above `max_rank`, a layer index the model lacks, and files that are missing or malformed. Only
safetensors are read (never a pickle: adapter_model.bin is refused).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served (the message names it and what is wrong)."""


@dataclasses.dataclass
class LoraAdapter:
    path: Path
    rank: int
    scale: float
    target_modules: tuple[str, ...]  # the projections it changes (of LORA_MODULES)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]  # (layer, module) -> (A [r, in], B [out, r]) float32


def read_lora_adapter(path, *, num_layers: int, max_rank: int, modules: tuple[str, ...] = LORA_MODULES) -> LoraAdapter:
    """`modules`: the projections the model serves LoRA on (a MoE model: the attention's only)."""
    path = Path(path)
    label = f"LoRA adapter {str(path)!r}"
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise AdapterError(f"{label}: no adapter_config.json")
    if not weights_file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise AdapterError(f"{label}: no adapter_model.safetensors" + (" (adapter_model.bin is a pickle, never loaded)" if pickled else ""))
    try:
        cfg = json.loads(config_file.read_text())
    except ValueError as e:
        raise AdapterError(f"{label}: adapter_config.json is not valid JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{label}: peft_type {cfg.get('peft_type')!r}, only LORA is served")
    unsupported = [name for name, bad in (
        ("use_dora (DoRA)", cfg.get("use_dora")),
        ("modules_to_save", cfg.get("modules_to_save")),
        ("rank_pattern", cfg.get("rank_pattern")),
        ("alpha_pattern", cfg.get("alpha_pattern")),
        ("lora_bias", cfg.get("lora_bias")),
        ("bias != 'none'", cfg.get("bias", "none") != "none"),
        ("layers_to_transform", cfg.get("layers_to_transform") is not None),
        ("fan_in_fan_out", cfg.get("fan_in_fan_out")),
    ) if bad]
    if unsupported:
        raise AdapterError(f"{label}: unsupported feature(s): {', '.join(unsupported)}")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{label}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise AdapterError(f"{label}: rank {rank} is above max_lora_rank={max_rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # a regex over module names
        targets = [m for m in LORA_MODULES if re.search(targets, m)] or [targets]
    bad = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(modules))
    if bad:
        raise AdapterError(f"{label}: target module(s) {bad} are not served (LoRA on {', '.join(modules)} only)")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(weights_file), "np") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise AdapterError(f"{label}: tensor {key!r} is not a LoRA A/B weight of a projection served "
                                       f"({', '.join(modules)}: no embedding, LM head, MoE expert or other module)")
                layer, module, which = int(m.group(1)), m.group(2), m.group(3)
                if module not in modules:
                    raise AdapterError(f"{label}: tensor {key!r}: module {module!r} is not served")
                if layer >= num_layers:
                    raise AdapterError(f"{label}: tensor {key!r}: the model has {num_layers} layers")
                parts.setdefault((layer, module), {})[which] = f.get_tensor(key).astype(np.float32)
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise AdapterError(f"{label}: adapter_model.safetensors cannot be read ({e})") from None
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{label}: layer {layer} {module} has lora_{''.join(sorted(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{label}: layer {layer} {module}: lora_A {a.shape} / lora_B {b.shape} do not have rank {rank}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise AdapterError(f"{label}: adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(path, rank, float(scale), tuple(sorted({m for _, m in weights})), weights)

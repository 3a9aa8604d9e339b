"""LoRA adapters in the model: a fixed table of adapter slots on the device, and the delta each
token's slot adds to the projections.

Slot 0 is "no adapter" (all zeros); slots 1..N-1 hold adapters, filled and evicted by the engine
(`jaxinfer.engine.lora`) without recompiling: the step only sees the table's fixed shapes and a
slot index per sequence. Per layer, each projection has an A and a B stack over the slots, the
scale folded into B and ranks padded to the table's rank R:

    lora.qkv_a      [L, N, H, 3R]       lora.qkv_b      [L, N, 3R, (Hq + 2Hkv')D]   q | k | v blocks
    lora.o_a        [L, N, Hq D, R]     lora.o_b        [L, N, R, H]
    lora.gate_up_a  [L, N, H, 2R]       lora.gate_up_b  [L, N, 2R, 2I]              gate | up blocks
    lora.down_a     [L, N, I, R]        lora.down_b     [L, N, R, H]

The fused B stacks take the fused weight's columns (shard-major, `param_layout.param_columns`),
so tensor parallelism splits them like qkv_proj / gate_up_proj; o and down's A stacks split on
their rows like o_proj / down_proj, and the partial delta joins the partial product before the
projection's all-reduce. An adapter that leaves a projection alone has zeros there.

The delta (`lora_delta`) is computed over every slot at once and masked to each token's slot:
two small matmuls ([T, K] x [K, N R] and [T, N R] x [N R, out]), no gather of per-token matrices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.param_layout import num_kv_heads_stored, param_columns

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# the HF modules feeding each block of a fused A / B stack, in block order
BLOCKS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_PART_MODULE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}

LORA_AXES = {
    "lora.qkv_a": ("layers", None, "embed", None), "lora.qkv_b": ("layers", None, None, "qkv"),
    "lora.o_a": ("layers", None, "heads", None), "lora.o_b": ("layers", None, None, "embed"),
    "lora.gate_up_a": ("layers", None, "embed", None), "lora.gate_up_b": ("layers", None, None, "mlp"),
    "lora.down_a": ("layers", None, "mlp", None), "lora.down_b": ("layers", None, None, "embed"),
}


@dataclasses.dataclass(frozen=True)
class LoraTable:
    num_slots: int  # adapters + 1 (slot 0: none)
    rank: int  # every adapter's rank is padded to this


def lora_shapes(config: ModelConfig, table: LoraTable, tp: int = 1) -> dict[str, tuple[int, ...]]:
    c, N, R = config, table.num_slots, table.rank
    L, H, I = c.num_layers, c.hidden_size, c.intermediate_size
    q_dim = c.num_heads * c.head_dim
    qkv_dim = q_dim + 2 * num_kv_heads_stored(c, tp) * c.head_dim
    return {
        "lora.qkv_a": (L, N, H, 3 * R), "lora.qkv_b": (L, N, 3 * R, qkv_dim),
        "lora.o_a": (L, N, q_dim, R), "lora.o_b": (L, N, R, H),
        "lora.gate_up_a": (L, N, H, 2 * R), "lora.gate_up_b": (L, N, 2 * R, 2 * I),
        "lora.down_a": (L, N, I, R), "lora.down_b": (L, N, R, H),
    }


class LoraSlots(nnx.Module):
    """The slot table's A / B stacks (zeros: every slot empty), float32."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        for name, shape in shapes.items():
            setattr(self, name.removeprefix("lora."), nnx.Param(jnp.zeros(shape, jnp.float32)))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def fuse_adapter(config: ModelConfig, table: LoraTable, weights: dict, scale: float, tp: int = 1) -> dict[str, np.ndarray]:
    """One adapter as one slot of the table: name -> float32 [L, ...] (the stack without its slot
    axis). `weights`: (layer, HF module) -> (A [r, in], B [out, r]) as PEFT stores them."""
    shapes = {name: (shape[0],) + shape[2:] for name, shape in lora_shapes(config, table, tp).items()}
    out = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    R = table.rank
    columns = param_columns(config, tp)
    for (layer, module), (a, b) in weights.items():
        r = a.shape[0]
        for proj, modules in BLOCKS.items():
            if module not in modules:
                continue
            block = modules.index(module)
            rows = slice(block * R, block * R + r)
            out[f"lora.{proj}_a"][layer, :, rows] = a.T
            bt = b.T * scale  # [r, out] of this module
            if proj in ("o", "down"):
                out[f"lora.{proj}_b"][layer, rows] = bt
                continue
            col = 0  # the fused columns, shard-major: where this module's HF rows go
            for part, start, width in columns["layers.qkv_proj" if proj == "qkv" else "layers.gate_up_proj"]:
                if _PART_MODULE[part] == module:
                    out[f"lora.{proj}_b"][layer, rows, col : col + width] = bt[:, start : start + width]
                col += width
    return out


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slot: jax.Array) -> jax.Array:
    """x [T, K] (this device's K), a [N, K, R'], b [N, R', O], slot [T] int32 -> float32 [T, O]:
    x @ a[slot] @ b[slot] per token, over all slots with the others masked out."""
    N, K, Rp = a.shape
    xa = jnp.dot(x.astype(jnp.float32), a.transpose(1, 0, 2).reshape(K, N * Rp)).reshape(-1, N, Rp)  # [T, N, R']
    xa = jnp.where((slot[:, None] == jnp.arange(N))[:, :, None], xa, 0.0)
    return jnp.dot(xa.reshape(-1, N * Rp), b.reshape(N * Rp, -1))

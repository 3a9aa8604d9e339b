"""LoRA adapters in the model: a fixed table of adapter slots on the device, and the delta each
token's slot adds to the projections.

Slot 0 is "no adapter" (all zeros); slots 1..N-1 hold adapters, filled and evicted by the engine
(`jaxinfer.engine.lora`) without recompiling: the step only sees the table's fixed shapes and a
slot index per sequence. Per layer, each projection input has one A stack over the slots (the
blocks of the modules sharing that input side by side), each HF module its own B stack, the
scale folded into B and ranks padded to the table's rank R:

    lora.qkv_a      [L, N, H, 3R]   (q | k | v)   lora.q_b [L, N, R, Hq D]  lora.k_b, lora.v_b [L, N, R, Hkv' D]
    lora.o_a        [L, N, Hq D, R]               lora.o_b [L, N, R, H]
    lora.gate_up_a  [L, N, H, 2R]   (gate | up)   lora.gate_b, lora.up_b [L, N, R, I]
    lora.down_a     [L, N, I, R]                  lora.down_b [L, N, R, H]

Tensor parallelism splits the B stacks of q / k / v / gate / up on their columns (each device's
columns are then exactly its part of the fused qkv_proj / gate_up_proj, in the same order), and
the A stacks of o / down on their rows; the partial delta of o and down joins the projection's
partial sum before its all-reduce. An adapter that leaves a module alone has zeros there. A MoE
model's table has the attention's stacks only (its experts take no adapter: `served_modules`).

The model adds each projection's delta through its kernel table (`Kernels.lora_delta`, from
`pallas_kernels.lora_sgmv`): on the CPU every slot at once, masked to each token's slot (two
plain matmuls); on TPU and GPU grouped SGMV-style kernels whose work follows the adapters the
tokens use. Steps where no sequence uses an adapter skip it (`RaggedBatch.lora_slots` is None).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints_conv.views import QK_ROWS_REORDERED, pairs_to_halves
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models.param_layout import num_kv_heads_stored, param_columns

# projection input -> the HF modules reading it, in the order of their blocks in its A stack
A_BLOCKS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
B_NAME = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def served_modules(config: ModelConfig) -> tuple[str, ...]:
    """The projections an adapter may change: all seven, or on a MoE model the attention's (its
    MLP is experts, which take no adapter here)."""
    attention = A_BLOCKS["qkv"] + A_BLOCKS["o"]
    return attention if config.is_moe else tuple(B_NAME)


LORA_AXES = {
    "lora.qkv_a": ("layers", None, "embed", None), "lora.q_b": ("layers", None, None, "heads"),
    "lora.k_b": ("layers", None, None, "qkv"), "lora.v_b": ("layers", None, None, "qkv"),
    "lora.o_a": ("layers", None, "heads", None), "lora.o_b": ("layers", None, None, "embed"),
    "lora.gate_up_a": ("layers", None, "embed", None), "lora.gate_b": ("layers", None, None, "mlp"),
    "lora.up_b": ("layers", None, None, "mlp"),
    "lora.down_a": ("layers", None, "mlp", None), "lora.down_b": ("layers", None, None, "embed"),
}


@dataclasses.dataclass(frozen=True)
class LoraTable:
    num_slots: int  # adapters + 1 (slot 0: none)
    rank: int  # every adapter's rank is padded to this


def lora_shapes(config: ModelConfig, table: LoraTable, tp: int = 1) -> dict[str, tuple[int, ...]]:
    c, N, R = config, table.num_slots, table.rank
    if any(kind.head_dim is not None for kind in c.layer_kinds()) or c.kv_shared_layers or c.per_layer_input_size:
        raise ConfigError(f"LoRA adapters for {c.model_type} (layers of several attention shapes, shared K/V or per-layer "
                          "inputs: Gemma 4) are not supported")
    if c.is_mla:
        raise ConfigError(f"LoRA adapters for {c.model_type} (multi-head latent attention: DeepSeek) are not supported")
    L, H, I = c.num_layers, c.hidden_size, c.intermediate_size
    q_dim, kv_dim = c.num_heads * c.head_dim, num_kv_heads_stored(c, tp) * c.head_dim
    shapes = {
        "lora.qkv_a": (L, N, H, 3 * R), "lora.q_b": (L, N, R, q_dim), "lora.k_b": (L, N, R, kv_dim), "lora.v_b": (L, N, R, kv_dim),
        "lora.o_a": (L, N, q_dim, R), "lora.o_b": (L, N, R, H),
    }
    if not c.is_moe:  # a MoE model's MLP (experts) takes no adapter: served_modules
        shapes.update({
            "lora.gate_up_a": (L, N, H, 2 * R), "lora.gate_b": (L, N, R, I), "lora.up_b": (L, N, R, I),
            "lora.down_a": (L, N, I, R), "lora.down_b": (L, N, R, H),
        })
    return shapes


class LoraSlots(nnx.Module):
    """The slot table's A / B stacks (zeros: every slot empty), in `dtype`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype=jnp.float32):
        for name, shape in shapes.items():
            setattr(self, name.removeprefix("lora."), nnx.Param(jnp.zeros(shape, dtype)))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: var.get_value() for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def fuse_adapter(config: ModelConfig, table: LoraTable, weights: dict, scale: float, tp: int = 1) -> dict[str, np.ndarray]:
    """One adapter as one slot of the table: name -> float32 [L, ...] (the stack without its slot
    axis). `weights`: (layer, HF module) -> (A [r, in], B [out, r]) as PEFT stores them."""
    shapes = {name: (shape[0],) + shape[2:] for name, shape in lora_shapes(config, table, tp).items()}
    out = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    R = table.rank
    qkv_columns = param_columns(config, tp)["layers.qkv_proj"]
    served = served_modules(config)
    for (layer, module), (a, b) in weights.items():
        if module not in served:
            raise ValueError(f"LoRA on {module} is not served on {config.model_type} (only {', '.join(served)})")
        r = a.shape[0]
        proj = next(p for p, modules in A_BLOCKS.items() if module in modules)
        block = A_BLOCKS[proj].index(module)
        out[f"lora.{proj}_a"][layer, :, block * R : block * R + r] = a.T
        bt = b.T * scale  # [r, out features in HF order]
        if config.model_type in QK_ROWS_REORDERED and module in ("q_proj", "k_proj"):
            # the base q/k rows were reordered from RoPE pairs to halves at load (checkpoints_conv.views): the same here
            bt = bt.reshape(r, -1, config.head_dim)[:, :, pairs_to_halves(config.head_dim)].reshape(r, -1)
        name = f"lora.{B_NAME[module]}_b"
        if module in ("k_proj", "v_proj"):  # the stored KV columns, shard by shard (KV heads may be replicated)
            part = module[0]
            col = 0
            for seg_part, start, width in qkv_columns:
                if seg_part == part:
                    out[name][layer, :r, col : col + width] = bt[:, start : start + width]
                    col += width
        else:
            out[name][layer, :r] = bt
    return out

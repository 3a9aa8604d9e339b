"""Hugging Face checkpoints with block-scaled fp8 weights (quant_method "fp8": DeepSeek-V3 / R1,
Kimi K2, and the "-FP8" releases of Qwen3 and others), read as fp8 grids.

    config.json  quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [bn, bk]}          # [128, 128] as released
    <m>.weight            float8_e4m3fn [N, K]
    <m>.weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]
    w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]     (no weight_block_size: one scale)

`Fp8HFSource` lists each such `<m>.weight` under its own name ([N, K]; a float read dequantizes
it, as transformers does on a CPU: one float32 product per weight) and hands it out as an fp8
`Grid` (checkpoints_conv.quantized): the e4m3 values as stored and, for each row, its block's
scale per group of 128 input columns, which is jaxinfer's fp8 mode with groups of 128 (a block
of bk = 256 is two groups sharing a scale; a single scale is every group's). The activations are
not quantized (the checkpoint's "dynamic" scheme leaves them to the runtime: here they stay in
the compute dtype), and a "static" scheme's input scales are refused by name, as is a block
width over K that is not a multiple of 128.
"""

from __future__ import annotations

import numpy as np

from checkpoints_conv.errors import CheckpointError
from checkpoints_conv.quantized import Grid, QuantLayout
from checkpoints_conv.tensor_source import TensorSource

GROUP = 128  # rows of K per scale, as the fp8 kernels run them
FP8_GROUPS = QuantLayout(bits=8, group_size=GROUP, has_offsets=False, scale_dtype=np.dtype(np.float32), fp8=True)


def read_fp8_config(config: dict, source: str = "config.json") -> tuple[int, int] | None:
    """The (bn, bk) blocks of a quant_method "fp8" config (None: one scale per matrix);
    CheckpointError for what is not read here."""
    qc = config["quantization_config"]
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: fp8 format {qc.get('fmt')!r} is not supported (supported: 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{source}: fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported "
                              f"(supported: 'dynamic'; the activations run in the compute dtype)")
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if len(block) != 2 or block[0] < 1 or block[1] < 1 or block[1] % GROUP:
        raise CheckpointError(f"{source}: fp8 weight_block_size={block!r}: expected [rows, columns] with columns a "
                              f"multiple of {GROUP}")
    return int(block[0]), int(block[1])


class Fp8HFSource(TensorSource):
    """An HF checkpoint with fp8 weights and `weight_scale_inv` blocks (module docstring)."""

    def __init__(self, source: TensorSource, block: tuple[int, int] | None, path: str = "checkpoint"):
        self.source, self.block, self.path = source, block, path
        listing = dict(source.listing())
        self.layers = {f"{name[: -len('_scale_inv')]}": listing[name[: -len("_scale_inv")]]
                       for name in listing if name.endswith(".weight_scale_inv")}  # "<m>.weight" -> [N, K]
        self._listing = [(n, tuple(s)) for n, s in listing.items() if not n.endswith(".weight_scale_inv")]

    def listing(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(self._listing)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if name not in self.layers:
            return self.source.read(name, index)
        w = self.read_grid(name).dequantize()
        return w if index is None else w[index]

    def quantized(self):
        return {name: FP8_GROUPS for name in self.layers}

    def read_grid(self, name: str) -> Grid:
        N, K = self.layers[name]
        values = self.source.read(name)
        scale_inv = np.asarray(self.source.read(f"{name}_scale_inv"), np.float32)
        groups = -(-K // GROUP)
        if self.block is None:
            if scale_inv.size != 1:
                raise CheckpointError(f"{self.path}: {name}_scale_inv has shape {scale_inv.shape}; without "
                                      f"weight_block_size one scale per matrix is expected")
            scales = np.full((N, groups), scale_inv.reshape(()), np.float32)
        else:
            bn, bk = self.block
            want = (-(-N // bn), -(-K // bk))
            if scale_inv.shape != want:
                raise CheckpointError(f"{self.path}: {name}_scale_inv has shape {scale_inv.shape}, expected {want} "
                                      f"for a [{N}, {K}] weight in blocks of {list(self.block)}")
            scales = np.repeat(np.repeat(scale_inv, bn, axis=0)[:N], bk // GROUP, axis=1)[:, :groups]  # [N, groups]
        return Grid(values, np.ascontiguousarray(scales), None, FP8_GROUPS)

    def input_order(self, name: str):
        return None

    def close(self) -> None:
        self.source.close()

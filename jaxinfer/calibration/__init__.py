"""Weight quantization from calibration text, in JAX: RTN, GPTQ and AWQ, written as checkpoints.

    jaxinfer quantize MODEL OUT --method gptq --bits 4 --group-size 128
    quantize("./Llama-3.2-1B", "./llama-gptq", method="gptq")        # the same from Python
    LLM("./llama-gptq")                                                # runs the grids as they are stored

- `forward`: the decoder layer by layer over whole sequences, with every matmul's input;
- `grid`: integer grids with zero points (what the formats store), round to nearest;
- `gptq`, `awq`: the two calibration methods;
- `calibrate`: the layer-by-layer driver; `export`: the HF folder in GPTQ / AWQ /
  compressed-tensors layout (checkpoints_conv.hf_quantized reads it back).

The default calibration text (`calibration.txt`, a few hundred tokens of plain English prose
written for this purpose) is separate from any text perplexity is measured on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax.numpy as jnp
from flax import nnx

import checkpoints_conv
from jaxinfer.calibration.calibrate import METHODS, Calibrated, calibrate
from jaxinfer.calibration.export import write_checkpoint
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tree import nested_to_flat

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")

__all__ = ["CALIBRATION_TEXT", "METHODS", "Calibrated", "calibrate", "calibration_sequences", "quantize", "write_checkpoint"]


def calibration_sequences(tokenizer, text: str, num_tokens: int, seq_len: int) -> list[list[int]]:
    """The first `num_tokens` tokens of `text` (repeated if it is shorter) in sequences of seq_len."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the calibration text has no tokens")
    while len(ids) < num_tokens:
        ids = ids + ids
    ids = ids[:num_tokens]
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def quantize(model, out, *, method: str = "gptq", bits: int = 4, group_size: int = 128, symmetric: bool = False,
             act_order: bool = False, calibration_text: str | None = None, num_tokens: int = 512, seq_len: int = 256,
             log: Callable[[str], None] | None = None) -> Path:
    """Quantize `model` (a path, or None for the default) with `method` and write the folder `out`."""
    source = resolve_model(model)
    config = read_config(source)
    _, state = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    flat = nested_to_flat(nnx.to_pure_dict(state))
    tokenizer = load_tokenizer(source)
    text = calibration_text if calibration_text is not None else CALIBRATION_TEXT.read_text()
    sequences = calibration_sequences(tokenizer, text, num_tokens, seq_len)
    cal = calibrate(config, flat, sequences, method=method, bits=bits, group_size=group_size, symmetric=symmetric,
                    act_order=act_order, log=log)
    hf_config = checkpoints_conv.read_checkpoint_config(source.path)
    return write_checkpoint(out, config, hf_config, cal, tokenizer)

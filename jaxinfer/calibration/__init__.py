"""Weight quantization from calibration text, in JAX: RTN, GPTQ and AWQ, written as checkpoints.

    jaxinfer quantize MODEL OUT --method gptq --bits 4 --group-size 128
    quantize("./Llama-3.2-1B", "./llama-gptq", method="gptq")        # the same from Python
    LLM("./llama-gptq")                                                # runs the grids as they are stored

- `forward`: the decoder layer by layer over whole sequences, with every matmul's input;
- `grid`: integer grids with zero points (what the formats store), round to nearest;
- `gptq`, `awq`: the two calibration methods; `smoothquant`: W8A8 (int8 weights per column,
  int8 activations per token) with the activations' outlier channels folded into the weights
  (`--method smoothquant --bits 8 --alpha 0.5`, written in compressed-tensors' int-quantized format);
- `calibrate`: the layer-by-layer driver; `export`: the HF folder in GPTQ / AWQ /
  compressed-tensors layout (checkpoints_conv.hf_quantized reads it back);
- `obs`: the blocked lazy Optimal-Brain-Surgeon loop GPTQ and SparseGPT share (Hessian, damping,
  Cholesky of H⁻¹); `pruning`: magnitude / Wanda / SparseGPT, unstructured or 2:4 (`jaxinfer prune`,
  `prune(...)`), in compressed-tensors' sparse formats (checkpoints_conv.sparse reads them back);
- `sensitivity`: each layer's held-out perplexity alone compressed; `--keep-sensitive N` /
  `--ppl-budget PCT` keep the most sensitive layers float (held out: `sensitivity.txt`).

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
from jaxinfer.calibration import pruning, sensitivity
from jaxinfer.calibration.export import write_checkpoint
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tokenizer import load_tokenizer
from jaxinfer.tree import nested_to_flat

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")

__all__ = ["CALIBRATION_TEXT", "METHODS", "Calibrated", "calibrate", "calibration_sequences", "prune", "quantize",
           "write_checkpoint"]


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
             log: Callable[[str], None] | None = None, alpha: float | None = 0.5, keep_sensitive: int = 0,
             ppl_budget: float | None = None, sensitivity_text: str | None = None) -> Path:
    """Quantize `model` (a path, or None for the default) with `method` and write the folder `out`.
    `alpha`: SmoothQuant's migration strength (None: W8A8 without smoothing). `keep_sensitive` N /
    `ppl_budget` PCT: the N decoder layers whose quantization alone costs the most held-out
    perplexity, or as few as keep it within PCT %, stay float (`sensitivity`)."""
    sensitive = bool(keep_sensitive) or ppl_budget is not None
    if sensitive and method == "smoothquant":
        raise ValueError("keep_sensitive / ppl_budget: not with smoothquant (its int8 activations are not measured)")
    source, config, flat, tokenizer, sequences = _float_model_and_text(model, calibration_text, num_tokens, seq_len,
                                                                       keep_sensitive, ppl_budget)
    cal = calibrate(config, flat, sequences, method=method, bits=bits, group_size=group_size, symmetric=symmetric,
                    act_order=act_order, log=log, alpha=alpha)
    hf_config = checkpoints_conv.read_checkpoint_config(source.path)
    if not sensitive:
        return write_checkpoint(out, config, hf_config, cal, tokenizer)
    sens = sensitivity.keep_sensitive(config, flat, sensitivity.calibrated_layers(cal, config.num_layers), tokenizer,
                                      keep=keep_sensitive, budget=ppl_budget, text=sensitivity_text, log=log)
    return write_checkpoint(out, config, hf_config, sensitivity.keep_calibrated(cal, flat, sens.kept), tokenizer,
                            kept_layers=sens.kept, extra_config={sensitivity.RECORD_KEY: sens.record()})


def prune(model, out, *, method: str = "sparsegpt", sparsity: float | None = None, pattern: str | None = None,
          bits: int | None = None, quant_method: str | None = None, group_size: int = 128, symmetric: bool = False,
          calibration_text: str | None = None, num_tokens: int = 512, seq_len: int = 256, keep_sensitive: int = 0,
          ppl_budget: float | None = None, sensitivity_text: str | None = None,
          log: Callable[[str], None] | None = None) -> Path:
    """Prune `model` (a path, or None for the default) with `method` (magnitude, wanda, sparsegpt),
    `sparsity` (default 0.5) unstructured or `pattern` "2:4", then with `bits` quantize it
    (`quant_method` gptq / rtn), and write the compressed-tensors folder `out` (`pruning`).
    `keep_sensitive` / `ppl_budget`: as `quantize`'s."""
    pruning.check_options(method, sparsity, pattern, bits, quant_method)
    source, config, flat, tokenizer, sequences = _float_model_and_text(model, calibration_text, num_tokens, seq_len,
                                                                       keep_sensitive, ppl_budget)
    pruned = pruning.prune_layers(config, flat, sequences, method=method, sparsity=sparsity, pattern=pattern, bits=bits,
                                  quant_method=quant_method, group_size=group_size, symmetric=symmetric, log=log)
    extra = {}
    if keep_sensitive or ppl_budget is not None:
        sens = sensitivity.keep_sensitive(config, flat, [pruned.layer(i) for i in range(config.num_layers)], tokenizer,
                                          keep=keep_sensitive, budget=ppl_budget, text=sensitivity_text, log=log)
        pruned, extra = pruning.keep_layers_float(pruned, flat, sens.kept), {sensitivity.RECORD_KEY: sens.record()}
    hf_config = checkpoints_conv.read_checkpoint_config(source.path)
    return pruning.write_pruned(out, config, hf_config, pruned, tokenizer, extra_config=extra)


def _float_model_and_text(model, calibration_text: str | None, num_tokens: int, seq_len: int, keep_sensitive: int,
                          ppl_budget: float | None):
    """What `quantize` and `prune` start from: (source, config, flat float32 params, tokenizer,
    calibration sequences); the sensitivity options checked against the model's layer count."""
    source = resolve_model(model)
    config = read_config(source)
    sensitivity.check_options(keep_sensitive, ppl_budget, config.num_layers)
    _, state = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    flat = nested_to_flat(nnx.to_pure_dict(state))
    tokenizer = load_tokenizer(source)
    text = calibration_text if calibration_text is not None else CALIBRATION_TEXT.read_text()
    return source, config, flat, tokenizer, calibration_sequences(tokenizer, text, num_tokens, seq_len)

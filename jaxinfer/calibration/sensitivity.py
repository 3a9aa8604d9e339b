"""Per-layer sensitivity: which decoder layers to keep in floats while the others are quantized or
pruned.

    jaxinfer quantize MODEL OUT --method gptq --keep-sensitive 2   # the 2 layers that hurt most alone stay float
    jaxinfer prune MODEL OUT --method wanda --ppl-budget 5         # as few as keep the perplexity within +5 %

Each decoder layer's effect is measured alone: the held-out perplexity of the model with only that
layer compressed (its weights as the checkpoint will have them: pruned, dequantized, AWQ's folded
scales), every other layer float. `keep=N` keeps the N layers with the highest such perplexity;
`budget=PCT` keeps, in that order, the fewest layers for which the model with every other layer
compressed measures within PCT % of the float model's perplexity (all layers, if none does).
The compressed weights are those of the one layer-by-layer pass (each layer calibrated on the
earlier layers compressed, the kept ones included): keeping a layer does not recalibrate the
layers after it.

Held-out text: `sensitivity.txt` (prose written for this; neither the calibration text nor
tests/data/perplexity_text.txt, which the tests and scripts/quantization_quality.py score on), its
first `num_tokens` tokens. Perplexities are the layer-by-layer forward (forward.py) in float32, the
float model's activations before each layer computed once. The quantizers store the result in the
checkpoint's config: the kept layers' modules in the format's skip list (export.skip_modules) and
`jaxinfer_compression` (the kept layers and the perplexities) beside it.

Loading: the kept layers' tensors are plain float `.weight`s, so every reader loads them as floats.
jaxinfer stacks a matmul's layers into one parameter, and a stack with a float layer loads as floats
entirely (checkpoints_conv.quantized.param_layouts; exact, but the other layers' grids are then
dequantized: no per-layer mixed precision inside one stack yet); pruned layers are floats anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.calibrate import Calibrated
from jaxinfer.calibration.forward import embed, layer_forward, layer_weights, logits
from jaxinfer.calibration.obs import fast_jit
from jaxinfer.config import ModelConfig

SENSITIVITY_TEXT = Path(__file__).with_name("sensitivity.txt")
RECORD_KEY = "jaxinfer_compression"  # config.json: what sensitivity chose


@dataclasses.dataclass
class Sensitivity:
    """kept: the layers kept in floats (ascending); float_ppl: the held-out perplexity of the
    float model; alone[i]: with only layer i compressed; final_ppl: with every layer but the kept
    ones compressed; order: the layers, most sensitive first."""

    kept: tuple[int, ...]
    float_ppl: float
    alone: list[float]
    final_ppl: float
    order: list[int]

    def record(self) -> dict:
        """What config.json records (under RECORD_KEY)."""
        return {"kept_float_layers": list(self.kept), "held_out_perplexity": {
            "float": round(self.float_ppl, 4), "compressed": round(self.final_ppl, 4),
            "one_layer_compressed": [round(p, 4) for p in self.alone]}}

    def describe(self) -> str:
        layers = ", ".join(f"{i} ({self.alone[i]:.3f})" for i in sorted(self.kept, key=self.order.index)) or "none"
        return (f"kept in floats: layers {layers} (held-out perplexity with only that layer compressed; float "
                f"{self.float_ppl:.3f}); the model: {self.final_ppl:.3f}")


def held_out_ids(tokenizer, text: str | None, num_tokens: int, max_len: int) -> list[int]:
    """The first `num_tokens` tokens of `text` (default: sensitivity.txt), at most `max_len`."""
    ids = tokenizer.encode(SENSITIVITY_TEXT.read_text() if text is None else text)[: min(num_tokens, max_len)]
    if len(ids) < 2:
        raise ValueError("the held-out text for sensitivity has fewer than 2 tokens")
    return ids


@functools.partial(fast_jit, static_argnums=0)
def _nll(config: ModelConfig, head: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of targets [T-1] after the last layer's output x [T, H]."""
    logprobs = jax.nn.log_softmax(logits(config, head, x[:-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logprobs, targets[:, None], axis=1))


def perplexity(config: ModelConfig, flat: dict, layers: list[dict], ids: list[int], start: int = 0, x=None) -> float:
    """The held-out perplexity of the model with decoder layers `layers` (from layer `start`, whose
    input is x; default: the embedded ids)."""
    x = embed(flat, ids) if x is None else x
    for w in layers[start:]:
        x = layer_forward(config, w, x)[0]
    head = {k: flat[k] for k in ("final_norm", "embed", "lm_head") if k in flat}
    return math.exp(float(_nll(config, head, x, jnp.asarray(ids[1:], jnp.int32))))


def check_options(keep: int, budget: float | None, num_layers: int) -> None:
    """ValueError naming a bad keep_sensitive / ppl_budget (before any calibration runs)."""
    if keep < 0 or keep > num_layers:
        raise ValueError(f"keep_sensitive={keep}: expected 0..{num_layers} (the model's layers)")
    if budget is not None and not budget >= 0:
        raise ValueError(f"ppl_budget={budget}: expected a percentage >= 0")


def choose(config: ModelConfig, flat: dict, compressed: list[dict], ids: list[int], *, keep: int = 0,
           budget: float | None = None, log: Callable[[str], None] | None = None) -> Sensitivity:
    """The layers to keep in floats (module docstring). `flat`: the float parameters (flat names,
    stacked); `compressed`: each layer's compressed weights (name -> array)."""
    L = config.num_layers
    check_options(keep, budget, L)
    flat = {name: jnp.asarray(a, jnp.float32) for name, a in flat.items()}
    floats = [layer_weights(flat, i) for i in range(L)]
    xs = [embed(flat, ids)]  # the float model's input to each layer
    for w in floats[:-1]:
        xs.append(layer_forward(config, w, xs[-1])[0])
    float_ppl = perplexity(config, flat, floats, ids, L - 1, xs[-1])
    alone = []
    for i in range(L):
        alone.append(perplexity(config, flat, floats[:i] + [compressed[i]] + floats[i + 1:], ids, i, xs[i]))
        if log:
            log(f"sensitivity: layer {i} alone compressed: held-out perplexity {alone[-1]:.3f} (float {float_ppl:.3f})")
    order = sorted(range(L), key=lambda i: -alone[i])

    def mixed(kept) -> float:
        first = min(set(range(L)) - kept, default=L - 1)  # the float layers before it: their activations are known
        return perplexity(config, flat, [floats[i] if i in kept else compressed[i] for i in range(L)], ids, first, xs[first])

    if budget is None:
        kept = set(order[:keep])
        final = mixed(kept)
    else:
        limit = float_ppl * (1 + budget / 100)
        for n in range(max(keep, 0), L + 1):
            kept = set(order[:n])
            final = mixed(kept) if n < L else float_ppl
            if log:
                log(f"sensitivity: {n} layers kept: held-out perplexity {final:.3f} (budget {limit:.3f})")
            if final <= limit:
                break
    return Sensitivity(tuple(sorted(kept)), float_ppl, alone, final, order)


def keep_sensitive(config: ModelConfig, flat: dict, compressed: list[dict], tokenizer, *, keep: int = 0,
                   budget: float | None = None, text: str | None = None, num_tokens: int = 256,
                   log: Callable[[str], None] | None = None) -> Sensitivity:
    """`choose` on the first `num_tokens` tokens of the held-out `text` (default sensitivity.txt)."""
    ids = held_out_ids(tokenizer, text, num_tokens, config.max_position_embeddings)
    sens = choose(config, flat, compressed, ids, keep=keep, budget=budget, log=log)
    if log:
        log(sens.describe())
    return sens


# ----------------------------------------------------------------------------- quantize's side
def calibrated_layers(cal: Calibrated, num_layers: int) -> list[dict]:
    """Each layer's weights as the calibrated checkpoint computes with them (grids dequantized)."""
    out = []
    for i in range(num_layers):
        w = {name.split(".", 1)[1]: jnp.asarray(a[i]) for name, a in cal.floats.items() if name.startswith("layers.")}
        w.update({name.split(".", 1)[1]: jnp.asarray(gs[i].dequantize()) for name, gs in cal.grids.items()})
        out.append(w)
    return out


def keep_calibrated(cal: Calibrated, flat: dict, layers) -> Calibrated:
    """`cal` with the layers `layers` back to their float parameters `flat` (a float array in
    place of each grid, which export writes dense; AWQ's folded norms undone)."""
    grids = {name: list(gs) for name, gs in cal.grids.items()}
    floats = {name: np.array(a, copy=True) for name, a in cal.floats.items()}
    for i in layers:
        for name in grids:
            grids[name][i] = np.asarray(flat[name][i], np.float32)
        for name in floats:
            if name.startswith("layers."):
                floats[name][i] = np.asarray(flat[name][i], np.float32)
    return dataclasses.replace(cal, grids=grids, floats=floats)

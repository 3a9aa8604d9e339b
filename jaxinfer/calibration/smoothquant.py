"""SmoothQuant (Xiao et al., 2023): W8A8 with the activations' outlier channels divided down into
the weights, so that int8 per token loses little on either side.

A few input channels of a layer carry activations 10-100x the others; quantizing a token's row
to int8 on its absmax then leaves the rest a handful of levels. For y = x @ W, dividing input
channel j by s_j in x and multiplying row j of W by s_j leaves y unchanged in exact arithmetic,
and with

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)      (max over calibration tokens / output columns)

the per-channel ranges of x / s and s W meet in between (alpha: how much of the difficulty moves
to the weights; the paper's default 0.5). A channel either side never saw (max 0) keeps s = 1.
The 1 / s is folded into the operation that feeds the matmul, so the checkpoint is a plain W8A8
one (int8 weights per output column, int8 activations per token, dynamic):

    feeder                                   matmul        exact because
    input_layernorm's weight                 q, k, v       RMSNorm ends in an elementwise product
    post_attention_layernorm's weight        gate, up      the same
    v_proj's output columns (and bias)       o_proj        attention is linear in v; with GQA one
                                                           KV head's column d feeds query heads
                                                           h of its group: s is shared by them
                                                           (max over the group's channels)
    up_proj's output columns (and bias)      down_proj     silu(gate) * up is linear in up

(the first two are the paper's reference implementation for Llama; the last two are what
llm-compressor's mappings and AWQ add). Then each weight is rounded to int8 per output column
(absmax / 127, the w8a8 mode's quantizer without its rotation), layer by layer through
`calibrate`'s driver, with each layer's activation maxima taken from the float model (as the
reference implementation collects them: one pass over the calibration text).

`alpha=None`: no smoothing (s = 1), plain per-column int8 W8A8, for comparison. (alpha = 0 is not
that: it divides each weight row by its max and moves all the range into the activations.)

Measured on SmolLM2-135M (512 calibration tokens; the first 256 held-out tokens of
tests/data/perplexity_text.txt), the mean KL divergence from the float model's next-token
distributions, steady within 2 % across XLA settings: alpha 0.5 0.0095, alpha 0.8 0.012, no
smoothing 0.030, alpha 0 0.12; the w8a8 mode's rotation 0.0037 (it spreads each token's
outliers over the row, which a per-channel factor cannot). Perplexity is the noisier number: a
token row with one huge channel (the first token's) leaves the others a level or two, and a
last-bit change anywhere flips roundings that grow through the layers: alpha 0.5 +0.05 % / +0.8 %,
no smoothing +5.4 % / +1.9 % under two XLA settings (the whole 414-token text: +0.6 %, +4.1 %).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.calibration.forward import MATMULS, embed, layer_forward, layer_weights
from jaxinfer.calibration.grid import ZeroPointGrid
from jaxinfer.config import ModelConfig
from jaxinfer.ops.quantization import quantize_int8

MIN_SCALE = 1e-5  # the reference implementation's clamp


@jax.jit
def channel_max(inputs: list) -> jnp.ndarray:
    """max |x| [K] per input channel over every row of every calibration input [T, K]."""
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32)), axis=0) for x in inputs]), axis=0)


def smoothing_scales(act_max: jnp.ndarray, w_max: jnp.ndarray, alpha: float) -> jnp.ndarray:
    """s [K] = act_max^alpha / w_max^(1 - alpha), 1 where either is 0 (module docstring)."""
    s = jnp.maximum(act_max, MIN_SCALE) ** alpha / jnp.maximum(w_max, MIN_SCALE) ** (1 - alpha)
    return jnp.where((act_max > 0) & (w_max > 0), jnp.maximum(s, MIN_SCALE), 1.0)


def smooth_layer(config: ModelConfig, w: dict, inputs: dict, alpha: float | None) -> dict:
    """Layer w's weights with the four smoothings of the module docstring folded in, from the
    float inputs of its matmuls (name -> [T, K] arrays); alpha None returns w as it is."""
    if alpha is None:
        return w
    act_max = {name: channel_max(inputs[name]) for name in MATMULS}
    return _smooth(config, dict(w), act_max, jnp.float32(alpha))


@functools.partial(jax.jit, static_argnums=0)
def _smooth(config: ModelConfig, w: dict, act_max: dict, alpha: jax.Array) -> dict:
    """smooth_layer from each matmul's input channel maxima act_max [K]."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    I = c.intermediate_size

    # q, k, v <- input_layernorm; gate, up <- post_attention_layernorm
    for matmul, norm in (("qkv_proj", "attn_norm"), ("gate_up_proj", "mlp_norm")):
        s = smoothing_scales(act_max[matmul], jnp.max(jnp.abs(w[matmul]), axis=1), alpha)
        w[norm] = w[norm] / s
        w[matmul] = w[matmul] * s[:, None]

    # o_proj <- v_proj: one scale per (KV head, dim), shared by the query heads of its group
    G = c.num_heads // c.num_kv_heads
    grouped = lambda a: jnp.max(a.reshape(c.num_kv_heads, G, c.head_dim), axis=1).reshape(kv_dim)  # noqa: E731
    s_kv = smoothing_scales(grouped(act_max["o_proj"]), grouped(jnp.max(jnp.abs(w["o_proj"]), axis=1)), alpha)
    s_rows = jnp.repeat(s_kv.reshape(c.num_kv_heads, 1, c.head_dim), G, axis=1).reshape(q_dim)  # query head h: KV head h // G
    v_cols = slice(q_dim + kv_dim, q_dim + 2 * kv_dim)
    w["qkv_proj"] = w["qkv_proj"].at[:, v_cols].divide(s_kv[None, :])
    if "qkv_bias" in w:
        w["qkv_bias"] = w["qkv_bias"].at[v_cols].divide(s_kv)
    w["o_proj"] = w["o_proj"] * s_rows[:, None]

    # down_proj <- up_proj
    s = smoothing_scales(act_max["down_proj"], jnp.max(jnp.abs(w["down_proj"]), axis=1), alpha)
    w["gate_up_proj"] = w["gate_up_proj"].at[:, I:].divide(s[None, :])
    if "gate_up_bias" in w:
        w["gate_up_bias"] = w["gate_up_bias"].at[I:].divide(s)
    w["down_proj"] = w["down_proj"] * s[:, None]
    return w


def quantize_columns(w) -> ZeroPointGrid:
    """w [K, N] rounded to int8 per output column, symmetric (absmax / 127, float32 scales): the
    w8a8 weight quantizer (`ops.quantization.quantize_int8`) without the rotation, as the grid
    the calibration driver and `export` take (q = v + 128 around a zero point of 128, one group
    of all K rows; int16)."""
    v, scales, _ = quantize_int8(jnp.asarray(w, jnp.float32))
    K, N = v.shape
    return ZeroPointGrid(np.asarray(v).astype(np.int16) + 128, np.full((1, N), 128, np.int16), np.asarray(scales, np.float32)[None, :],
                         np.zeros(K, np.int64), 8, K)


def smooth(config: ModelConfig, flat: dict, sequences: list[list[int]], alpha: float) -> dict:
    """The float parameters (flat, stacked [L, ...]) with every layer smoothed and nothing
    quantized: the same function of the tokens (what the tests check the folding by)."""
    flat = {name: jnp.asarray(a, jnp.float32) for name, a in flat.items()}
    xs = [embed(flat, ids) for ids in sequences]
    for i in range(config.num_layers):
        outs = [layer_forward(config, layer_weights(flat, i), x) for x in xs]
        w = smooth_layer(config, layer_weights(flat, i), {name: [taps[name] for _, taps in outs] for name in MATMULS}, alpha)
        for name, value in w.items():
            flat[f"layers.{name}"] = flat[f"layers.{name}"].at[i].set(value)
        xs = [x for x, _ in outs]
    return flat

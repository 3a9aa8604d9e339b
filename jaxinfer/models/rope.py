"""Rotary position embeddings: each layer kind's cos / sin tables for a step's tokens.

A model has up to two tables: "global" (the model's `rope_theta` and scaling) and "local" (Gemma
3's sliding layers, with their own base). A NoPE layer (SmolLM3) rotates nothing: it gets the
identity table (cos 1, sin 0), so every layer runs the same RoPE + KV-write path.

Scalings, as transformers computes them (frequencies in float64 on the host, then float32):

- linear: frequencies / factor;
- llama3: the three wavelength bands of Llama 3.1;
- dynamic (NTK): the base grows once a sequence passes max_position_embeddings, per token from
  its sequence's length after the step (`seq_lens`), as HF does for the one sequence it runs;
- yarn: a ramp between interpolated and extrapolated frequencies, and cos / sin scaled by the
  attention factor (0.1 ln(factor) + 1 unless given);
- freq_factors (a GGUF's rope_freqs tensor, llama.cpp's form of llama3 scaling): frequency i
  divided by factor i;
- proportional (Gemma 4's global layers): the first `rotated_fraction` of the head's frequency
  pairs at their usual frequencies (over the whole head dim), the rest at frequency 0 (turned by
  nothing), all divided by factor;
- longrope (Phi-3): one factor per frequency, the short ones while the sequence is within
  original_max_position_embeddings and the long ones past it (per sequence, from `seq_lens`),
  cos / sin scaled by sqrt(1 + ln(factor) / ln(original)).

M-RoPE (Qwen2.5-VL, Qwen3-VL: `ModelConfig.mrope_section`, `mrope_interleaved`; jaxinfer.models.mrope):
given a step's `rope_positions` [3, T] (temporal, height, width per token), frequency i takes its
angle from the row of rope_positions its section names rather than from `positions`, as
transformers' recomposition of the (t, h, w) frequencies does; without them (text only, the three
positions equal) `positions` rotate.

Partial rotary embeddings (`ModelConfig.rotary_dim` < head_dim) give tables of rotary_dim
columns; `pallas_kernels.rope_kv_write.apply_rope` turns the first rotary_dim dims of each head
and passes the rest through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling, yarn_mscale
from jaxinfer.models.mrope import section_of_frequency


def inv_freq(theta: float, rs: RopeScaling, dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim // 2] float64, cos / sin scale) with static scaling applied.

    Dynamic NTK and longrope's long factors depend on the sequence length and are applied in
    `cos_sin`; here they return the unscaled (short) frequencies."""
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rs.rope_type == "linear":
        return inv / rs.factor, 1.0
    if rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        with np.errstate(divide="ignore", invalid="ignore"):  # equal factors (Llama 4): no medium band to smooth
            smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rs.rope_type == "yarn":
        return _yarn(theta, rs, dim)
    if rs.rope_type == "longrope":
        return inv / np.asarray(rs.short_factor, np.float64), _longrope_scale(rs)
    if rs.rope_type == "freq_factors":
        return inv / np.asarray(rs.freq_factors, np.float64), 1.0
    if rs.rope_type == "proportional":  # Gemma 4's global layers: the first pairs turn, the others stay
        turned = int(rs.rotated_fraction * dim // 2)
        return np.where(np.arange(dim // 2) < turned, inv, 0.0) / rs.factor, 1.0
    return inv, 1.0


def _yarn(theta: float, rs: RopeScaling, dim: int) -> tuple[np.ndarray, float]:
    factor = rs.factor
    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rs.mscale) / yarn_mscale(factor, rs.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations):  # the dim whose wavelength makes `rotations` turns over the original length
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    # HF computes these two in float32 (torch); so does this, then widens
    pos_freqs = (theta ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (high frequencies), 0: interpolate
    inv = (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
    return inv.astype(np.float64), float(attention_factor)


def _longrope_scale(rs: RopeScaling) -> float:
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rs.factor) / math.log(rs.original_max_position_embeddings))


def cos_sin(theta: float, rs: RopeScaling, dim: int, positions: jax.Array, seq_lens: jax.Array,
            rope_positions: jax.Array | None = None, mrope_section: tuple[int, ...] | None = None,
            mrope_interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, dim] (float32) for token positions [T]; seq_lens [T] is each token's sequence
    length after this step (read by dynamic NTK and longrope). With `rope_positions` [3, T] and
    `mrope_section`, each frequency's angle comes from its section's row (M-RoPE)."""
    inv, scale = inv_freq(theta, rs, dim)
    if rs.rope_type == "dynamic":
        max_pos = rs.original_max_position_embeddings
        seq = jnp.maximum(seq_lens, max_pos).astype(jnp.float32)
        base = theta * ((rs.factor * seq / max_pos) - (rs.factor - 1)) ** (dim / (dim - 2))  # [T]
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        inv_t = 1.0 / (base[:, None] ** exponents[None, :])  # [T, dim/2]
    elif rs.rope_type == "longrope":
        long_inv = inv * np.asarray(rs.short_factor, np.float64) / np.asarray(rs.long_factor, np.float64)
        is_long = (seq_lens > rs.original_max_position_embeddings)[:, None]
        inv_t = jnp.where(is_long, jnp.asarray(long_inv, jnp.float32)[None], jnp.asarray(inv, jnp.float32)[None])
    else:
        inv_t = jnp.asarray(inv, jnp.float32)[None, :]
    if rope_positions is not None and mrope_section is not None:  # each frequency's position: its section's
        angle_pos = rope_positions[section_of_frequency(mrope_section, mrope_interleaved)].T.astype(jnp.float32)  # [T, dim/2]
    else:
        angle_pos = positions.astype(jnp.float32)[:, None]  # [T, 1]
    freqs = angle_pos * inv_t  # [T, dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def rope_tables(config: ModelConfig, positions: jax.Array, seq_lens: jax.Array,
                rope_positions: jax.Array | None = None) -> dict[str | None, tuple[jax.Array, jax.Array]]:
    """Every table this model's layers use: LayerKind.rope -> (cos, sin) [T, rotary_dim] each (the
    rotary dims of the layers using it: Gemma 4's global layers have a head dim of their own).
    positions, seq_lens [T]; rope_positions [3, T] or None: M-RoPE's (t, h, w) positions, read when
    the config has an `mrope_section`."""
    c = config
    dims = {kind.rope: c.rotary_dim or c.kind_head_dim(kind) for kind in c.layer_kinds()}
    mrope = (rope_positions, c.mrope_section, c.mrope_interleaved)
    tables = {}
    if "global" in dims:
        tables["global"] = cos_sin(c.rope_theta, c.rope_scaling, dims["global"], positions, seq_lens, *mrope)
    if "local" in dims:
        tables["local"] = cos_sin(c.local_rope_theta, c.local_rope_scaling, dims["local"], positions, seq_lens, *mrope)
    if None in dims:  # NoPE: the identity rotation
        T = positions.shape[0]
        tables[None] = (jnp.ones((T, dims[None]), jnp.float32), jnp.zeros((T, dims[None]), jnp.float32))
    return tables


def rope_cos_sin(config: ModelConfig, positions: jax.Array, seq_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The global table cos, sin [T, rotary_dim] (float32)."""
    return cos_sin(config.rope_theta, config.rope_scaling, config.rope_dim, positions, seq_lens)

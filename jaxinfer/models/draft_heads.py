"""Draft heads: small layers that read the target's last hidden state and guess the next tokens.

The target's LM head turns the final-normed hidden state h_t of position t into the distribution
of token t+1, y. A draft head guesses the k tokens after y, d_1 .. d_k, each as
`lm_head(state_i)` with the target's own LM head (frozen) and a state of its own:

- **medusa** (Medusa-style: k independent heads, all reading h_t):

      state_i = h_t + silu(h_t @ W_i + b_i)                            # W_i: [H, H], zero at start

  Head i must guess token t+1+i without knowing the tokens before it (not even y).

- **eagle** (EAGLE-style: one layer applied again and again, at the level of features): it takes
  the previous state and the embedding of the token that state led to, and predicts the next
  final-normed hidden state, which the LM head reads and which feeds the next application:

      state_0 = h_t,  e_0 = embed(y),  e_i = embed(d_i)
      state_i = state_{i-1} + silu(state_{i-1} @ A + e_{i-1} @ B + b) @ C     # A, B, C: [H, H]

  It knows y and its own earlier drafts, so each guess is conditioned like the target's. Unlike
  EAGLE proper there is no attention over the earlier features: the context arrives only
  through h_t. C starts at zero (the first guess then repeats y).

Only the head parameters train (`jaxinfer.training.draft_heads`, `scripts/train_draft_head.py`).
Heads are saved with orbax (`save_heads` / `load_heads`: params/ + heads.json with
the kind).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import checkpoints_conv

HEADS_FORMAT = "jaxinfer-draft-heads-v1"
KINDS = ("medusa", "eagle")


def init_heads(kind: str, num_heads: int, hidden_size: int, seed: int = 0) -> dict[str, jax.Array]:
    """medusa: {"w": [K, H, H], "b": [K, H]}, zeros. eagle: {"a", "b_e" [H, H] random, "bias" [H],
    "c" [H, H] zeros}; num_heads is then the longest chain it is trained for."""
    H = hidden_size
    if kind == "medusa":
        return {"w": jnp.zeros((num_heads, H, H), jnp.float32), "b": jnp.zeros((num_heads, H), jnp.float32)}
    if kind != "eagle":
        raise ValueError(f"draft head kind {kind!r}: expected one of {KINDS}")
    ka, kb = jax.random.split(jax.random.key(seed))
    scale = 1.0 / np.sqrt(H)
    return {"a": jax.random.normal(ka, (H, H), jnp.float32) * scale, "b_e": jax.random.normal(kb, (H, H), jnp.float32) * scale,
            "bias": jnp.zeros((H,), jnp.float32), "c": jnp.zeros((H, H), jnp.float32)}


def num_heads_of(heads: dict) -> int | None:
    """Medusa heads' count (the longest draft they give); None for an eagle layer (any length)."""
    return heads["w"].shape[0] if "w" in heads else None


def head_state(heads: dict, i: int, state: jax.Array, h0: jax.Array, token_embedding: jax.Array) -> jax.Array:
    """State of guess i + 1 (i = 0 .. k-1) from the previous one ([N, H] float32 each). h0: the
    target's hidden state; token_embedding: the embedding of the token the previous state led to."""
    if "w" in heads:  # medusa: head i reads h0 only
        return h0 + jax.nn.silu(h0 @ heads["w"][i] + heads["b"][i])
    z = state @ heads["a"] + token_embedding.astype(jnp.float32) @ heads["b_e"] + heads["bias"]
    return state + jax.nn.silu(z) @ heads["c"]


def save_heads(path: str | Path, heads: dict, *, base_model: str, overwrite: bool = False) -> Path:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpoints_conv.save_params(path / "params", {k: np.asarray(v) for k, v in heads.items()}, overwrite=overwrite)
    kind = "medusa" if "w" in heads else "eagle"
    H = heads["w"].shape[-1] if kind == "medusa" else heads["a"].shape[0]
    (path / "heads.json").write_text(json.dumps({"format": HEADS_FORMAT, "kind": kind, "num_heads": num_heads_of(heads),
                                                 "hidden_size": H, "base_model": base_model}, indent=2))
    return path


def load_heads(path: str | Path, hidden_size: int, kind: str | None = None) -> dict[str, jax.Array]:
    """Heads saved by save_heads; ValueError naming the folder when they do not fit the model (or
    are not of `kind`)."""
    path = Path(path)
    try:
        meta = json.loads((path / "heads.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a folder of draft heads written by scripts/train_draft_head.py ({e})") from None
    if meta.get("format") != HEADS_FORMAT:
        raise ValueError(f"{path}: heads in format {meta.get('format')!r}, expected {HEADS_FORMAT!r}")
    if kind is not None and meta["kind"] != kind:
        raise ValueError(f"{path}: {meta['kind']} heads, not {kind} (speculative_config['method'] must be {meta['kind']!r})")
    if meta["hidden_size"] != hidden_size:
        raise ValueError(f"{path}: heads for hidden size {meta['hidden_size']}, the model's is {hidden_size}")
    H = meta["hidden_size"]
    shapes = {"w": (meta["num_heads"], H, H), "b": (meta["num_heads"], H)} if meta["kind"] == "medusa" else \
        {"a": (H, H), "b_e": (H, H), "bias": (H,), "c": (H, H)}
    abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    return {k: jnp.asarray(v) for k, v in checkpoints_conv.restore_params(path / "params", abstract).items()}

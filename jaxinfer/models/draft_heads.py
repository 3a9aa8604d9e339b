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

Only the head parameters train (`scripts/train_draft_head.py`): the target generates text from
prompts; a forward pass over prompt + text gives h_t at every position; for each position t the
heads are unrolled over the true tokens t+1 .. t+k (teacher forcing; an EAGLE state is its own
prediction, as when drafting) and state_i learns both token t+i+1 (cross-entropy through the LM
head) and the target's own hidden state h_{t+i} (smooth-L1: EAGLE's feature regression), with
optax AdamW. Heads are saved with orbax (`save_heads` / `load_heads`: params/ + heads.json with
the kind).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def training_windows(hidden: np.ndarray, tokens: np.ndarray, num_heads: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: hidden [n, H] at every position, its tokens [n]. Returns, for the positions
    t >= first that have at least one guess to learn:

    - states [m, K + 1, H]: the target's hidden states at t .. t+K (zeros past the end);
      states[:, 0] is what the heads read, states[:, i] what guess i should look like;
    - window [m, K + 1]: tokens t+1 .. t+K+1 (-1 past the end); window[:, 0] is y (what the LM
      head says from h_t), window[:, i] the token guess i should give."""
    n = len(tokens)
    positions = np.arange(first, n - 2)
    window = np.full((len(positions), num_heads + 1), -1, np.int32)
    states = np.zeros((len(positions), num_heads + 1, hidden.shape[1]), np.float32)
    for i in range(num_heads + 1):
        ok = positions + 1 + i < n
        window[ok, i] = tokens[positions[ok] + 1 + i]
        ok = positions + i < n
        states[ok, i] = hidden[positions[ok] + i]
    return states, window


def unrolled_states(heads: dict, h: jax.Array, window: jax.Array, embed: jax.Array, num_steps: int) -> jax.Array:
    """h [N, H], window [N, >= num_steps] (the true tokens fed in) -> the heads' states [N, num_steps, H]."""
    h = h.astype(jnp.float32)
    state, out = h, []
    for i in range(num_steps):
        state = head_state(heads, i, state, h, embed[jnp.maximum(window[:, i], 0)])
        out.append(state)
    return jnp.stack(out, axis=1)


def loss_fn(heads, states, window, lm_head, embed, feature_weight: float = 1.0):
    """Guess i (i = 1..K) is the heads' state for position t+i. It learns to read like the
    target's own hidden state there (smooth-L1 over the features: EAGLE's regression loss, a
    dense signal that keeps a small head from overfitting its few tokens) and to put the LM
    head's top logit on token t+i+1 (cross-entropy). Returns (loss, top-1 accuracy per guess [K])."""
    targets = window[:, 1:]
    B, K = targets.shape
    predicted = unrolled_states(heads, states[:, 0], window, embed, K)  # [B, K, H]
    logits = lm_head(predicted.reshape(B * K, -1)).reshape(B, K, -1)
    valid = targets >= 0  # position t+i+1 exists (so t+i does too)
    count = jnp.maximum(valid.sum(), 1)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]  # [B, K]
    cross_entropy = -(picked * valid).sum() / count
    feature_error = optax.huber_loss(predicted, states[:, 1:].astype(jnp.float32)).mean(axis=-1)  # [B, K]
    loss = cross_entropy + feature_weight * (feature_error * valid).sum() / count
    correct = (jnp.argmax(logits, axis=-1) == targets) & valid
    accuracy = correct.sum(axis=0) / jnp.maximum(valid.sum(axis=0), 1)  # [K]
    return loss, accuracy


def train_heads(states: np.ndarray, window: np.ndarray, lm_head, embed, *, kind: str, steps: int, batch_size: int = 256,
                learning_rate: float = 1e-3, weight_decay: float = 0.0, feature_weight: float = 1.0, seed: int = 0,
                log=None) -> dict[str, jax.Array]:
    """AdamW on random minibatches of (states, window) from `training_windows`; returns the
    trained heads (K = window width - 1)."""
    heads = init_heads(kind, window.shape[1] - 1, states.shape[-1], seed)
    optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    opt_state = optimizer.init(heads)

    @jax.jit
    def update(heads, opt_state, sb, wb):
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads, sb, wb, lm_head, embed, feature_weight)
        updates, opt_state = optimizer.update(grads, opt_state, heads)
        return optax.apply_updates(heads, updates), opt_state, loss, accuracy

    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = rng.integers(0, len(window), batch_size)
        heads, opt_state, loss, accuracy = update(heads, opt_state, jnp.asarray(states[idx]), jnp.asarray(window[idx]))
        if log is not None and (step % max(1, steps // 10) == 0 or step == steps - 1):
            log(step, float(loss), np.asarray(accuracy))
    return heads


def evaluate_heads(heads, states: np.ndarray, window: np.ndarray, lm_head, embed, batch_size: int = 512) -> np.ndarray:
    """Top-1 accuracy of each guess [K] on held-out (states, window), earlier guesses fed the true tokens."""
    K = window.shape[1] - 1

    @jax.jit
    def guesses(h, w):
        predicted = unrolled_states(heads, h, w, embed, K)
        return jnp.argmax(lm_head(predicted.reshape(-1, predicted.shape[-1])), axis=-1).reshape(h.shape[0], K)

    correct, count = np.zeros(K), np.zeros(K)
    for start in range(0, len(window), batch_size):
        w = window[start : start + batch_size]
        guess = np.asarray(guesses(jnp.asarray(states[start : start + batch_size, 0]), jnp.asarray(w)))
        t = w[:, 1:]
        correct += ((guess == t) & (t >= 0)).sum(axis=0)
        count += (t >= 0).sum(axis=0)
    return correct / np.maximum(count, 1)


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

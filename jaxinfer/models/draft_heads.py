"""Medusa-style draft heads: K small heads that read the target's last hidden state and guess the
tokens after the next one.

The target's LM head turns the final-normed hidden state h_t of position t into the distribution
of token t+1. Head i (i = 1..K) turns the same h_t into a guess for token t+1+i:

    head_i(h) = lm_head(h + silu(h @ W_i + b_i))        # a residual block, then the target's LM head

W_i starts at zero (head i then predicts what the LM head predicts), and only W and b train; the
LM head is the target's own, frozen. So a head costs H*H + H parameters (SmolLM2: 332k) and one
LM-head matmul per guess. Proposals for a sequence whose step emitted token y from row h_t:
d_i ~ processed(head_i(h_t)), i = 1..k: the k tokens after y (`engine.medusa.MedusaProposer`).

Training (`scripts/train_draft_head.py`): the target generates text from prompts; a forward pass
over prompt + text gives h_t at every position; head i learns token t+1+i with cross-entropy
(optax AdamW). Heads are saved with orbax (`save_heads` / `load_heads`: params/ + heads.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import checkpoints_conv

HEADS_FORMAT = "jaxinfer-medusa-v1"


def init_heads(num_heads: int, hidden_size: int) -> dict[str, jax.Array]:
    """{"w": [K, H, H] zeros, "b": [K, H] zeros}: every head starts as the target's LM head."""
    return {"w": jnp.zeros((num_heads, hidden_size, hidden_size), jnp.float32), "b": jnp.zeros((num_heads, hidden_size), jnp.float32)}


def head_states(heads: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    """h [N, H] -> [N, K, H]: each head's residual block applied to h."""
    h = h.astype(jnp.float32)
    return h[:, None, :] + jax.nn.silu(jnp.einsum("nh,khg->nkg", h, heads["w"]) + heads["b"][None])


def head_logits(heads: dict[str, jax.Array], h: jax.Array, lm_head) -> jax.Array:
    """h [N, H] -> logits [N, K, V]; lm_head: [.., H] -> [.., V] float32 (the target's)."""
    states = head_states(heads, h)  # [N, K, H]
    N, K, H = states.shape
    return lm_head(states.reshape(N * K, H)).reshape(N, K, -1)


def training_pairs(hidden: np.ndarray, tokens: np.ndarray, num_heads: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: hidden [n, H] at every position, its tokens [n]. Returns (h [m, H], targets
    [m, K]) for positions t >= first: target i is tokens[t + 1 + i] (-1 past the end)."""
    n = len(tokens)
    positions = np.arange(first, n - 2)  # at least one head has a target
    targets = np.full((len(positions), num_heads), -1, np.int32)
    for i in range(num_heads):
        ahead = positions + 2 + i
        ok = ahead < n
        targets[ok, i] = tokens[ahead[ok]]
    return hidden[positions], targets


def loss_fn(heads, h, targets, lm_head):
    """Mean cross-entropy of every (position, head) with a target; also the top-1 accuracy per head."""
    logits = head_logits(heads, h, lm_head)  # [B, K, V]
    valid = targets >= 0
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]  # [B, K]
    loss = -(picked * valid).sum() / jnp.maximum(valid.sum(), 1)
    correct = (jnp.argmax(logits, axis=-1) == targets) & valid
    accuracy = correct.sum(axis=0) / jnp.maximum(valid.sum(axis=0), 1)  # [K]
    return loss, accuracy


def train_heads(h: np.ndarray, targets: np.ndarray, lm_head, *, num_heads: int, steps: int, batch_size: int = 256,
                learning_rate: float = 1e-3, seed: int = 0, log=None) -> dict[str, jax.Array]:
    """AdamW on random minibatches of (h, targets); returns the trained heads."""
    heads = init_heads(num_heads, h.shape[1])
    optimizer = optax.adamw(learning_rate, weight_decay=0.0)
    state = optimizer.init(heads)

    @jax.jit
    def update(heads, state, hb, tb):
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(heads, hb, tb, lm_head)
        updates, state = optimizer.update(grads, state, heads)
        return optax.apply_updates(heads, updates), state, loss, accuracy

    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = rng.integers(0, len(h), batch_size)
        heads, state, loss, accuracy = update(heads, state, jnp.asarray(h[idx]), jnp.asarray(targets[idx]))
        if log is not None and (step % max(1, steps // 10) == 0 or step == steps - 1):
            log(step, float(loss), np.asarray(accuracy))
    return heads


def evaluate_heads(heads, h: np.ndarray, targets: np.ndarray, lm_head, batch_size: int = 512) -> np.ndarray:
    """Top-1 accuracy of each head [K] on held-out (h, targets)."""
    correct = np.zeros(targets.shape[1])
    count = np.zeros(targets.shape[1])
    fn = jax.jit(lambda hb: jnp.argmax(head_logits(heads, hb, lm_head), axis=-1))
    for start in range(0, len(h), batch_size):
        guess = np.asarray(fn(jnp.asarray(h[start : start + batch_size])))
        t = targets[start : start + batch_size]
        correct += ((guess == t) & (t >= 0)).sum(axis=0)
        count += (t >= 0).sum(axis=0)
    return correct / np.maximum(count, 1)


def save_heads(path: str | Path, heads: dict, *, base_model: str, overwrite: bool = False) -> Path:
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpoints_conv.save_params(path / "params", {k: np.asarray(v) for k, v in heads.items()}, overwrite=overwrite)
    K, H, _ = heads["w"].shape
    (path / "heads.json").write_text(json.dumps({"format": HEADS_FORMAT, "num_heads": K, "hidden_size": H,
                                                 "base_model": base_model}, indent=2))
    return path


def load_heads(path: str | Path, hidden_size: int) -> dict[str, jax.Array]:
    """Heads saved by save_heads; ValueError naming the folder when they do not fit the model."""
    path = Path(path)
    try:
        meta = json.loads((path / "heads.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a folder of draft heads written by scripts/train_draft_head.py ({e})") from None
    if meta.get("format") != HEADS_FORMAT:
        raise ValueError(f"{path}: heads in format {meta.get('format')!r}, expected {HEADS_FORMAT!r}")
    if meta["hidden_size"] != hidden_size:
        raise ValueError(f"{path}: heads for hidden size {meta['hidden_size']}, the model's is {hidden_size}")
    K, H = meta["num_heads"], meta["hidden_size"]
    abstract = {"w": jax.ShapeDtypeStruct((K, H, H), jnp.float32), "b": jax.ShapeDtypeStruct((K, H), jnp.float32)}
    return {k: jnp.asarray(v) for k, v in checkpoints_conv.restore_params(path / "params", abstract).items()}

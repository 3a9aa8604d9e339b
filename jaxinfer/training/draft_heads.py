"""Training draft heads (`jaxinfer.models.draft_heads`) on the target's own text, with optax.

The target generates text from prompts; a forward pass over prompt + text gives h_t at every
position (`jaxinfer.runtime.evaluate.hidden_states`); for each position t the heads are unrolled
over the true tokens t+1 .. t+k (teacher forcing; an EAGLE state is its own prediction, as when
drafting) and state_i learns both token t+i+1 (cross-entropy through the LM head) and the
target's own hidden state h_{t+i} (smooth-L1: EAGLE's feature regression), with optax AdamW.
`scripts/train_draft_head.py` runs it end to end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.models.draft_heads import head_state, init_heads


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

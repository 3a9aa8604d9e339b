"""Training an EAGLE-3 head (`jaxinfer.models.eagle3`) on the target's own text, with optax.

The target generates text; its own model program gives, at every position, the residual streams
at the input of the head's three aux layers (`jaxinfer.runtime.evaluate.stream_states`). The head
then learns, by teacher forcing over whole sequences (`eagle3_forward`: causal attention, no
cache), to put its top logit on the token after next: row p reads the aux streams of position p
and the token t_{p+1} and learns t_{p+2} (cross-entropy over the draft vocabulary; tokens outside
it are skipped). With `unroll` = 2 it also learns its second guess: row p then reads the head's
own pre-norm output of row p - 1 (as when it chains at serving time; unlike serving, the earlier
rows it attends to are second guesses too) and learns the same token, at half the weight.

The draft vocabulary is the `draft_vocab` most frequent tokens of the training text (as SpecForge
builds it); the target's embedding is frozen and not saved (the published heads share it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.models.eagle3 import Eagle3Spec, eagle3_forward, init_eagle3


def draft_vocabulary(sequences: list[np.ndarray], vocab_size: int, draft_vocab: int) -> np.ndarray:
    """The draft_vocab most frequent target ids of the text, sorted ([Vd] int32)."""
    counts = np.bincount(np.concatenate(sequences), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[:draft_vocab]
    return np.sort(order).astype(np.int32)


def pack(sequences: list[np.ndarray], aux: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, length] (-1 past the end), aux [N, length, 3Ht]), each sequence cut to length."""
    tokens = np.full((len(sequences), length), -1, np.int32)
    states = np.zeros((len(sequences), length, aux[0].shape[-1]), np.float32)
    for i, (t, a) in enumerate(zip(sequences, aux)):
        n = min(len(t), length)
        tokens[i, :n], states[i, :n] = t[:n], a[:n]
    return tokens, states


def loss_fn(params, spec: Eagle3Spec, embed, tokens, aux, to_draft, unroll: int):
    """tokens [B, T] (-1: padding), aux [B, T, 3Ht]; to_draft [V]: each target id's draft id (-1:
    none). Returns (loss, top-1 accuracy of each unrolled guess [unroll])."""
    inputs, labels = jnp.maximum(tokens[:, 1:-1], 0), tokens[:, 2:]  # row p: t_{p+1} in, t_{p+2} out
    target = jnp.where(labels >= 0, to_draft[jnp.maximum(labels, 0)], -1)  # [B, T - 2] draft ids
    valid = target >= 0
    x, total, accuracy = aux[:, :-2], 0.0, []
    for step in range(unroll):
        logits, s = eagle3_forward(params, spec, embed, x, inputs)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logprobs, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
        count = jnp.maximum(valid.sum(), 1)
        total = total + 0.5**step * -(picked * valid).sum() / count
        accuracy.append(((jnp.argmax(logits, -1) == target) & valid).sum() / count)
        x = jnp.concatenate([jnp.zeros_like(s[:, :1]), s[:, :-1]], axis=1)  # row p reads row p - 1's output
    return total, jnp.stack(accuracy)


def train_eagle3(spec: Eagle3Spec, embed, tokens: np.ndarray, aux: np.ndarray, draft_ids: np.ndarray, *, steps: int,
                 batch_size: int = 16, learning_rate: float = 1e-3, weight_decay: float = 0.0, unroll: int = 2, seed: int = 0,
                 log=None) -> dict[str, jax.Array]:
    """AdamW on random minibatches of packed sequences; returns the head's parameters (`Eagle3Head` names)."""
    params = {k: jnp.asarray(v) for k, v in init_eagle3(spec, draft_ids, seed).items()}
    fixed = params.pop("draft_ids")
    to_draft = jnp.full((spec.config.vocab_size,), -1, jnp.int32).at[fixed].set(jnp.arange(len(fixed), dtype=jnp.int32))
    optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
    opt_state = optimizer.init(params)
    embed = jnp.asarray(embed, jnp.float32)

    @jax.jit
    def update(params, opt_state, tb, ab):
        (loss, accuracy), grads = jax.value_and_grad(
            lambda p: loss_fn({**p, "draft_ids": fixed}, spec, embed, tb, ab, to_draft, unroll), has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accuracy

    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = rng.integers(0, len(tokens), batch_size)
        params, opt_state, loss, accuracy = update(params, opt_state, jnp.asarray(tokens[idx]), jnp.asarray(aux[idx]))
        if log is not None and (step % max(1, steps // 10) == 0 or step == steps - 1):
            log(step, float(loss), np.asarray(accuracy))
    return {**params, "draft_ids": fixed}

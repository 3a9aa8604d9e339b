"""The draft-head proposer of speculative decoding (methods "eagle" and "medusa").

    LLM(target, speculative_config={"method": "eagle", "model": "./heads", "num_speculative_tokens": 3})

The target's step returns the final-normed hidden state of every logits row
(`StepFunction(return_hidden=True)`). For a sequence whose newest token y came from row h, the
heads (`jaxinfer.models.draft_heads`) turn h (and, EAGLE-style, y and each draft in turn) into k
distributions, one after another; each draft is sampled from its distribution with the
request's temperature / top-k / top-p / min-p (greedy: the argmax) under a seed of its own, and
the distributions go to the verification step as q (rejection sampling stays exact). No second
model, no cache of its own: one small jitted call per step. A sequence without a fresh hidden
row (it sat out the last step) drafts nothing.

With a confidence threshold, a sequence's draft ends before the first guess whose distribution
(the heads' logits at temperature 1) has a top probability below it: a small head is right
about as often as it is confident, and a guess it is unsure of costs a verification row for
little. The cut reads each guess's distribution, never the token drawn from it, so every draft
that is verified is still a draw from its q: the sampler stays exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.seeds import DRAFT_SEED_SALT, child_seed
from jaxinfer.engine.spec_decode import MAX_SPECULATIVE_TOKENS, DraftContext, Drafts
from jaxinfer.models.draft_heads import head_state, num_heads_of
from jaxinfer.models.layers import embed_lookup, matmul, tied_logits
from jaxinfer.ops.sampling import SamplingTensors, sample


class DraftHeadProposer:
    on_device = True

    def __init__(self, heads: dict, lm_weight, tied: bool, embed, confidence_threshold: float = 0.0):
        self.heads = heads  # draft_heads.init_heads' layout (medusa or eagle)
        self.confidence_threshold = confidence_threshold
        self.lm_weight = lm_weight  # the target's LM head [H, V] (or its tied embedding: layers.tied_logits)
        self.tied = tied
        self.embed = embed  # the target's embedding [V, H] (or quantized: layers.embed_lookup)
        self.max_k = num_heads_of(heads) or MAX_SPECULATIVE_TOKENS  # an eagle layer chains any length

    def propose(self, ctx: DraftContext, asked) -> Drafts:
        ready = [(i, seq, min(k, self.max_k)) for i, (seq, k) in enumerate(asked)
                 if seq.spec.hidden_row is not None and seq.spec.hidden_step == ctx.num_processed]
        tokens = [[] for _ in asked]
        if not ready:
            return Drafts(tokens)
        K = max(k for _, _, k in ready)
        n = 1 << (len(ready) - 1).bit_length()  # a few compiled sizes
        replica, row, newest = (np.zeros(n, np.int32) for _ in range(3))
        fields = {name: np.zeros((K, n), dtype) for name, dtype in (  # [guess, sequence]
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("seed", np.uint32),
            ("counter", np.int32), ("min_p", np.float32))}
        fields["top_p"][:] = 1.0
        for j, (_, seq, _) in enumerate(ready):
            p = seq.request.params
            replica[j], row[j], newest[j] = seq.request.replica, seq.spec.hidden_row, seq.token_ids[-1]
            fields["temperature"][:, j], fields["top_k"][:, j], fields["top_p"][:, j] = p.temperature, p.top_k, p.top_p
            fields["min_p"][:, j], fields["seed"][:, j] = p.min_p, child_seed(seq.seed, DRAFT_SEED_SALT)
            fields["counter"][:, j] = len(seq.output_token_ids) + np.arange(K)  # the draft seed keeps these apart from the target's
        f = {name: value.reshape(-1) for name, value in fields.items()}  # row i * n + j: guess i of sequence j
        st = SamplingTensors(f["temperature"], f["top_k"], f["top_p"], f["seed"], f["counter"], np.full(n * K, -1, np.int32),
                             min_p=f["min_p"], return_probs=np.ones(1, bool))
        drafted, confidence, probs = _draft(self.heads, self.lm_weight, self.embed, ctx.last_hidden, replica, row,
                                            newest, st, K, self.tied)
        drafted, confident = np.asarray(drafted), np.asarray(confidence) >= self.confidence_threshold  # [K, n] each
        src = [[] for _ in asked]
        for j, (i, _, k) in enumerate(ready):
            k = int(np.cumprod(confident[:k, j]).sum())  # up to the first unconfident guess
            tokens[i] = drafted[:k, j].tolist()
            src[i] = [g * n + j for g in range(k)]
        buffer = jnp.broadcast_to(probs[None], (ctx.num_replicas,) + probs.shape)  # every replica reads its own rows
        return Drafts(tokens, buffer, src)


@functools.partial(jax.jit, static_argnames=("num_guesses", "tied"))
def _draft(heads, lm_weight, embed, hidden, replica, row, newest, st: SamplingTensors, num_guesses: int, tied: bool):
    """hidden [replicas, R, H] -> (drafted tokens [K, n], each guess's confidence [K, n] (its
    distribution's top probability at temperature 1), the distributions drawn from [K * n, V])."""
    h = hidden[replica, row].astype(jnp.float32)  # [n, H]
    n = h.shape[0]
    lm_head = functools.partial(tied_logits, table=lm_weight) if tied else (lambda x: matmul(x, lm_weight))
    state, token, drafted, confidence, probs = h, newest, [], [], []
    for i in range(num_guesses):
        state = head_state(heads, i, state, h, embed_lookup(embed, token))
        rows = jax.tree.map(lambda a: a[i * n : (i + 1) * n] if a.shape[0] == num_guesses * n else a, st)
        logits = lm_head(state)  # [n, V]
        out = sample(logits, rows, 0)
        token = out.tokens
        drafted.append(token)
        confidence.append(jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)))
        probs.append(out.probs)
    return jnp.stack(drafted), jnp.stack(confidence), jnp.concatenate(probs)

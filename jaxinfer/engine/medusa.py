"""The Medusa proposer of speculative decoding: draft heads on the target's own hidden state.

    LLM(target, speculative_config={"method": "medusa", "model": "./heads", "num_speculative_tokens": 3})

The target's step returns the final-normed hidden state of every logits row
(`StepFunction(return_hidden=True)`); for a sequence whose newest token y came from row h, the
heads (`jaxinfer.models.draft_heads`) read h and give k distributions for the k tokens after y.
Drafts are sampled from them with the request's temperature / top-k / top-p / min-p (greedy:
their argmax) under a seed of their own, and their distributions go to the verification step as
q (rejection sampling stays exact). No second model, no cache of its own: one small jitted call
per step. A sequence without a fresh hidden row (it sat out the last step) drafts nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.draft_model import DRAFT_SEED_SALT
from jaxinfer.engine.spec_decode import Drafts
from jaxinfer.models.draft_heads import head_logits
from jaxinfer.models.layers import matmul
from jaxinfer.sampling import SamplingTensors, sample


class MedusaProposer:
    on_device = True

    def __init__(self, heads: dict, lm_weight, tied: bool):
        self.heads = heads  # {"w": [K, H, H], "b": [K, H]}
        self.lm_weight = lm_weight  # the target's LM head [H, V] (or its tied embedding [V, H])
        self.tied = tied
        self.num_heads = heads["w"].shape[0]

    def propose(self, engine, asked) -> Drafts:
        from jaxinfer.engine.engine import _child_seed

        ready = [(i, seq, min(k, self.num_heads)) for i, (seq, k) in enumerate(asked)
                 if seq.hidden_row is not None and seq.hidden_step == engine.num_processed]
        tokens = [[] for _ in asked]
        if not ready:
            return Drafts(tokens)
        K = max(k for _, _, k in ready)
        n = 1 << (len(ready) - 1).bit_length()  # a few compiled sizes
        replica = np.zeros(n, np.int32)
        row = np.zeros(n, np.int32)
        fields = {name: np.zeros(n * K, dtype) for name, dtype in (
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("seed", np.uint32),
            ("counter", np.int32), ("min_p", np.float32))}
        fields["top_p"][:] = 1.0
        for j, (_, seq, _) in enumerate(ready):
            p = seq.request.params
            replica[j], row[j] = seq.request.replica, seq.hidden_row
            rows = slice(j * K, (j + 1) * K)
            fields["temperature"][rows], fields["top_k"][rows], fields["top_p"][rows] = p.temperature, p.top_k, p.top_p
            fields["min_p"][rows], fields["seed"][rows] = p.min_p, _child_seed(seq.seed, DRAFT_SEED_SALT)
            fields["counter"][rows] = len(seq.output_token_ids) + np.arange(K)  # the draft seed keeps these apart from the target's
        st = SamplingTensors(fields["temperature"], fields["top_k"], fields["top_p"], fields["seed"], fields["counter"],
                             np.full(n * K, -1, np.int32), min_p=fields["min_p"], return_probs=np.ones(1, bool))
        drafted, probs = _draft(self.heads, self.lm_weight, engine.last_hidden, replica, row, st, K, self.tied)
        drafted = np.asarray(drafted).reshape(n, K)
        src = [[] for _ in asked]
        for j, (i, _, k) in enumerate(ready):
            tokens[i] = drafted[j, :k].tolist()
            src[i] = [j * K + h for h in range(k)]
        buffer = jnp.broadcast_to(probs[None], (len(engine.replicas),) + probs.shape)  # every replica reads its own rows
        return Drafts(tokens, buffer, src)


@functools.partial(jax.jit, static_argnames=("num_heads", "tied"))
def _draft(heads, lm_weight, hidden, replica, row, st: SamplingTensors, num_heads: int, tied: bool):
    """hidden [replicas, R, H] -> (drafted tokens [n * K], their distributions [n * K, V])."""
    h = hidden[replica, row]  # [n, H]
    if tied:
        lm_head = lambda x: jnp.einsum("nh,vh->nv", x.astype(lm_weight.dtype), lm_weight, preferred_element_type=jnp.float32)  # noqa: E731
    else:
        lm_head = lambda x: matmul(x, lm_weight)  # noqa: E731
    heads = {name: value[:num_heads] for name, value in heads.items()}
    logits = head_logits(heads, h, lm_head)  # [n, K, V]
    out = sample(logits.reshape(-1, logits.shape[-1]), st, 0)
    return out.tokens, out.probs

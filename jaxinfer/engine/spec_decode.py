"""Speculative decoding: its configuration and the proposers that draft tokens.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

Each engine step, every decoding sequence that speculates gets up to k drafted tokens from the
proposer; its step then computes its newest token and the drafts together (k + 1 query rows of
the same ragged step), and the target's distributions at those rows decide, on the device, how
many drafts to keep (`jaxinfer.ops.sampling.verify_drafts`: the longest matching prefix under
greedy decoding, the standard rejection sampler otherwise), plus one more token sampled from the
target. The rest is rolled back: the sequence's length rewinds and pages past it are released
(`BlockManager.truncate`).

Proposers implement `propose(ctx, asked) -> Drafts`, where `ctx` is a `DraftContext` (what a
proposer may read and do in the engine core: page tables, reserving slots with their page
copies, the last step's hidden states), `asked` is a list of (sequence, k) and each draft is a
list of at most k token ids (plus, for a model that samples its drafts, the distributions they
came from). The engine builds the proposer of a `SpeculativeConfig` (`jaxinfer.engine.build`).
Here:

- `NgramProposer` (method "ngram", prompt lookup): the last n tokens (n from prompt_lookup_max
  down to prompt_lookup_min) are searched for earlier in the prompt and output; what followed
  their latest earlier occurrence is the draft. No model; a deterministic proposal (its
  distribution q is one-hot), so rejection sampling accepts a drafted token with the target's
  probability of it.
- `draft_model.DraftModelProposer` (method "draft_model"): another model, or the target itself
  quantized or truncated to its first layers, drafts autoregressively in its own paged cache.
- `draft_head.DraftHeadProposer` (methods "eagle" and "medusa"): draft heads trained on the
  target's own text (`scripts/train_draft_head.py`) read the target's last hidden state.
- `mtp.MTPProposer` (method "mtp"): DeepSeek-V3's multi-token-prediction layer, shipped in its
  checkpoint, reads the target's hidden state of every token and drafts from its own cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np

METHODS = ("ngram", "draft_model", "eagle", "medusa", "mtp")
MAX_SPECULATIVE_TOKENS = 7  # k + 1 verification rows fit the spec_block bucket of 8


class SpecConfigError(ValueError):
    """A speculative_config the engine cannot use; the message names the key at fault."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys: method, num_speculative_tokens, prompt_lookup_max,
    prompt_lookup_min (method "ngram"), model, quantization (method "draft_model": a model path,
    None for the target itself; the draft's weight quantization), and jaxinfer's num_layers (a
    draft of the first num_layers layers of `model`: self-speculation) and
    draft_confidence_threshold (methods "eagle" / "medusa": a draft stops at the first guess whose
    distribution's top probability is below it; 0 drafts all k); disable_by_batch_size (vLLM's:
    no sequence drafts in a step that starts with at least this many running in its replica,
    where verification rows cost more than they save)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: str | None = None
    num_layers: int | None = None
    draft_confidence_threshold: float = 0.0
    disable_by_batch_size: int | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "SpeculativeConfig | None":
        if d is None:
            return None
        if not isinstance(d, dict):
            raise SpecConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = d.get("method", "ngram" if "prompt_lookup_max" in d else None)
        if method not in METHODS:
            raise SpecConfigError(f"speculative_config['method']={method!r}: expected one of {METHODS}")
        config = SpeculativeConfig(**{**d, "method": method})
        config.check()
        return config

    def check(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpecConfigError(f"speculative_config['num_speculative_tokens']={k!r}: must be an integer in "
                                  f"[1, {MAX_SPECULATIVE_TOKENS}]")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise SpecConfigError(f"speculative_config['num_layers']={self.num_layers!r}: must be a positive integer")
        if self.method == "ngram" and (self.model or self.quantization or self.num_layers):
            raise SpecConfigError("speculative_config: model / quantization / num_layers need method 'draft_model' "
                                  "(or 'eagle' / 'medusa': model)")
        if self.method == "mtp" and (self.model or self.quantization or self.num_layers):
            raise SpecConfigError("speculative_config: method 'mtp' drafts with the target checkpoint's own "
                                  "multi-token-prediction layer and takes no model / quantization / num_layers")
        if self.method in ("eagle", "medusa") and (not self.model or self.quantization or self.num_layers):
            raise SpecConfigError(f"speculative_config: method {self.method!r} needs 'model' (a folder of heads from "
                                  "scripts/train_draft_head.py) and takes no quantization / num_layers")
        tau = self.draft_confidence_threshold
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < 1:
            raise SpecConfigError(f"speculative_config['draft_confidence_threshold']={tau!r}: must be a number in [0, 1)")
        if tau and self.method not in ("eagle", "medusa"):
            raise SpecConfigError(f"speculative_config['draft_confidence_threshold'] applies to methods 'eagle' and "
                                  f"'medusa', not {self.method!r}")
        n = self.disable_by_batch_size
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 2):
            raise SpecConfigError(f"speculative_config['disable_by_batch_size']={n!r}: must be an integer >= 2")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise SpecConfigError(
                f"speculative_config: prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with 1 <= min <= max"
            )

    @property
    def spec_block(self) -> int:
        """Rows of the longest verification chunk (the newest token + k drafts), as a power of two."""
        return 1 << (self.num_speculative_tokens).bit_length()


class DraftContext(Protocol):
    """What a proposer may read and do in the engine core (`jaxinfer.engine.core` implements it)."""

    num_replicas: int
    num_processed: int  # steps read back so far
    last_hidden: Any  # [replicas, R, H] hidden states of the last step read (None unless the step returns them)

    def page_table(self, seq) -> list[int]:
        """The sequence's pages (ids within its replica's pool)."""

    def holds(self, seq, num_tokens: int) -> bool:
        """Whether the sequence still holds the K/V of its first num_tokens tokens (not preempted
        or rewound since)."""

    def reserve(self, seq, num_tokens: int) -> list[tuple[int, tuple[int, int]]] | None:
        """Slots for the sequence to hold num_tokens tokens; returns the (replica, (src, dst))
        page copies done in the target's pool for copy-on-write (a draft model's pool must
        mirror them), or None when out of pages."""


@dataclasses.dataclass
class Drafts:
    """What a proposer returns for the sequences it was asked about, in order."""

    tokens: list[list[int]]  # at most k drafted tokens each
    buffer: Any = None  # [replicas, N, V] device array of the drafts' distributions; None: deterministic drafts
    src: list[list[int]] | None = None  # per sequence, per draft: its row of buffer


class NgramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    on_device = False

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1):
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, ctx: DraftContext, asked) -> Drafts:
        return Drafts([self.draft(seq.token_ids, k) for seq, k in asked])

    def draft(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens for what follows `tokens`; [] when no n-gram of the suffix recurs."""
        ids = np.asarray(tokens, np.int64)
        L = len(ids)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram but the suffix itself
            hits = np.flatnonzero((windows == ids[L - n :]).all(axis=1))
            if len(hits):
                start = hits[-1] + n  # the latest occurrence, and what followed it
                return ids[start : start + k].tolist()
        return []


def replica_speculates(config: SpeculativeConfig, num_running: int) -> bool:
    """Whether a replica's sequences may draft this step: not while it runs `disable_by_batch_size` or more."""
    return config.disable_by_batch_size is None or num_running < config.disable_by_batch_size


def draft_budget(seq, max_model_len: int) -> int:
    """How many tokens to draft for a running sequence now (0: it decodes plainly this step)."""
    request, p = seq.request, seq.request.params
    if seq.spec is None or not seq.spec.tick():  # tick: a pause counts down every step
        return 0
    if seq.is_prefill or seq.pending or seq.hold or not request.forked:
        return 0
    num_out = len(seq.output_token_ids)
    if num_out < p.min_tokens:  # min_tokens bans EOS for some positions; the drafts would not know
        return 0
    left = min((p.max_tokens or max_model_len) - num_out, request.max_len - len(seq.token_ids))
    if left <= 1:
        return 0
    return min(seq.spec.k, left - 1)

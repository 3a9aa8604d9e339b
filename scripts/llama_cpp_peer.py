"""llama.cpp as a benchmark peer: greedy continuous batching over a few slots, through
llama-cpp-python's low-level API (the `bench` extra: pip install -e '.[bench]').

The high-level `llama_cpp.Llama` runs one sequence at a time; a fair peer for batched serving
is what llama.cpp's own server does: `slots` sequences share one unified KV cache, and every
`llama_decode` call carries one new token for each decoding slot plus prompt chunks of newly
admitted requests, within `n_batch` tokens. A finished slot's cells are freed
(`llama_memory_seq_rm`) and the next waiting request takes it. slots=1 is the batch-1 peer.

    peer = LlamaCppPeer("model.gguf", slots=16, n_ctx=16 * 1024, threads=2)
    results = peer.generate([(prompt_ids, max_new_tokens), ...])   # greedy, EOS ignored
    # each: {"tokens": [...], "first_token_at": t, "last_token_at": t} (time.perf_counter)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Slot:
    index: int            # request index
    prompt: list[int]
    max_new: int
    done_prompt: int = 0  # prompt tokens already in the KV cache
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.done_prompt < len(self.prompt)


class LlamaCppPeer:
    def __init__(self, model_path: str, *, slots: int, n_ctx: int, threads: int = 2, n_batch: int = 512):
        import llama_cpp
        from llama_cpp._logger import set_verbose

        set_verbose(False)
        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = slots
        cparams.kv_unified = True  # slots share the cells, as the server's --kv-unified
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.slots, self.n_batch = slots, n_batch
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.settings = {"slots": slots, "n_ctx": n_ctx, "n_batch": n_batch, "threads": threads, "kv_unified": True,
                         "llama_cpp_python": getattr(llama_cpp, "__version__", "?")}

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, requests: list[tuple[list[int], int]], on_step=None) -> list[dict]:
        """Greedy continuations of `requests` ((prompt ids, new tokens)), EOS ignored."""
        waiting = deque(range(len(requests)))
        free_seq = list(range(self.slots))
        active: dict[int, _Slot] = {}  # seq id -> slot
        results: list[dict | None] = [None] * len(requests)
        while waiting or active:
            while waiting and free_seq:
                i = waiting.popleft()
                prompt, max_new = requests[i]
                active[free_seq.pop(0)] = _Slot(i, list(prompt), max_new)
            # One token per decoding slot, then prompt chunks in the room left.
            entries, picks = [], []  # picks: seqs whose row's logits choose their next token
            for seq, s in active.items():
                if not s.prefilling:
                    entries.append((s.tokens[-1], len(s.prompt) + len(s.tokens) - 1, seq, True))
                    picks.append(seq)
            for seq, s in active.items():
                while s.prefilling and len(entries) < self.n_batch:
                    last = s.done_prompt == len(s.prompt) - 1
                    entries.append((s.prompt[s.done_prompt], s.done_prompt, seq, last))
                    s.done_prompt += 1
                    if last:
                        picks.append(seq)
            next_tokens = self.step(entries)
            now = time.perf_counter()
            for seq, token in zip(picks, next_tokens):
                s = active[seq]
                s.tokens.append(token)
                s.first_token_at = s.first_token_at or now
                s.last_token_at = now
                if len(s.tokens) == s.max_new:
                    results[s.index] = {"tokens": s.tokens, "first_token_at": s.first_token_at,
                                        "last_token_at": s.last_token_at}
                    self.forget(seq)
                    del active[seq]
                    free_seq.append(seq)
            if on_step:
                on_step(len(entries))
        return results

    def step(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries (at most n_batch);
        returns the greedy next token of each entry that wants logits, in order."""
        b = self.batch
        for n, (token, pos, seq, logits) in enumerate(entries):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
            b.seq_id[n][0] = seq
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full? n_ctx too small for {self.slots} slots)")
        return [self._argmax(n) for n, e in enumerate(entries) if e[3]]

    def forget(self, seq: int, from_pos: int = -1) -> None:
        """Drops sequence `seq`'s cells from position `from_pos` on (all of them by default)."""
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), seq, from_pos, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)


if __name__ == "__main__":  # a quick check: greedy text of one prompt, then the same prompt in 4 slots
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from jaxinfer.runtime.loading import default_model_path

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(default_model_path()))
    a = p.parse_args()
    peer = LlamaCppPeer(a.model, slots=4, n_ctx=4096)
    prompt = [1, 4093, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    t0 = time.perf_counter()
    out = peer.generate([(prompt, 16)] * 4)
    print([o["tokens"] for o in out], f"{time.perf_counter() - t0:.2f} s")

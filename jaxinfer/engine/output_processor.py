"""Output processing: what a sampled token means for its sequence, and the RequestOutputs users see.

For each new token (`on_token`): its logprobs, the request's timing metrics, incremental
detokenization, and the stop checks in order: EOS (unless ignore_eos), a stop token id, a stop
string in the new text once past min_tokens (the text is cut there; `include_stop_str_in_output`
keeps it), the end of a structured_outputs constraint (the sequence's grammar matcher takes every
token), then the length limits (max_tokens, the request's max_len within max_model_len). It sets
the sequence's finish reason; the engine core then frees the sequence's pages. `output` builds the
RequestOutput of a request from its sequences.

The text an unfinished sequence shows holds back its end while that end may still begin a stop
string (at most the longest stop string less one character): a later token could complete the
stop string, and the text would then be cut before it. So each output's text extends the one
before, and a stream's deltas add up to the finished text exactly.
"""

from __future__ import annotations

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.model_runner import RowResult
from jaxinfer.engine.request import Request, Sequence
from jaxinfer.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, PositionLogprobs,
                              RequestOutput)


class OutputProcessor:
    def __init__(self, tokenizer, *, eos_token_ids, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def on_token(self, seq: Sequence, row: RowResult, index: int, now: float) -> None:
        """A newly sampled token, already at seq.token_ids[index]: sets seq.finish_reason when it ends the sequence."""
        request, p = seq.request, seq.request.params
        token = row.token
        seq.cumulative_logprob += row.logprob
        if p.logprobs is not None:
            seq.output_logprobs.append(self.position_logprobs(token, row, p.logprobs))
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generated_tokens += 1
        self.num_generated_tokens += 1

        length = index + 1  # the sequence's length up to this token (later pending tokens excluded)
        num_out = length - len(request.prompt_token_ids)
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        else:
            if p.detokenize:
                if seq.detokenizer is None:
                    seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                             skip_special_tokens=p.skip_special_tokens)
                delta = seq.detokenizer.add(token)
                seq.text = seq.detokenizer.text
                if p.stop and delta and num_out > p.min_tokens:  # as in vLLM: no stop string within min_tokens
                    self._check_stop_strings(seq, len(delta))
            if seq.finish_reason is None and seq.grammar is not None:
                accepted = seq.grammar.accept(token)
                if not accepted or seq.grammar.is_terminated:  # the constraint is complete: stop as EOS would
                    seq.finish_reason = "stop"
                    self._flush(seq)
            if seq.finish_reason is None and (num_out >= (p.max_tokens or self.max_model_len) or length >= request.max_len):
                seq.finish_reason = "length"
                self._flush(seq)

    @staticmethod
    def _flush(seq: Sequence) -> None:
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()

    def on_prompt_logprob(self, request: Request, target: int, row: RowResult) -> None:
        """The logprob of prompt token `target` (scored by `row`), appended to the request's prompt
        logprobs: rows come in prompt order, each scoring the next position without an entry."""
        request.prompt_logprobs.append(self.position_logprobs(target, row, request.params.prompt_logprobs))

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> None:
        """Ends `seq` at the first stop string that ends in its newest `delta_len` characters (each
        searched from where it could start and still reach them, as vLLM does: text before
        min_tokens, never checked, is not searched later either)."""
        p = seq.request.params
        hits = [(seq.text.find(s, max(0, len(seq.text) - delta_len - len(s) + 1)), s) for s in p.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, stop = min(hits)
            seq.text = seq.text[: at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
            seq.finish_reason, seq.stop_reason = "stop", stop

    def position_logprobs(self, token: int, row: RowResult, n: int) -> PositionLogprobs:
        """{token id: Logprob} of one position: the chosen token first, then the top n."""
        decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
        top_ids = [int(t) for t in row.top_ids[:n]]
        entry: PositionLogprobs = {}
        if token not in top_ids[:n]:
            rank = top_ids.index(token) + 1 if token in top_ids else None
            entry[token] = Logprob(row.logprob, rank, decode(token))
        for rank, (tid, lp) in enumerate(zip(top_ids, row.top_logprobs[:n]), start=1):
            entry.setdefault(tid, Logprob(float(lp), rank, decode(tid)))
        if token in entry:  # the chosen token first
            entry = {token: entry[token], **{k: v for k, v in entry.items() if k != token}}
        return entry

    @staticmethod
    def output(request: Request) -> RequestOutput | PoolingRequestOutput:
        if request.pooling is not None:
            return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                        PoolingOutput(request.pooled) if request.pooled is not None else None,
                                        request.finished, request.metrics, request.error)
        p = request.params
        seqs = sorted(request.seqs, key=lambda s: s.index)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs if p.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(
                    index=s.index, text=shown_text(s), token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if p.logprobs is not None else None,
                    logprobs=s.output_logprobs if p.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                )
                for s in seqs
            ],
            finished=request.finished,
            metrics=request.metrics,
            error=request.error,
            kv_handoff=request.exported_kv,
        )


def shown_text(seq: Sequence) -> str:
    """The sequence's text as its RequestOutput shows it: all of it once finished; while it runs,
    less the longest end of it that begins one of its stop strings (which a later token may
    complete, cutting the text there). With include_stop_str_in_output nothing is held back: the
    cut then falls after the stop string, past every character shown before."""
    p, text = seq.request.params, seq.text
    if seq.finish_reason is not None or not p.stop or p.include_stop_str_in_output:
        return text
    for held in range(min(max(len(s) for s in p.stop) - 1, len(text)), 0, -1):
        end = text[-held:]
        if any(s.startswith(end) for s in p.stop):
            return text[:-held]
    return text

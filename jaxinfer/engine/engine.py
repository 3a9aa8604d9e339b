"""`LLMEngine`: the continuous-batching loop, for custom drivers (and under `LLM`).

    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():        # RequestOutputs that changed this step
            print(out.request_id, out.outputs[0].text)

One `step()`: the scheduler picks sequences and chunk sizes, the runner copies pages that
copy-on-write asked for and runs the jitted step, then each sequence takes its sampled token:
logprobs, incremental detokenization, stop checks; finished sequences free their pages. A request
with n > 1 runs as one sequence through its prompt; the step that finishes the prompt samples n
tokens from the last row (one seed each) and forks the sequence n - 1 times, sharing every
prompt page.

Speculative decoding (`speculative_config`): before scheduling, each decoding sequence that
speculates gets drafted tokens from the proposer (`spec_decode`); its chunk in the step is its
newest token plus the drafts, every row's logits verify one draft (rejection sampling on the
device), and processing keeps the accepted drafts plus one sampled token, rewinding the rest
(`BlockManager.truncate`). Steps holding speculating sequences are read before the next one is
scheduled (the next drafts need the accepted tokens on the host). Each sequence adapts its own
draft length to its acceptance (`request.SpecState`); `get_stats` reports drafted and accepted
tokens.

Data parallelism: the runner's model has `num_replicas` attention replicas, each with its own
pages. Each replica has its own `BlockManager` and `Scheduler` (with the full token and sequence
budgets), and every step runs all replicas' choices together. A request is assigned to one
replica when it arrives: the one holding the longest cached prefix of its prompt, then the one
with the least work queued (unfinished sequences, then KV usage), so the replicas stay balanced
and prefix hits stay where the prefix is.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jaxinfer.batch import SequenceChunk
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.model_runner import ModelRunner, RowResult, RowSampling, ScheduledChunk
from jaxinfer.engine.request import PENDING, Request, RequestMetrics, Sequence, SpecState, SwappedKV
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler
from jaxinfer.engine.spec_decode import SpeculativeConfig, make_proposer
from jaxinfer.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger("jaxinfer")


@dataclasses.dataclass
class Replica:
    """One attention replica's host state: its page pool and its scheduler."""

    block_manager: BlockManager
    scheduler: Scheduler


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable pages held by sequences
    prefix_cache_hit_rate: float  # cached pages found / pages looked up
    num_preemptions: int
    num_compiles: int
    num_steps: int
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    # speculative decoding: verification chunks, tokens drafted into them, drafts accepted
    num_spec_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus the sampled one."""
        return 1 + self.num_accepted_tokens / self.num_spec_verifications if self.num_spec_verifications else 0.0


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        eos_token_ids,
        max_logprobs: int = 20,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        seed: int = 0,
        log_stats_interval: float | None = None,
        speculative_config: SpeculativeConfig | None = None,
        proposer=None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.eos_token_ids = set(eos_token_ids)
        self.replicas = []
        for _ in range(runner.num_replicas):
            bm = BlockManager(runner.pages_per_replica, runner.page_size, enable_prefix_caching=enable_prefix_caching)
            self.replicas.append(Replica(bm, Scheduler(bm, max_num_batched_tokens=max_num_batched_tokens,
                                                       max_num_seqs=max_num_seqs, preemption_mode=preemption_mode)))
        self.requests: dict[str, Request] = {}
        self._seed_rng = np.random.default_rng(seed)
        self._counter = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.log_stats_interval = log_stats_interval
        self._last_log = time.time()
        self.spec_config = speculative_config
        if proposer is None and speculative_config is not None:
            proposer = make_proposer(speculative_config)
        self.proposer = proposer  # drafts tokens (jaxinfer.engine.spec_decode); None: no speculation
        self._draft_buffer = None  # this step's draft distributions (a draft model's), on the device
        self.num_processed = 0  # steps read back so far
        self.last_hidden = None  # [replicas, R, H] hidden states of the last step read (draft heads read them)
        self.num_spec_verifications = self.num_draft_tokens = self.num_accepted_tokens = 0
        self._inflight: _InFlight | None = None  # the dispatched step not processed yet

    @property
    def block_manager(self) -> BlockManager:
        """The first replica's block manager (the only one without data parallelism)."""
        return self.replicas[0].block_manager

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one without data parallelism)."""
        return self.replicas[0].scheduler

    def _replica(self, seq: Sequence) -> Replica:
        return self.replicas[seq.request.replica]

    def _pick_replica(self, token_ids: list[int]) -> int:
        """The replica a new request runs on: the longest cached prefix, then the least work."""
        def rank(i: int):
            bm, sched = self.replicas[i].block_manager, self.replicas[i].scheduler
            unfinished = sum(seq.request.params.n if not seq.request.forked else 1 for seq in sched.waiting) + len(sched.running)
            return (-bm.num_cached_prefix_pages(token_ids), unfinished, bm.usage, i)
        return min(range(len(self.replicas)), key=rank)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request. A bad one raises ValueError naming it; nothing else is affected."""
        params = params or SamplingParams()
        request_id = str(self._counter) if request_id is None else str(request_id)
        self._counter += 1
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        text, ids = self.tokenize(prompt, f"request {request_id!r}")
        self.validate(ids, params, f"request {request_id!r}")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31))
        limit = self.max_model_len if params.max_tokens is None else min(self.max_model_len, len(ids) + params.max_tokens)
        request = Request(request_id, text, ids, params, seed, limit, priority,
                          RequestMetrics(arrival_time if arrival_time is not None else time.time()),
                          replica=self._pick_replica(ids))
        seq = Sequence(request, 0, list(ids), seed)
        k = self._draft_length(params)
        if k:
            seq.spec = SpecState(max_k=k, k=k)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self._replica(seq).scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> None:
        """Stops a request at once: its sequences finish with reason "abort" and free their pages."""
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._replica(seq).scheduler.finish(seq)
        request.metrics.finished_time = time.time()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of the requests it advanced.

        Pipelined: it schedules and dispatches step N+1 first, then reads and processes step N,
        whose sampled tokens step N+1 already takes on the device. A sequence whose step-N token
        ends it (EOS, stop) has a wasted slot in step N+1, whose result is ignored. When step N
        must be read before scheduling (its tokens feed penalties, or a request forks into n
        completions), it is processed first.
        """
        outputs: list[RequestOutput] = []
        previous, self._inflight = self._inflight, None
        if previous is not None and previous.must_sync:
            outputs += self._process(previous)
            previous = None
        if self.proposer is not None:
            self._propose_drafts()
        plans = [replica.scheduler.schedule() for replica in self.replicas]
        for plan in plans:
            for seq in plan.preempted:
                seq.draft_computed = 0  # its pages are gone, the draft model's too
        if any(plan.scheduled for plan in plans):
            self._inflight = self._dispatch(plans)
        if previous is not None:
            outputs += self._process(previous)
        if self._inflight is None and previous is None and not outputs:
            if any(r.scheduler.waiting and not r.scheduler.running for r in self.replicas):
                raise RuntimeError("no waiting request fits in the KV cache; raise num_pages")  # add_request prevents this
        self._maybe_log()
        return outputs

    def _dispatch(self, plans: list) -> "_InFlight":
        """Launches one step for every replica's plan (SchedulerOutput)."""
        copies = []
        for r, plan in enumerate(plans):
            bm = self.replicas[r].block_manager
            for seq, pages, num_computed in plan.swap_out:  # before anything can overwrite the freed pages
                k, v = self.runner.read_pages(r, pages)
                seq.swapped = SwappedKV(k, v, num_computed)
            for seq, first, pages in plan.swap_in:
                self.runner.write_pages(r, pages, seq.swapped.k[:, first : first + len(pages)],
                                        seq.swapped.v[:, first : first + len(pages)])
                bm.mark_computed(seq.seq_id, seq.num_computed, seq.token_ids)
                seq.swapped = None
            copies += [(r, copy) for copy in plan.page_copies]
        if copies:
            self.runner.copy_pages(copies)
        scheduled = [plan.scheduled for plan in plans]
        chunks = [[self._chunk(s) for s in replica_scheduled] for replica_scheduled in scheduled]
        want_logprobs = any(
            s.seq.request.params.logprobs is not None or s.seq.request.wants_prompt_logprobs
            for replica_scheduled in scheduled for s in replica_scheduled
        )
        drafts_sampled = any(c.sampling.draft_src for replica_chunks in chunks for c in replica_chunks)
        handle = self.runner.dispatch(chunks, want_logprobs=want_logprobs,
                                      draft_buffer=self._draft_buffer if drafts_sampled else None)
        self.num_steps += 1
        inflight = _InFlight(scheduled, chunks, handle)
        for replica, replica_scheduled, replica_chunks, replica_rows in zip(self.replicas, scheduled, chunks, handle.rows_of_chunk):
            speculates = self._speculates(replica)
            for s, chunk, rows in zip(replica_scheduled, replica_chunks, replica_rows):
                seq, request = s.seq, s.seq.request
                if speculates and seq.spec is not None and seq.spec.drafts_next_step:
                    inflight.must_sync = True  # its next draft needs this step's tokens on the host
                if s.num_draft:  # verification: num_computed and tokens are settled when it is read
                    continue
                seq.num_computed += s.num_tokens
                if not s.samples:
                    continue
                sample_rows = [r for r, t in zip(rows, chunk.sampling.target_ids) if t < 0]
                seq.token_ids.append(PENDING)  # the sampled token, known on the device only for now
                seq.pending[len(seq.token_ids) - 1] = sample_rows[0]
                p = request.params
                num_out = len(seq.token_ids) - len(request.prompt_token_ids)
                if num_out >= (p.max_tokens or self.max_model_len) or len(seq.token_ids) >= request.max_len:
                    seq.hold = True  # this token ends it: nothing more to schedule
                if not request.forked or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                    inflight.must_sync = True
        return inflight

    def _chunk(self, s: ScheduledSeq) -> ScheduledChunk:
        seq, request = s.seq, s.seq.request
        start = s.start
        rows, targets = [], []
        if request.wants_prompt_logprobs and seq.index == 0:
            have = len(request.prompt_logprobs or [None])
            for i in range(s.num_tokens):
                nxt = start + i + 1  # the row at offset i scores token nxt
                if have <= nxt < len(request.prompt_token_ids):
                    rows.append(i)
                    targets.append(request.prompt_token_ids[nxt])
        seed: int | list[int] = seq.seed
        p = request.params
        num_out = len(seq.output_token_ids)
        counter: int | list[int] = num_out
        draft_tokens: list[int] = []
        draft_src: list[int] = []
        if s.num_draft:  # verification: row i verifies draft i and samples output token num_out + i
            rows = list(range(s.num_tokens - s.num_draft - 1, s.num_tokens))
            targets = [-1] * len(rows)
            counter = [num_out + i for i in range(len(rows))]
            draft_tokens = seq.draft[: s.num_draft] + [-1]  # the last row: the bonus token
            draft_src = seq.draft_src[: s.num_draft] + [-1] if seq.draft_src else []
        elif s.samples:  # the last row samples; before its request forks, it samples all n completions
            n = 1 if request.forked else request.params.n
            rows += [s.num_tokens - 1] * n
            targets += [-1] * n
            # prompt-logprob rows keep the sequence's seed; sample row j gets completion j's seed
            seed = [seq.seed] * (len(rows) - n) + [_child_seed(seq.seed, j) for j in range(n)]
        banned = ()
        if num_out < p.min_tokens and not p.ignore_eos:
            banned = tuple(sorted(self.eos_token_ids | set(p.stop_token_ids or ())))
        elif num_out < p.min_tokens:
            banned = tuple(p.stop_token_ids or ())
        sampling = RowSampling(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
            seed=seed,
            counter=counter, target_ids=targets,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, banned_ids=banned, draft_tokens=draft_tokens, draft_src=draft_src,
        )
        if sampling.uses_penalties:  # history as of the sampled row: everything up to this chunk's end
            sampling.history = seq.token_ids[: start + s.num_tokens]
            sampling.num_prompt_history = min(len(request.prompt_token_ids), start + s.num_tokens)
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.time()
        tokens = seq.token_ids[start : start + s.num_tokens - s.num_draft] + seq.draft[: s.num_draft]
        pages = self._replica(seq).block_manager.page_table(seq.seq_id)
        device_tokens = {i: seq.pending[start + i] for i in range(s.num_tokens) if start + i in seq.pending}
        return ScheduledChunk(SequenceChunk(tokens, start, pages, rows, device_tokens), sampling)

    def _process(self, inflight: "_InFlight") -> list[RequestOutput]:
        """Reads a dispatched step's tokens and applies them: logprobs, forks, stop checks."""
        results = self.runner.collect(inflight.handle)
        self.num_processed += 1
        self.last_hidden = inflight.handle.out.hidden
        now = time.time()
        touched: dict[str, Request] = {}
        for replica_scheduled, replica_chunks, replica_results, replica_rows in zip(
            inflight.scheduled, inflight.chunks, results, inflight.handle.rows_of_chunk
        ):
            for sched, chunk, rows, row_ids in zip(replica_scheduled, replica_chunks, replica_results, replica_rows):
                if sched.seq.finished:  # finished or aborted after this step was dispatched
                    continue
                self._advance(sched, chunk, rows, now, row_ids)
                touched[sched.seq.request.request_id] = sched.seq.request
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self._output(request))
        return outputs

    def _advance(self, s: ScheduledSeq, chunk: ScheduledChunk, rows: list[RowResult], now: float, row_ids: list[int]) -> None:
        if s.num_draft:
            return self._verified(s, rows, now, row_ids)
        seq, request = s.seq, s.seq.request
        seq.draft_computed = min(seq.draft_computed, seq.num_computed)  # its drafts went unverified
        if s.samples:  # the row its next token comes from (every sample row of a fork has the same hidden state)
            seq.hidden_row, seq.hidden_step = row_ids[-1], self.num_processed
        samples = []
        for row, target in zip(rows, chunk.sampling.target_ids):
            if target >= 0:
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None]
                request.prompt_logprobs.append(self._position_logprobs(target, row, request.params.prompt_logprobs))
            else:
                samples.append(row)
        end = s.start + s.num_tokens
        if samples:
            index = end  # where this step's sampled token sits in token_ids
            seq.token_ids[index] = samples[0].token
            seq.pending.pop(index, None)
        replica = self._replica(seq)
        if seq.seq_id in replica.block_manager.seqs and seq.num_computed >= end:  # not preempted meanwhile
            replica.block_manager.mark_computed(seq.seq_id, end, seq.token_ids)
        if s.num_tokens > 1:
            self.num_prompt_tokens_computed += s.num_tokens
        if not samples:
            return
        if not request.forked:  # the prompt is done: make the n completions, sharing its pages
            for j, row in enumerate(samples[1:], start=1):
                child = Sequence(request, j, seq.token_ids[:end] + [row.token], _child_seed(request.seed, j), num_computed=end)
                replica.block_manager.fork(seq.seq_id, child.seq_id)
                child.spec = dataclasses.replace(seq.spec) if seq.spec else None
                child.hidden_row, child.hidden_step = seq.hidden_row, seq.hidden_step
                request.seqs.append(child)
                replica.scheduler.add_running(child)
                self._on_token(child, row, end, now)
            request.forked = True
        self._on_token(seq, samples[0], end, now)
        if seq.finished:
            del seq.token_ids[end + 1 :]  # drop tokens of steps dispatched after the one that ended it
            seq.pending.clear()

    def _verified(self, s: ScheduledSeq, rows: list[RowResult], now: float, row_ids: list[int]) -> None:
        """A verification chunk's results: keep the accepted drafts and the sampled token after
        them, rewind the sequence's length past them (the rejected drafts' K/V are dropped)."""
        seq = s.seq
        draft = seq.draft[: s.num_draft]
        accepted = next((i for i, row in enumerate(rows[: s.num_draft]) if not row.accepted), s.num_draft)
        computed = s.start + 1 + accepted  # the newest token's K/V and the accepted drafts'
        bm = self._replica(seq).block_manager
        if seq.seq_id in bm.seqs:  # not preempted meanwhile
            bm.truncate(seq.seq_id, computed)
            seq.num_computed = computed
            emitted = draft[:accepted] + [rows[accepted].token]
            bm.mark_computed(seq.seq_id, computed, seq.token_ids + emitted)
        else:
            emitted = []
        seq.hidden_row, seq.hidden_step = row_ids[accepted], self.num_processed  # the row y came from
        self.num_spec_verifications += 1
        self.num_draft_tokens += s.num_draft
        self.num_accepted_tokens += accepted
        seq.spec.update(s.num_draft, accepted)
        seq.draft, seq.draft_src = [], []
        seq.draft_computed = min(seq.draft_computed, seq.num_computed)  # a draft model's cache past the accepted drafts is stale
        for i, token in enumerate(emitted):
            seq.token_ids.append(token)
            self._on_token(seq, dataclasses.replace(rows[i], token=token), len(seq.token_ids) - 1, now)
            if seq.finished:
                break

    def _propose_drafts(self) -> None:
        """Drafts for every decoding sequence that speculates this step (one proposer call)."""
        asked = []
        for replica in self.replicas:
            speculates = self._speculates(replica)
            for seq in replica.scheduler.running:
                seq.draft, seq.draft_src = [], []
                k = self._draft_budget(seq) if speculates else 0
                if k:
                    asked.append((seq, k))
        self._draft_buffer = None
        if not asked:
            return
        drafts = self.proposer.propose(self, asked)
        self._draft_buffer = drafts.buffer
        for i, (seq, k) in enumerate(asked):
            seq.draft = list(drafts.tokens[i][:k])
            seq.draft_src = list(drafts.src[i][:k]) if drafts.src else []
            seq.spec.proposed(len(seq.draft))

    def _speculates(self, replica) -> bool:
        """Whether `replica`'s sequences may draft now: not while it runs `disable_by_batch_size` or more."""
        limit = self.spec_config.disable_by_batch_size if self.spec_config is not None else None
        return limit is None or len(replica.scheduler.running) < limit

    def _draft_budget(self, seq: Sequence) -> int:
        """How many tokens to draft for `seq` now (0: it decodes plainly this step)."""
        request, p = seq.request, seq.request.params
        if seq.spec is None or not seq.spec.tick():  # tick: a pause counts down every step
            return 0
        if seq.is_prefill or seq.pending or seq.hold or not request.forked:
            return 0
        num_out = len(seq.output_token_ids)
        if num_out < p.min_tokens:  # min_tokens bans EOS for some positions; the drafts would not know
            return 0
        left = min((p.max_tokens or self.max_model_len) - num_out, request.max_len - len(seq.token_ids))
        if left <= 1:
            return 0
        return min(seq.spec.k, left - 1)

    def _draft_length(self, p: SamplingParams) -> int:
        """A new request's maximum draft length (0: it does not speculate)."""
        if self.spec_config is None:
            return 0
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return 0  # penalties depend on every token before: verified rows could not apply them
        k = self.spec_config.num_speculative_tokens if p.num_speculative_tokens is None else p.num_speculative_tokens
        return min(k, self.spec_config.num_speculative_tokens)

    def _on_token(self, seq: Sequence, row: RowResult, index: int, now: float) -> None:
        """A newly sampled token (already in seq.token_ids): logprobs, metrics, text, stop checks."""
        request, p = seq.request, seq.request.params
        token = row.token
        seq.cumulative_logprob += row.logprob
        if p.logprobs is not None:
            seq.output_logprobs.append(self._position_logprobs(token, row, p.logprobs))
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
                if p.stop and delta:
                    self._check_stop_strings(seq, len(delta))
            if seq.finish_reason is None and (num_out >= (p.max_tokens or self.max_model_len) or length >= request.max_len):
                seq.finish_reason = "length"
                if seq.detokenizer is not None:
                    seq.text += seq.detokenizer.flush()
        if seq.finish_reason is not None:
            self._replica(seq).scheduler.finish(seq)

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> None:
        p = seq.request.params
        longest = max(len(s) for s in p.stop)
        window_start = max(0, len(seq.text) - delta_len - longest + 1)
        hits = [(seq.text.find(s, window_start), s) for s in p.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, stop = min(hits)
            seq.text = seq.text[: at + len(stop)] if p.include_stop_str_in_output else seq.text[:at]
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _position_logprobs(self, token: int, row: RowResult, n: int) -> PositionLogprobs:
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

    def _output(self, request: Request) -> RequestOutput:
        p = request.params
        seqs = sorted(request.seqs, key=lambda s: s.index)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs if p.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(
                    index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if p.logprobs is not None else None,
                    logprobs=s.output_logprobs if p.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                )
                for s in seqs
            ],
            finished=request.finished,
            metrics=request.metrics,
        )

    # ------------------------------------------------------------------ input checks
    def tokenize(self, prompt, label: str) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as a string, token ids, or a dict."""
        if isinstance(prompt, str):
            return prompt, (self.tokenizer.encode(prompt) if prompt else [])
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            text = prompt.get("prompt")
            ids = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else self.tokenizer.encode(text or "")
            return text, [int(t) for t in ids]
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, [int(t) for t in prompt]
        raise ValueError(f"{label}: expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, ids: list[int], p: SamplingParams, label: str) -> None:
        """Raises ValueError, starting with `label`, for a prompt the engine cannot run."""
        if not ids:
            raise ValueError(f"{label}: the prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{label}: the prompt has {len(ids)} tokens, over max_model_len={self.max_model_len} "
                f"(a prompt needs at most max_model_len - 1 tokens to leave room for one generated token)"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{label}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        for field in ("logprobs", "prompt_logprobs"):
            v = getattr(p, field)
            if v is not None and v > self.max_logprobs:
                raise ValueError(f"{label}: SamplingParams.{field}={v} exceeds max_logprobs={self.max_logprobs}")
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"{label}: SamplingParams.n={p.n} exceeds max_num_seqs={self.scheduler.max_num_seqs}")
        if p.num_speculative_tokens and self.spec_config and p.num_speculative_tokens > self.spec_config.num_speculative_tokens:
            raise ValueError(
                f"{label}: SamplingParams.num_speculative_tokens={p.num_speculative_tokens} exceeds the engine's "
                f"num_speculative_tokens={self.spec_config.num_speculative_tokens}"
            )
        total = min(self.max_model_len, len(ids) + (p.max_tokens or self.max_model_len))
        need = self.block_manager.pages_needed(total) + (1 if p.n > 1 else 0) * (p.n - 1)
        if need > self.block_manager.num_usable_pages:
            raise ValueError(
                f"{label}: needs {need} KV pages but the cache has {self.block_manager.num_usable_pages} (per replica); "
                f"raise num_pages or lower max_tokens"
            )

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        """Totals over the replicas (KV usage: the mean; prefix hit rate: over all look-ups)."""
        bms = [r.block_manager for r in self.replicas]
        scheds = [r.scheduler for r in self.replicas]
        queries = sum(bm.stats.queries for bm in bms)
        return EngineStats(
            num_running=sum(len(s.running) for s in scheds),
            num_waiting=sum(len(s.waiting) for s in scheds),
            kv_cache_usage=sum(bm.usage for bm in bms) / len(bms),
            prefix_cache_hit_rate=sum(bm.stats.hits for bm in bms) / queries if queries else 0.0,
            num_preemptions=sum(s.num_preemptions for s in scheds),
            num_compiles=self.runner.num_compiles,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_spec_verifications=self.num_spec_verifications,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    def _maybe_log(self) -> None:
        if self.log_stats_interval is None or time.time() - self._last_log < self.log_stats_interval:
            return
        self._last_log = time.time()
        s = self.get_stats()
        logger.info(
            "running %d, waiting %d, KV cache %.1f%%, prefix hit rate %.1f%%, preemptions %d, compiles %d, "
            "generated %d tokens in %d steps",
            s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * s.prefix_cache_hit_rate,
            s.num_preemptions, s.num_compiles, s.num_generated_tokens, s.num_steps,
        )


@dataclasses.dataclass
class _InFlight:
    scheduled: list[list[ScheduledSeq]]  # per replica
    chunks: list[list[ScheduledChunk]]
    handle: object  # model_runner.InFlightStep
    must_sync: bool = False  # read it before scheduling the next step


def _child_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`)."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] >> 1)

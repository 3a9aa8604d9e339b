"""The engine core: schedule -> dispatch -> collect, one iteration per `step()`.

Each step every replica's scheduler picks its sequences and chunk sizes, the runner copies the
pages copy-on-write asked for (and swaps pages out and in), `plan_chunk` turns each scheduled
sequence into its chunk, and the jitted step runs them all. Reading a step back applies each
chunk's results to its sequence: prompt logprobs, the sampled token (through the
`OutputProcessor`: logprobs, text, stop checks), forks into n completions, verified drafts.

Pipelined: `step()` dispatches step N+1 before it reads step N, whose sampled tokens step N+1
already takes on the device. A sequence whose step-N token ends it has a wasted slot in step
N+1, whose result is ignored. Step N is read first when it must be (its tokens feed penalties,
a request forks, or a sequence drafts next from them).

Data parallelism: one `Replica` (block manager + scheduler, each with the full budgets) per
attention replica of the runner's model. A request runs on one replica, picked when it arrives:
the longest cached prefix of its prompt, then the least work queued.

Structured outputs: a constrained sequence's sampling rows carry the bitmask of the tokens its
grammar allows next (`GrammarBackend`), computed when its step is planned; the step before must
have been read, so a batch holding constrained sequences runs without the pipelining above.

KV tiers (engine.kv_tiers): with kv_offloading_size the block managers report the cached pages
they evict and the pages their prefix hits found in host memory or on disk; `_move_tier_pages`
reads the former to the tiers and writes the latter, after the step's swap-out reads and before
anything else of the step writes a page.

Pooling (runner="pooling", engine.pooling): a pooling request's chunks ask for the hidden-state
rows its pooling reads, nothing samples; reading the chunk that ends its prompt makes its vector
and finishes it, freeing its pages.

Speculative decoding: before scheduling, each sequence that speculates gets drafts from the
proposer, which sees the core only through `DraftContext` (page tables, slot reservation, the
last hidden states). Its chunk is its newest token plus the drafts; the rows verify them on the
device (rejection sampling) and reading the step keeps the accepted drafts plus one token,
rewinding the rest (`BlockManager.truncate`). A draft tree may bring extra rows after its nodes
(`SpecState.draft_extra`: lookahead's Jacobi window) that are never accepted: their K/V is dropped
with the rejected nodes', and the tokens sampled at them go back to the proposer (`observe`).

Failures: a step that raises never leaves the engine broken. Work that belongs to one request
(planning its chunk, its grammar's mask, its LoRA slot, packing its rows, reading its results)
fails that request alone: it finishes with reason "error" and `Request.error` says why, and the
step goes on without it. A failure that belongs to no one request (launching or reading the
step on the device, scheduling, drafting) fails the requests of the steps in play (the one being
read and the one dispatched after it; every unfinished request when no step was in play, since
the same failure would come back); the in-flight step is discarded, and what the failure
consumed on the device (donated to a program that did not finish) is re-created: the KV pool
(every other running sequence is then recomputed from its tokens), a draft model's pool, the
LoRA table. Otherwise waiting requests are untouched; the next step runs as if the failed
requests had been aborted.

Threads: `add`, `abort` and `has_unfinished` may be called from any thread while another drives
`step()`; one lock serializes them with the step (they wait for a running step to end).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import jax
import numpy as np

from jaxinfer.engine.block_manager import BlockManager, OutOfPagesError
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.grammar import GrammarBackend
from jaxinfer.engine.kv_handoff import KVHandoff
from jaxinfer.engine.lora import LoraManager
from jaxinfer.engine.model_runner import InFlightStep, ModelRunner, RowResult
from jaxinfer.engine.multimodal import ImageEncoder, attach_image_inputs
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.pooling import PoolerConfig
from jaxinfer.engine.request import PENDING, Request, Sequence, SwappedKV
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from jaxinfer.engine.seeds import child_seed
from jaxinfer.engine.spec_decode import accepted_path, draft_budget, replica_speculates, tree_depths
from jaxinfer.engine.step_plan import plan_chunk, spec_layout

logger = logging.getLogger("jaxinfer")


@dataclasses.dataclass
class Replica:
    """One attention replica's host state: its page pool and its scheduler."""

    block_manager: BlockManager
    scheduler: Scheduler


@dataclasses.dataclass
class _InFlight:
    """A dispatched step: each replica's plan, whose entries hold their chunks (rows, then results)."""

    plans: list[SchedulerOutput]
    handle: InFlightStep
    must_sync: bool = False  # read it before scheduling the next step


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner, output: OutputProcessor, proposer=None, *,
                 grammar: GrammarBackend | None = None, lora: LoraManager | None = None, kv_tiers=None,
                 image_encoder: ImageEncoder | None = None, pooler: PoolerConfig | None = None):
        self.config = config
        self.pooler = pooler  # runner="pooling": how prompts' hidden states become vectors (engine.pooling)
        self.image_encoder = image_encoder  # a vision model's encoder and its cache (jaxinfer.engine.multimodal)
        self.kv_tiers = kv_tiers  # jaxinfer.engine.kv_tiers.KVTiers: evicted prefix pages in host memory / on disk
        self.grammar = grammar  # computes the allowed-token bitmasks of constrained sequences
        self.runner = runner
        self.output = output
        self.proposer = proposer  # drafts tokens (jaxinfer.engine.spec_decode); None: no speculation
        self.replicas = []
        # LoRA: the table is shared by the replicas, so each runs at most its share of max_loras adapters
        lora_share = config.max_loras // runner.num_replicas if config.enable_lora else None
        if lora_share == 0:
            raise ValueError(f"max_loras={config.max_loras} is below the {runner.num_replicas} data-parallel replicas, "
                             f"which share its slots (at least one each)")
        for _ in range(runner.num_replicas):
            sequence_slots = config.max_num_seqs + 1 if runner.state_slots_per_replica else 0  # (a hybrid model's)
            bm = BlockManager(runner.pages_per_replica, runner.page_size, enable_prefix_caching=config.enable_prefix_caching,
                              windows=runner.kv_windows, page_factors=runner.kv_page_factors, num_state_slots=sequence_slots,
                              num_prefix_states=max(0, runner.state_slots_per_replica - sequence_slots), lower_tiers=kv_tiers,
                              kv_shards=runner.kv_shards)
            self.replicas.append(Replica(bm, Scheduler(bm, max_num_batched_tokens=config.max_num_batched_tokens,
                                                       max_num_seqs=config.max_num_seqs, preemption_mode=config.preemption_mode,
                                                       max_loras=lora_share,
                                                       max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
                                                       is_encoded=image_encoder.cache.__contains__ if image_encoder else None)))
        self.lora = lora  # with enable_lora: which table slot holds which adapter
        self.requests: dict[str, Request] = {}
        self._lock = threading.RLock()
        self._arrived = threading.Condition(self._lock)
        self._inflight: _InFlight | None = None
        self._draft_buffer = None  # this step's draft distributions (a draft model's), on the device
        self._in_play: list[list[SchedulerOutput]] = []  # the steps a failure now would fail (see _recover)
        self.num_processed = 0  # steps read back so far
        self.last_hidden = None  # [replicas, R, H] hidden states of the last step read (draft heads read them)
        self.num_steps = self.num_prompt_tokens_computed = 0
        self.num_spec_verifications = self.num_draft_tokens = self.num_accepted_tokens = 0
        # draft trees: verifications that accepted 2+ nodes along a path off the top-ranked chain
        self.num_tree_side_accepts = 0
        self.num_accepted_tokens_per_pos: list[int] = []  # [i]: verifications that accepted draft i (0-based) and those before it
        self.num_draft_tokens_cut_by_grammar = 0  # constrained sequences' drafted tokens their grammar forbade (never verified)

    # ------------------------------------------------------------------ requests (any thread)
    def add(self, request: Request) -> None:
        """Queues a checked request (InputProcessor.make_request) on the replica that suits it."""
        with self._lock:
            if request.request_id in self.requests:
                self.release(request)
                raise ValueError(f"request {request.request_id!r}: a request with this id is already running")
            request.replica = self._pick_replica(request.seqs[0].cache_ids(), request.seqs[0].prefix_salt)
            self.requests[request.request_id] = request
            for seq in request.seqs:
                self.replicas[request.replica].scheduler.add(seq)
            self._arrived.notify_all()

    def abort(self, request_id: str) -> None:
        """Stops a request: its sequences finish with reason "abort" and free their pages."""
        with self._lock:
            request = self.requests.pop(str(request_id), None)
            if request is None:
                return
            self.release(request)
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
                    self._scheduler(seq).finish(seq)
            request.metrics.finished_time = time.time()

    def release(self, request: Request) -> None:
        """A request leaves the engine (or was made and never added): its adapter's pin, taken
        when it was made, goes."""
        if request.lora is not None and self.lora is not None:
            self.lora.unpin(request.lora.lora_int_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def wait_for_requests(self, timeout: float | None = None) -> bool:
        """Blocks until some request is unfinished (or the timeout passes); returns whether one is."""
        with self._arrived:
            return self._arrived.wait_for(lambda: bool(self.requests), timeout)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Request]:
        """Runs one iteration; returns the requests it advanced, failed ones included (see the
        module docstring)."""
        with self._lock:
            advanced: dict[str, Request] = {}
            try:
                self._step(advanced)
            except Exception as error:  # noqa: BLE001 - a failed step fails its requests, the engine goes on
                self._recover(error, advanced)
            if self._inflight is None and not advanced:
                if any(r.scheduler.waiting and not r.scheduler.running for r in self.replicas):
                    raise RuntimeError("no waiting request fits in the KV cache; raise num_pages")  # validation prevents this
            return list(advanced.values())

    def _step(self, advanced: dict[str, Request]) -> None:
        previous, self._inflight = self._inflight, None
        self._in_play = [previous.plans] if previous is not None else []
        if previous is not None and previous.must_sync:
            self._process(previous, advanced)
            previous, self._in_play = None, []
        if self.proposer is not None:
            self._propose_drafts()
        plans = [replica.scheduler.schedule() for replica in self.replicas]
        self._in_play.append(plans)
        for plan in plans:
            for seq in plan.preempted:
                if seq.spec is not None:
                    seq.spec.draft_computed = 0  # its pages are gone, the draft model's too
        if any(plan.scheduled for plan in plans):
            self._inflight = self._dispatch(plans, advanced)
        for r in range(len(self.replicas)):  # (done in _dispatch; a step that runs nothing has none)
            self._move_tier_pages(r)
        if previous is not None:
            self._process(previous, advanced)
        self._in_play = []

    # ------------------------------------------------------------------ failures
    def _fail(self, request: Request, error: BaseException | str, advanced: dict[str, Request]) -> bool:
        """Finishes a request with reason "error" (its pages freed, its adapter's pin released,
        nothing of it left queued); False if it had finished already."""
        if request.finished:
            return False
        request.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        logger.error("request %r failed: %s", request.request_id, request.error)
        for seq in request.seqs:
            if seq.finished:
                continue
            seq.finish_reason = "error"
            if seq.pending:  # tokens of steps that will never be read
                del seq.token_ids[min(seq.pending):]
                seq.pending.clear()
            self._scheduler(seq).finish(seq)
        request.metrics.finished_time = time.time()
        if self.requests.pop(request.request_id, None) is not None:
            self.release(request)
        advanced[request.request_id] = request
        return True

    def _recover(self, error: Exception, advanced: dict[str, Request]) -> None:
        """A failure no single request owns: the requests of the steps in play fail (every
        unfinished request when none was in play: drafting or scheduling failed, and would fail
        again), the in-flight step is dropped, and what the failure consumed on the device is
        re-created: the KV pool (the sequences that held pages in it start over from their
        tokens), a draft model's pool, the LoRA table (its adapters are written again)."""
        logger.error("engine step failed; failing the requests of the steps in play", exc_info=error)
        message = f"the engine step failed: {type(error).__name__}: {error}"
        self._inflight, self._draft_buffer = None, None
        in_play = [s.seq.request for plans in self._in_play for plan in plans for s in plan.scheduled]
        in_play += [seq.request for plans in self._in_play for plan in plans for seq, *_ in plan.swap_out
                    if seq.swapped is None]  # preempted to host memory, but its pages were never read
        self._in_play = []
        failed = [request for request in in_play if self._fail(request, message, advanced)]
        if not failed:
            for request in list(self.requests.values()):
                self._fail(request, message, advanced)
        recovered = self.runner.recover()
        if recovered.lora_table and self.lora is not None:
            self.lora.forget_slots()
        draft_runner = getattr(self.proposer, "runner", None)  # a draft model's own pool
        draft_lost = draft_runner is not None and draft_runner.recover().pool
        if recovered.pool:
            logger.error("the KV cache was lost with the failed step: re-created, running sequences recomputed")
        for replica in self.replicas:
            bm = replica.block_manager
            if recovered.pool or bm.pending_loads:  # (KV tiers: pages given to lower-tier hits, never written)
                replica.scheduler.requeue_running()
                bm.reset_prefix_cache()
            bm.evicted.clear()
            bm.pending_loads.clear()
        if recovered.pool or draft_lost:
            for replica in self.replicas:
                for seq in replica.scheduler.running + replica.scheduler.waiting:
                    if seq.spec is not None:
                        seq.spec.draft_computed = 0

    # ------------------------------------------------------------------ KV tiers (engine.kv_tiers)
    def _move_tier_pages(self, replica: int) -> None:
        """A replica's pages, before anything else of this step writes one (swap-outs read already):
        the prefix pages its block manager evicted are read to host memory (the tiers keep them),
        then the pages its prefix hits found in the tiers are written into the fresh pages they
        were given."""
        self._offload_evicted(replica)
        loads = self.replicas[replica].block_manager.pending_loads
        if loads:
            self.runner.write_pages_from_host(replica, [page for page, _, _ in loads], [content for *_, content in loads])
            loads.clear()

    def save_cached_pages(self) -> int:
        """Every page the device's prefix caches hold that the disk tier lacks, written to it (at
        shutdown, so that a later process finds them too); returns how many."""
        disk = self.kv_tiers.disk if self.kv_tiers is not None else None
        if disk is None:
            return 0
        saved = 0
        # reads of what the writer's bounded queue takes at once, each flushed before the next
        most = max(1, min(self.runner.buckets.pages_per_seq, disk.max_pending_bytes // disk.layout.nbytes))
        with self._lock:
            for r, replica in enumerate(self.replicas):
                missing = [(page, key) for page, key in replica.block_manager.cached_pages() if key not in disk]
                for chunk in (missing[i : i + most] for i in range(0, len(missing), most)):
                    for (_, key), content in zip(chunk, self.runner.read_pages_to_host(r, [page for page, _ in chunk])):
                        saved += disk.put(key, content)
                    disk.flush()
        return saved

    def _offload_evicted(self, replica: int) -> None:
        """The pages a replica's block manager evicted since last asked, to the KV tiers (one read,
        dispatched behind every step so far and before anything later writes them)."""
        bm = self.replicas[replica].block_manager
        if self.kv_tiers is None or not bm.evicted:
            return
        wanted = [(page, key) for page, key in bm.evicted if self.kv_tiers.wants(key)]
        bm.evicted.clear()
        if wanted:
            contents = self.runner.read_pages_to_host(replica, [page for page, _ in wanted])
            for (_, key), content in zip(wanted, contents):
                self.kv_tiers.offload(key, content)

    @staticmethod
    def _drop_failed(plans: list[SchedulerOutput]) -> None:
        for plan in plans:
            plan.scheduled = [s for s in plan.scheduled if not s.seq.finished]

    def _dispatch(self, plans: list[SchedulerOutput], advanced: dict[str, Request]) -> _InFlight | None:
        """Page copies and swaps, then one step for every replica's plan. A request whose own part
        of the step cannot be built fails alone (`_fail`); None if no request is left to run."""
        copies = []
        # prefix hits' saved recurrent states into their sequences' slots (before a swap-in's own)
        self.runner.copy_states([(r, copy) for r, plan in enumerate(plans) for copy in plan.state_restores])
        for r, (plan, replica) in enumerate(zip(plans, self.replicas)):
            for seq, pages, num_computed, state_slot in plan.swap_out:  # before anything can overwrite the freed pages
                state = self.runner.read_state(r, state_slot) if state_slot else None  # (a hybrid model's)
                seq.swapped = SwappedKV(self.runner.read_pages(r, pages), num_computed, state)
            self._move_tier_pages(r)  # (KV tiers: evicted pages read, then lower-tier hits written)
            for seq, first, pages in plan.swap_in:
                self.runner.write_pages(r, pages, jax.tree.map(lambda a: a[:, first : first + len(pages)], seq.swapped.pages))
                if seq.swapped.state is not None:  # its recurrent states, into the slot it holds now
                    self.runner.write_state(r, replica.block_manager.state_slot(seq.seq_id), seq.swapped.state)
                replica.block_manager.mark_computed(seq.seq_id, seq.num_computed, seq.cache_ids())
                seq.swapped = None
            copies += [(r, copy) for copy in plan.page_copies]
            for s in plan.scheduled:
                try:
                    s.chunk = plan_chunk(s, *replica.block_manager.held_rows(s.seq.seq_id), self.output.eos_token_ids)
                    s.chunk.chunk.state_slot = replica.block_manager.state_slot(s.seq.seq_id)
                    s.chunk.chunk.verifies = s.num_draft > 0  # (a hybrid model keeps its inputs: `_verified` commits)
                    attach_image_inputs(s.chunk.chunk, s.seq.request, s.start, s.num_tokens, self.image_encoder)
                except Exception as error:  # noqa: BLE001 - this request's own failure
                    self._fail(s.seq.request, error, advanced)
        if copies:
            self.runner.copy_pages(copies)
            if hasattr(self.proposer, "copy_pages"):  # a proposer whose pool mirrors the target's pages (MTP)
                self.proposer.copy_pages(copies)
        self._drop_failed(plans)
        self._fill_allowed_tokens([s for plan in plans for s in plan.scheduled if s.seq.grammar is not None and s.samples],
                                  advanced)
        self._drop_failed(plans)
        if self.lora is not None:  # every adapter of the step in a slot (the scheduler kept them <= max_loras)
            in_use = {s.seq.lora_id for plan in plans for s in plan.scheduled}
            for s in (s for plan in plans for s in plan.scheduled):
                try:
                    s.chunk.chunk.lora_slot = self.lora.slot(s.seq.lora_id, in_use)
                except Exception as error:  # noqa: BLE001 - its adapter could not be loaded
                    self._fail(s.seq.request, error, advanced)
            self._drop_failed(plans)
        packed = self._pack(plans, advanced)
        if packed is None:
            return None
        handle = self.runner.launch(packed, self._draft_buffer)
        self.num_steps += 1
        self._save_states(plans)
        inflight = _InFlight(plans, handle)
        for plan, replica in zip(plans, self.replicas):
            speculates = self._speculates(replica)
            for s in plan.scheduled:
                inflight.must_sync |= self._dispatched(s, speculates)
        return inflight

    def _save_states(self, plans: list[SchedulerOutput]) -> None:
        """A hybrid model's prefix cache: each chunk that ends where its sequence saves its state
        (`BlockManager.save_state`) has its slot copied to a saved one, after the step that computes it."""
        saves = []
        for r, (plan, replica) in enumerate(zip(plans, self.replicas)):
            for s in plan.scheduled:
                if replica.block_manager.num_prefix_states and s.seq.seq_id in replica.block_manager.seqs:
                    copy = replica.block_manager.save_state(s.seq.seq_id, s.start + s.num_tokens, s.seq.cache_ids())
                    saves += [(r, copy)] if copy else []
        # one copy per saved slot, the last: a save may have evicted a slot an earlier one of this
        # step took (few saved states), and a scatter's duplicate indices have no defined winner
        last = {(r, dst): (r, (src, dst)) for r, (src, dst) in saves}
        self.runner.copy_states(list(last.values()))

    def _pack(self, plans: list[SchedulerOutput], advanced: dict[str, Request]):
        """The step's host arrays (ModelRunner.pack). If packing fails, each chunk is packed
        alone to find the ones at fault; their requests fail and the rest is packed again. A
        failure no single chunk causes is raised (the whole step fails)."""
        while any(plan.scheduled for plan in plans):
            entries = [s for plan in plans for s in plan.scheduled]
            want_logprobs = any(s.seq.request.params.logprobs is not None or s.seq.request.wants_prompt_logprobs
                                for s in entries)
            drafts_sampled = self._draft_buffer is not None and any(s.chunk.sampling.draft_src for s in entries)

            def pack(chunks):
                return self.runner.pack(chunks, want_logprobs=want_logprobs, with_draft_src=drafts_sampled)

            try:
                return pack([[s.chunk for s in plan.scheduled] for plan in plans])
            except Exception as error:  # noqa: BLE001 - find whose chunk it is
                culprits = []
                for r, plan in enumerate(plans):
                    for s in plan.scheduled:
                        try:
                            pack([[s.chunk] if i == r else [] for i in range(len(plans))])
                        except Exception as own:  # noqa: BLE001
                            culprits.append((s, own))
                if not culprits:
                    raise error
                for s, own in culprits:
                    self._fail(s.seq.request, own, advanced)
                self._drop_failed(plans)
        return None

    def _fill_allowed_tokens(self, constrained: list[ScheduledSeq], advanced: dict[str, Request]) -> None:
        """Each constrained sampling chunk's bitmask of allowed tokens, from its sequence's
        matcher, which has taken every token so far (such a step is read before the next one is
        scheduled: `_dispatched`). A verification chunk gets one per row: row r the tokens allowed
        after its newest token and drafts 1..r (a draft tree's row r + 1: after node r's path; the
        matcher walks the drafts and rolls back; the drafts hold only tokens the grammar allows:
        `_cut_drafts_by_grammar`), so each row is masked as unspeculated decoding would mask it.
        One parallel call for the whole step; if it fails, one call per sequence finds the
        matchers at fault, whose requests fail."""
        if not constrained:
            return
        drafts = [list(s.seq.draft[: s.num_draft]) for s in constrained]
        parents = [list(s.seq.spec.draft_parents[: s.num_draft]) if s.num_draft else [] for s in constrained]  # (trees)
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])
        masks = np.empty((int(starts[-1]), self.grammar.num_words), np.int32)
        try:
            self.grammar.fill_bitmasks([s.seq.grammar for s in constrained], masks, drafts, parents)
        except Exception:  # noqa: BLE001 - find the matcher at fault
            for i, s in enumerate(constrained):
                try:
                    self.grammar.fill_bitmasks([s.seq.grammar], masks[starts[i] : starts[i + 1]], [drafts[i]], [parents[i]])
                except Exception as error:  # noqa: BLE001
                    self._fail(s.seq.request, error, advanced)
        for i, s in enumerate(constrained):
            if not s.seq.finished:  # [num_draft + 1, words] for a verification chunk's rows, else one for all its rows
                s.chunk.sampling.allowed_tokens = masks[starts[i] : starts[i + 1]] if s.num_draft else masks[starts[i]]

    def _cut_drafts_by_grammar(self, seq: Sequence) -> None:
        """A constrained sequence's drafts end before the first token its grammar forbids from
        where it stands (nothing is consumed; counted in num_draft_tokens_cut_by_grammar). A
        matcher that cannot say drafts nothing: `_fill_allowed_tokens` then fails its request."""
        spec = seq.spec
        if seq.grammar is None or not spec.draft:
            return
        try:
            if spec.draft_parents:  # a draft tree: the nodes whose paths it allows (their ancestors kept too)
                keep = [i for i, ok in enumerate(seq.grammar.valid_nodes(spec.draft, spec.draft_parents)) if ok]
            else:
                keep = list(range(seq.grammar.valid_prefix(spec.draft)))
        except Exception:  # noqa: BLE001 - its own failure, found again (and failed alone) when its mask is made
            logger.exception("request %r: checking its drafts against its grammar failed", seq.request.request_id)
            keep = []
        self.num_draft_tokens_cut_by_grammar += len(spec.draft) - len(keep)
        if len(keep) == len(spec.draft):
            return
        index = {old: new for new, old in enumerate(keep)}
        if spec.draft_parents:
            spec.draft_parents = [index[spec.draft_parents[i]] if spec.draft_parents[i] >= 0 else -1 for i in keep]
        spec.draft = [spec.draft[i] for i in keep]
        spec.draft_src = [spec.draft_src[i] for i in keep] if spec.draft_src else []

    def _dispatched(self, s: ScheduledSeq, speculates: bool) -> bool:
        """Advances a sequence past its dispatched chunk (its sampled token PENDING on the device);
        returns whether the step must be read before the next one is scheduled."""
        seq, request, p = s.seq, s.seq.request, s.seq.request.params
        if request.pooling is not None:  # a prompt to pool, nothing to sample
            seq.num_computed += s.num_tokens
            seq.hold = s.samples  # its whole prompt is dispatched: reading this step finishes it
            return False
        must_sync = speculates and seq.spec is not None and seq.spec.drafts_next_step  # its next draft needs the tokens
        must_sync |= seq.grammar is not None  # its next allowed tokens depend on this step's
        if s.num_draft:  # verification: num_computed and tokens are settled when it is read
            # (a hybrid model's states: committed then; a draft tree's accepted K/V: moved then, before any later step)
            return (must_sync or bool(self.runner.state_slots_per_replica) or bool(seq.spec.draft_parents)
                    or seq.spec.draft_extra is not None)
        seq.num_computed += s.num_tokens
        if not s.samples:
            return must_sync
        sample_rows = [r for r, t in zip(s.chunk.rows, s.chunk.sampling.target_ids) if t < 0]
        seq.token_ids.append(PENDING)
        seq.pending[len(seq.token_ids) - 1] = sample_rows[0]
        num_out = len(seq.token_ids) - len(request.prompt_token_ids)
        if num_out >= (p.max_tokens or self.config.max_model_len) or len(seq.token_ids) >= request.max_len:
            seq.hold = True  # this token ends it: nothing more to schedule
        penalties = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        return must_sync or not request.forked or bool(penalties)

    def _process(self, inflight: _InFlight, advanced: dict[str, Request]) -> None:
        """Reads a dispatched step back and applies each chunk's results to its sequence."""
        self.runner.collect(inflight.handle)
        self.num_processed += 1
        self.last_hidden = inflight.handle.out.hidden
        now = time.time()
        touched: dict[str, Request] = {}
        commits = []  # a hybrid model's verified chunks: (replica, (sequence, its state slot, tokens kept))
        moves = []  # draft trees' accepted nodes: ModelRunner.move_kv_rows' entries
        for plan in inflight.plans:
            for s in plan.scheduled:
                if s.seq.finished:  # finished or aborted after this step was dispatched
                    continue
                try:
                    if s.num_draft:
                        self._verified(s, now, commits, moves)
                    else:
                        self._advance(s, now)
                except Exception as error:  # noqa: BLE001 - reading this request's results failed: it alone fails
                    self._fail(s.seq.request, error, advanced)
                touched[s.seq.request.request_id] = s.seq.request
        # (before anything reads those slots: the next step is not out yet). A sequence that finished
        # since gave its slot back, maybe to a fork made in this loop: its commit is dropped
        self.runner.move_kv_rows(moves)  # (before the next step, and before anything reuses the pages truncate gave back)
        self.runner.commit_drafts([(r, (slot, kept)) for r, (seq, slot, kept) in commits
                                   if not seq.finished and seq.seq_id in self.replicas[r].block_manager.seqs
                                   and self.replicas[r].block_manager.state_slot(seq.seq_id) == slot])
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                if self.requests.pop(request.request_id, None) is not None:
                    self.release(request)
            advanced[request.request_id] = request
        if hasattr(self.proposer, "ingest"):  # a proposer that reads every step's hidden states (MTP)
            self.proposer.ingest(CoreDraftContext(self), inflight.plans, inflight.handle)

    def _advance(self, s: ScheduledSeq, now: float) -> None:
        """A prefill chunk's or a decode's results: prompt logprobs, the sampled token, forks."""
        seq, request, chunk = s.seq, s.seq.request, s.chunk
        if request.pooling is not None:
            return self._pooled(s, now)
        if seq.spec is not None:
            seq.spec.draft_computed = min(seq.spec.draft_computed, seq.num_computed)  # its drafts went unverified
            if s.samples:  # the row its next token comes from (every sample row of a fork has the same hidden state)
                seq.spec.hidden_row, seq.spec.hidden_step = chunk.rows[-1], self.num_processed
        samples = []
        for row, target in zip(chunk.results, chunk.sampling.target_ids):
            if target >= 0:
                self.output.on_prompt_logprob(request, target, row)
            else:
                samples.append(row)
        end = s.start + s.num_tokens
        if samples:
            seq.token_ids[end] = samples[0].token  # where this step's sampled token sits
            seq.pending.pop(end, None)
        replica = self.replicas[request.replica]
        if seq.seq_id in replica.block_manager.seqs and seq.num_computed >= end:  # not preempted meanwhile
            replica.block_manager.mark_computed(seq.seq_id, end, seq.cache_ids())
        if s.num_tokens > 1:
            self.num_prompt_tokens_computed += s.num_tokens
        if not samples:
            return
        if not request.forked:  # the prompt is done: make the n completions, sharing its pages
            state_copies = []  # (a hybrid model's: each child's recurrent states start as the parent's)
            for j, row in enumerate(samples[1:], start=1):
                child = Sequence(request, j, seq.token_ids[:end] + [row.token], child_seed(request.seed, j), num_computed=end)
                child.grammar = seq.grammar.copy() if seq.grammar is not None else None  # before seq takes its token
                replica.block_manager.fork(seq.seq_id, child.seq_id)
                if self.runner.state_slots_per_replica:
                    state_copies.append((request.replica, (replica.block_manager.state_slot(seq.seq_id),
                                                           replica.block_manager.state_slot(child.seq_id))))
                # its own draft length; the hidden row it came from; nothing in a draft model's cache yet
                child.spec = dataclasses.replace(seq.spec, draft=[], draft_src=[], draft_parents=[], draft_extra=None,
                                                 draft_computed=0) if seq.spec else None
                request.seqs.append(child)
                replica.scheduler.add_running(child)
                self._on_token(child, row, end, now)
            self.runner.copy_states(state_copies)  # (one program for every child; none without states)
            request.forked = True
        self._on_token(seq, samples[0], end, now)
        if seq.finished:
            del seq.token_ids[end + 1 :]  # drop tokens of steps dispatched after the one that ended it
            seq.pending.clear()

    def _pooled(self, s: ScheduledSeq, now: float) -> None:
        """A pooling chunk's hidden-state rows, folded into its request's pooling; the chunk that
        ends the prompt finishes the request (its vector made, its pages freed)."""
        seq, request = s.seq, s.seq.request
        hidden = np.stack([row.hidden for row in s.chunk.results]) if s.chunk.results else np.zeros((0, 0), np.float32)
        request.pooling.add(s.start, s.num_tokens, hidden)
        end = s.start + s.num_tokens
        bm = self.replicas[request.replica].block_manager
        if seq.seq_id in bm.seqs and seq.num_computed >= end:  # not preempted meanwhile
            bm.mark_computed(seq.seq_id, end, seq.cache_ids())
        self.num_prompt_tokens_computed += s.num_tokens
        if not request.pooling.done:
            return
        request.pooled = self.pooler.finish(request.pooling)
        request.metrics.first_token_time = request.metrics.last_token_time = now
        seq.finish_reason = "stop"
        self._scheduler(seq).finish(seq)

    def _verified(self, s: ScheduledSeq, now: float, commits: list, moves: list) -> None:
        """A verification chunk's results: keep the accepted drafts and the sampled token after
        them, rewind the sequence's length past them (the rejected drafts' K/V are dropped; a
        hybrid model's states are to advance by the newest token and the accepted drafts: `commits`).

        A draft tree (`spec.draft_parents`): the accepted path is walked from the root along each
        row's accepted child (`accepted_path`); its nodes' K/V, written at their slots root + row,
        are to move to root + 1 .. root + depth (`moves`, done by `_process` before the next step).
        Extra rows after the nodes (`spec.draft_extra`) are on no path: truncating past the accepted
        nodes drops their K/V, and the tokens sampled at them go to the proposer's `observe`."""
        seq, spec, rows = s.seq, s.seq.spec, s.chunk.results
        draft = spec.draft[: s.num_draft]
        parents, extra = spec_layout(spec, s.num_draft)
        num_nodes = s.num_draft - (len(extra.tokens) if extra is not None else 0)
        if parents or extra is not None:  # a tree: rows are the root (0) and the nodes (1 ..), the path the accepted nodes' rows
            path = accepted_path(parents, [row.child for row in rows[: num_nodes + 1]])
        else:
            path = list(range(1, 1 + next((i for i, row in enumerate(rows[: s.num_draft]) if not row.accepted), s.num_draft)))
        accepted = len(path)
        path_rows = [0] + path  # emitted token i comes from row path_rows[i]
        root = s.start + s.num_tokens - s.num_draft - 1  # the newest token's slot
        computed = root + 1 + accepted  # the newest token's K/V and the accepted drafts'
        bm = self.replicas[seq.request.replica].block_manager
        if seq.seq_id in bm.seqs:  # not preempted meanwhile
            c = s.chunk.chunk
            moves += [(seq.request.replica, c.pages, c.page_offsets, root + row, root + i)
                      for i, row in enumerate(path, start=1) if row != i]
            bm.truncate(seq.seq_id, computed)
            seq.num_computed = computed
            if self.runner.state_slots_per_replica:  # a hybrid model's states advance by the tokens kept
                commits.append((seq.request.replica, (seq, bm.state_slot(seq.seq_id), 1 + accepted)))
            emitted = [draft[row - 1] for row in path] + [rows[path_rows[-1]].token]
            bm.mark_computed(seq.seq_id, computed, seq.cache_ids(seq.token_ids + emitted))
        else:
            emitted = []
        if parents and accepted >= 2 and any(rows[row].child > 0 for row in path_rows[:-1]):
            self.num_tree_side_accepts += 1
        spec.hidden_row, spec.hidden_step = s.chunk.rows[path_rows[-1]], self.num_processed  # the row y came from
        self.num_spec_verifications += 1
        self.num_draft_tokens += num_nodes
        self.num_accepted_tokens += accepted
        self.num_accepted_tokens_per_pos += [0] * (accepted - len(self.num_accepted_tokens_per_pos))
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        if getattr(self.proposer, "backs_off", True):  # (lookahead's rows are its configured cost: no back-off)
            spec.update(max(tree_depths(parents)) if parents else num_nodes, accepted)  # (a tree: per level drafted)
        if extra is not None and hasattr(self.proposer, "observe"):  # the target's tokens at the extra rows
            self.proposer.observe(seq, [row.token for row in rows[num_nodes + 1 : num_nodes + 1 + len(extra.tokens)]])
        spec.draft, spec.draft_src, spec.draft_parents, spec.draft_extra = [], [], [], None
        spec.draft_computed = min(spec.draft_computed, seq.num_computed)  # a draft model's cache past the accepted drafts is stale
        for i, token in enumerate(emitted):
            seq.token_ids.append(token)
            self._on_token(seq, dataclasses.replace(rows[path_rows[i]], token=token), len(seq.token_ids) - 1, now)
            if seq.finished:
                break

    def _on_token(self, seq: Sequence, row: RowResult, index: int, now: float) -> None:
        self.output.on_token(seq, row, index, now)
        if seq.finish_reason is not None:
            if seq.request.export_kv and seq.finish_reason not in ("abort", "error"):
                self._export_kv(seq)
            self._scheduler(seq).finish(seq)

    def _export_kv(self, seq: Sequence) -> None:
        """A prefill instance's request is done: the K/V of its prompt but the last token, gathered
        from its pages into arrays of their own before the pages are freed (engine.kv_handoff; the
        gather runs on the device after every step dispatched so far, before any later one)."""
        request = seq.request
        bm = self.replicas[request.replica].block_manager
        num_tokens = len(request.prompt_token_ids) - 1
        pages = bm.page_table(seq.seq_id)[0][: bm.pages_needed(num_tokens)]
        request.exported_kv = KVHandoff(self.runner.gather_pages(request.replica, pages) if pages else None, num_tokens,
                                        list(request.prompt_token_ids))

    # ------------------------------------------------------------------ speculative decoding
    def _propose_drafts(self) -> None:
        """Drafts for every decoding sequence that speculates this step (one proposer call)."""
        asked = []
        for replica in self.replicas:
            speculates = self._speculates(replica)
            for seq in replica.scheduler.running:
                if seq.spec is not None:
                    seq.spec.draft, seq.spec.draft_src, seq.spec.draft_parents, seq.spec.draft_extra = [], [], [], None
                k = draft_budget(seq, self.config.max_model_len) if speculates else 0
                if k:
                    asked.append((seq, k))
        self._draft_buffer = None
        if not asked:
            return
        drafts = self.proposer.propose(CoreDraftContext(self), asked)
        self._draft_buffer = drafts.buffer
        for i, (seq, k) in enumerate(asked):
            seq.spec.draft = list(drafts.tokens[i][:k])
            seq.spec.draft_src = list(drafts.src[i][:k]) if drafts.src else []
            seq.spec.draft_parents = list(drafts.parents[i][:k]) if drafts.parents else []
            self._cut_drafts_by_grammar(seq)
            extra = drafts.extra[i] if drafts.extra else None
            if extra is not None and extra.tokens and seq.grammar is None:  # (a grammar's masks are for the tree's rows)
                self._add_extra_rows(seq, extra, k, len(drafts.tokens[i]))
            seq.spec.proposed(len(seq.spec.draft))

    @staticmethod
    def _add_extra_rows(seq: Sequence, extra, k: int, num_nodes: int) -> None:
        """A tree's extra rows (lookahead's window) after its nodes, within the sequence's budget of k
        drafted rows (the first ones: an extra row sees only rows before it). Their masks count the
        tree's num_nodes nodes: a tree cut to k keeps none."""
        kept = k - num_nodes
        if kept <= 0:
            return
        seq.spec.draft_extra = dataclasses.replace(extra, tokens=list(extra.tokens[:kept]), masks=list(extra.masks[:kept]),
                                                   offsets=list(extra.offsets[:kept]))
        seq.spec.draft += seq.spec.draft_extra.tokens

    def _speculates(self, replica: Replica) -> bool:
        spec = self.config.speculative_config
        return spec is not None and replica_speculates(spec, len(replica.scheduler.running))

    def _scheduler(self, seq: Sequence) -> Scheduler:
        return self.replicas[seq.request.replica].scheduler

    def _pick_replica(self, token_ids: list[int], salt: bytes = b"") -> int:
        """The replica a new request runs on: the longest cached prefix (under its adapter's
        salt), then the least work."""
        def rank(i: int):
            bm, sched = self.replicas[i].block_manager, self.replicas[i].scheduler
            unfinished = sum(seq.request.params.n if not seq.request.forked else 1 for seq in sched.waiting) + len(sched.running)
            return (-bm.num_cached_prefix_pages(token_ids, salt=salt), unfinished, bm.usage, i)
        return min(range(len(self.replicas)), key=rank)


class CoreDraftContext:
    """What a proposer sees of the core (spec_decode.DraftContext)."""

    def __init__(self, core: EngineCore):
        self._core = core
        self.num_replicas = len(core.replicas)
        self.num_processed = core.num_processed
        self.last_hidden = core.last_hidden

    def page_table(self, seq: Sequence) -> list[list[int]]:
        return self._core.replicas[seq.request.replica].block_manager.page_table(seq.seq_id)

    def holds(self, seq: Sequence, num_tokens: int) -> bool:
        return seq.seq_id in self._core.replicas[seq.request.replica].block_manager.seqs and seq.num_computed >= num_tokens

    def reserve(self, seq: Sequence, num_tokens: int) -> list[tuple[int, tuple[int, int]]] | None:
        r = seq.request.replica
        bm = self._core.replicas[r].block_manager
        extra = num_tokens - bm.seqs[seq.seq_id].num_tokens
        if extra <= 0:
            return []
        try:
            copies = [(r, copy) for copy in bm.prepare_append(seq.seq_id, extra)]
        except OutOfPagesError:
            return None
        self._core._offload_evicted(r)  # (KV tiers: before a copy can overwrite a page it evicted)
        if copies:
            self._core.runner.copy_pages(copies)
        return copies

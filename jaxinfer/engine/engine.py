"""`LLMEngine`: the continuous-batching engine, for custom drivers (and under `LLM`).

    engine = build_engine(EngineConfig(model="./model"))        # jaxinfer.engine.build
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():        # RequestOutputs that changed this step
            print(out.request_id, out.outputs[0].text)

Three parts, as in vLLM v1:
- `InputProcessor` (input_processor.py): tokenize, validate, make the Request;
- `EngineCore` (core.py): schedule -> dispatch -> collect, pipelining, replicas, speculation;
- `OutputProcessor` (output_processor.py): logprobs, detokenization, stop checks, RequestOutputs;
- `GrammarBackend` (grammar.py): structured outputs' grammars, one matcher per sequence.

`add_request` and `abort_request` may be called from other threads while one thread drives
`step()` (the HTTP server does); see `EngineCore`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.grammar import GrammarBackend
from jaxinfer.engine.input_processor import InputProcessor
from jaxinfer.engine.kv_handoff import KVHandoff, prepare_handoff
from jaxinfer.engine.lora import LoraManager
from jaxinfer.engine.model_runner import ModelRunner
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.pooling import PoolerConfig
from jaxinfer.engine.request import Request
from jaxinfer.lora_request import LoRARequest
from jaxinfer.outputs import PoolingRequestOutput, RequestOutput
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger("jaxinfer")


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
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: verifications that accepted the draft at position i
    num_draft_tokens_cut_by_grammar: int = 0  # constrained sequences' drafted tokens their grammar forbade (never verified)
    # per KV layer group (jaxinfer.kv_groups), pages held by sequences, all replicas together
    kv_pages_in_use_by_group: tuple[int, ...] = ()
    # prefix cache in pages: looked up, and loaded back from the KV tiers (engine.kv_tiers) rather than computed
    prefix_cache_queries: int = 0
    prefix_cache_host_hits: int = 0
    prefix_cache_disk_hits: int = 0
    kv_offloaded_pages: int = 0  # evicted device pages kept in the host tier

    @property
    def prefix_cache_host_hit_rate(self) -> float:
        """Pages loaded back from host memory / pages looked up."""
        return self.prefix_cache_host_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prefix_cache_disk_hit_rate(self) -> float:
        """Pages loaded back from disk / pages looked up."""
        return self.prefix_cache_disk_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts plus the sampled one."""
        return 1 + self.num_accepted_tokens / self.num_spec_verifications if self.num_spec_verifications else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer, *, vocab_size: int, eos_token_ids,
                 proposer=None, lora: LoraManager | None = None, kv_tiers=None, images=None, image_encoder=None,
                 pooler: PoolerConfig | None = None):
        """`config` with max_model_len set (EngineConfig.resolved); `proposer` drafts for
        config.speculative_config, `lora` serves LoRA adapters with enable_lora, `kv_tiers` keeps
        evicted prefix pages with kv_offloading_size (jaxinfer.engine.build makes them)."""
        if config.max_model_len is None:
            raise ValueError("LLMEngine needs an EngineConfig with max_model_len set (EngineConfig.resolved)")
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.grammar = GrammarBackend(tokenizer, vocab_size, eos_token_ids)  # structured outputs
        self.lora = lora
        self.input = InputProcessor(config, tokenizer, vocab_size=vocab_size, pages_per_replica=runner.pages_per_replica,
                                    grammar=self.grammar, lora=lora, eos_token_ids=eos_token_ids,
                                    kv_windows=runner.kv_windows, kv_page_factors=runner.kv_page_factors, images=images,
                                    pooler=pooler, kv_shards=runner.kv_shards)
        self.output = OutputProcessor(tokenizer, eos_token_ids=eos_token_ids, max_model_len=config.max_model_len)
        self.core = EngineCore(config, runner, self.output, proposer, grammar=self.grammar, lora=lora, kv_tiers=kv_tiers,
                               image_encoder=image_encoder, pooler=pooler)
        if kv_tiers is not None:  # (its disk writer's queue is written out when the engine goes, at the latest at exit)
            weakref.finalize(self, kv_tiers.close)
        self._last_log = time.time()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | PoolingParams | None = None, *,
                    priority: int = 0, arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    export_kv: bool = False, kv_handoff: KVHandoff | None = None) -> Request:
        """Queues a request (with `lora_request`: under that adapter; PoolingParams on a pooling
        engine: a prompt to embed or classify, engine.pooling). A bad one raises ValueError
        naming it; nothing else is affected. Disaggregation (engine.kv_handoff): `export_kv` hands
        its prompt's pages off when it finishes (its RequestOutput.kv_handoff); `kv_handoff` starts
        it from another engine's pages."""
        request = self.input.make_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time,
                                          lora_request=lora_request)
        try:
            prepare_handoff(request, export_kv, kv_handoff, recurrent_states=self.runner.kv.state is not None)
        except ValueError:
            self.discard(request)
            raise
        self.core.add(request)
        return request

    def discard(self, request: Request) -> None:
        """A request made (`input.make_request`) but never added: gives back what making it took
        (its LoRA adapter's pin)."""
        self.core.release(request)

    def abort_request(self, request_id: str) -> None:
        """Stops a request at once: its sequences finish with reason "abort" and free their pages."""
        self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Runs one iteration; returns the outputs of the requests it advanced."""
        outputs = [self.output.output(request) for request in self.core.step()]
        self._maybe_log()
        return outputs

    def shutdown(self) -> None:
        """With kv_offloading_dir: writes the pages the device's prefix cache holds (which only
        evicted pages reach otherwise) and what the disk writer has queued to the directory, and
        stops the writer (what is queued is also written when the engine is collected or the
        interpreter exits). The engine still runs afterwards, without writing pages to disk."""
        if self.core.kv_tiers is not None:
            self.core.save_cached_pages()
            self.core.kv_tiers.close()

    # ------------------------------------------------------------------ views
    @property
    def proposer(self):
        return self.core.proposer

    @proposer.setter
    def proposer(self, proposer) -> None:
        self.core.proposer = proposer

    @property
    def replicas(self):
        return self.core.replicas

    @property
    def block_manager(self):
        """The first replica's block manager (the only one without data parallelism)."""
        return self.core.replicas[0].block_manager

    @property
    def scheduler(self):
        """The first replica's scheduler (the only one without data parallelism)."""
        return self.core.replicas[0].scheduler

    @property
    def eos_token_ids(self) -> set[int]:
        return self.output.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:  # one set: the input checks count what the sampler holds back
        self.output.eos_token_ids = self.input.eos_token_ids = set(ids)

    def tokenize(self, prompt, label: str) -> tuple[str | None, list[int]]:
        return self.input.tokenize(prompt, label)

    def process(self, prompt, label: str):
        """(text, token ids, images or None): `tokenize`, and a prompt's multi_modal_data processed."""
        return self.input.process(prompt, label)

    def validate(self, ids: list[int], params: SamplingParams | PoolingParams, label: str,
                 lora_request: LoRARequest | None = None) -> None:
        self.input.validate(ids, params, label, lora_request)

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        """Totals over the replicas (KV usage: the mean; prefix hit rate: over all look-ups)."""
        core = self.core
        bms = [r.block_manager for r in core.replicas]
        scheds = [r.scheduler for r in core.replicas]
        queries = sum(bm.stats.queries for bm in bms)
        return EngineStats(
            num_running=sum(len(s.running) for s in scheds),
            num_waiting=sum(len(s.waiting) for s in scheds),
            kv_cache_usage=sum(bm.usage for bm in bms) / len(bms),
            prefix_cache_hit_rate=sum(bm.stats.hits for bm in bms) / queries if queries else 0.0,
            num_preemptions=sum(s.num_preemptions for s in scheds),
            num_compiles=self.runner.num_compiles,
            num_steps=core.num_steps,
            num_generated_tokens=self.output.num_generated_tokens,
            num_prompt_tokens_computed=core.num_prompt_tokens_computed,
            num_spec_verifications=core.num_spec_verifications,
            num_draft_tokens=core.num_draft_tokens,
            num_accepted_tokens=core.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(core.num_accepted_tokens_per_pos),
            num_draft_tokens_cut_by_grammar=core.num_draft_tokens_cut_by_grammar,
            kv_pages_in_use_by_group=tuple(map(sum, zip(*(bm.pages_in_use for bm in bms)))),
            prefix_cache_queries=queries,
            prefix_cache_host_hits=sum(bm.stats.host_hits for bm in bms),
            prefix_cache_disk_hits=sum(bm.stats.disk_hits for bm in bms),
            kv_offloaded_pages=core.kv_tiers.stats.offloaded if core.kv_tiers is not None else 0,
        )

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval
        if interval is None or time.time() - self._last_log < interval:
            return
        self._last_log = time.time()
        s = self.get_stats()
        if self.core.kv_tiers is not None:
            logger.info("KV tiers: %d pages offloaded, prefix hit rate host %.1f%%, disk %.1f%%", s.kv_offloaded_pages,
                        100 * s.prefix_cache_host_hit_rate, 100 * s.prefix_cache_disk_hit_rate)
        logger.info(
            "running %d, waiting %d, KV cache %.1f%%, prefix hit rate %.1f%%, preemptions %d, compiles %d, "
            "generated %d tokens in %d steps",
            s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * s.prefix_cache_hit_rate,
            s.num_preemptions, s.num_compiles, s.num_generated_tokens, s.num_steps,
        )

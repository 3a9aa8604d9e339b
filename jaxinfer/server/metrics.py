"""Prometheus metrics of the server (`GET /metrics`), vLLM's names with a `jaxinfer:` prefix.

Latency histograms are observed as each request finishes, from its `RequestMetrics`: time to
first token, mean inter-token latency (per generated token), end to end, and queue time
(arrival to first scheduled step). Gauges and counters are read from the engine's stats when
scraped: running / waiting / swapped requests, KV cache usage, prefix cache hit rate (the KV
tiers': host and disk, engine.kv_tiers), preemptions, compiles, tokens, and speculative decoding:
verifications (spec_decode_num_drafts), drafted and accepted tokens, accepted tokens per draft
position (spec_decode_num_accepted_tokens_per_pos{position="i"}, as vLLM's), drafted tokens a
structured output's grammar cut.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.engine.engine import LLMEngine
from jaxinfer.kv_groups import describe
from jaxinfer.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.registry = CollectorRegistry()
        hist = lambda name, doc: Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)  # noqa: E731
        self.ttft = hist("jaxinfer:time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("jaxinfer:inter_token_latency_seconds", "Mean gap between a request's generated tokens")
        self.e2e = hist("jaxinfer:e2e_request_latency_seconds", "Arrival to finish")
        self.queue = hist("jaxinfer:request_queue_time_seconds", "Arrival to the first step that scheduled it")
        self.registry.register(_EngineCollector(engine))

    def observe(self, out: RequestOutput) -> None:
        """A finished request's latencies."""
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.itl.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's stats at scrape time."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self):
        s = self.engine.get_stats()
        swapped = sum(seq.swapped is not None for r in self.engine.replicas for seq in list(r.scheduler.waiting))
        for name, doc, value in (
            ("num_requests_running", "Sequences in the running batch", s.num_running),
            ("num_requests_waiting", "Sequences waiting for a slot", s.num_waiting),
            ("num_requests_swapped", "Waiting sequences whose KV pages sit in host memory", swapped),
            ("kv_cache_usage_perc", "Fraction of KV pages held by sequences", s.kv_cache_usage),
            ("prefix_cache_hit_rate", "Cached prefix pages found / pages looked up", s.prefix_cache_hit_rate),
            ("prefix_cache_host_hit_rate", "Prefix pages loaded back from host memory / pages looked up",
             s.prefix_cache_host_hit_rate),
            ("prefix_cache_disk_hit_rate", "Prefix pages loaded back from disk / pages looked up", s.prefix_cache_disk_hit_rate),
            ("spec_decode_acceptance_rate", "Accepted / drafted speculative tokens", s.acceptance_rate),
        ):
            yield GaugeMetricFamily(f"jaxinfer:{name}", doc, value=value)
        by_group = GaugeMetricFamily("jaxinfer:kv_cache_pages_in_use", "KV pages held by sequences, per KV layer group "
                                     "(the window its layers keep, 'chunk C' for chunked attention, 'full' for full attention)", labels=["group", "window"])
        for g, (pages, window) in enumerate(zip(s.kv_pages_in_use_by_group, self.engine.runner.kv_windows)):
            label = "full" if window is None else str(window) if isinstance(window, int) else describe(window)  # "chunk C"
            by_group.add_metric([str(g), label], pages)
        yield by_group
        for name, doc, value in (
            ("num_preemptions", "Sequences preempted", s.num_preemptions),
            ("num_compiles", "Step programs compiled (model buckets and sampling variants)", s.num_compiles),
            ("generation_tokens", "Tokens generated", s.num_generated_tokens),
            ("prompt_tokens_computed", "Prompt tokens computed in prefill chunks", s.num_prompt_tokens_computed),
            ("prefix_cache_host_hits", "Prefix pages loaded back from the host memory tier", s.prefix_cache_host_hits),
            ("prefix_cache_disk_hits", "Prefix pages loaded back from the disk tier", s.prefix_cache_disk_hits),
            ("kv_offloaded_pages", "Evicted prefix pages kept in the host memory tier", s.kv_offloaded_pages),
            ("spec_decode_num_drafts", "Verification steps of speculated sequences", s.num_spec_verifications),
            ("spec_decode_num_draft_tokens", "Speculative tokens drafted and verified", s.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Speculative tokens accepted", s.num_accepted_tokens),
            ("spec_decode_num_draft_tokens_cut_by_grammar", "Drafted tokens a structured output's grammar forbade "
             "(dropped before verification)", s.num_draft_tokens_cut_by_grammar),
        ):
            yield CounterMetricFamily(f"jaxinfer:{name}", doc, value=value)
        per_pos = CounterMetricFamily("jaxinfer:spec_decode_num_accepted_tokens_per_pos",
                                      "Verifications that accepted the draft at each position (0: the first)", labels=["position"])
        k = self.engine.config.speculative_config.num_speculative_tokens if self.engine.config.speculative_config else 0
        counts = s.num_accepted_tokens_per_pos
        for position in range(max(k, len(counts))):
            per_pos.add_metric([str(position)], counts[position] if position < len(counts) else 0)
        yield per_pos

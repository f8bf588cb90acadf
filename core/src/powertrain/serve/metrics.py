"""Prometheus metrics of one server: its own registry, so several apps (tests) never share counts.

Request-level metrics are observed as requests run; engine-level ones (load, KV
blocks, prefix cache, preemptions) are read from the engine's latest stats snapshot
when /metrics is scraped, so the engine loop never waits on the metrics code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from powertrain.interfaces.engine import EngineStats

#: Buckets in seconds: CPU time-to-first-token spans milliseconds to tens of seconds.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("powertrain_requests_running", "Sequences being computed.", value=s.running)
        yield GaugeMetricFamily("powertrain_requests_waiting", "Sequences queued for admission.", value=s.waiting)
        yield GaugeMetricFamily(
            "powertrain_kv_blocks_used", "KV cache blocks held.", value=s.kv_blocks_total - s.kv_blocks_free
        )
        yield GaugeMetricFamily("powertrain_kv_blocks_free", "KV cache blocks free.", value=s.kv_blocks_free)
        yield CounterMetricFamily(
            "powertrain_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=s.prefix_cache_queried_tokens,
        )
        yield CounterMetricFamily(
            "powertrain_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            value=s.prefix_cache_hit_tokens,
        )
        for name, help_text, values in (
            ("powertrain_prefix_cache_tier_hits", "Prompt tokens loaded from a tier.", s.prefix_cache_tier_hit_tokens),
            ("powertrain_kv_tier_written_bytes", "Bytes written to a tier.", s.kv_tier_bytes_written),
            ("powertrain_kv_tier_read_bytes", "Bytes read from a tier.", s.kv_tier_bytes_read),
            ("powertrain_kv_tier_seconds", "Seconds spent writing to and reading from a tier.", s.kv_tier_seconds),
            ("powertrain_kv_tier_errors", "Tier calls that failed (each a miss).", s.kv_tier_errors),
        ):
            family = CounterMetricFamily(name, help_text, labels=["tier"])
            for tier, value in values.items():
                family.add_metric([tier], value)
            yield family
        yield CounterMetricFamily("powertrain_preemptions", "Sequences preempted for memory.", value=s.preemptions)
        yield CounterMetricFamily(
            "powertrain_speculative_request_steps",
            "Decoding steps of sequences that could speculate.",
            value=s.speculative_request_steps,
        )
        yield CounterMetricFamily(
            "powertrain_speculative_verified_tokens", "Draft tokens verified.", value=s.speculative_verified_tokens
        )
        yield CounterMetricFamily(
            "powertrain_speculative_accepted_tokens", "Draft tokens accepted.", value=s.speculative_accepted_tokens
        )
        yield CounterMetricFamily(
            "powertrain_prefill_handoffs", "Prompts a prefill rank handed to a decode rank.", value=s.handoffs
        )
        yield CounterMetricFamily(
            "powertrain_prefill_handoff_failures",
            "Hand-offs whose blocks did not reach the store (the decode rank computed them).",
            value=s.handoff_failures,
        )
        yield CounterMetricFamily(
            "powertrain_prefill_handoff_seconds",
            "Seconds from sending a prompt to a prefill rank to its blocks being in the store.",
            value=s.handoff_seconds,
        )


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "powertrain_requests", "Finished HTTP generation requests.", ["protocol", "status"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "powertrain_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "powertrain_inter_token_latency_seconds",
            "Time between generated tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("powertrain_prompt_tokens", "Prompt tokens of requests.", registry=self.registry)
        self.generation_tokens = Counter("powertrain_generation_tokens", "Tokens generated.", registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

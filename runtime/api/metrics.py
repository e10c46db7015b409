"""Prometheus metrics of a server (`kiln:` prefix, vLLM-compatible names), in a registry of its own."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..ipc.protocol import CoreStats
from .async_engine import RequestObserver

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 300.0)


class ServerMetrics(RequestObserver):
    """Latency histograms and token counters fed by the engine's output task; gauges and the engine's own counters
    (prefix cache, preemptions) read from `stats()` at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], CoreStats], block_size: int,
                 speculative: str | None = None) -> None:
        disable_created_metrics()  # no `*_created` series, as vLLM
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        self._ttft = histogram("kiln:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("kiln:inter_token_latency_seconds", "Time between two token deliveries.",
                              _ITL_BUCKETS)
        self._e2e = histogram("kiln:e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self._queue = histogram("kiln:request_queue_time_seconds", "Arrival to first scheduled.",
                                _REQUEST_BUCKETS)
        self._prompt_tokens = counter("kiln:prompt_tokens", "Prompt tokens of accepted requests.")
        self._generation_tokens = counter("kiln:generation_tokens", "Generated tokens.")
        self._reasoning_tokens = counter("kiln:reasoning_tokens", "Generated tokens inside thinking blocks "
                                         "(included in kiln:generation_tokens).")
        self._success = Counter("kiln:request_success", "Requests that finished (not aborted).",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.registry.register(_EngineCollector(model_name, stats, block_size, speculative))

    # RequestObserver: called on the event loop.
    def on_queued(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def on_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def on_tokens(self, num_prompt: int, num_generated: int) -> None:
        if num_prompt:
            self._prompt_tokens.inc(num_prompt)
        if num_generated:
            self._generation_tokens.inc(num_generated)

    def on_reasoning_tokens(self, n: int) -> None:
        if n:
            self._reasoning_tokens.inc(n)

    def on_finished(self, e2e_seconds: float, finish_reason: str | None) -> None:
        self._e2e.observe(e2e_seconds)
        if finish_reason in ("stop", "length"):
            self._success.labels(self._model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], CoreStats], block_size: int,
                 speculative: str | None) -> None:
        self._model_name = model_name
        self._stats = stats
        self._block_size = block_size
        self._speculative = speculative or "none"  # the `method` label of the spec_decode series

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels, values = ["model_name"], [self._model_name]
        for name, doc, value in (
                ("kiln:num_requests_running", "Sequences holding KV blocks and being stepped.",
                 s.num_requests_running),
                ("kiln:num_requests_waiting", "Sequences waiting to be scheduled (queued or preempted).",
                 s.num_requests_waiting),
                ("kiln:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_cache_usage)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        # The prefix cache counts whole blocks; reported in tokens, as vLLM does.
        for name, doc, value in (
                ("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (whole blocks).",
                 s.prefix_cache_queries * self._block_size),
                ("kiln:prefix_cache_hits", "Prompt tokens served by the prefix cache (whole blocks).",
                 s.prefix_cache_hits * self._block_size),
                ("kiln:num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions),
                ("kiln:nonfinite_logits", "Requests failed because the model's logits for them were NaN or "
                 "infinite.", s.num_nonfinite_logits)):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        yield from self._kv_block_metrics(s)
        yield from self._speculative_metrics(s)

    def _kv_block_metrics(self, s: CoreStats) -> Iterator[Metric]:
        """The KV pool's blocks by state (offloaded: host blocks of the CPU offload tier) and the tier's traffic."""
        family = GaugeMetricFamily("kiln:kv_blocks", "KV blocks by state (free, active, leased, cached; offloaded: "
                                   "in the CPU offload tier).", labels=["model_name", "state"])
        for state in ("free", "active", "leased", "cached", "offloaded"):
            family.add_metric([self._model_name, state], getattr(s, f"kv_blocks_{state}"))
        yield family
        for name, doc, value in (
                ("kiln:kv_offload_blocks", "Evicted prefix-cache blocks copied to the CPU offload tier.",
                 s.kv_offload_offloaded),
                ("kiln:kv_restore_blocks", "Blocks copied back from the CPU offload tier on a prefix hit.",
                 s.kv_offload_restored),
                ("kiln:kv_offload_bytes", "Bytes copied to the CPU offload tier.", s.kv_offload_offload_bytes),
                ("kiln:kv_restore_bytes", "Bytes copied back from the CPU offload tier.", s.kv_offload_restore_bytes),
                ("kiln:kv_offload_hits", "Prompt tokens served from the CPU offload tier instead of recomputed.",
                 s.kv_offload_restored * self._block_size)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family

    def _speculative_metrics(self, s: CoreStats) -> Iterator[Metric]:
        """Speculative decoding, labelled with its method (mtp, ngram, draft; "none" when off)."""
        labels, values = ["model_name", "method"], [self._model_name, self._speculative]
        drafts, drafted, accepted = s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens
        for name, doc, value in (
                ("kiln:spec_decode_num_drafts", "Verify steps of a sequence with draft tokens.", drafts),
                ("kiln:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).", drafted),
                ("kiln:spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).", accepted)):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family
        for name, doc, value in (
                ("kiln:spec_decode_draft_acceptance_rate",
                 "Accepted / verified draft tokens since start (0 without speculation).",
                 accepted / drafted if drafted else 0.0),
                ("kiln:spec_decode_mean_acceptance_length",
                 "Tokens a verify step gains on average, 1 + accepted drafts (0 without speculation).",
                 1 + accepted / drafts if drafts else 0.0)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family

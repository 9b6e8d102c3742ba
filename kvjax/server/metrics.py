"""Prometheus metrics of a server: vLLM's `vllm:*` names with a `kvjax:` prefix, and the
same series again under vLLM's own names (`VLLM_NAMES`), so dashboards made for vLLM read a
kvjax server unchanged.

Engine gauges and counters are read from `AsyncEngine.metrics()` (the engine thread's copy
of `Engine.metrics()` after its last step) when /metrics is scraped; latency histograms and
request counters are observed by the engine thread as each request finishes, on the engine's
clock (arrival is when the HTTP handler received the request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvjax.engine.request import RequestOutput
from kvjax.server.async_engine import AsyncEngine

# vLLM's buckets, so dashboards built for it read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, HELP, key of Engine.metrics()); all labelled with the model name.
_ENGINE_GAUGES = (
    ("kvjax:num_requests_running", "Sequences running on the engine (holding KV pages).",
     "num_running"),
    ("kvjax:num_requests_waiting", "Sequences waiting to be scheduled (no KV pages).",
     "num_waiting"),
    ("kvjax:num_requests_swapped", "Sequences whose KV is swapped out to host memory.",
     "num_swapped"),
    ("kvjax:kv_cache_pages_total", "KV pages in the device pool.", "num_pages"),
    ("kvjax:kv_cache_pages_used", "KV pages held by at least one sequence.", "num_used_pages"),
    ("kvjax:kv_cache_pages_free", "KV pages allocatable now (free, or cached and unreferenced).",
     "num_free_pages"),
    ("kvjax:num_compiles", "Step and KV programs compiled so far.", "num_compiles"),
)
_ENGINE_COUNTERS = (
    ("kvjax:num_preemptions", "Sequences preempted (swapped out or dropped for recompute).",
     "preemptions"),
    ("kvjax:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_query_tokens"),
    ("kvjax:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_hit_tokens"),
    ("kvjax:engine_steps", "Engine steps that ran the model.", "steps"),
    ("kvjax:prefill_tokens", "Tokens computed in prefill chunks.", "prefill_tokens"),
    ("kvjax:decode_tokens", "Tokens computed in decode rows.", "decode_tokens"),
)


# kvjax name -> vLLM's names of the same series (same type, labels and meaning).
VLLM_NAMES = {
    "kvjax:num_requests_running": ("vllm:num_requests_running",),
    "kvjax:num_requests_waiting": ("vllm:num_requests_waiting",),
    "kvjax:num_requests_swapped": ("vllm:num_requests_swapped",),
    "kvjax:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "kvjax:num_preemptions": ("vllm:num_preemptions",),
    "kvjax:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "kvjax:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "kvjax:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "kvjax:time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",),
    "kvjax:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "kvjax:prompt_tokens": ("vllm:prompt_tokens",),
    "kvjax:generation_tokens": ("vllm:generation_tokens",),
    "kvjax:request_success": ("vllm:request_success",),
}


class _VllmAliases(Collector):
    """The series of `source` that vLLM also exports, under vLLM's names."""

    def __init__(self, source: CollectorRegistry):
        self._source = source

    def collect(self):
        for family in self._source.collect():
            for alias in VLLM_NAMES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                copy.samples = [sample._replace(name=alias + sample.name[len(family.name):])
                                for sample in family.samples]
                yield copy


class _EngineCollector(Collector):
    """Engine state at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        m, labels = self._engine.metrics(), [self._model_name]

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        for name, doc, key in _ENGINE_GAUGES:
            yield gauge(name, doc, m[key])
        yield gauge("kvjax:num_requests_queued", "Sequences (n per request) accepted without an "
                    "output token yet (bounded: beyond the bound requests get 429).",
                    self._engine.num_waiting)
        yield gauge("kvjax:kv_cache_usage_perc", "Fraction of KV pages held by sequences "
                    "(1 = full).", m["num_used_pages"] / max(m["num_pages"], 1))
        queries = m["prefix_query_tokens"]
        yield gauge("kvjax:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, "
                    "since start.", m["prefix_hit_tokens"] / queries if queries else 0.0)
        for name, doc, key in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, m[key])
            yield family
        moved = CounterMetricFamily("kvjax:kv_bytes_moved", "KV bytes moved per tier, both "
                                    "ways (host: device <-> host; disk: host <-> disk).",
                                    labels=["model_name", "tier"])
        moved.add_metric([self._model_name, "host"], m["host_bytes"])
        moved.add_metric([self._model_name, "disk"], m["disk_bytes"])
        yield moved


class ServerMetrics:
    """The server's Prometheus registry: engine state plus per-request observations.

    Attributes:
      registry: a registry of its own (servers in one process do not mix counts): the
        kvjax series and their vLLM aliases.
      rejected: kvjax:num_requests_rejected_total{reason}: queue_full (429), invalid (4xx),
        not_admitting (503).
    """

    def __init__(self, engine: AsyncEngine, model_name: str):
        kvjax_series = CollectorRegistry()
        self.model_name = model_name
        kw = dict(labelnames=["model_name"], registry=kvjax_series)
        self.ttft = Histogram("kvjax:time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, **kw)
        self.tpot = Histogram("kvjax:time_per_output_token_seconds", "Mean time per output "
                              "token after the first, per request (sample 0).",
                              buckets=TPOT_BUCKETS, **kw)
        self.e2e = Histogram("kvjax:e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=E2E_BUCKETS, **kw)
        self.prompt_tokens = Counter("kvjax:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", **kw)
        self.generation_tokens = Counter("kvjax:generation_tokens", "Tokens generated for "
                                         "finished requests (all samples).", **kw)
        self.success = Counter("kvjax:request_success", "Finished requests by the engine's "
                               "finish reason of sample 0.",
                               labelnames=["model_name", "finished_reason"],
                               registry=kvjax_series)
        self.rejected = Counter("kvjax:num_requests_rejected", "Requests refused before "
                                "reaching the engine's queue, by reason.",
                                labelnames=["model_name", "reason"], registry=kvjax_series)
        kvjax_series.register(_EngineCollector(engine, model_name))
        self.registry = CollectorRegistry()
        self.registry.register(kvjax_series)
        self.registry.register(_VllmAliases(kvjax_series))
        engine.on_finished.append(self.observe_finished)

    def observe_finished(self, out: RequestOutput) -> None:
        name = self.model_name
        if out.first_token_time is not None:
            self.ttft.labels(name).observe(out.first_token_time - out.arrival_time)
            if len(out.token_times) > 1:
                self.tpot.labels(name).observe((out.token_times[-1] - out.first_token_time)
                                               / (len(out.token_times) - 1))
        if out.finish_time is not None:
            self.e2e.labels(name).observe(out.finish_time - out.arrival_time)
        self.prompt_tokens.labels(name).inc(len(out.prompt_ids))
        self.generation_tokens.labels(name).inc(sum(len(o.token_ids) for o in out.outputs))
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.success.labels(name, reason.value if reason is not None else "none").inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

"""Prometheus metrics of the HTTP router: the replicas' series gathered, and its own.

A replica's series keep their names and labels, plus `replica` (its URL); each counter is
also summed over the replicas under `replica="all"` (select `replica!="all"` before summing
in PromQL). The router's own series are `kvjax:router_*`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # kvjax.bench.remote reads ALL_REPLICAS without needing httpx.
    from kvjax.router.replicas import Replica, ReplicaSet

ALL_REPLICAS = "all"


def aggregate_replica_metrics(texts: Mapping[str, str]) -> bytes:
    """Replica URL -> its /metrics text, as one exposition (see the module docstring).

    A family a replica does not expose is simply missing from its labels; the help text and
    type are the first replica's.
    """
    families: dict[str, Metric] = {}
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for url, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": url}, s.value)
                if family.type == "counter" and not s.name.endswith("_created"):
                    key = (s.name, tuple(sorted(s.labels.items())))
                    sums[family.name][key] += s.value
    for name, totals in sums.items():
        for (sample_name, labels), value in totals.items():
            families[name].add_sample(sample_name, {**dict(labels), "replica": ALL_REPLICAS},
                                      value)

    class _Gathered(Collector):
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Gathered())
    return generate_latest(registry)


class _ReplicaGauges(Collector):
    """Per replica: in the rotation (1/0) and the router's requests in flight there."""

    def __init__(self, replicas: ReplicaSet):
        self._replicas = replicas

    def collect(self):
        up = GaugeMetricFamily("kvjax:router_replica_up", "1 while the replica is in the "
                               "rotation.", labels=["replica"])
        in_flight = GaugeMetricFamily("kvjax:router_requests_in_flight", "Requests the router "
                                      "sent to the replica that have not ended.",
                                      labels=["replica"])
        for r in self._replicas.replicas:
            up.add_metric([r.url], float(r.is_healthy))
            in_flight.add_metric([r.url], float(len(r.in_flight)))
        return [up, in_flight]


class RouterMetrics:
    """The router's own series.

    Attributes:
      requests: kvjax:router_requests_total{replica, outcome}: one per try of a request on a
        replica (outcome: the replica's status, 'failed_before_output' (retried elsewhere if
        it was the first try), 'stream_broken', 'client_gone', 'timeout', 'broken',
        'router_error' (logged); replica '' and 'no_replica' when none could take it).
      retries: kvjax:router_retries_total: requests sent again to another replica.
      kv_transfers, kv_transfer_bytes: kvjax:router_kv_transfers_total and
        kvjax:router_kv_transfer_bytes_total: prefill/decode handoffs and the KV bytes their
        frames carried from a prefill replica to a decode one (bytes per request: their ratio).
    """

    def __init__(self, replicas: ReplicaSet):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("kvjax:router_requests", "Tries of requests on replicas, by "
                                "outcome.", ["replica", "outcome"], registry=self.registry)
        self.retries = Counter("kvjax:router_retries", "Requests sent again to another replica "
                               "after theirs failed before any output.", registry=self.registry)
        self.kv_transfers = Counter("kvjax:router_kv_transfers", "Requests whose KV pages "
                                    "moved from a prefill replica to a decode replica.",
                                    registry=self.registry)
        self.kv_transfer_bytes = Counter("kvjax:router_kv_transfer_bytes", "KV bytes moved "
                                         "from prefill replicas to decode replicas.",
                                         registry=self.registry)
        self.registry.register(_ReplicaGauges(replicas))

    def count(self, replica: Replica | None, outcome: str) -> None:
        self.requests.labels("" if replica is None else replica.url, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

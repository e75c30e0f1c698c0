"""Declaring Prometheus metrics in one line each, in one registry per process part."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
SIZES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, *labels: str, buckets: Sequence[float] = SECONDS
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

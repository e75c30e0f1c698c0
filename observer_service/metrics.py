"""An observer service's Prometheus metrics, served on ``ORCH_METRICS_PORT`` (off by default).

Labels are bounded: a kind, a reason, a kind of write. Never an observer id.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import start_http_server

from contracts.metrics import SIZES, Metrics


class ServiceMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        m = self
        self.running = m.gauge("orch_observers_running", "Copies this service runs")
        self.takes = m.counter("orch_takes_total", "Observers taken")
        self.releases = m.counter(
            "orch_releases_total", "Copies stopped and handed back, by reason", "reason"
        )
        self.restarts = m.counter("orch_restarts_total", "Restarts after a kind error", "kind")
        self.failed = m.counter("orch_failed_total", "Observers failed, by kind", "kind")
        self.fenced = m.counter(
            "orch_fenced_writes_total", "Writes refused: a newer epoch holds it", "write"
        )
        self.lease_lost = m.counter("orch_lease_lost_total", "Self-fencing, by reason", "reason")
        self.renewal = m.histogram("orch_lease_renewal_seconds", "Time a lease renewal took")
        self.checkpoint_flush = m.histogram(
            "orch_checkpoint_flush_seconds", "Time one batched checkpoint write took"
        )
        self.checkpoint_batch = m.histogram(
            "orch_checkpoint_batch_size", "Checkpoints written by one statement", buckets=SIZES
        )
        self.take_batch = m.histogram(
            "orch_take_batch_size", "Start messages decided by one statement", buckets=SIZES
        )
        self.stalls = m.counter(
            "orch_loop_stalls_total",
            "Steps of kind code that blocked the event loop past ORCH_LOOP_STALL, by kind",
            "kind",
        )
        self.control_refused = m.counter(
            "orch_control_refused_total",
            "Control messages not acted on: the database did not confirm them, by type",
            "type",
        )
        self.reconnects = m.counter(
            "orch_broker_reconnects_total", "Broker sessions opened after the first"
        )
        self.channel_closes = m.counter(
            "orch_channel_closes_total",
            "Broker sessions that closed, by reason (precondition_failed is usually the "
            "broker's consumer timeout)",
            "reason",
        )

    def running_is(self, count: Callable[[], int]) -> None:
        self.running.set_function(count)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)

"""An observer service's Prometheus metrics, served on ``ORCH_METRICS_PORT`` (off by default).

Labels are bounded: a kind, a reason, a kind of write. Never an observer id.

The server (:class:`MetricsServer`) is one thread with an event loop of its own, so that it
answers while kind code blocks the service's loop, and holds nothing for long: it listens on
``ORCH_METRICS_HOST`` (loopback unless set), each connection has ``ORCH_METRICS_TIMEOUT``
seconds for its whole exchange (one request, one answer, closed), and past
``ORCH_METRICS_MAX_CONNECTIONS`` at once a connection is answered 503 and closed. No thread per
connection, whatever a client sends or does not send.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import threading
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from orch_contracts.metrics import SIZES, Metrics

log = logging.getLogger(__name__)

#: A request head larger than this is refused (a scrape's is a few hundred bytes).
MAX_HEAD = 16 << 10


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

        self.outputs_committed = m.counter(
            "orch_outputs_committed_total",
            "Records observers emitted and committed, by kind",
            "kind",
        )
        self.outputs_published = m.counter(
            "orch_outputs_published_total", "Records the broker confirmed on the outputs exchange"
        )
        self.output_lag = m.histogram(
            "orch_output_lag_seconds", "From a record's commit to the broker's confirm"
        )
        self.output_publish = m.histogram(
            "orch_output_publish_seconds", "Time one round of output publishes took"
        )
        self.outputs_unconfirmed = m.gauge(
            "orch_outputs_unconfirmed", "Records committed here and not yet confirmed"
        )
        self.oldest_unconfirmed = m.gauge(
            "orch_output_oldest_unconfirmed_seconds",
            "Age of the oldest record committed here and not yet confirmed (0: none)",
        )
        self.no_progress = m.counter(
            "orch_no_progress_total",
            "Copies restarted because they committed nothing for their progress_timeout, by kind",
            "kind",
        )

    def running_is(self, count: Callable[[], int]) -> None:
        self.running.set_function(count)

    def serve(
        self,
        port: int,
        host: str = "127.0.0.1",
        *,
        timeout: float = 5.0,
        max_connections: int = 16,
    ) -> MetricsServer:
        """Serve these metrics from a thread of their own (see :class:`MetricsServer`)."""
        server = MetricsServer(
            self.registry, host=host, port=port, timeout=timeout, max_connections=max_connections
        )
        server.start()
        return server


def _answer(
    status: int, body: bytes = b"", content_type: str = "text/plain", *, head: bool = False
) -> bytes:
    phrase = http.HTTPStatus(status).phrase
    lines = [
        f"HTTP/1.1 {status} {phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head else body)


class MetricsServer:
    """A Prometheus endpoint bounded in time and in connections (module docstring). ``GET`` (or
    ``HEAD``) of ``/metrics`` or ``/``; the exposition format is chosen from ``Accept`` as the
    Prometheus client does (``name[]`` selects metrics)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str,
        port: int,
        timeout: float,
        max_connections: int,
    ) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.timeout = timeout
        self.max_connections = max_connections
        #: Connections open now (the server's thread alone reads and writes it).
        self.open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen (a port in use fails here, in the caller's thread), then serve in a thread."""
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._connection, self.host, self.port, limit=MAX_HEAD, backlog=64
                    )
                )
            except BaseException as exc:  # given to the caller
                failed.append(exc)
                started.set()
                loop.close()
                return
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="metrics-server", daemon=True)
        self._thread.start()
        started.wait()
        if failed:
            raise failed[0]

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or server is None or loop.is_closed():
            return

        def close() -> None:
            server.close()
            loop.stop()

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(close)
        if self._thread is not None:
            self._thread.join(5)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            writer.write(_answer(503, b"too many connections\n"))
            writer.transport.abort()  # the answer is in the kernel's hands already, or lost
            return
        self.open += 1
        done = False
        try:
            async with asyncio.timeout(self.timeout):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    writer.write(_answer(431, b"request head too large\n"))
                else:
                    writer.write(self._respond(head))
                await writer.drain()
                done = True
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception:  # one scrape's failure, never the thread's
            log.exception("metrics: answering a scrape failed")
        finally:
            self.open -= 1
            if done:
                writer.close()
            else:
                # Cut, not closed: a close waits for a buffer a client never reads.
                writer.transport.abort()

    def _respond(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _answer(400, b"bad request\n")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _answer(405, b"GET only\n")
        url = urlsplit(target)
        if url.path not in ("/metrics", "/"):
            return _answer(404, b"metrics are at /metrics\n")
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        encoder, content_type = choose_encoder(accept)
        names = parse_qs(url.query).get("name[]")
        registry = self.registry.restricted_registry(names) if names else self.registry
        return _answer(200, encoder(registry), content_type, head=method == "HEAD")

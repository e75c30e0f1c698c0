"""Traces across processes: a manager and services with the OpenTelemetry SDK exporting over
OTLP/HTTP to a collector in this test, which decodes what they send.

One start is one trace over three processes' spans (the manager's API request and publish, the
service's take and its start up to the first checkpoint), continued from the caller's own
``traceparent``; a delete's cancel reaches the holder in the request's trace; the sweeper's
re-dispatch of a killed service's observer starts a trace that the new holder's take joins.
"""

from __future__ import annotations

import gzip
import http.server
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support.cluster import Cluster, wait_for

#: Every test here needs processes of its own (faults, or what one process holds).
pytestmark = pytest.mark.processes


@dataclass(frozen=True)
class Span:
    name: str
    process: str  # the resource's service.name
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, object]

    @property
    def ms(self) -> float:
        return (self.end - self.start) / 1e6


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: what the processes export."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            s.name,
                            str(resource.get("service.name")),
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(got)

    def named(self, name: str, **attributes: object) -> list[Span]:
        with self.lock:
            return [
                s
                for s in self.spans
                if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())
            ]

    def by_id(self, span_id: str) -> Span:
        with self.lock:
            (found,) = [s for s in self.spans if s.span_id == span_id]
        return found


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    got = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            got.add(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def _exported(got: Collector, name: str, observer_id: str) -> list[Span]:
    """The spans ``name`` of this observer, once one is exported."""

    async def found() -> list[Span]:
        return got.named(name, **{"orch.observer_id": observer_id})

    return await wait_for(found, timeout=30, what=f"a {name} span of {observer_id}")


def _parent(got: Collector, span: Span) -> Span:
    return got.by_id(span.parent_id)


async def _parent_exported(got: Collector, span: Span) -> Span:
    """Its parent, once exported: each process exports its spans in batches of its own, so a
    child may arrive before its parent from another process (CI: the sweeper's re-dispatch)."""

    async def found() -> Span | None:
        with got.lock:
            return next((s for s in got.spans if s.span_id == span.parent_id), None)

    return await wait_for(found, timeout=30, what=f"the parent of {span.name}")


def _ancestors(got: Collector, span: Span) -> list[Span]:
    """Its parent, their parent, … up to the trace's first span exported here."""
    out = []
    while span.parent_id:
        try:
            span = _parent(got, span)
        except ValueError:  # a parent outside (the caller's)
            break
        out.append(span)
    return out


async def test_a_start_a_delete_and_a_redispatch_are_each_one_trace_across_processes(
    cluster: Cluster, collector: tuple[Collector, int]
) -> None:
    got, port = collector
    cluster.env.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
    )
    await cluster.start_manager()
    first = await cluster.start_service("svc-a", worker_count=5)

    # A caller's own trace continues through every process.
    trace_id = uuid.uuid4().hex
    parent_id = uuid.uuid4().hex[:16]
    async with cluster.api() as api:
        r = await api.post(
            "/observers",
            json={"name": "traced", "kind": "ticker", "params": {"interval": 0.1}},
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
        assert r.status_code == 201, r.text
        oid = r.json()["id"]

    (start,) = await _exported(got, "start", oid)
    assert start.attributes["orch.checkpointed"] is True
    take = _parent(got, start)
    publish = _parent(got, take)
    request = _ancestors(got, publish)[-1]  # the request's own server span, under FastAPI's
    assert (take.name, take.process) == ("take", "orch-service")
    assert (publish.name, publish.process) == ("publish", "orch-manager")
    assert (request.name, request.process) == ("POST /observers", "orch-manager")
    assert request.parent_id == parent_id  # the caller's
    trace = [s for s in got.spans if s.trace_id == trace_id]
    assert {s.process for s in trace} == {"orch-manager", "orch-service"}
    # The group commit that wrote it is a step of the request.
    (commit,) = [s for s in trace if s.name == "group commit"]
    assert request in _ancestors(got, commit)
    print("\nthe trace of one start:")
    for s in sorted(trace, key=lambda s: s.start):
        depth = len(_ancestors(got, s))
        print(
            f"  {s.process:13} {'  ' * depth + s.name:34} {s.ms:8.2f} ms"
            f"  at +{(s.start - request.start) / 1e6:.2f} ms"
        )

    # A delete: the cancel reaches the holder in the request's trace, and ends once stopped.
    async with cluster.api() as api:
        assert (await api.delete(f"/observers/{oid}")).status_code in (200, 202)
    (cancel,) = await _exported(got, "cancel", oid)
    cancel_publish = _parent(got, cancel)
    delete = _ancestors(got, cancel_publish)[-1]
    assert (cancel_publish.name, delete.name) == ("publish", "DELETE /observers/{observer_id}")
    assert cancel.trace_id == delete.trace_id
    await cluster.wait_status(oid, "deleted")

    # A re-dispatch by the sweeper is a trace of its own, which the new holder's take joins.
    # The holder freezes (a killed one's start would come back by the broker's requeue, in the
    # create's trace): its lease runs out with its connection still open.
    moved = (await cluster.create("moved", "ticker", interval=0.1))["id"]
    await _exported(got, "start", moved)
    await cluster.start_service("svc-b", worker_count=5)

    async def retaken() -> list[Span]:
        return [
            s
            for s in got.named("start", **{"orch.observer_id": moved})
            if s.attributes["orch.epoch"] != 1
        ]

    async with cluster.frozen(first, before_waking=lambda: first.signal(signal.SIGKILL)):
        again = (await wait_for(retaken, timeout=60, what="the moved observer started again"))[0]
    redispatch = again
    for _ in range(3):
        redispatch = await _parent_exported(got, redispatch)
    assert redispatch.name == "sweeper re-dispatch"
    assert redispatch.parent_id == ""  # a root
    assert redispatch.attributes["orch.reason"] == "holder gone"

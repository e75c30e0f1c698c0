"""``orch_contracts.tracing``: off unless asked, a no-op when off, and the SDK's console exporter
when asked for it (in a process of its own: a process sets its tracer provider once)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from orch_contracts import tracing
from orch_contracts.errors import StartupError
from tests.support.cluster import ROOT


@pytest.mark.parametrize(
    ("environ", "names"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": " OTLP , console "}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_the_environment_names_the_exporters(environ: dict[str, str], names: list[str]) -> None:
    assert tracing.exporters_named(environ) == names


def test_an_exporter_it_does_not_have_is_a_startup_error() -> None:
    with pytest.raises(StartupError, match="zipkin not supported"):
        tracing.check({"OTEL_TRACES_EXPORTER": "otlp,zipkin"})
    with pytest.raises(StartupError, match="OTLP protocol 'http/json' not supported"):
        tracing.check({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_off_every_call_is_a_no_op() -> None:
    assert not tracing.enabled()
    assert not tracing.configure("service", {})
    with tracing.span("x", parent={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}):
        assert tracing.carrier() is None
    opened = tracing.begin("y")
    opened.end(attributes={"nothing": "happens"})
    tracing.record("z", parent=None, started=0, ended=1)
    assert tracing.carrier_of({"traceparent": "00-x"}) is None
    assert tracing.now() == 0


SCRIPT = """
from orch_contracts import tracing
assert tracing.configure("service", {"OTEL_TRACES_EXPORTER": "console"}, instance="svc-1")
parent = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
with tracing.span("take", parent=parent, kind="consumer", attributes={"orch.pool": "p"}):
    sent = tracing.carrier()
    first = tracing.begin("start")
first.end(attributes={"orch.checkpointed": True})
print("CARRIER " + sent["traceparent"], flush=True)
tracing.shutdown()
"""


def test_the_console_exporter_prints_the_spans_with_their_parents() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    carrier = next(line for line in out.splitlines() if line.startswith("CARRIER "))
    # The console exporter prints each span as an indented JSON object.
    decoder = json.JSONDecoder()
    spans = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r"^\{", out, re.M)]
    assert len(spans) == 2, out
    by_name = {s["name"]: s for s in spans}
    take, start = by_name["take"], by_name["start"]
    assert take["context"]["trace_id"] == "0x" + "a" * 32
    assert take["parent_id"] == "0x" + "b" * 16
    assert take["kind"] == "SpanKind.CONSUMER"
    assert take["resource"]["attributes"]["service.name"] == "orch-service"
    assert take["resource"]["attributes"]["service.instance.id"] == "svc-1"
    assert start["parent_id"] == take["context"]["span_id"]
    assert start["attributes"]["orch.checkpointed"] is True
    assert carrier.split("-")[2] == take["context"]["span_id"][2:]

"""Traces (OpenTelemetry), optional and off by default.

Tracing is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, or both,
comma-separated) and the ``[otel]`` extra is installed; ``OTEL_SDK_DISABLED=true`` turns it off
again. Everything else is the SDK's own standard variables: ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_PROTOCOL``
(``http/protobuf``, the default, or ``grpc``), ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_PROPAGATORS``.

The trace context crosses processes in W3C ``traceparent``/``tracestate`` headers: of HTTP
requests into the manager, and of every AMQP message (``orch_contracts.routing.Sender`` adds them),
so that ``POST /observers`` → outbox publish → take → first checkpoint is one trace over three
processes. A message written to the outbox keeps the context it was written in (its ``trace``
column), so a start the relay publishes later stays in its request's trace.

Off, every call here is one test of a module global: no OpenTelemetry module is imported, spans
are a shared no-op, and carriers are ``None``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from orch_contracts import __version__
from orch_contracts.errors import StartupError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

#: The W3C trace context of a message or request: ``traceparent`` and maybe ``tracestate``.
Carrier = dict[str, str]
#: Attribute values a span takes.
Attributes = Mapping[str, str | int | float | bool]
#: Attributes, or a function that makes them: called only when tracing is on (a hot path pays
#: nothing for them when it is off).
SomeAttributes = Attributes | Callable[[], Attributes] | None

#: The exporters ``OTEL_TRACES_EXPORTER`` may name.
EXPORTERS = ("otlp", "console")
INSTALL = "pip install 'observer-orchestrator[otel]'"

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()


def enabled() -> bool:
    return _tracer is not None


def exporters_named(environ: Mapping[str, str]) -> list[str]:
    """The exporters the environment asks for (none: tracing stays off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise StartupError(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: "
            f"{', '.join(unknown)} not supported (use {' or '.join(EXPORTERS)}, or none)"
        )
    return names


def check(environ: Mapping[str, str]) -> None:
    """Raise StartupError if the environment asks for traces this install cannot make."""
    names = exporters_named(environ)
    if not names:
        return
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise StartupError(
            f"OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed ({INSTALL})"
        ) from exc
    if "otlp" in names:
        _otlp_exporter_class(environ)


def configure(role: str, environ: Mapping[str, str], *, instance: str | None = None) -> bool:
    """Turn tracing on in this process if the environment asks for it (True when on).

    ``role``: ``manager`` or ``service``; the spans' ``service.name`` is ``orch-<role>`` unless
    ``OTEL_SERVICE_NAME`` says otherwise. Call it once per process, after any fork."""
    global _tracer, _provider
    names = exporters_named(environ)
    if not names:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    except ImportError as exc:
        raise StartupError(
            f"OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed ({INSTALL})"
        ) from exc
    attributes: dict[str, str] = {"service.version": __version__, "orch.role": role}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"orch-{role}"
    if instance is not None:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(_scrubber())
    for name in names:
        exporter: SpanExporter = _otlp_exporter(environ) if name == "otlp" else _console_exporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("observer-orchestrator", __version__)
    return True


#: Request headers a caller's trace context comes in: heeded only from a caller whose token is
#: known good (``for_traces``).
_CONTEXT_HEADERS = frozenset({b"traceparent", b"tracestate", b"baggage"})


def for_traces(scope: Mapping[str, Any], *, trusted: bool) -> dict[str, Any]:
    """An HTTP request's ASGI scope as the request's server span may see it: without the
    ``Host`` header (a client's word: the span names the socket's own address instead), and,
    unless the caller is ``trusted`` (its token known good, or auth off), without a trace
    context to continue (an unknown caller starts no span under a trace id of its choosing)."""
    drop = {b"host"} if trusted else {b"host", *_CONTEXT_HEADERS}
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() not in drop]
    return {**scope, "headers": headers}


def _redacted_query(query: str) -> str:
    """A query string with every value ``REDACTED``: its names alone are exported."""
    names = [part.split("=", 1)[0] for part in query.split("&") if part]
    return "&".join(f"{name[:100]}=REDACTED" for name in names[:50])


def _scrubber() -> Any:
    """A span processor that runs before the exporters': no span leaves with a query string's
    values (``url.query``: a token, a secret …)."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Scrub(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            query = (span.attributes or {}).get("url.query")
            if isinstance(query, str):
                span.set_attribute("url.query", _redacted_query(query))

    return Scrub()


def _otlp_exporter(environ: Mapping[str, str]) -> Any:
    return _otlp_exporter_class(environ)()


def _otlp_exporter_class(environ: Mapping[str, str]) -> Any:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        else:
            raise StartupError(
                f"OTLP protocol {protocol!r} not supported (use http/protobuf or grpc)"
            )
    except ImportError as exc:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise StartupError(f"the OTLP {protocol} exporter is not installed ({package})") from exc
    return OTLPSpanExporter


def _console_exporter() -> Any:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def shutdown() -> None:
    """Export what is left and stop (a process's last step; nothing when off)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


# ------------------------------------------------------------------------------------ spans
def span(
    name: str,
    *,
    parent: Carrier | None = None,
    kind: str = "internal",
    attributes: SomeAttributes = None,
) -> contextlib.AbstractContextManager[Any]:
    """A span around a block, current inside it: a child of ``parent`` when given, else of the
    current span (a new trace if there is none). An exception leaving the block marks it
    failed."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(
        name, context=_context(parent), kind=_kind(kind), attributes=_made(attributes)
    )


def child(
    name: str, attributes: Attributes | None = None
) -> contextlib.AbstractContextManager[Any]:
    """A span around a block only inside a span that records (a step of a request, say),
    never a trace of its own: for steps that loops also take, every second."""
    if _tracer is None:
        return _NULL
    from opentelemetry import trace

    if not trace.get_current_span().is_recording():
        return _NULL
    return _tracer.start_as_current_span(name, attributes=_made(attributes))


class Open:
    """A span begun now and ended later, elsewhere (``end`` is idempotent), that is not made
    current."""

    __slots__ = ("_span",)

    def __init__(self, span_: Any) -> None:
        self._span = span_

    def end(self, *, attributes: Attributes | None = None) -> None:
        """End it (again: nothing), with more attributes."""
        s = self._span
        if s is None:
            return
        self._span = None
        if attributes:
            s.set_attributes(attributes)
        s.end()


_NO_SPAN = Open(None)


def begin(
    name: str,
    *,
    parent: Carrier | None = None,
    kind: str = "internal",
    attributes: SomeAttributes = None,
) -> Open:
    """A span begun now, to be ``end``-ed by whoever sees its end."""
    if _tracer is None:
        return _NO_SPAN
    return Open(
        _tracer.start_span(
            name, context=_context(parent), kind=_kind(kind), attributes=_made(attributes)
        )
    )


def record(
    name: str,
    *,
    parent: Carrier | None,
    started: float,
    ended: float,
    attributes: SomeAttributes = None,
) -> None:
    """A span already over, from ``started`` to ``ended`` (``time.time()`` seconds): one step
    that many requests shared, recorded in each one's trace."""
    if _tracer is None:
        return
    s = _tracer.start_span(
        name, context=_context(parent), attributes=_made(attributes), start_time=int(started * 1e9)
    )
    s.end(end_time=int(ended * 1e9))


def now() -> float:
    """The wall clock ``record`` takes (0 when off: nothing reads it)."""
    return time.time() if _tracer is not None else 0.0


def carrier() -> Carrier | None:
    """The current span's context, to send along (None when off or outside any span)."""
    if _tracer is None:
        return None
    from opentelemetry.propagate import inject

    out: Carrier = {}
    inject(out)
    return out or None


def carrier_of(headers: Mapping[str, Any] | None) -> Carrier | None:
    """The trace context among a message's or a request's headers, if any."""
    if _tracer is None or not headers:
        return None
    out = {k: str(v) for k in ("traceparent", "tracestate") if (v := headers.get(k)) is not None}
    return out or None


def _made(attributes: SomeAttributes) -> Attributes | None:
    return attributes() if callable(attributes) else attributes


def _context(parent: Carrier | None) -> Any:
    if parent is None:
        return None  # the current context
    from opentelemetry.propagate import extract

    return extract(parent)


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind[kind.upper()]

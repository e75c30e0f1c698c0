"""Built-in observer kinds, registered through the ``observer_orchestrator.kinds`` entry point.

``recorder`` (writes files where a caller asks) is not among them: load it explicitly with
``ORCH_KIND_MODULES=observer_service.kinds.recorder`` where it is wanted (tests, benchmarks).
"""

from observer_service.kinds import http_poll, ticker, websocket

__all__ = ["http_poll", "ticker", "websocket"]

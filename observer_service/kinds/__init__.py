"""Built-in observer kinds (registered through the ``observer_orchestrator.kinds`` entry point)."""

from observer_service.kinds import http_poll, recorder, ticker

__all__ = ["http_poll", "recorder", "ticker"]

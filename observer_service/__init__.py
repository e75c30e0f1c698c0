"""Observer service: runs observers. Kind authors need only what is exported here."""

from contracts.errors import Fenced, LeaseLost
from contracts.kinds import RestartPolicy, observer_kind
from observer_service.context import ObserverContext

__all__ = ["Fenced", "LeaseLost", "ObserverContext", "RestartPolicy", "observer_kind"]

"""Observer service: runs observers. Kind authors need only what is exported here."""

from observer_service.context import ObserverContext
from orch_contracts.errors import Fenced, LeaseLost
from orch_contracts.kinds import RestartPolicy, observer_kind

__all__ = ["Fenced", "LeaseLost", "ObserverContext", "RestartPolicy", "observer_kind"]

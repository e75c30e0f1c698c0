"""The registry of observer kinds, loaded the same way by the manager (to validate) and the
services (to run)."""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contracts.errors import InvalidParams, StartupError, UnknownKind

ENTRY_POINT_GROUP = "observer_orchestrator.kinds"

RunFn = Callable[[Any], Coroutine[Any, Any, None]]
T = TypeVar("T")


class RestartPolicy(BaseModel):
    """How an observer whose code raised is restarted in place: exponential backoff with jitter,
    at most ``max_restarts`` restarts within a window. The window heals: after ``reset_after``
    seconds without a restart the count starts again from zero, so an endless poller that hits
    a transient error now and then is never failed for it. The count is kept in the database,
    so it survives a move between services."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_restarts: int = Field(default=5, ge=0, le=1000)
    base_delay: float = Field(default=1.0, ge=0.05, le=3600)
    max_delay: float = Field(default=60.0, ge=0.05, le=86_400)
    reset_after: float = Field(default=600.0, ge=1, le=30 * 86_400)

    @model_validator(mode="after")
    def _delays(self) -> Self:
        if self.max_delay < self.base_delay:
            raise ValueError("max_delay must be at least base_delay")
        return self

    def delay(self, restarts: int) -> float:
        """Seconds to wait before restart number ``restarts`` (1 for the first)."""
        exponential = self.base_delay * 2.0 ** min(max(restarts - 1, 0), 32)
        return min(self.max_delay, exponential) + random.uniform(0, self.base_delay)


@dataclass(frozen=True)
class KindSpec:
    name: str
    run: RunFn
    params_model: type[BaseModel] | None = None
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    description: str = ""
    #: Where it was defined ("module:qualname"): the same kind imported twice is no duplicate.
    origin: str = ""

    def validate_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validated params as JSON-ready data; raises InvalidParams with a readable message."""
        if self.params_model is None:
            return params
        try:
            return self.params_model.model_validate(params).model_dump(mode="json")
        except ValidationError as exc:
            raise InvalidParams(f"invalid params for kind {self.name!r}: {_readable(exc)}") from exc

    def policy(self, override: dict[str, Any] | None) -> RestartPolicy:
        """The kind's restart policy with an observer's own fields over it."""
        if not override:
            return self.restart_policy
        return RestartPolicy.model_validate({**self.restart_policy.model_dump(), **override})


class KindLoadError(StartupError):
    pass


_REGISTRY: dict[str, KindSpec] = {}


def observer_kind(
    name: str,
    *,
    params: type[BaseModel] | None = None,
    restart: RestartPolicy | None = None,
) -> Callable[[T], T]:
    """Register an observer kind: an ``async def run(ctx)`` function, or a class whose instances
    have one (a new instance for every run)."""

    def register(obj: T) -> T:
        if inspect.isclass(obj):
            cls: Any = obj

            async def run(ctx: Any) -> None:
                await cls().run(ctx)

        elif inspect.iscoroutinefunction(obj):
            run = obj
        else:
            raise TypeError(f"observer kind {name!r} must be an async function or a class")
        origin = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', '?')}"
        existing = _REGISTRY.get(name)
        if existing is not None and existing.origin != origin:
            raise KindLoadError(
                f"observer kind {name!r} is registered twice: {existing.origin} and {origin}"
            )
        doc = (obj.__doc__ or "").strip()
        _REGISTRY[name] = KindSpec(
            name=name,
            run=run,
            params_model=params,
            restart_policy=restart or RestartPolicy(),
            description=doc.splitlines()[0] if doc else "",
            origin=origin,
        )
        return obj

    return register


def load_kinds(modules: Iterable[str] = ()) -> dict[str, KindSpec]:
    """Import the built-in kinds (entry points) and the named modules; return the registry."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            raise KindLoadError(f"cannot load kinds from entry point {ep.value!r}: {exc}") from exc
    for module in modules:
        try:
            importlib.import_module(module)
        except KindLoadError:
            raise
        except Exception as exc:
            raise KindLoadError(f"cannot import kind module {module!r}: {exc}") from exc
    return dict(_REGISTRY)


def get_kind(kinds: dict[str, KindSpec], name: str) -> KindSpec:
    try:
        return kinds[name]
    except KeyError:
        known = ", ".join(sorted(kinds)) or "none"
        raise UnknownKind(f"unknown kind {name!r}; known kinds: {known}") from None


def _readable(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "params"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)

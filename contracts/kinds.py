"""The registry of observer kinds, loaded the same way by the manager (to validate) and the
services (to run)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENTRY_POINT_GROUP = "observer_orchestrator.kinds"

RunFn = Callable[[Any], Awaitable[None]]
T = TypeVar("T")


class RestartPolicy(BaseModel):
    """How an observer whose code raised is restarted in place: exponential backoff with jitter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_restarts: int = Field(default=5, ge=0, le=1_000_000)
    base_delay: float = Field(default=1.0, ge=0, le=3600)
    max_delay: float = Field(default=60.0, ge=0, le=86_400)


@dataclass(frozen=True)
class KindSpec:
    name: str
    run: RunFn
    params_model: type[BaseModel] | None = None
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    description: str = ""

    def validate_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validated params as JSON-ready data; raises InvalidParams with a readable message."""
        if self.params_model is None:
            return params
        try:
            return self.params_model.model_validate(params).model_dump(mode="json")
        except ValidationError as exc:
            raise InvalidParams(f"invalid params for kind {self.name!r}: {_readable(exc)}") from exc


class UnknownKind(LookupError):
    pass


class InvalidParams(ValueError):
    pass


class KindLoadError(RuntimeError):
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

            doc = obj.__doc__ or ""
        elif inspect.iscoroutinefunction(obj):
            run = obj
            doc = obj.__doc__ or ""
        else:
            raise TypeError(f"observer kind {name!r} must be an async function or a class")
        existing = _REGISTRY.get(name)
        if existing is not None and getattr(existing.run, "__qualname__", None) != getattr(
            run, "__qualname__", None
        ):
            raise KindLoadError(f"observer kind {name!r} is registered twice")
        _REGISTRY[name] = KindSpec(
            name=name,
            run=run,
            params_model=params,
            restart_policy=restart or RestartPolicy(),
            description=doc.strip().splitlines()[0] if doc.strip() else "",
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

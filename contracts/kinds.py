"""The registry of observer kinds, loaded the same way by the manager (to validate) and the
services (to run).

Secret params
-------------
A kind declares a param secret by giving it a pydantic secret type in its params model::

    class Params(BaseModel):
        url: AnyHttpUrl
        api_key: SecretStr                   # or SecretBytes, or Secret[int] …
        password: SecretStr | None = None

    @observer_kind("my_kind", params=Params)
    async def run(ctx):
        key = ctx.params.api_key.get_secret_value()   # the real value

(A field the kind cannot retype may be marked with ``Field(json_schema_extra={"secret": True})``
instead; it is masked the same way and reaches the kind as it is.) The params are stored as
given and the kind gets the real values; only what the API shows a ``read`` token is masked,
``***`` in place of each secret (``KindSpec.mask_params``). Whatever a kind declares, every
string param is also masked generically: in a URL, the password and the values of query
parameters named like secrets (``api_key``, ``token``, ``password``, ``secret``, ``key``,
``signature``, ``…_key`` …, and those a ``secret_query`` param lists) become ``***`` and so
does a user name; a param *named* like a secret is masked whole. A secret in a URL's path
(``/bot<token>/``) is not recognised: declare such a param ``SecretStr``. Text logs and JSON
logs mask URL passwords and secret query values too (``orch_contracts.masking.mask``, the one
masker), an observer's errors and its ``ctx.logger`` lines the values of its secret params as
well; never log a secret yourself (a ``SecretStr`` prints as ``**********``), and set
``hide_input_in_errors=True`` on a params model whose validation errors could quote a secret.
The API never echoes what a client sent: a validator of yours whose message would quote the
value can tell, with ``from_client(info)``, that the manager checks a client's params, and
name the rule alone then (``http_poll``'s egress check does).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Self, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import to_jsonable_python

from orch_contracts import adverts
from orch_contracts.errors import AdvertRefused, InvalidParams, StartupError, UnknownKind
from orch_contracts.masking import SECRET, is_secret_name, mask

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
    #: Seconds: a copy that commits nothing (no checkpoint, no record) for this long is
    #: restarted with the error "no progress for N s" (None: never). A kind declares it with
    #: ``observer_kind(progress_timeout=...)``; an observer's own policy may set it too.
    progress_timeout: float | None = Field(default=None, ge=0.1, le=86_400)

    @model_validator(mode="after")
    def _delays(self) -> Self:
        if self.max_delay < self.base_delay:
            raise ValueError("max_delay must be at least base_delay")
        return self

    def nominal_delay(self, restarts: int) -> float:
        """The exponential part of :meth:`delay`, without its jitter (what the console shows as
        the earliest next restart)."""
        return min(self.max_delay, self.base_delay * 2.0 ** min(max(restarts - 1, 0), 32))

    def delay(self, restarts: int) -> float:
        """Seconds to wait before restart number ``restarts`` (1 for the first): the nominal
        delay plus a jitter of up to ``base_delay``."""
        return self.nominal_delay(restarts) + random.uniform(0, self.base_delay)


#: The version of a kind that names none.
DEFAULT_VERSION = "1"
#: What a kind version may be: letters, digits and ``.``, ``-``, ``_``, ``+`` (``2``, ``1.4.0``,
#: ``2024-06-rc1``).
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"


def check_version(version: str) -> str:
    """``version`` if it may name a kind's version, else ValueError."""
    if not re.fullmatch(VERSION_PATTERN, version):
        raise ValueError(
            "a kind version is 1 to 64 letters, digits, '.', '-', '_' or '+', starting with a "
            "letter or digit"
        )
    return version


@dataclass(frozen=True)
class KindSpec:
    name: str
    run: RunFn
    params_model: type[BaseModel] | None = None
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    description: str = ""
    #: Where it was defined ("module:qualname"): the same kind imported twice is no duplicate.
    origin: str = ""
    #: The params shown to a ``read`` token as ``***``: those given here, and every field of
    #: the params model of a secret type (``SecretStr`` …) or marked ``{"secret": True}``.
    secret_params: frozenset[str] = frozenset()
    #: Outputs: seconds between the commits a copy makes on its own of the records it staged
    #: with ``ctx.emit`` (None: records are committed only with ``ctx.checkpoint``). For kinds
    #: with nothing to resume from: see ``docs/outputs.md`` for what each mode guarantees.
    commit_every: float | None = None
    #: The params' JSON schema as a service advertised it, for a kind known only from services'
    #: adverts (``from_advert``: no code, no params model); params are checked against it.
    params_schema: dict[str, Any] | None = None
    #: Its version, as its author names releases of its code: an observer may be pinned to one
    #: (it then runs only on services that have that version).
    version: str = DEFAULT_VERSION

    def __post_init__(self) -> None:
        found = secret_fields(self.params_model) if self.params_model is not None else set()
        object.__setattr__(self, "secret_params", frozenset(self.secret_params) | found)

    def validate_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validated params as JSON-ready data, secrets as they were given (they are stored so:
        the kind needs them); raises InvalidParams with a readable message."""
        if self.params_model is None:
            if self.params_schema is not None:
                adverts.check_params(self.name, self.params_schema, params)
            return params
        try:
            model = self.params_model.model_validate(params, context=CLIENT)
        except ValidationError as exc:
            raise InvalidParams(f"invalid params for kind {self.name!r}: {_readable(exc)}") from exc
        dumped: dict[str, Any] = model.model_dump(mode="json")
        _reveal(model, dumped)
        return dumped

    def mask_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` as a ``read`` token may see them: see ``mask_params``."""
        return mask_params(params, self)

    def advert(self) -> dict[str, Any]:
        """What a service tells of this kind in its row (``services.kinds``): enough for the
        manager and the operator to know it without its code."""
        return {
            "description": self.description,
            "params_schema": (
                self.params_model.model_json_schema()
                if self.params_model is not None
                else self.params_schema
            ),
            "secret_params": sorted(self.secret_params),
            "restart_policy": self.restart_policy.model_dump(),
            "version": self.version,
        }

    @classmethod
    def from_advert(cls, name: str, advert: dict[str, Any]) -> KindSpec:
        """A kind as a service advertised it (``advert``, read by ``adverts.read_advert``): its
        params are checked against the advertised schema, its secrets masked, its restart
        policy known; it cannot run here. Raises AdvertRefused for an advert it cannot read."""
        # Read as the tolerant reader reads messages: a field of a later release is ignored.
        policy = advert.get("restart_policy") or {}
        schema = advert.get("params_schema")
        secrets = advert.get("secret_params") or []
        if not isinstance(policy, dict) or not isinstance(secrets, list):
            raise AdvertRefused("its restart policy or its secret params are not of their shape")
        if schema is not None:
            adverts.check_schema(schema)
        known = {k: v for k, v in policy.items() if k in RestartPolicy.model_fields}
        try:
            restart = RestartPolicy.model_validate(known, strict=False)
            version = check_version(str(advert.get("version") or DEFAULT_VERSION))
        except ValueError as exc:  # pydantic's ValidationError too
            raise AdvertRefused(f"its restart policy or version is not valid: {exc}") from None
        return cls(
            name=name,
            run=_not_here,
            restart_policy=restart,
            description=str(advert.get("description") or "")[:1000],
            origin="advertised",
            secret_params=frozenset(str(s) for s in secrets),
            params_schema=schema,
            version=version,
        )

    def policy(self, override: dict[str, Any] | None) -> RestartPolicy:
        """The kind's restart policy with an observer's own fields over it."""
        if not override:
            return self.restart_policy
        return RestartPolicy.model_validate({**self.restart_policy.model_dump(), **override})


async def _not_here(ctx: Any) -> None:
    raise RuntimeError("a kind known from services' adverts runs only on those services")


#: The validation context of params a client sent (the manager's check): a validator that
#: raises should then name the rule, not the value (``from_client``).
CLIENT = {"client": True}


def from_client(info: Any) -> bool:
    """Whether a validator (given its ``ValidationInfo``) checks what a client sent: its error
    goes back to that client, which the API never echoes its input to."""
    context = getattr(info, "context", None)
    return isinstance(context, dict) and context.get("client") is True


def _is_secret_type(annotation: Any) -> bool:
    """``SecretStr``, ``SecretBytes``, ``Secret[T]``, or one of them in ``X | None``,
    ``list[X]``, ``Annotated[X, …]`` …"""
    origin = get_origin(annotation)
    if inspect.isclass(origin) and hasattr(origin, "get_secret_value"):
        return True
    if inspect.isclass(annotation) and hasattr(annotation, "get_secret_value"):
        return True
    return any(_is_secret_type(arg) for arg in get_args(annotation))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The params models nested in a field's type (``Inner``, ``Inner | None``, ``list[Inner]``)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def secret_fields(model: type[BaseModel]) -> set[str]:
    """The fields of ``model`` that hold secrets: of a secret type, or marked secret."""
    found = set()
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra
        if (isinstance(extra, dict) and extra.get("secret") is True) or _is_secret_type(
            info.annotation
        ):
            found.add(name)
    return found


def _reveal(model: BaseModel, dumped: dict[str, Any]) -> None:
    """Put the real values of ``model``'s secrets where its JSON dump has ``**********``."""
    for name in type(model).model_fields:
        if name in dumped:
            dumped[name] = _revealed(getattr(model, name), dumped[name])


def _revealed(value: Any, dumped: Any) -> Any:
    if hasattr(value, "get_secret_value"):
        return to_jsonable_python(value.get_secret_value())
    if isinstance(value, BaseModel) and isinstance(dumped, dict):
        _reveal(value, dumped)
    elif isinstance(value, list | tuple) and isinstance(dumped, list):
        return [_revealed(v, d) for v, d in zip(value, dumped, strict=False)]
    elif isinstance(value, dict) and isinstance(dumped, dict):
        for key, v in value.items():
            if str(key) in dumped:
                dumped[str(key)] = _revealed(v, dumped[str(key)])
    return dumped


def mask_params(params: dict[str, Any], spec: KindSpec | None) -> dict[str, Any]:
    """``params`` as a ``read`` token may see them (a copy): the kind's secret params (those of
    nested models too) are ``***``; so is any param named like a secret (``password``,
    ``api_key``, ``token`` …); and in every string, the URLs' user names, passwords and secret
    query values. ``spec`` is None for a kind this manager does not know: the generic rules
    only."""
    model = spec.params_model if spec is not None else None
    extra = spec.secret_params if spec is not None else frozenset()
    if spec is not None and model is None and spec.params_schema is not None:
        # A kind known from its advert alone: its nested secrets are found in its schema.
        params = adverts.masked(params, spec.params_schema)
    declared = params.get(SECRET_QUERY)
    names = tuple(n for n in (declared if isinstance(declared, list) else []) if isinstance(n, str))
    return _masked(params, model, extra, names)  # type: ignore[no-any-return]


def secret_values(
    params: dict[str, Any], spec: KindSpec | None, masked: dict[str, Any] | None = None
) -> list[str]:
    """The values ``mask_params`` hides as a whole (a secret param's value, as text), longest
    first: what an error message that quotes one must not show either (``mask``'s
    ``secrets``). ``masked``: what ``mask_params`` made of ``params`` already, if the caller
    has it."""
    found: set[str] = set()

    def walk(given: Any, shown: Any) -> None:
        if shown == SECRET and given != SECRET and given not in (None, ""):
            found.update(_leaves(given))  # a list, a dict, a model: every value in it
        elif isinstance(given, dict) and isinstance(shown, dict):
            for key, value in given.items():
                walk(value, shown.get(key))
        elif isinstance(given, list) and isinstance(shown, list):
            for a, b in zip(given, shown, strict=False):
                walk(a, b)

    walk(params, masked if masked is not None else mask_params(params, spec))
    # Short values (a PIN of 3 digits) would mask every number in a message: left to the rest.
    return sorted((v for v in found if len(v) >= 4), key=len, reverse=True)


def _leaves(value: Any) -> Iterator[str]:
    """Every string and number in ``value`` as text (a dict's values, not its keys)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, str | int | float) and not isinstance(item, bool):
            found = str(item)
            if found != SECRET:
                yield found


def mask_as(params: dict[str, Any], specs: Sequence[KindSpec] | None) -> dict[str, Any]:
    """``params`` as a ``read`` token may see them, given what tells which are secret:
    ``specs``, the versions of its kind that may run the observer (each one's secrets masked);
    None where nothing tells (no advert, or one that could not be read): every value masked."""
    if not specs:
        return adverts.mask_all(params)  # type: ignore[no-any-return]
    for spec in specs:
        params = mask_params(params, spec)
    return params


def mask_text_in(value: Any, secrets: Sequence[str] = (), depth: int = 0) -> Any:
    """A JSON value (a checkpoint) as a ``read`` token may see it: every string in it masked
    as an error is (``mask``: URL user info, secret query values, ``secrets``), the value of a
    key named like a secret ``***``, and past 64 levels all of it."""
    if depth > 64:
        return SECRET
    if isinstance(value, str):
        return mask(value, secrets=secrets, keep_user=False)
    if isinstance(value, list):
        return [mask_text_in(v, secrets, depth + 1) for v in value]
    if isinstance(value, dict):
        return {
            k: SECRET
            if is_secret_name(str(k)) and v not in (None, "")
            else mask_text_in(v, secrets, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, int | float) and not isinstance(value, bool) and str(value) in secrets:
        return SECRET
    return value


#: A param of this name (a list of query-parameter names) adds to the secret query values
#: masked in that observer's URLs (``http_poll`` has one).
SECRET_QUERY = "secret_query"


def _masked(
    value: Any,
    model: type[BaseModel] | None,
    secret: frozenset[str] = frozenset(),
    names: tuple[str, ...] = (),
) -> Any:
    if isinstance(value, str):
        return mask(value, keep_user=False, names=names)
    if isinstance(value, list):
        return [_masked(v, model, names=names) for v in value]
    if not isinstance(value, dict):
        return value
    fields = model.model_fields if model is not None else {}
    hidden = secret | (secret_fields(model) if model is not None else set())
    out: dict[str, Any] = {}
    for key, v in value.items():
        named = key != SECRET_QUERY and is_secret_name(str(key))
        if v is not None and v != "" and (key in hidden or named):
            out[key] = SECRET
            continue
        info = fields.get(key)
        inner = _models_in(info.annotation) if info is not None else []
        out[key] = _masked(v, inner[0] if len(inner) == 1 else None, names=names)
    return out


class KindLoadError(StartupError):
    pass


_REGISTRY: dict[str, KindSpec] = {}


def observer_kind(
    name: str,
    *,
    params: type[BaseModel] | None = None,
    restart: RestartPolicy | None = None,
    commit_every: float | None = None,
    progress_timeout: float | None = None,
    version: str = "1",
) -> Callable[[T], T]:
    """Register an observer kind: an ``async def run(ctx)`` function, or a class whose instances
    have one (a new instance for every run). ``commit_every`` (seconds) makes each copy commit
    the records it emits on its own, without a checkpoint; ``progress_timeout`` (seconds)
    restarts a copy that commits nothing for that long; ``version`` names this release of its
    code (an observer pinned to a version runs only where that version is)."""
    if commit_every is not None and not 0.001 <= commit_every <= 60:
        raise ValueError("commit_every must be between 0.001 and 60 seconds")
    check_version(version)
    policy = restart or RestartPolicy()
    if progress_timeout is not None:
        policy = RestartPolicy.model_validate(
            {**policy.model_dump(), "progress_timeout": progress_timeout}
        )

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
            restart_policy=policy,
            description=doc.splitlines()[0] if doc else "",
            origin=origin,
            commit_every=commit_every,
            version=version,
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
        # The name asked for is not repeated: an error never echoes what a client sent.
        raise UnknownKind(f"unknown kind; known kinds: {known}") from None


#: Pydantic's messages that quote part of the input (``found `z` at 1``): the rule alone.
RULE_ONLY = {"uuid_parsing": "Input should be a valid UUID"}


def _readable(exc: ValidationError) -> str:
    """The field and the rule of each error (never the value: ``input`` is left out)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "params"
        parts.append(f"{where}: {RULE_ONLY.get(err['type'], err['msg'])}")
    return "; ".join(parts)

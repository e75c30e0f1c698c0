"""Request and response bodies of the HTTP API."""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    model_validator,
)

from orch_contracts import names
from orch_contracts.kinds import VERSION_PATTERN, RestartPolicy
from orch_contracts.names import REFUSED_CLASS
from orch_contracts.pools import DEFAULT_POOL, POOL_PATTERN
from orch_contracts.statuses import ObserverStatus
from orch_manager.problems import Problem

#: Nesting of ``params`` (objects in arrays in objects …) beyond this is refused.
MAX_PARAMS_DEPTH = 16


def clean_text(value: str) -> str:
    """Refuse what no database column and no JSON encoder should see: NUL and lone surrogates."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    if any("\ud800" <= ch <= "\udfff" for ch in value):
        raise ValueError("must not contain a lone surrogate (invalid Unicode)")
    return value


#: The largest integer a param may be (a double's exact integers, and JavaScript's): a larger
#: one would reach a reader as infinity, or as another number.
MAX_INT = 2**53


def clean_params(value: dict[str, Any]) -> dict[str, Any]:
    """Every string (keys too) clean, every number finite and an integer within ±2^53 (the
    error names where), and nested no deeper than MAX_PARAMS_DEPTH."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "params")]
    while stack:
        item, depth, where = stack.pop()
        if depth > MAX_PARAMS_DEPTH:
            raise ValueError(f"nested deeper than {MAX_PARAMS_DEPTH} levels")
        if isinstance(item, str):
            clean_text(item)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int) and abs(item) > MAX_INT:
            raise ValueError(f"{where}: an integer must be within ±2^53 ({MAX_INT})")
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where}: a number must be finite (not NaN, Infinity or 1e400)")
        elif isinstance(item, dict):
            for k, v in item.items():
                clean_text(k)
                stack.append((v, depth + 1, f"{where}.{str(k)[:100]}"))
        elif isinstance(item, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(item))
    return value


SafeText = Annotated[str, AfterValidator(clean_text)]

#: The longest observer name: one line of a terminal or of the console (the column is text, so
#: longer names created before stay readable; only new names are bounded).
MAX_NAME = 100
#: The names' rule for the schema; ``check_name`` enforces it first, with the reason in words.
NAME_PATTERN = rf"^[^\s{REFUSED_CLASS}]([^{REFUSED_CLASS}]*[^\s{REFUSED_CLASS}])?$"


def check_name(value: Any) -> Any:
    """Refuse, saying why (the character's class and position, not the name), a name that
    would steer a terminal or a log rather than show, or that shows nothing where it differs
    from another: control characters, format characters (bidi controls, zero-width space and
    joiners, soft hyphen, byte order mark), line and paragraph separators, default-ignorable
    code points (``orch_contracts.names``); and one that starts or ends with blanks. A name is kept
    in NFC. What is not a string is left to the type check."""
    if not isinstance(value, str):
        return value
    reason = names.refusal(value)
    if reason is not None:
        raise ValueError(reason)
    if value != value.strip():
        raise ValueError("must not start or end with whitespace")
    return names.normal(value)


Name = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_NAME,
        pattern=NAME_PATTERN,
        description=f"1 to {MAX_NAME} characters, kept in NFC; no control, format (bidi, "
        "zero-width …) or other invisible characters, no line separators, no blanks at either "
        "end; unique among observers that are not deleted, names that look alike (case, "
        "width, Cyrillic or Greek letters for Latin ones) counting as one",
    ),
    AfterValidator(clean_text),
    BeforeValidator(check_name),  # the outermost: it runs first, so the reason is in words
]
KindName = Annotated[
    SafeText, Field(min_length=1, max_length=100, description="a registered observer kind")
]

PoolName = Annotated[
    str,
    Field(
        pattern=POOL_PATTERN,
        description="a pool: 1 to 63 lowercase letters, digits, '-' or '_'",
        examples=["default", "eu"],
    ),
]

KindVersion = Annotated[
    str,
    Field(pattern=VERSION_PATTERN, description="a version of a kind, as its services advertise"),
]


class ObserverCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name
    kind: KindName
    pool: PoolName = Field(
        default=DEFAULT_POOL,
        description="the pool it runs in: only services of that pool run it (one of them must "
        "have advertised the kind)",
    )
    version: KindVersion | None = Field(
        default=None,
        description="pin it to this version of its kind: only services that have that version "
        "run it (null: any version)",
    )
    params: Annotated[dict[str, Any], AfterValidator(clean_params)] = Field(
        default_factory=dict, description="validated by the kind"
    )
    restart_policy: RestartPolicy | None = Field(
        default=None, description="overrides the kind's restart policy for this observer"
    )


class ObserverEdit(BaseModel):
    """New params for a paused or failed observer, as a JSON merge patch (RFC 7396)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    params: Annotated[dict[str, Any], AfterValidator(clean_params)] = Field(
        description="merged into its params: a key given replaces that key's value (an object "
        "is merged key by key), a key given as null is removed; the result is validated by "
        "the kind as a create's params are"
    )


#: Observers in one bulk create at most.
MAX_BATCH = 1000


class ObserverBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    observers: list[Any] = Field(
        min_length=1,
        max_length=MAX_BATCH,
        description="each one shaped like the body of createObserver; one that is not fails "
        "alone, with a problem of its own",
    )


class ObserverOut(BaseModel):
    id: uuid.UUID
    name: str
    kind: str
    params: dict[str, Any]
    status: ObserverStatus
    service_id: uuid.UUID | None
    epoch: int
    checkpoint: Any | None
    checkpointed_at: datetime | None
    restart_count: int
    last_error: str | None = Field(description="its last error's line")
    traceback: str | None = Field(
        default=None,
        description="that error's Python traceback, when its kind's code raised it",
    )
    restart_policy: dict[str, Any] | None
    created_at: datetime
    modified_at: datetime
    started_at: datetime | None
    output_seq: int = Field(
        default=0, description="the last seq committed of what it emitted (0: nothing yet)"
    )
    committed_at: datetime | None = Field(
        default=None, description="when its current copy last committed (progress)"
    )
    waiting: str | None = Field(
        default=None,
        description="why nobody runs it while it waits for a service able to (no live "
        "service of its pool runs its kind, or one without its kind passed it on; it starts "
        "when a service of its pool that runs the kind has room)",
    )
    pool: str = Field(default=DEFAULT_POOL, description="the pool it runs in")
    kind_version: str | None = Field(
        default=None, description="the version of its kind it is pinned to (null: any)"
    )


class ObserverPage(BaseModel):
    items: list[ObserverOut]
    limit: int
    offset: int
    next_offset: int | None


class ObserverEventOut(BaseModel):
    at: datetime
    event: str
    service_id: uuid.UUID | None
    service_name: str | None = Field(default=None, description="that service's name")
    epoch: int | None
    detail: str | None
    actor: str | None = Field(
        default=None,
        description="the name of the API token whose request did it (none: the orchestrator "
        "did it by itself, or the API runs without tokens)",
    )


class ServiceOut(BaseModel):
    id: uuid.UUID
    name: str
    worker_count: int
    running: int
    host: str
    pid: int
    version: str
    created_at: datetime
    last_heartbeat_at: datetime
    lease_expires_at: datetime
    is_deleted: bool
    draining: bool
    pool: str = Field(default=DEFAULT_POOL, description="the pool it joined")
    kinds: list[str] | None = Field(
        default=None,
        description="the kinds it runs, as it advertised them (null: a service of an earlier "
        "release, which runs every kind)",
    )
    rss_bytes: int | None = Field(
        default=None, description="its resident memory at its last renewal (null: not known)"
    )
    cpu: float | None = Field(
        default=None,
        description="its share of one core over its last renewal period (1.0: a whole core; "
        "null: not known)",
    )


class KindOut(BaseModel):
    name: str
    description: str
    params_schema: dict[str, Any] | None
    restart_policy: RestartPolicy
    services: list[str] = Field(
        default_factory=list,
        description="the live services that run it (its observers wait while there is none)",
    )
    pools: list[str] = Field(
        default_factory=list, description="the pools of the live services that run it"
    )
    version: str = Field(
        default="1", description="its version here (this manager's code, or the newest advert)"
    )
    versions: list[str] = Field(
        default_factory=list, description="the versions the live services that run it have"
    )


class PoolOut(BaseModel):
    name: str
    services: int = Field(description="its live services")
    slots: int = Field(description="the worker_count of its live services taking work")
    running: int = Field(description="the observers its live services hold")
    unheld: int = Field(
        description="its live observers nobody holds: queued for a free slot, or waiting for "
        "a service able to run them"
    )
    kinds: list[str] | None = Field(
        description="the kinds its live services run (null: one of them is of an earlier "
        "release and runs every kind)"
    )


class LeaderOut(BaseModel):
    holder: str | None
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    live: bool = False
    this_replica: str
    this_replica_leads: bool


class BatchItemOut(BaseModel):
    index: int = Field(description="its position in the request")
    status: int = Field(description="201 when created, else the status of its problem")
    observer: ObserverOut | None = None
    problem: Problem | None = Field(default=None, description="why it was not created")


class ObserverBatchOut(BaseModel):
    created: int
    failed: int
    items: list[BatchItemOut] = Field(description="one per observer asked for, in order")


class Action(StrEnum):
    """What ``POST /observers/actions`` does to each observer it selects."""

    PAUSE = "pause"
    RESUME = "resume"
    RESTART = "restart"
    DELETE = "delete"


#: The most observers one action request acts on.
MAX_ACTION = 10_000


class ObserverSelector(BaseModel):
    """Which observers (not deleted) an action takes: every condition given holds."""

    model_config = ConfigDict(extra="forbid")

    ids: list[uuid.UUID] | None = Field(default=None, min_length=1, max_length=MAX_ACTION)
    status: ObserverStatus | None = None
    kind: SafeText | None = Field(default=None, min_length=1, max_length=200)
    pool: PoolName | None = Field(default=None, description="only observers of this pool")
    name_prefix: SafeText | None = Field(default=None, min_length=1, max_length=200)

    @model_validator(mode="after")
    def _names_something(self) -> ObserverSelector:
        named = (self.ids, self.status, self.kind, self.pool, self.name_prefix)
        if all(v is None for v in named):
            raise ValueError("name the observers to act on: ids, status, kind, pool or name_prefix")
        return self


class ObserverAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Action
    selector: ObserverSelector
    limit: int = Field(
        default=1000, ge=1, le=MAX_ACTION, description="act on at most this many, oldest first"
    )


class ObserverMove(BaseModel):
    """Move observers to another pool, or pin them to a version of their kind (or unpin them):
    each running one is handed over gracefully, resumed from its checkpoint where it now
    belongs; moving them back is a rollback."""

    model_config = ConfigDict(extra="forbid")

    selector: ObserverSelector
    percent: float = Field(
        default=100,
        gt=0,
        le=100,
        description="move this share of the observers selected (the oldest first, rounded up)",
    )
    to_pool: PoolName | None = Field(default=None, description="the pool they move to")
    to_version: KindVersion | None = Field(
        default=None, description="pin them to this version of their kind"
    )
    any_version: StrictBool = Field(default=False, description="unpin them: any version runs them")
    limit: int = Field(
        default=1000, ge=1, le=MAX_ACTION, description="select at most this many, oldest first"
    )

    @model_validator(mode="after")
    def _names_a_target(self) -> ObserverMove:
        if self.to_pool is None and self.to_version is None and not self.any_version:
            raise ValueError("name where they move: to_pool, to_version or any_version")
        if self.to_version is not None and self.any_version:
            raise ValueError("to_version pins them, any_version unpins them: give one")
        return self


class ObserverMoveOut(BaseModel):
    matched: int = Field(description="observers the selector took (at most the limit)")
    moved: int = Field(description="those the move changed (the others were there already)")
    more: bool = Field(description="more observers match than the limit took")
    ids: list[uuid.UUID] = Field(description="the observers moved, oldest first")


class ActionItemOut(BaseModel):
    id: uuid.UUID
    status: int = Field(description="200 when done, else the status of its problem")
    observer: ObserverOut | None = None
    problem: Problem | None = Field(default=None, description="why it was not done")


class ObserverActionOut(BaseModel):
    matched: int = Field(description="observers the selector took (at most the limit)")
    done: int
    failed: int
    more: bool = Field(description="more observers match than the limit took")
    items: list[ActionItemOut] = Field(description="one per observer, oldest first")

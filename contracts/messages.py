"""Bodies of the broker messages (and of the outbox rows that hold them). Every body is JSON.

Two releases run side by side through a rolling upgrade, so a body is read tolerantly: a field
this release does not know is ignored, and a body names its protocol version in ``v`` (absent:
1, what releases before 0.2 wrote). This release writes ``PROTOCOL`` and reads ``READS``: the
version of the release before it, its own, and the next release's. A new field may be written
only by a release whose predecessor reads tolerantly (every release since 0.1), and a field a
reader needs must never be one that the release before it did not write
(``docs/upgrading.md``).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

#: The protocol version this release writes.
PROTOCOL = 2
#: The versions it reads: the release before it, its own, the next one.
READS = (PROTOCOL - 1, PROTOCOL, PROTOCOL + 1)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            version = data.get("v", 1)
            if version not in READS:
                raise ValueError(
                    f"protocol version {version!r}: this release reads {', '.join(map(str, READS))}"
                )
        return data

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    def to_json(self) -> dict[str, Any]:
        """The body: its protocol version, then its fields."""
        return {"v": PROTOCOL, **self.model_dump(mode="json")}


class StartMessage(Message):
    """Sent to the work queue; the one whose dispatch_id matches the row may start the observer."""

    observer_id: uuid.UUID
    dispatch_id: uuid.UUID


class CancelMessage(Message):
    """Broadcast on the control exchange: the holder of this observer stops it."""

    type: Literal["cancel"] = "cancel"
    observer_id: uuid.UUID


class DirectedStart(Message):
    """Sent to one chosen service's control queue: start this observer.

    Recovery uses it instead of the work queue, where a frozen service's free prefetch slots
    would swallow the message until the broker notices the freeze.
    """

    type: Literal["start"] = "start"
    observer_id: uuid.UUID
    dispatch_id: uuid.UUID

    @classmethod
    def of(cls, start: StartMessage) -> DirectedStart:
        return cls(observer_id=start.observer_id, dispatch_id=start.dispatch_id)

    def start(self) -> StartMessage:
        return StartMessage(observer_id=self.observer_id, dispatch_id=self.dispatch_id)


class HandoffMessage(Message):
    """Sent by the leader to a holder's control queue: hand this observer to service ``to``."""

    type: Literal["handoff"] = "handoff"
    observer_id: uuid.UUID
    to: uuid.UUID


class DrainMessage(Message):
    """Broadcast: service ``service_id`` stops taking work and hands all its observers over."""

    type: Literal["drain"] = "drain"
    service_id: uuid.UUID


class UndrainMessage(Message):
    """Broadcast: service ``service_id`` (drained) takes work again."""

    type: Literal["undrain"] = "undrain"
    service_id: uuid.UUID


AnyControl = CancelMessage | DirectedStart | HandoffMessage | DrainMessage | UndrainMessage
ControlMessage = Annotated[AnyControl, Field(discriminator="type")]
CONTROL_MESSAGE: TypeAdapter[AnyControl] = TypeAdapter(ControlMessage)

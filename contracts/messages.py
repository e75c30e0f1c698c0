"""Bodies of the broker messages. Every body is JSON; unknown fields are refused."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


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

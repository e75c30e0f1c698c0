"""Bodies of the broker messages. Every body is JSON; unknown fields are refused."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class StartMessage(_Message):
    """Sent to the work queue; the one whose dispatch_id matches the row may start the observer."""

    observer_id: uuid.UUID
    dispatch_id: uuid.UUID


class CancelMessage(_Message):
    """Broadcast on the control exchange: the holder of this observer stops it."""

    type: Literal["cancel"] = "cancel"
    observer_id: uuid.UUID


class DirectedStart(_Message):
    """Sent by the leader to one chosen service's control queue: start this observer.

    Recovery uses it instead of the work queue, where a frozen service's free prefetch slots
    would swallow the message until the broker notices the freeze.
    """

    type: Literal["start"] = "start"
    observer_id: uuid.UUID
    dispatch_id: uuid.UUID


ControlMessage = Annotated[CancelMessage | DirectedStart, Field(discriminator="type")]
CONTROL_MESSAGE: TypeAdapter[CancelMessage | DirectedStart] = TypeAdapter(ControlMessage)

"""Bodies of the broker messages. Every body is JSON; unknown fields are refused."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict


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


ControlMessage = CancelMessage

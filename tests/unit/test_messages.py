"""Broker message bodies across two releases: read tolerantly, written as the release before
reads them (``contracts/messages.py``)."""

from __future__ import annotations

import json
import uuid

import pytest
from pydantic import ValidationError

from contracts.messages import (
    CONTROL_MESSAGE,
    READS,
    CancelMessage,
    DirectedStart,
    DrainMessage,
    HandoffMessage,
    Message,
    StartMessage,
    UndrainMessage,
)

A, B = uuid.uuid4(), uuid.uuid4()

#: What the release before this one reads of each body, and refuses anything else: this
#: release writes exactly these keys.
BEFORE: dict[type[Message], set[str]] = {
    StartMessage: {"observer_id", "dispatch_id"},
    CancelMessage: {"type", "observer_id"},
    DirectedStart: {"type", "observer_id", "dispatch_id"},
    HandoffMessage: {"type", "observer_id", "to"},
    DrainMessage: {"type", "service_id"},
    UndrainMessage: {"type", "service_id"},
}

SAMPLES: list[Message] = [
    StartMessage(observer_id=A, dispatch_id=B),
    CancelMessage(observer_id=A),
    DirectedStart(observer_id=A, dispatch_id=B),
    HandoffMessage(observer_id=A, to=B),
    DrainMessage(service_id=A),
    UndrainMessage(service_id=A),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_what_this_release_writes_the_release_before_reads(message: Message) -> None:
    assert set(json.loads(message.to_bytes())) == BEFORE[type(message)]


def test_a_newer_body_with_fields_unknown_here_is_read() -> None:
    body = {"v": 2, "observer_id": str(A), "dispatch_id": str(B), "pool": "eu"}
    assert StartMessage.model_validate_json(json.dumps(body)) == SAMPLES[0]
    control = {"v": 2, "type": "cancel", "observer_id": str(A), "reason": "deleted"}
    assert CONTROL_MESSAGE.validate_json(json.dumps(control)) == CancelMessage(observer_id=A)


def test_versions_beyond_the_next_release_are_refused() -> None:
    assert READS == (1, 2)
    body = {"observer_id": str(A), "dispatch_id": str(B)}
    assert StartMessage.model_validate(body) == StartMessage.model_validate({**body, "v": 1})
    with pytest.raises(ValidationError, match="protocol version 3"):
        StartMessage.model_validate({**body, "v": 3})


def test_a_control_message_of_a_type_unknown_here_is_refused_not_guessed() -> None:
    with pytest.raises(ValidationError):
        CONTROL_MESSAGE.validate_json(json.dumps({"v": 2, "type": "reshard", "pool": "eu"}))

"""Broker message bodies across two releases: read tolerantly, written as the release before
reads them (``contracts/messages.py``); each body this release writes is read by the previous
release's own code."""

from __future__ import annotations

import json
import uuid

import pytest
from pydantic import ValidationError

from orch_contracts.messages import (
    CONTROL_MESSAGE,
    PROTOCOL,
    READS,
    CancelMessage,
    DirectedStart,
    DrainMessage,
    HandoffMessage,
    Message,
    StartMessage,
    UndrainMessage,
)
from tests.support.releases import previous_module

A, B = uuid.uuid4(), uuid.uuid4()

#: What the release before this one reads of each body (it ignores other keys): this release
#: writes these keys, and its protocol version.
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
    body = json.loads(message.to_bytes())
    assert set(body) == BEFORE[type(message)] | {"v"}
    assert body["v"] == PROTOCOL
    assert body == message.to_json()


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_the_previous_release_reads_every_body_this_one_writes(message: Message) -> None:
    """Its own ``contracts/messages.py``, from the repository's history, parses each body."""
    old = previous_module("contracts/messages.py")
    read = (
        old.StartMessage.model_validate_json(message.to_bytes())
        if isinstance(message, StartMessage)
        else old.CONTROL_MESSAGE.validate_json(message.to_bytes())
    )
    assert read.model_dump(mode="json") == message.model_dump(mode="json")


def test_a_newer_body_with_fields_unknown_here_is_read() -> None:
    body = {"v": 2, "observer_id": str(A), "dispatch_id": str(B), "pool": "eu"}
    assert StartMessage.model_validate_json(json.dumps(body)) == SAMPLES[0]
    control = {"v": 2, "type": "cancel", "observer_id": str(A), "reason": "deleted"}
    assert CONTROL_MESSAGE.validate_json(json.dumps(control)) == CancelMessage(observer_id=A)


def test_versions_beyond_the_next_release_are_refused() -> None:
    assert READS == (1, 2, 3)
    body = {"observer_id": str(A), "dispatch_id": str(B)}
    assert StartMessage.model_validate(body) == StartMessage.model_validate({**body, "v": 1})
    assert StartMessage.model_validate({**body, "v": 3}) == StartMessage.model_validate(body)
    with pytest.raises(ValidationError, match="protocol version 4"):
        StartMessage.model_validate({**body, "v": 4})


def test_a_control_message_of_a_type_unknown_here_is_refused_not_guessed() -> None:
    with pytest.raises(ValidationError):
        CONTROL_MESSAGE.validate_json(json.dumps({"v": 2, "type": "reshard", "pool": "eu"}))

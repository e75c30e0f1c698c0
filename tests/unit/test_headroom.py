"""The process's own resources (``observer_service/headroom.py``): told apart from a kind's
errors, and room counted in descriptors as well as slots."""

from __future__ import annotations

import errno

import httpx

from observer_service.headroom import COOLDOWN, Headroom, resource_error


def test_the_process_running_out_is_told_apart_from_the_kinds_own_errors() -> None:
    assert resource_error(OSError(errno.EMFILE, "Too many open files"))
    assert resource_error(MemoryError())
    assert not resource_error(OSError(errno.ECONNREFUSED, "refused"))
    assert not resource_error(ValueError("bad"))
    # As a client library hands it on: wrapped, the OSError its cause.
    wrapped = httpx.ConnectError("All connection attempts failed")
    wrapped.__cause__ = OSError(errno.EMFILE, "Too many open files")
    assert resource_error(wrapped)


def test_no_room_near_the_descriptor_limit_nor_for_a_while_after_a_resource_error() -> None:
    now = [0.0]
    used = [50]
    room = Headroom(lambda: now[0], count=lambda: used[0], limit=lambda: 128)
    assert room.ok()
    used[0] = 100  # within the reserve of 32
    now[0] += 1
    assert not room.ok()
    assert "RLIMIT_NOFILE" in room.why()
    used[0] = 40
    now[0] += 1
    assert room.ok()
    room.exhausted()
    assert not room.ok()
    now[0] += COOLDOWN
    assert room.ok()
    assert room.tell()
    assert not room.tell(), "told once a cooldown"

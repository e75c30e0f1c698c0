"""The AMQP frames of output messages, encoded in one pass, and their publish with confirms.

A service publishes one message per record (``contracts/outputs.py``), tens of thousands a
second. Through aio-pika each publish waits, under the channel's lock, for its frames to reach
the socket, and pamqp encodes every property table anew: about 400 µs a record on a busy event
loop. Here the frames of a whole round are encoded together (what a commit's records share,
once), written to the connection as one chunk, and their confirms awaited together.

The frames are those of AMQP 0-9-1 ``basic.publish``: a method frame, a content header with
the properties ``content-type``, ``headers``, ``delivery-mode``, ``message-id`` and
``timestamp`` (the commit's second), and the
body in frames of at most ``frame_max``.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Iterator
from typing import Any

from aiormq.abc import ChannelFrame
from aiormq.channel import Channel

from orch_contracts.outputs import (
    COMMITTED_AT,
    CONTENT_TYPE,
    EPOCH,
    KIND,
    NAME,
    OBSERVER_ID,
    SEQ,
    Committed,
    message_id,
)

_METHOD, _HEADER, _BODY = 1, 2, 3
_FRAME = struct.Struct(">BHI")
_END = b"\xce"
_BASIC = 60
_PUBLISH = struct.Struct(">HHH")  # class, method (basic.publish = 40), reserved
_CONTENT = struct.Struct(">HHQH")  # class, weight, body size, property flags
#: content-type, headers, delivery-mode, message-id, timestamp (AMQP 0-9-1 property bits).
_FLAGS = 1 << 15 | 1 << 13 | 1 << 12 | 1 << 7 | 1 << 6
_PERSISTENT = b"\x02"
_LONG = struct.Struct(">I")
_INT64 = struct.Struct(">q")
_UINT64 = struct.Struct(">Q")


def _short(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError(f"an AMQP short string is at most 255 bytes: {text[:40]!r}…")
    return bytes((len(raw),)) + raw


def _text_field(key: str, value: str) -> bytes:
    raw = value.encode()
    return _short(key) + b"S" + _LONG.pack(len(raw)) + raw


def _int_field(key: str, value: int) -> bytes:
    return _short(key) + b"l" + _INT64.pack(value)


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _FRAME.pack(kind, channel, len(payload)) + payload + _END


class OutputFrames:
    """Encodes output messages for one channel (its number and largest body frame)."""

    def __init__(self, *, channel: int, max_body: int, exchange: str) -> None:
        self.channel = channel
        # A frame_max of 0 (no limit) gives aiormq's max_content_size as -8.
        self.max_body = max_body if max_body > 0 else 1 << 31
        self._exchange = _short(exchange)
        self._content_type = _short(CONTENT_TYPE)

    def messages(self, commits: Iterable[Committed]) -> Iterator[bytes]:
        """The frames of every record of these commits, one message's worth each, in order."""
        for c in commits:
            method = _frame(
                _METHOD,
                self.channel,
                _PUBLISH.pack(_BASIC, 40, 0) + self._exchange + _short(c.kind) + b"\x00",
            )
            shared = b"".join(
                (
                    _text_field(OBSERVER_ID, str(c.observer_id)),
                    _int_field(EPOCH, c.epoch),
                    _text_field(KIND, c.kind),
                    _text_field(NAME, c.name),
                    # As text: AMQP tables carry a float in 32 bits (``Output.headers``).
                    _text_field(COMMITTED_AT, f"{c.committed_at:.6f}"),
                )
            )
            stamp = _UINT64.pack(int(c.committed_at))
            for i, record in enumerate(c.records):
                seq = c.seq + i
                table = shared + _int_field(SEQ, seq)
                body = record.encode()
                header = _frame(
                    _HEADER,
                    self.channel,
                    _CONTENT.pack(_BASIC, 0, len(body), _FLAGS)
                    + self._content_type
                    + _LONG.pack(len(table))
                    + table
                    + _PERSISTENT
                    + _short(message_id(c.observer_id, seq))
                    + stamp,
                )
                yield method + header + self._body(body)

    def _body(self, body: bytes) -> bytes:
        step = self.max_body
        return b"".join(
            _frame(_BODY, self.channel, body[i : i + step]) for i in range(0, len(body), step)
        )


async def publish_confirmed(
    raw: Channel, frames: OutputFrames, commits: Iterable[Committed]
) -> list[Any]:
    """Write every message of ``commits`` on the aiormq channel ``raw`` (publisher confirms on)
    as one chunk, and return each message's confirm frame (or the exception it raised).

    The messages get the channel's next delivery tags under its lock, registered only once
    the chunk is queued for the socket: a cancellation before that sends and registers
    nothing, so the channel's tags stay in step with what the broker saw."""
    messages = list(frames.messages(commits))
    if not messages:
        return []
    async with raw.lock:
        drained = raw.create_future()
        await raw.write_queue.put(
            ChannelFrame(payload=b"".join(messages), should_close=False, drain_future=drained)
        )
        confirms = []
        for _ in messages:
            raw.delivery_tag += 1
            confirm = raw.create_future()
            raw.confirmations[raw.delivery_tag] = confirm
            confirms.append(confirm)
    await drained
    return await asyncio.gather(*confirms, return_exceptions=True)

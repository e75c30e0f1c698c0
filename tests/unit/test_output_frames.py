"""The output messages' frames, read back by pamqp (the AMQP library aiormq itself uses): what
a consumer gets is what ``Output`` says, record by record, whatever the body's size."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from pamqp import commands, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from orch_contracts.output_frames import OutputFrames
from orch_contracts.outputs import CONTENT_TYPE, Committed, Output


def _read(data: bytes) -> list[Any]:
    frames = []
    while data:
        consumed, channel, value = frame.unmarshal(data)
        assert channel == 7
        frames.append(value)
        data = data[consumed:]
    return frames


def _messages(data: bytes) -> list[tuple[commands.Basic.Publish, ContentHeader, bytes]]:
    out: list[tuple[commands.Basic.Publish, ContentHeader, bytes]] = []
    frames = _read(data)
    while frames:
        method, header = frames.pop(0), frames.pop(0)
        assert isinstance(method, commands.Basic.Publish)
        assert isinstance(header, ContentHeader)
        body = b""
        while len(body) < header.body_size:
            part = frames.pop(0)
            assert isinstance(part, ContentBody)
            body += part.value
        out.append((method, header, body))
    return out


def test_every_record_is_one_message_with_its_id_headers_and_body() -> None:
    observer = uuid.uuid4()
    records = (json.dumps({"n": 1}), json.dumps({"n": "é" * 3}), json.dumps([1, 2, 3]))
    commit = Committed(observer, 41, 3, "ws_feed", "btc/usd", 1796252515.985805, records)
    frames = OutputFrames(channel=7, max_body=131_064, exchange="p.outputs")
    data = b"".join(frames.messages([commit]))
    got = _messages(data)
    assert len(got) == 3
    for i, (method, header, body) in enumerate(got):
        assert (method.exchange, method.routing_key) == ("p.outputs", "ws_feed")
        assert not method.mandatory
        assert not method.immediate
        props = header.properties
        assert props.content_type == CONTENT_TYPE
        assert props.delivery_mode == 2
        assert props.message_id == f"{observer}:{41 + i}"
        assert props.timestamp == datetime.fromtimestamp(1796252515, tz=UTC)
        assert body == records[i].encode()
        out = Output.from_message(body, dict(props.headers or {}))
        expected = Output(observer, 41 + i, 3, "ws_feed", "btc/usd", 1796252515.985805, None)
        assert out == Output(**{**expected.__dict__, "record": json.loads(records[i])})
        assert out.headers() == {k: _plain(v) for k, v in (props.headers or {}).items()}


def _plain(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def test_a_body_larger_than_a_frame_is_split_and_read_back_whole() -> None:
    big = json.dumps("x" * 10_000)
    commit = Committed(uuid.uuid4(), 1, 1, "k", "n", 1.0, (big, "1"))
    frames = OutputFrames(channel=7, max_body=4096, exchange="e")
    data = b"".join(frames.messages([commit]))
    bodies = [body for _, _, body in _messages(data)]
    assert bodies == [big.encode(), b"1"]
    assert sum(isinstance(f, ContentBody) for f in _read(data)) == 3 + 1


def test_several_commits_keep_their_order() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    commits = [
        Committed(a, 1, 1, "k", "a", 1.0, ("1", "2")),
        Committed(b, 9, 2, "k", "b", 2.0, ("3",)),
        Committed(a, 3, 1, "k", "a", 3.0, ("4",)),
    ]
    frames = OutputFrames(channel=7, max_body=131_064, exchange="e")
    ids = [h.properties.message_id for _, h, _ in _messages(b"".join(frames.messages(commits)))]
    assert ids == [f"{a}:1", f"{a}:2", f"{b}:9", f"{a}:3"]


def test_a_broker_without_a_frame_limit_gets_each_body_in_one_frame() -> None:
    commit = Committed(uuid.uuid4(), 1, 1, "k", "n", 1.0, ('"a"', '"b"'))
    frames = OutputFrames(channel=7, max_body=0 - 8, exchange="e")  # frame_max 0: no limit
    assert [body for _, _, body in _messages(b"".join(frames.messages([commit])))] == [
        b'"a"',
        b'"b"',
    ]

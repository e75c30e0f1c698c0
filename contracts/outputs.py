"""What an observer emits, as it travels downstream: the message format both sides agree on.

A kind stages records with ``await ctx.emit(record)``; ``await ctx.checkpoint(state)`` commits
the state and every record staged since the last commit in one write fenced by the copy's
epoch. Each committed record gets ``seq``, rising by one per observer across all its copies.
Committed records wait in the outbox table ``observer_outputs`` until they are published to the
durable topic exchange ``<prefix>.outputs`` (``Topology.outputs_exchange``) and confirmed.

One message per record:

- routing key: the kind's name;
- body: the record as JSON (``application/json``);
- ``message_id``: ``"<observer_id>:<seq>"`` (``message_id``), the same on every retry;
- headers (``HEADERS``): ``observer_id``, ``seq``, ``epoch`` (of the copy that committed it),
  ``kind``, ``name`` and ``committed_at`` (epoch seconds as a decimal string,
  ``"1796252515.985805"``: an AMQP table carries a float in 32 bits);
- persistent, published with publisher confirms.

Per observer, records are published in ``seq`` order; a retry may repeat a ``message_id``,
never reorder or skip one. A consumer drops repeats by ``message_id`` and sees a gap as a
``seq`` that skips (``contracts/reader.py``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

#: The header names every output message carries.
OBSERVER_ID, SEQ, EPOCH, KIND, NAME, COMMITTED_AT = (
    "observer_id",
    "seq",
    "epoch",
    "kind",
    "name",
    "committed_at",
)
HEADERS = (OBSERVER_ID, SEQ, EPOCH, KIND, NAME, COMMITTED_AT)
CONTENT_TYPE = "application/json"
#: The largest record ``emit`` accepts, as JSON bytes.
MAX_RECORD_BYTES = 1024 * 1024


class RecordTooLarge(ValueError):
    """``emit`` of a record over ``MAX_RECORD_BYTES`` as JSON (the service and ``orch.testing``
    raise it alike)."""


def check_record(text: str) -> str:
    """A record's JSON text, or RecordTooLarge."""
    if len(text.encode()) > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"a record is at most {MAX_RECORD_BYTES} bytes as JSON")
    return text


def message_id(observer_id: uuid.UUID | str, seq: int) -> str:
    return f"{observer_id}:{seq}"


@dataclass(frozen=True)
class Output:
    """One committed record, as a consumer receives it."""

    observer_id: uuid.UUID
    seq: int
    epoch: int
    kind: str
    name: str
    committed_at: float
    record: Any

    @property
    def message_id(self) -> str:
        return message_id(self.observer_id, self.seq)

    def headers(self) -> dict[str, Any]:
        return {
            OBSERVER_ID: str(self.observer_id),
            SEQ: self.seq,
            EPOCH: self.epoch,
            KIND: self.kind,
            NAME: self.name,
            # As text: AMQP tables carry a float in 32 bits (a minute's precision in 2026).
            COMMITTED_AT: f"{self.committed_at:.6f}",
        }

    @classmethod
    def from_message(cls, body: bytes, headers: dict[str, Any]) -> Output:
        """Parse a received message; ValueError when it is not an output message."""
        try:
            return cls(
                observer_id=uuid.UUID(str(headers[OBSERVER_ID])),
                seq=int(headers[SEQ]),
                epoch=int(headers[EPOCH]),
                kind=_text(headers[KIND]),
                name=_text(headers[NAME]),
                committed_at=float(_text(headers[COMMITTED_AT])),
                record=orjson.loads(body),
            )
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"not an output message: {exc}") from exc


@dataclass(frozen=True)
class Committed:
    """One commit's records (JSON texts), holding ``seq`` onwards, as the outbox keeps them
    until the broker confirmed every one (``observer_outputs``)."""

    observer_id: uuid.UUID
    seq: int
    epoch: int
    kind: str
    name: str
    committed_at: float
    records: tuple[str, ...]

    @property
    def key(self) -> tuple[uuid.UUID, int]:
        return (self.observer_id, self.seq)

    @property
    def last_seq(self) -> int:
        return self.seq + len(self.records) - 1

    def outputs(self) -> list[Output]:
        """One message's worth each (the records parsed): what a consumer receives."""
        return [
            Output(
                self.observer_id,
                self.seq + i,
                self.epoch,
                self.kind,
                self.name,
                self.committed_at,
                orjson.loads(r),
            )
            for i, r in enumerate(self.records)
        ]

    @classmethod
    def from_row(cls, r: Any) -> Committed:
        """An ``observer_outputs`` row (``records`` as JSON text, ``committed_at`` as epoch
        seconds): its records' texts, one each."""
        records = tuple(orjson.dumps(x).decode() for x in orjson.loads(r["records"]))
        return cls(
            r["observer_id"], r["seq"], r["epoch"], r["kind"], r["name"], r["committed_at"], records
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

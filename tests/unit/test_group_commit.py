"""Group commit of single creates (manager/intake.py): a lone create is written at once and
alone; creates that arrive while a write is in flight share the next write and its publish;
each gets its own answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from orch_contracts.errors import DatabaseUnavailable, NameTaken
from orch_manager.intake import GroupCommit
from orch_manager.outbox import Pending
from orch_manager.repository import NewObserver


class Store:
    """Writes rows as CREATE_MANY does (a live name is taken once), slowly when asked."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.writes: list[list[str]] = []
        self.published: list[int] = []
        self.gate: asyncio.Event | None = None
        self.fail: BaseException | None = None

    async def write(
        self, new: Sequence[NewObserver]
    ) -> tuple[list[dict[str, Any] | None], list[Pending]]:
        self.writes.append([n.name for n in new])
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        rows: list[dict[str, Any] | None] = []
        for n in new:
            if n.name in self.names:
                rows.append(None)
            else:
                self.names.add(n.name)
                rows.append({"name": n.name})
        return rows, []

    async def publish(self, pending: Sequence[Pending]) -> None:
        self.published.append(len(self.writes))


Start = Callable[..., GroupCommit]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Group commits with their writer running (as the manager's runtime runs it)."""
    tasks: list[asyncio.Task[None]] = []

    def make(store: Store, **kw: Any) -> GroupCommit:
        commit = GroupCommit(store.write, store.publish, **kw)
        tasks.append(asyncio.create_task(commit.run()))
        return commit

    yield make
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _turns() -> None:
    """A few turns of the loop: the tasks just made have run as far as they can."""
    for _ in range(3):
        await asyncio.sleep(0)


def _new(name: str) -> NewObserver:
    return NewObserver(name, "ticker", {}, None)


async def test_a_lone_create_is_written_at_once_and_alone(start: Start) -> None:
    store = Store()
    commit = start(store)
    assert await commit.create(_new("a")) == {"name": "a"}
    assert store.writes == [["a"]]
    assert store.published == [1], "published once it was written"


async def test_creates_arriving_during_a_write_share_the_next_one(start: Start) -> None:
    store = Store()
    commit = start(store)
    store.gate = asyncio.Event()
    first = asyncio.create_task(commit.create(_new("first")))
    await _turns()
    assert store.writes == [["first"]]
    rest = [asyncio.create_task(commit.create(_new(f"n{i}"))) for i in range(50)]
    await _turns()
    store.gate.set()
    rows = await asyncio.gather(first, *rest)
    assert [r["name"] for r in rows] == ["first"] + [f"n{i}" for i in range(50)]
    assert store.writes == [["first"], [f"n{i}" for i in range(50)]]
    assert commit.writes == 2
    assert commit.creates == 51


async def test_a_taken_name_fails_alone_and_a_name_twice_in_a_write_stands_once(
    start: Start,
) -> None:
    store = Store()
    store.names.add("old")
    commit = start(store)
    store.gate = asyncio.Event()
    blocker = asyncio.create_task(commit.create(_new("x")))
    await _turns()
    tasks = [asyncio.create_task(commit.create(_new(n))) for n in ("old", "dup", "dup", "ok")]
    await _turns()
    store.gate.set()
    results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
    assert results[0] == {"name": "x"}
    assert isinstance(results[1], NameTaken)
    assert results[2] == {"name": "dup"}
    assert isinstance(results[3], NameTaken)
    assert results[4] == {"name": "ok"}
    assert store.writes[1] == ["old", "dup", "ok"], "the second 'dup' never reached the table"


async def test_an_error_of_the_write_is_every_waiting_requests_error(start: Start) -> None:
    store = Store()
    store.fail = DatabaseUnavailable("down")
    commit = start(store)
    results = await asyncio.gather(
        *(commit.create(_new(f"n{i}")) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, DatabaseUnavailable) for r in results)
    store.fail = None
    assert await commit.create(_new("later")) == {"name": "later"}, "the next write goes on"


async def test_a_write_carries_at_most_its_limit(start: Start) -> None:
    store = Store()
    commit = start(store, most=10)
    store.gate = asyncio.Event()
    store.gate.set()
    await asyncio.gather(*(commit.create(_new(f"n{i}")) for i in range(25)))
    assert [len(w) for w in store.writes] == [10, 10, 5]


@pytest.mark.parametrize("n", [200])
async def test_concurrent_creates_of_one_name_give_exactly_one_row(start: Start, n: int) -> None:
    store = Store()
    commit = start(store)
    results = await asyncio.gather(
        *(commit.create(_new("same")) for _ in range(n)), return_exceptions=True
    )
    assert sum(1 for r in results if isinstance(r, dict)) == 1
    assert sum(1 for r in results if isinstance(r, NameTaken)) == n - 1

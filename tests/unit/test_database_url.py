"""Database URLs with several hosts: both forms read, one kept, each driver given its own."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from orch_contracts import database_url as dburl
from orch_contracts.settings import CommonSettings, asyncpg_dsn, on_database

LIBPQ = "postgresql://u:pw@h1:5432,h2:5442/db?target_session_attrs=read-write"
SQLA = "postgresql://u:pw@/db?host=h1:5432&host=h2:5442&target_session_attrs=read-write"
CANONICAL = (
    "postgresql+asyncpg://u:pw@/db?host=h1%3A5432&host=h2%3A5442&target_session_attrs=read-write"
)


@pytest.mark.parametrize(
    "given",
    [
        LIBPQ,
        SQLA,
        "postgresql+asyncpg://u:pw@/db?host=h1,h2&port=5432,5442&target_session_attrs=read-write",
        "postgres://u:pw@h1:5432,h2:5442/db?target_session_attrs=read-write",
    ],
)
def test_both_multi_host_forms_become_one(given: str) -> None:
    settings = CommonSettings(database_url=given)
    assert settings.database_url == CANONICAL
    assert settings.asyncpg_dsn == LIBPQ
    assert settings.url.query["host"] == ("h1:5432", "h2:5442")
    assert dburl.hosts(given) == [("h1", 5432), ("h2", 5442)]


def test_the_canonical_form_is_stable_and_read_by_sqlalchemy() -> None:
    assert dburl.normalize(CANONICAL) == CANONICAL
    assert make_url(CANONICAL).query["host"] == ("h1:5432", "h2:5442")
    engine = create_async_engine(CANONICAL)
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    assert kwargs["host"] == ["h1", "h2"]
    assert kwargs["port"] == [5432, 5442]
    assert kwargs["target_session_attrs"] == "read-write"


def test_a_host_without_a_port_gets_the_default_one() -> None:
    settings = CommonSettings(database_url="postgresql://u@h1,h2:6000/db")
    assert settings.asyncpg_dsn == "postgresql://u@h1:5432,h2:6000/db"


def test_one_host_stays_in_the_authority() -> None:
    for given in ("postgresql://u@h:5433/db", "postgresql://u@/db?host=h:5433"):
        settings = CommonSettings(database_url=given)
        assert settings.database_url == "postgresql+asyncpg://u@h:5433/db"
        assert settings.asyncpg_dsn == "postgresql://u@h:5433/db"
    assert asyncpg_dsn("postgresql://u@[::1]:5432/db") == "postgresql://u@[::1]:5432/db"
    socket_dir = CommonSettings(database_url="postgresql://u@/db?host=/run/postgresql")
    assert make_url(socket_dir.asyncpg_dsn).query["host"] == "/run/postgresql"


def test_another_database_keeps_every_host_and_the_password() -> None:
    other = on_database(LIBPQ, "postgres")
    assert other == CANONICAL.replace("/db?", "/postgres?")
    assert asyncpg_dsn(other) == LIBPQ.replace("/db?", "/postgres?")
    assert on_database("postgresql://u:p%40ss@h:1/db", "x") == "postgresql+asyncpg://u:p%40ss@h:1/x"
    assert asyncpg_dsn(on_database("postgresql://u:p%40ss@a:1,b:2/db", "x")) == (
        "postgresql://u:p%40ss@a:1,b:2/x"
    )


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("postgresql://u:hunter2@h1:5432,h2:x/db", "port"),
        ("postgresql://u:hunter2@h1:5432,,h2/db", "empty host"),
        ("postgresql://u:hunter2@h0/db?host=h1:1&host=h2:2", "both"),
        ("postgresql://u:hunter2@/db?host=h1,h2,h3&port=1,2", "number of hosts"),
        ("postgresql://u:hunter2@[::1]:5432,h2:5432/db", "IPv6"),
        ("mysql://u:hunter2@h/db", "postgresql://"),
        ("postgresql://u@h/db?password=hunter2&host=a:1&host=b:2&port=3", "port="),
    ],
)
def test_bad_urls_say_why_and_never_print_the_password(given: str, why: str) -> None:
    with pytest.raises(ValidationError, match="ORCH_DATABASE_URL must look like") as info:
        CommonSettings(database_url=given)
    assert why in str(info.value)
    assert "hunter2" not in str(info.value)


def test_each_host_is_a_dsn_of_its_own() -> None:
    assert dburl.each_host(LIBPQ) == [
        "postgresql://u:pw@h1:5432/db?target_session_attrs=read-write",
        "postgresql://u:pw@h2:5442/db?target_session_attrs=read-write",
    ]
    assert dburl.each_host("postgresql://u@h/db") == ["postgresql://u@h:5432/db"]


async def test_connect_tries_the_next_host_whatever_the_first_one_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncpg gives up at a host that answers with an error; libpq (and we) go on."""
    import asyncpg

    from orch_contracts import pgconnect

    tried: list[str] = []

    async def fake_connect(dsn: str, **kwargs: object) -> str:
        tried.append(dsn)
        if "h1" in dsn:
            raise asyncpg.CannotConnectNowError("the database system is starting up")
        if "h2" in dsn:
            raise ConnectionRefusedError
        return "conn"

    monkeypatch.setattr(asyncpg, "connect", fake_connect)
    three = "postgresql://u@h1:1,h2:2,h3:3/db?target_session_attrs=read-write"
    assert await pgconnect.connect(three, timeout=1) == "conn"
    assert [d.split("@")[1].split("/")[0] for d in tried] == ["h1:1", "h2:2", "h3:3"]
    with pytest.raises(ConnectionRefusedError):
        await pgconnect.connect("postgresql://u@h1:1,h2:2/db")

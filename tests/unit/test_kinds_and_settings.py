"""The kind registry, params validation, restart policy and settings validation."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from contracts.kinds import (
    InvalidParams,
    KindLoadError,
    RestartPolicy,
    UnknownKind,
    get_kind,
    load_kinds,
    observer_kind,
)
from contracts.settings import CommonSettings
from observer_service.context import ObserverContext
from observer_service.errors import Fenced
from observer_service.runner import run_with_restarts
from observer_service.settings import ServiceSettings


def test_builtin_kinds_load_and_validate() -> None:
    kinds = load_kinds()
    assert {"ticker", "http_poll", "recorder"} <= set(kinds)
    assert kinds["ticker"].validate_params({}) == {"interval": 1.0}
    with pytest.raises(InvalidParams, match="interval"):
        kinds["ticker"].validate_params({"interval": "soon"})
    with pytest.raises(InvalidParams, match="url"):
        kinds["http_poll"].validate_params({})
    with pytest.raises(UnknownKind, match=r"known kinds: .*ticker"):
        get_kind(kinds, "nope")


def test_unknown_module_is_one_clear_error() -> None:
    with pytest.raises(KindLoadError, match=r"cannot import kind module .no\.such\.module."):
        load_kinds(["no.such.module"])


def test_class_kinds_register() -> None:
    class P(BaseModel):
        x: int

    @observer_kind("unit_class_kind", params=P)
    class K:
        """A class kind."""

        async def run(self, ctx: Any) -> None:
            ctx.seen = True

    spec = load_kinds()["unit_class_kind"]
    assert spec.description == "A class kind."
    ctx = type("C", (), {})()
    asyncio.run(spec.run(ctx))
    assert ctx.seen is True


def test_settings_refuse_bad_urls_and_timings() -> None:
    with pytest.raises(ValidationError, match="ORCH_DATABASE_URL must look like"):
        CommonSettings(database_url="mysql://x")
    with pytest.raises(ValidationError, match="ORCH_AMQP_URL must look like"):
        CommonSettings(amqp_url="http://x")
    with pytest.raises(ValidationError, match="shorter than ORCH_LEASE_TTL"):
        ServiceSettings(lease_ttl=2, renew_interval=1.5, fence_margin=1)
    s = ServiceSettings(lease_ttl=5)
    assert (s.renew_every, s.margin) == (1.0, 1.0)
    assert CommonSettings(database_url="postgresql://u@h/db").asyncpg_dsn == "postgresql://u@h/db"


def _ctx(valid: bool = True) -> ObserverContext:
    async def write(*_: Any) -> None:
        return None

    return ObserverContext(
        observer_id=uuid.uuid4(),
        name="n",
        kind="k",
        epoch=1,
        service_id=uuid.uuid4(),
        params={},
        last_checkpoint=None,
        write_checkpoint=write,
        lease_valid=lambda: valid,
    )


async def test_restart_policy_restarts_then_gives_up() -> None:
    calls: list[str] = []
    restarts: list[float] = []

    async def failing(ctx: Any) -> None:
        calls.append("run")
        raise ValueError("nope")

    spec = type("S", (), {"run": staticmethod(failing)})()
    policy = RestartPolicy(max_restarts=3, base_delay=0.01, max_delay=0.02)

    async def on_restart(err: str, delay: float) -> None:
        assert "ValueError: nope" in err
        restarts.append(delay)

    error = await run_with_restarts(spec, _ctx(), policy, on_restart)  # type: ignore[arg-type]
    assert error == "ValueError: nope"
    assert len(calls) == 4
    assert len(restarts) == 3
    assert all(0 <= d <= 0.02 + 0.01 for d in restarts)


async def test_fenced_is_never_retried() -> None:
    async def fenced(ctx: Any) -> None:
        raise Fenced("stale")

    spec = type("S", (), {"run": staticmethod(fenced)})()

    async def on_restart(err: str, delay: float) -> None:
        raise AssertionError("retried a fenced observer")

    with pytest.raises(Fenced):
        await run_with_restarts(spec, _ctx(), RestartPolicy(), on_restart)  # type: ignore[arg-type]


async def test_context_refuses_to_continue_without_a_lease() -> None:
    from observer_service.errors import LeaseLost

    ctx = _ctx(valid=False)
    with pytest.raises(LeaseLost):
        await ctx.sleep(0)
    with pytest.raises(LeaseLost):
        await ctx.checkpoint({"x": 1})

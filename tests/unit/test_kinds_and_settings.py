"""The kind registry, params validation, restart policy and settings validation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from observer_service.context import ObserverContext
from observer_service.settings import ServiceSettings
from orch_contracts.errors import InvalidParams, LeaseLost, UnknownKind
from orch_contracts.kinds import (
    KindLoadError,
    RestartPolicy,
    get_kind,
    load_kinds,
    observer_kind,
)
from orch_contracts.settings import CommonSettings


def test_recorder_is_registered_only_when_asked_for() -> None:
    """It writes files wherever a caller says: no deployment gets it by default."""
    code = (
        "import sys; from orch_contracts.kinds import load_kinds; "
        "print(sorted(load_kinds(sys.argv[1:])))"
    )
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "['http_poll', 'ticker', 'websocket']"
    asked = subprocess.run(
        [sys.executable, "-c", code, "observer_service.kinds.recorder"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "'recorder'" in asked.stdout


def test_builtin_kinds_load_and_validate() -> None:
    kinds = load_kinds()
    assert {"ticker", "http_poll"} <= set(kinds)
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
    assert (s.lease_timings.renew_interval, s.lease_timings.margin) == (1.0, 1.0)
    assert CommonSettings(database_url="postgresql://u@h/db").asyncpg_dsn == "postgresql://u@h/db"


def test_fence_margin_must_be_positive_and_timings_fit_the_heartbeat() -> None:
    with pytest.raises(ValidationError, match="fence_margin"):
        CommonSettings(fence_margin=0)
    with pytest.raises(ValidationError, match="shorter than ORCH_AMQP_HEARTBEAT"):
        CommonSettings(lease_ttl=60, amqp_heartbeat=5)
    assert CommonSettings(lease_ttl=60, renew_interval=2, fence_margin=1, amqp_heartbeat=5)


def test_settings_errors_never_print_a_password() -> None:
    with pytest.raises(ValidationError) as info:
        CommonSettings(database_url="mysql://user:hunter2@db/x")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValidationError) as info:
        CommonSettings(amqp_url="http://user:hunter2@mq/")
    assert "hunter2" not in str(info.value)


def test_restart_policy_bounds_and_delays() -> None:
    with pytest.raises(ValidationError):
        RestartPolicy(base_delay=0)
    with pytest.raises(ValidationError):
        RestartPolicy(max_restarts=1_000_000)
    with pytest.raises(ValidationError, match="at least base_delay"):
        RestartPolicy(base_delay=10, max_delay=1)
    p = RestartPolicy(base_delay=1, max_delay=8)
    assert [round(p.delay(n)) for n in (1, 2, 3, 4, 10)] <= [2, 3, 5, 9, 9]
    assert all(p.delay(n) >= min(8, 2 ** (n - 1)) for n in range(1, 12))


def test_a_kind_registered_twice_from_different_code_is_refused() -> None:
    async def one(ctx: Any) -> None: ...

    async def two(ctx: Any) -> None: ...

    observer_kind("unit_twice")(one)
    observer_kind("unit_twice")(one)  # the same code again (a re-import) is fine
    with pytest.raises(KindLoadError, match="registered twice"):
        observer_kind("unit_twice")(two)


def _ctx(valid: bool = True) -> ObserverContext:
    async def save(_: Any) -> None:
        return None

    return ObserverContext(
        observer_id=uuid.uuid4(),
        name="n",
        kind="k",
        epoch=1,
        service_id=uuid.uuid4(),
        params={},
        last_checkpoint=None,
        save=save,
        alive=lambda: valid,
    )


async def test_context_refuses_to_continue_without_a_lease() -> None:
    ctx = _ctx(valid=False)
    with pytest.raises(LeaseLost):
        await ctx.sleep(0)
    with pytest.raises(LeaseLost):
        await ctx.checkpoint({"x": 1})


@pytest.mark.parametrize("seconds", [-5, -0.001, float("nan")])
async def test_a_negative_or_nan_sleep_is_an_error_naming_it(seconds: float) -> None:
    """As ``time.sleep`` refuses it: ``asyncio.sleep`` would return at once, and a kind that
    sleeps a bad interval between polls would run hot."""
    with pytest.raises(ValueError, match=f"ctx.sleep\\({seconds}\\)"):
        await _ctx().sleep(seconds)
    await _ctx().sleep(0)  # a turn of the loop, as ever


@pytest.mark.parametrize("seconds", [-5, float("nan")])
async def test_the_kit_refuses_a_negative_or_nan_sleep_as_a_service_does(seconds: float) -> None:
    from orch.testing import run_kind
    from orch_contracts.kinds import KindSpec

    async def bad(ctx: Any) -> None:
        await ctx.sleep(seconds)

    async with run_kind(KindSpec("unit_bad_sleep", bad)) as run:
        assert run.stopped
        assert isinstance(run.error, ValueError)

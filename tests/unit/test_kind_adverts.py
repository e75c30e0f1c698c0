"""A kind known to the manager from a service's advert alone (``KindSpec.advert`` and
``from_advert``): its params are checked against the advertised schema without echoing them, its
secrets are masked, nested ones too, and an advert of a later release is read, not refused."""

from __future__ import annotations

import re
import time

import pytest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from orch_contracts.adverts import read_advert
from orch_contracts.errors import AdvertRefused, InvalidParams
from orch_contracts.kinds import KindSpec, RestartPolicy, mask_params


class Auth(BaseModel):
    user: str
    badge: SecretStr


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    interval: float = Field(default=1.0, gt=0)
    login: Auth | None = None
    backups: list[Auth] = []
    pin: str = Field(default="", json_schema_extra={"secret": True})


async def _run(ctx: object) -> None:
    pass


CODE = KindSpec("feed", _run, params_model=Params, restart_policy=RestartPolicy(max_restarts=3))
ADVERTISED = KindSpec.from_advert("feed", CODE.advert())


def test_an_advertised_kind_checks_params_against_the_schema_and_never_echoes_them() -> None:
    assert ADVERTISED.validate_params({"url": "u", "interval": 2}) == {"url": "u", "interval": 2}
    with pytest.raises(InvalidParams) as bad:
        ADVERTISED.validate_params({"url": "u", "interval": "every-minute"})
    assert "interval" in str(bad.value)
    assert "every-minute" not in str(bad.value)
    with pytest.raises(InvalidParams, match="missing url"):
        ADVERTISED.validate_params({})
    with pytest.raises(InvalidParams, match="unknown field"):
        ADVERTISED.validate_params({"url": "u", "surprise-field": 1})
    assert ADVERTISED.restart_policy.max_restarts == 3


def test_an_advertised_kind_masks_the_secrets_its_code_would() -> None:
    params = {
        "url": "https://x/?token=abc123",
        "login": {"user": "me", "badge": "k-0001"},
        "backups": [{"user": "b", "badge": "k-0002"}],
        "pin": "9911",
    }
    assert mask_params(params, ADVERTISED) == mask_params(params, CODE)
    shown = mask_params(params, ADVERTISED)
    assert shown["login"]["badge"] == "***"
    assert shown["backups"][0]["badge"] == "***"
    assert shown["pin"] == "***"
    assert shown["login"]["user"] == "me"


def test_an_advert_of_a_later_release_is_read() -> None:
    advert = CODE.advert()
    advert["restart_policy"] = {**advert["restart_policy"], "a_later_field": True}
    advert["a_later_key"] = {"x": 1}
    spec = KindSpec.from_advert("feed", advert)
    assert spec.restart_policy.max_restarts == 3


# ------------------------------------------------------------------ adverts as input
REFUSED = [
    ("not an object", '["x"]', "not an object"),
    ("not JSON", "{", "not JSON"),
    ("too deep", '{"a": ' + "[" * 100 + "]" * 100 + "}", "nested deeper"),
    ("too large", '{"description": "' + "x" * (300 << 10) + '"}', "over"),
    ("remote $ref", '{"params_schema": {"$ref": "http://127.0.0.1:9/s.json"}}', "outside"),
    (
        "file $ref",
        '{"params_schema": {"properties": {"x": {"$ref": "file:///etc/passwd"}}}}',
        "outside",
    ),
    ("a $id", '{"params_schema": {"$id": "http://example.com/s", "type": "object"}}', "$id"),
    ("a dangling $ref", '{"params_schema": {"$ref": "#/$defs/none"}}', "points nowhere"),
    ("look-around", '{"params_schema": {"properties": {"x": {"pattern": "(?=a)a"}}}}', "linear"),
    ("back-reference", '{"params_schema": {"patternProperties": {"(a)\\\\1": {}}}}', "linear"),
    (
        "another dialect",
        '{"params_schema": {"$schema": "http://json-schema.org/draft-03/schema#"}}',
        "dialect",
    ),
    ("an invalid schema", '{"params_schema": {"type": 12}}', "not valid"),
]


@pytest.mark.parametrize(("what", "text", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_an_advert_that_cannot_be_read_safely_is_refused(what: str, text: str, reason: str) -> None:
    with pytest.raises(AdvertRefused, match=re.escape(reason)):
        KindSpec.from_advert("k", read_advert(text))


def test_a_pattern_is_matched_in_linear_time() -> None:
    spec = KindSpec.from_advert(
        "k", read_advert('{"params_schema": {"properties": {"v": {"pattern": "^(a+)+$"}}}}')
    )
    began = time.perf_counter()
    with pytest.raises(InvalidParams, match="v: fails 'pattern'"):
        spec.validate_params({"v": "a" * 5000 + "!"})
    assert time.perf_counter() - began < 0.1
    assert spec.validate_params({"v": "aaa"}) == {"v": "aaa"}


def test_unique_items_is_checked_by_hashing_and_numbers_compare_as_json_does() -> None:
    spec = KindSpec.from_advert(
        "k", read_advert('{"params_schema": {"properties": {"v": {"uniqueItems": true}}}}')
    )
    with pytest.raises(InvalidParams, match="uniqueItems"):
        spec.validate_params({"v": [1, 1.0]})
    began = time.perf_counter()
    spec.validate_params({"v": [{"n": i} for i in range(20_000)]})
    assert time.perf_counter() - began < 1

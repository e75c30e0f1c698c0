"""The API in process, auth on, on a real database and broker: names that would steer a
terminal or a log are refused with the reason; secret params are shown to a ``read`` token
masked and to an ``admin`` token as they are."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from orch_contracts.kinds import observer_kind
from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api


class VaultParams(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    endpoint: str
    token: SecretStr
    region: str = Field(default="eu", json_schema_extra={"secret": True})


@observer_kind("test_vault", params=VaultParams)
async def vault_kind(ctx: Any) -> None:  # never run here: the manager only validates
    """A kind with secret params (for these tests)."""


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, __name__) as a:
        yield a


# ----------------------------------------------------------------------------------- names
BAD_NAMES = [
    ("ESC", "esc\x1b[31mRED", "control character (U+001B"),
    ("CR", "a\rb", "control character (U+000D"),
    ("LF", "a\nb", "control character (U+000A"),
    ("TAB", "a\tb", "control character (U+0009"),
    ("DEL", "a\x7fb", "control character (U+007F"),
    ("C1 NEL", "a\x85b", "control character (U+0085"),
    ("C1 CSI", "a\x9b31mb", "control character (U+009B"),
    ("ALM", "a\u061cb", "bidi control character (U+061C"),
    ("LRM", "a\u200eb", "bidi control character (U+200E"),
    ("RLM", "a\u200fb", "bidi control character (U+200F"),
    ("LRE", "a\u202ab", "bidi control character (U+202A"),
    ("RLO", "txt.\u202eexe", "bidi control character (U+202E"),
    ("LRI", "a\u2066b", "bidi control character (U+2066"),
    ("PDI", "a\u2069b", "bidi control character (U+2069"),
    ("ZWSP", "a\u200bb", "a format character (invisible) (U+200B at position 1)"),
    ("ZWJ", "a\u200db", "a format character (invisible) (U+200D"),
    ("WJ", "a\u2060b", "a format character (invisible) (U+2060"),
    ("soft hyphen", "pay\u00adpal", "a format character (invisible) (U+00AD at position 3)"),
    ("BOM", "\ufeffname", "a format character (invisible) (U+FEFF at position 0)"),
    ("tag", "a\U000e0041", "a format character (invisible) (U+E0041"),
    ("LS", "a\u2028b", "a line or paragraph separator (U+2028"),
    ("PS", "a\u2029b", "a line or paragraph separator (U+2029"),
    ("VS16", "a\ufe0fb", "an invisible (default-ignorable) character (U+FE0F"),
    ("Hangul filler", "a\u3164b", "an invisible (default-ignorable) character (U+3164"),
    ("leading blank", " a", "must not start or end with whitespace"),
    ("101 characters", "n" * 101, "at most 100 characters"),
]


@pytest.mark.parametrize(("what", "name", "reason"), BAD_NAMES, ids=[b[0] for b in BAD_NAMES])
async def test_a_name_that_would_steer_a_terminal_is_refused_with_the_reason(
    clients: AuthApi, what: str, name: str, reason: str
) -> None:
    r = await clients.admin.post("/observers", json={"name": name, "kind": "ticker"})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == 422
    assert body["detail"]
    assert body["errors"][0]["loc"] == ["body", "name"]
    assert reason in body["errors"][0]["msg"], body
    assert name not in r.text, "the name sent is not echoed"
    # In a bulk create, that one item fails alone, with the same reason.
    batch = await clients.admin.post(
        "/observers/batch",
        json={"observers": [{"name": name, "kind": "ticker"}, {"name": what, "kind": "ticker"}]},
    )
    assert batch.status_code == 200, batch.text
    first, second = batch.json()["items"]
    assert first["status"] == 422
    assert reason in first["problem"]["errors"][0]["msg"]
    assert first["problem"]["errors"][0]["loc"] == ["body", "observers", 0, "name"]
    assert second["status"] == 201


async def test_printable_names_up_to_the_limit_are_taken(clients: AuthApi) -> None:
    for name in ("n" * 100, "x[/red]", "[link=http://127.0.0.1/]click[/link]", "é 日本 a\\x1b"):
        r = await clients.admin.post("/observers", json={"name": name, "kind": "ticker"})
        assert r.status_code == 201, (name, r.text)
        assert r.json()["name"] == name


async def test_the_schema_documents_the_name_rule(clients: AuthApi) -> None:
    spec = (await clients.read.get("/openapi.json")).json()
    name = spec["components"]["schemas"]["ObserverCreate"]["properties"]["name"]
    assert name["maxLength"] == 100
    assert "\\u0000-\\u001f" in name["pattern"]
    assert "\\u2028-\\u202e" in name["pattern"]
    assert "\\u200b-\\u200f" in name["pattern"]
    assert "\\ufeff" in name["pattern"]


#: Names that look like ``paypal``: none may live beside it.
LOOK_ALIKES = [
    ("Cyrillic a", "p\u0430ypal"),
    ("Cyrillic capitals", "\u0420\u0410YPAL"),
    ("Greek alpha", "p\u03b1ypal"),
    ("Greek capital rho", "\u03a1aypal"),
    ("fullwidth", "\uff50\uff41\uff59\uff50\uff41\uff4c"),
    ("case", "PayPal"),
    ("Latin alpha", "p\u0251ypal"),
    ("small capitals", "\u1d18\u1d00\u028f\u1d18\u1d00\u029f"),
    ("Lisu letters", "\ua4d1AYPA\ua4e1"),
]


@pytest.mark.parametrize(("what", "name"), LOOK_ALIKES, ids=[a[0] for a in LOOK_ALIKES])
async def test_a_name_that_looks_like_a_live_one_is_refused_naming_it(
    clients: AuthApi, what: str, name: str
) -> None:
    first = await clients.admin.post("/observers", json={"name": "paypal", "kind": "ticker"})
    assert first.status_code == 201
    r = await clients.admin.post("/observers", json={"name": name, "kind": "ticker"})
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert "'paypal'" in detail
    assert first.json()["id"] in detail
    assert "look alike" in detail
    assert name not in detail, "the name sent is not echoed"
    # In a bulk create, alone; and two look-alikes in one batch: the first stands.
    batch = await clients.admin.post(
        "/observers/batch",
        json={
            "observers": [
                {"name": name, "kind": "ticker"},
                {"name": "other", "kind": "ticker"},
                {"name": "OTHER", "kind": "ticker"},
            ]
        },
    )
    items = batch.json()["items"]
    assert [i["status"] for i in items] == [409, 201, 409]
    assert "'paypal'" in items[0]["problem"]["detail"]
    assert "'other'" in items[2]["problem"]["detail"]
    # Once the first is deleted, the look-alike may be created.
    assert (await clients.admin.delete(f"/observers/{first.json()['id']}")).status_code == 202
    again = await clients.admin.post("/observers", json={"name": name, "kind": "ticker"})
    assert again.status_code == 201, again.text


async def test_names_are_kept_in_nfc_and_one_spelling_of_a_letter_is_one_name(
    clients: AuthApi,
) -> None:
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    r = await clients.admin.post("/observers", json={"name": nfd, "kind": "ticker"})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == nfc
    twice = await clients.admin.post("/observers", json={"name": nfc, "kind": "ticker"})
    assert twice.status_code == 409


async def test_concurrent_look_alikes_make_one_observer(clients: AuthApi) -> None:
    names = ["paypal", "PAYPAL", "p\u0430ypal", "\uff50aypal"] * 5
    answers = await asyncio.gather(
        *(clients.admin.post("/observers", json={"name": n, "kind": "ticker"}) for n in names)
    )
    assert sorted(a.status_code for a in answers) == [201] + [409] * (len(names) - 1)


# --------------------------------------------------------------------------------- secrets
URL = "http://alice:S3cretPW@example.com/p?api_key=K3Y&page=2"
MASKED_URL = "http://***@example.com/p?api_key=***&page=2"
VAULT = {"endpoint": "https://vault/?token=V4ULT", "token": "t0ken-value", "region": "us"}


async def _created(clients: AuthApi) -> tuple[dict[str, Any], dict[str, Any]]:
    poll = await clients.admin.post(
        "/observers", json={"name": "poll", "kind": "http_poll", "params": {"url": URL}}
    )
    vault = await clients.admin.post(
        "/observers", json={"name": "vault", "kind": "test_vault", "params": VAULT}
    )
    assert poll.status_code == 201, poll.text
    assert vault.status_code == 201, vault.text
    return poll.json(), vault.json()


def _no_secret_in(text: str) -> None:
    for secret in ("S3cretPW", "K3Y", "alice", "t0ken-value", "V4ULT", '"us"'):
        assert secret not in text, secret


async def test_a_read_token_sees_secret_params_masked(clients: AuthApi) -> None:
    poll, vault = await _created(clients)
    page = await clients.read.get("/observers")
    assert page.status_code == 200
    _no_secret_in(page.text)
    by_name = {o["name"]: o for o in page.json()["items"]}
    assert by_name["poll"]["params"]["url"] == MASKED_URL
    assert by_name["poll"]["params"]["interval"] == 30.0, "what is not secret is shown"
    assert by_name["vault"]["params"] == {
        "endpoint": "https://vault/?token=***",
        "token": "***",
        "region": "***",
    }
    for created in (poll, vault):
        one = await clients.read.get(f"/observers/{created['id']}")
        assert one.status_code == 200
        _no_secret_in(one.text)
        events = await clients.read.get(f"/observers/{created['id']}/events")
        assert events.status_code == 200
        _no_secret_in(events.text)
    filtered = await clients.read.get("/observers", params={"kind": "http_poll"})
    assert filtered.json()["items"][0]["params"]["url"] == MASKED_URL


async def test_an_admin_token_sees_params_as_they_are(clients: AuthApi) -> None:
    poll, vault = await _created(clients)
    assert poll["params"]["url"] == URL, "the create answers the admin with the real values"
    assert vault["params"] == VAULT
    page = (await clients.admin.get("/observers")).json()
    by_name = {o["name"]: o for o in page["items"]}
    assert by_name["poll"]["params"]["url"] == URL
    assert by_name["vault"]["params"] == VAULT, "stored as given, not as **********"
    one = (await clients.admin.get(f"/observers/{vault['id']}")).json()
    assert one["params"]["token"] == "t0ken-value"


async def test_a_refused_secret_is_not_echoed(clients: AuthApi) -> None:
    r = await clients.admin.post(
        "/observers",
        json={"name": "v", "kind": "test_vault", "params": {"endpoint": 1, "token": "t0ken-value"}},
    )
    assert r.status_code == 422
    assert "t0ken-value" not in json.dumps(r.json())


# ---------------------------------------------------------------------------------- echoes
MARK = "zq7marker"
#: Requests whose errors could quote what was sent: each names the field and the rule.
ECHOES = [
    ("unknown kind", "POST", "/observers", {"json": {"name": "x", "kind": MARK}}),
    (
        "egress",
        "POST",
        "/observers",
        {"json": {"name": "x", "kind": "http_poll", "params": {"url": f"http://{MARK}.lan:22/"}}},
    ),
    (
        "a number",
        "POST",
        "/observers",
        {"json": {"name": "x", "kind": "ticker", "params": {"interval": MARK}}},
    ),
    ("a name", "POST", "/observers", {"json": {"name": f"{MARK}\u200b", "kind": "ticker"}}),
    ("a status", "GET", "/observers", {"params": {"status": MARK}}),
    ("an id", "GET", f"/observers/{MARK}", {}),
    ("a view id", "GET", "/views/observers", {"params": {"service_id": MARK}}),
    ("a body", "POST", "/observers", {"content": f'{{"name": "{MARK}", ', "headers": {}}),
]


@pytest.mark.parametrize(
    ("what", "method", "path", "request_args"), ECHOES, ids=[e[0] for e in ECHOES]
)
async def test_an_error_names_the_field_and_the_rule_never_the_value(
    clients: AuthApi, what: str, method: str, path: str, request_args: dict[str, Any]
) -> None:
    r = await clients.admin.request(method, path, **request_args)
    assert r.status_code in (400, 404, 422), r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert MARK not in r.text, r.text
    body = r.json()
    assert body["detail"]
    assert body.get("errors", [{"msg": "x"}])[0]["msg"]
    # In a bulk create too.
    if method == "POST" and "json" in request_args:
        batch = await clients.admin.post(
            "/observers/batch", json={"observers": [request_args["json"]]}
        )
        assert batch.status_code == 200, batch.text
        assert MARK not in batch.text, batch.text

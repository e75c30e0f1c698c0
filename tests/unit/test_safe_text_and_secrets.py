"""Names and secrets that must not leak or steer: ``safe_text`` for terminals and text logs,
masked URLs, secret params declared by a kind (``SecretStr`` or a marker) masked for reading
and given to the kind as they are."""

from __future__ import annotations

import json
import logging
import re
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr

from observer_service.context import ObserverContext
from orch_contracts import logs
from orch_contracts.errors import split_error, stored_error
from orch_contracts.kinds import KindSpec, mask_params, secret_values
from orch_contracts.logs import safe_text
from orch_contracts.masking import mask
from tests.unit.test_service_core import KINDS, harness, until

# ------------------------------------------------------------------------------ safe_text
BAD = {
    "ESC": ("\x1b", "\\x1b"),
    "CR": ("\r", "\\x0d"),
    "LF": ("\n", "\\x0a"),
    "NUL": ("\x00", "\\x00"),
    "DEL": ("\x7f", "\\x7f"),
    "C1 NEL": ("\x85", "\\x85"),
    "C1 CSI": ("\x9b", "\\x9b"),
    "ALM": ("\u061c", "\\u061c"),
    "LRM": ("\u200e", "\\u200e"),
    "RLM": ("\u200f", "\\u200f"),
    "LRE": ("\u202a", "\\u202a"),
    "RLO": ("\u202e", "\\u202e"),
    "LRI": ("\u2066", "\\u2066"),
    "PDI": ("\u2069", "\\u2069"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_safe_text_shows_controls_and_bidi_as_escapes(what: str) -> None:
    char, shown = BAD[what]
    assert safe_text(f"a{char}b") == f"a{shown}b"
    assert logs.UNSAFE_CHARS.search(safe_text(f"a{char}b")) is None


def test_safe_text_leaves_printable_text_alone() -> None:
    for text in ("plain", "x[/red]", "[link=http://127.0.0.1/]click[/link]", "é日本 \\x1b", ""):
        assert safe_text(text) == text
    assert safe_text("esc\x1b[31mRED") == "esc\\x1b[31mRED"


# ------------------------------------------------------------------------------ text logs
def test_a_text_log_line_escapes_an_esc_in_a_name_and_in_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure("INFO", "text", service="s")
    try:
        log = logs.observer_log(
            "t", observer_id=uuid.uuid4(), name="esc\x1b[31mRED\u202e", kind="ticker"
        )
        log.warning("raised (%s)", "RuntimeError: \x1b]0;owned\x07\r\nforged line")
        try:
            raise ValueError("in a traceback \x1b[2J")
        except ValueError:
            log.exception("failed")
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    for raw in ("\x1b", "\u202e", "\r", "\x07"):
        assert raw not in err
    assert 'observer="esc\\x1b[31mRED\\u202e"' in err
    assert "RuntimeError: \\x1b]0;owned\\x07\\x0d\\x0aforged line" in err
    assert "in a traceback \\x1b[2J" in err
    assert "Traceback (most recent call last):\n" in err, "a traceback keeps its lines"


FORGING = ["x] [observer_id=forged", 'a" observer_id=forged "', "a\\", "two words", "k=v", ""]


@pytest.mark.parametrize("name", FORGING)
def test_a_name_cannot_forge_a_field_of_a_text_log_line(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("INFO", "text", service="s")
    oid = uuid.uuid4()
    try:
        logs.observer_log("t", observer_id=oid, name=name, kind="ticker", epoch=3).warning("hi")
        err = capsys.readouterr().err.rstrip("\n")
    finally:
        logging.getLogger().handlers.clear()
    # The fields as a logfmt reader reads them: bare words, or quoted with \\ and \" escaped.
    block = err[err.index(": hi [") + 6 : -1]
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?: |$)', block)
    assert "".join(f"{k}={v} " for k, v in pairs).strip() == block, block
    fields = {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}
    assert fields == {
        "observer_id": str(oid),
        "observer": name,
        "kind": "ticker",
        "epoch": "3",
        "service": "s",
    }


@pytest.mark.parametrize("name", FORGING)
def test_a_json_log_line_keeps_each_name_in_its_field(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("INFO", "json", service="s")
    oid = uuid.uuid4()
    try:
        logs.observer_log("t", observer_id=oid, name=name).warning("hi")
        line = json.loads(capsys.readouterr().err)
    finally:
        logging.getLogger().handlers.clear()
    assert (line["observer_id"], line["observer"]) == (str(oid), name)


def test_a_json_log_line_carries_the_name_quoted(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("INFO", "json", service="s")
    try:
        logs.observer_log("t", observer_id=uuid.uuid4(), name="esc\x1b[31m").warning("hi")
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    assert "\x1b" not in err
    assert json.loads(err)["observer"] == "esc\x1b[31m"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_log_line_carries_a_url_password_or_secret_query_value(
    fmt: logs.LogFormat, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure("INFO", fmt, service="s")
    try:
        logging.getLogger("t").warning(
            "GET %s failed", "http://alice:S3cretPW@host/p?api_key=K3Y&page=2&token=T0K"
        )
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    for secret in ("S3cretPW", "K3Y", "T0K"):
        assert secret not in err
    assert "http://alice:***@host/p?api_key=***&page=2&token=***" in err


# ---------------------------------------------------------------------------- URL masking
@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("http://alice:S3cretPW@host/p?api_key=K", "http://***@host/p?api_key=***"),
        ("https://TOKEN@github.com/o/r.git", "https://***@github.com/o/r.git"),
        (
            "https://h/p?a=1&Signature=s&X-Amz-Credential=c",
            "https://h/p?a=1&Signature=***&X-Amz-Credential=***",
        ),
        ("https://h/cb#access_token=t&state=x", "https://h/cb#access_token=***&state=x"),
        ("https://h/p?password=&q=search", "https://h/p?password=&q=search"),
        ("https://h/p?key=k&monkey=banana", "https://h/p?key=***&monkey=banana"),
        ("https://example.com/", "https://example.com/"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url_hides_credentials_and_secret_query_values(url: str, masked: str) -> None:
    assert mask(url, keep_user=False) == masked


def test_mask_keeps_the_user_for_logs() -> None:
    assert mask("postgresql://orch:pw@db:5432/x") == "postgresql://orch:***@db:5432/x"
    assert mask("see 'https://u:p@h/x?client_secret=s' now") == (
        "see 'https://u:***@h/x?client_secret=***' now"
    )


# ------------------------------------------------------------------------- secret params
class Inner(BaseModel):
    password: SecretStr
    label: str = "l"


class SecretParams(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    url: AnyHttpUrl = AnyHttpUrl("http://example.com/")
    token: SecretStr
    maybe: SecretStr | None = None
    marked: str = Field(default="m", json_schema_extra={"secret": True})
    inner: Inner | None = None
    interval: float = 0.01


SEEN: dict[uuid.UUID, dict[str, Any]] = {}


async def keeps_secrets(ctx: ObserverContext) -> None:
    p: SecretParams = ctx.params
    SEEN[ctx.observer_id] = {
        "token": p.token.get_secret_value(),
        "marked": p.marked,
        "inner": p.inner.password.get_secret_value() if p.inner else None,
        "url": str(p.url),
    }
    while True:
        await ctx.sleep(p.interval)


SPEC = KindSpec("keeps_secrets", keeps_secrets, SecretParams)
RAW = {
    "url": "http://alice:S3cretPW@example.com/p?api_key=K3Y&page=2",
    "token": "t0ken-value",
    "marked": "marked-value",
    "inner": {"password": "inner-pw"},
}


def test_a_kind_declares_secrets_by_type_or_marker() -> None:
    assert SPEC.secret_params == {"token", "maybe", "marked"}
    explicit = KindSpec("x", keeps_secrets, SecretParams, secret_params=frozenset({"interval"}))
    assert explicit.secret_params == {"token", "maybe", "marked", "interval"}
    assert KindSpec("plain", keeps_secrets).secret_params == frozenset()


def test_params_are_stored_as_given_secrets_included() -> None:
    stored = SPEC.validate_params(RAW)
    assert stored["token"] == "t0ken-value", "not pydantic's **********"
    assert stored["marked"] == "marked-value"
    assert stored["inner"] == {"password": "inner-pw", "label": "l"}
    assert stored["url"] == RAW["url"]
    again = SecretParams.model_validate(stored)
    assert again.token.get_secret_value() == "t0ken-value"


def test_a_reader_sees_secret_params_masked() -> None:
    masked = SPEC.mask_params(SPEC.validate_params(RAW))
    assert masked["token"] == "***"
    assert masked["marked"] == "***"
    assert masked["maybe"] is None, "an absent secret stays absent"
    assert masked["inner"] == {"password": "***", "label": "l"}
    assert masked["url"] == "http://***@example.com/p?api_key=***&page=2"
    assert masked["interval"] == 0.01
    text = json.dumps(masked)
    for secret in ("t0ken-value", "marked-value", "inner-pw", "S3cretPW", "K3Y", "alice"):
        assert secret not in text


def test_a_kind_this_manager_does_not_know_gets_the_generic_rules() -> None:
    params = {"password": "p", "opts": [{"api_key": "k"}], "u": "ftp://a:b@h/", "n": 1}
    assert mask_params(params, None) == {
        "password": "***",
        "opts": [{"api_key": "***"}],
        "u": "ftp://***@h/",
        "n": 1,
    }
    assert params["password"] == "p", "a copy: the row is not changed"


async def test_the_kind_receives_the_real_secret_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validated by the manager, stored, taken by a service: the kind gets what was given."""
    monkeypatch.setitem(KINDS, SPEC.name, SPEC)
    async with harness() as h:
        row = h.store.add(SPEC.name, params=SPEC.validate_params(RAW))
        await h.run(row)
        await until(lambda: row.id in SEEN)
        assert SEEN[row.id] == {
            "token": "t0ken-value",
            "marked": "marked-value",
            "inner": "inner-pw",
            "url": RAW["url"],
        }


def test_an_observers_own_secret_query_names_are_masked_too() -> None:
    params = {
        "url": "https://example.com/x?sid=S1D&page=2",
        "secret_query": ["sid"],
        "interval": 30.0,
    }
    masked = mask_params(params, None)
    assert masked["url"] == "https://example.com/x?sid=***&page=2"
    assert masked["secret_query"] == ["sid"], "the names are no secret"


def test_a_reader_sees_urls_in_the_last_error_masked() -> None:
    from orch_manager.api.observers import shown

    state: Any = SimpleNamespace(secrets_of=lambda row: [SPEC])
    row = {
        "kind": SPEC.name,
        "params": SPEC.validate_params(RAW),
        "last_error": "ConnectError: http://alice:S3cretPW@example.com/p?api_key=K3Y failed",
    }
    masked = shown(state, row, raw=False)
    assert masked["last_error"] == "ConnectError: http://***@example.com/p?api_key=*** failed"
    assert masked["params"]["token"] == "***"
    assert shown(state, row, raw=True) == {**row, "traceback": None}, "an admin sees it as it is"


def test_a_traceback_is_shown_apart_from_the_error_and_masked_alike() -> None:
    from orch_manager.api.observers import shown

    state: Any = SimpleNamespace(secrets_of=lambda row: [SPEC])
    params = SPEC.validate_params(RAW)
    secret = str(params["token"])
    line = f"Refused: bad token {secret}"
    trace = f'Traceback (most recent call last):\n  File "k.py", line 3, in k\n{line}\n'
    row = {"kind": SPEC.name, "params": params, "last_error": stored_error(line, trace)}
    masked = shown(state, row, raw=False)
    assert masked["last_error"] == "Refused: bad token ***"
    assert masked["traceback"] == trace.replace(secret, "***")
    assert shown(state, row, raw=True)["traceback"] == trace
    # Cut to its end (where it was raised), saying so.
    long = stored_error("E: x", "Traceback (most recent call last):\n" + "x" * 10_000 + "E: x\n")
    assert split_error(long)[1] == (
        "Traceback (most recent call last):\n  ...\n" + ("x" * 10_000 + "E: x\n")[-6000:]
    )
    assert split_error("E: no traceback") == ("E: no traceback", None)


def test_a_reader_never_sees_a_secret_param_value_quoted_in_an_error() -> None:
    from orch_manager.api.observers import shown

    state: Any = SimpleNamespace(secrets_of=lambda row: [SPEC])
    params = SPEC.validate_params(RAW)
    secret = str(params["token"])
    row = {"kind": SPEC.name, "params": params, "last_error": f"Refused: bad token {secret}!"}
    masked = shown(state, row, raw=False)
    assert secret not in masked["last_error"]
    assert masked["last_error"] == "Refused: bad token ***!"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("https://h/p?a=1;token=x;b=2", "https://h/p?a=1;token=***;b=2"),
        ("https://h/p?jwt=j&bearer=b&cookie=c", "https://h/p?jwt=***&bearer=***&cookie=***"),
        ("https://h/p?privatekey=k&sessionid=s", "https://h/p?privatekey=***&sessionid=***"),
        ("https://h/p?client_assertion=a", "https://h/p?client_assertion=***"),
    ],
)
def test_more_secret_query_forms_are_masked(url: str, masked: str) -> None:
    assert mask(url) == masked


def test_a_user_name_alone_is_masked_even_in_logs() -> None:
    # Alone, a URL's user name is usually a token.
    assert mask("cloning https://ghp_T0KEN@github.com/o/r") == "cloning https://***@github.com/o/r"


def test_an_error_is_masked_before_it_is_cut() -> None:
    from observer_service.runner import describe

    # Cut at 2,000 characters first, the URL would end inside its password, before its "@".
    url = "https://admin:" + "p" * 40 + "@host/x"
    text = describe(RuntimeError("x" * (2000 - len("RuntimeError: ") - 34) + url))
    assert "ppppp" not in text
    assert len(text) <= 2000


# ------------------------------------------------------------------------- the one masker
@pytest.mark.parametrize(
    ("text", "kwargs", "masked"),
    [
        # An observer's secret values, wherever they stand (longest first).
        ("refused key sk_live_1234", {"secrets": ["sk_live_1234"]}, "refused key ***"),
        # A DSN that is not quite a URL: its password= parameter.
        (
            "bad: postgresql://h1,h2/db?password=pw&x=1",
            {},
            "bad: postgresql://h1,h2/db?password=***&x=1",
        ),
        ("not-a-url?password=pw", {}, "not-a-url?password=***"),
        # A URL inside another one's query: its credentials.
        (
            "https://h/?next=https://u:p@in/",
            {"keep_user": False},
            "https://h/?next=https://***@in/",
        ),
        # Names an observer declares, also URL-quoted.
        ("https://h/?my%20id=7&a=1", {"names": ["my id"]}, "https://h/?my%20id=***&a=1"),
        ("amqp://guest:guest@h:5672/", {}, "amqp://guest:***@h:5672/"),
        ("amqp://guest:guest@h:5672/", {"keep_user": False}, "amqp://***@h:5672/"),
        ("plain text, a=1", {}, "plain text, a=1"),
    ],
)
def test_the_one_masker(text: str, kwargs: dict[str, Any], masked: str) -> None:
    assert mask(text, **kwargs) == masked


def test_an_observer_logger_hides_its_secret_values(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("INFO", "text", service="s")
    try:
        log = logs.observer_log("t", observer_id=uuid.uuid4(), name="n", secrets=["t0p-secret"])
        log.info("key %s", "t0p-secret")
        log.warning("named %(key)s", {"key": "t0p-secret"})
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    assert "t0p-secret" not in err
    assert "key ***" in err
    assert "named ***" in err


def test_secret_values_of_any_shape_are_what_the_service_masks_in_errors_and_logs() -> None:
    """A list of secrets, a dict of them (``websocket``'s ``headers``), a secret number, a
    nested model: each value is one the service masks in an observer's errors and ``ctx.logger``
    lines (``intake`` gives ``secret_values`` to the runner)."""
    from pydantic import Secret

    class Login(BaseModel):
        user: str
        password: SecretStr

    class Shapes(BaseModel):
        keys: list[SecretStr] = []
        headers: dict[str, SecretStr] = {}
        pin: Secret[int] | None = None
        logins: list[Login] = []

    spec = KindSpec("shapes", _noop, params_model=Shapes)
    params = spec.validate_params(
        {
            "keys": ["K3y-one", "K3y-two"],
            "headers": {"Authorization": "Bearer-H34der"},
            "pin": 98765,
            "logins": [{"user": "bob", "password": "L0gin-pw"}],
        }
    )
    values = secret_values(params, spec)
    for secret in ("K3y-one", "K3y-two", "Bearer-H34der", "98765", "L0gin-pw"):
        assert secret in values
    assert "Authorization" not in values, "a dict's keys are no secret"
    line = mask(f"failed with {params!r}", secrets=values)
    for secret in ("K3y-one", "K3y-two", "Bearer-H34der", "98765", "L0gin-pw"):
        assert secret not in line


async def _noop(ctx: object) -> None:
    pass


async def test_httpx_logs_no_line_per_request_at_the_default_level(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An ``http_poll`` observer polls every few seconds: httpx's INFO line for each request
    would be most of a service's log. Its warnings still show."""
    import asyncio

    import httpx

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    levels = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    logs.configure("INFO", "text", service="s")
    try:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        async with server, httpx.AsyncClient() as client:
            port = server.sockets[0].getsockname()[1]
            assert (await client.get(f"http://127.0.0.1:{port}/price")).text == "ok"
        logging.getLogger("httpx").warning("a warning of its own")
        err = capsys.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
        for name, level in levels.items():  # as other tests expect them
            logging.getLogger(name).setLevel(level)
    assert "HTTP Request" not in err
    assert "/price" not in err
    assert "a warning of its own" in err

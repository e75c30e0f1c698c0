"""http_poll, safe by default: a capped body, capped redirects, a timeout, and an egress policy
checked on the address actually connected to (loopback listeners only: nothing leaves this
machine); secrets in its URL never reach a log line or an error."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import ipaddress
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpcore
import httpx
import pytest
from pydantic import ValidationError

from observer_service import egress
from observer_service.egress import EgressPolicy, EgressRefused, is_public, parse_address
from observer_service.kinds.http_poll import (
    BodyTooLarge,
    HttpPollParams,
    HttpPollSettings,
    NotAllowed,
    PollFailed,
    PollTimedOut,
    client_for,
    fetch,
)

REFUSED = "refused by the egress policy"


class Listener:
    """A small HTTP server on a loopback address that counts the connections it accepted."""

    def __init__(self, route: Callable[[str], tuple[str, bytes]] | None = None) -> None:
        self.route = route or (lambda path: ("HTTP/1.1 200 OK\r\n", b"hello"))
        self.connections = 0
        self.accept_encoding: list[str] = []
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> Listener:
        self.server = await asyncio.start_server(self._serve, host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            head, body = self.route(request.split(b" ")[1].decode())
            self.accept_encoding += [
                m.decode() for m in re.findall(rb"(?im)^accept-encoding: *(\S+?)\r?$", request)
            ]
            if head.endswith("SLOW\r\n"):
                await asyncio.sleep(1)
                head = head.removesuffix("SLOW\r\n")
            trickle = head.endswith("TRICKLE\r\n")
            head = head.removesuffix("TRICKLE\r\n")
            writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            for i in range(0, len(body), 1 if trickle else len(body) or 1):
                writer.write(body[i : i + (1 if trickle else len(body))])
                await writer.drain()
                if trickle:
                    await asyncio.sleep(0.1)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


#: Zeros, gzipped twice: a few KiB on the wire, 64 MiB inflated.
BOMB = gzip.compress(gzip.compress(bytes(64 << 20)))


def _site_route(path: str) -> tuple[str, bytes]:
    if path.startswith("/hop/") and int(path.rsplit("/", 1)[1]) > 0:
        n = int(path.rsplit("/", 1)[1])
        return f"HTTP/1.1 302 Found\r\nLocation: /hop/{n - 1}\r\n", b""
    if path == "/big":
        return "HTTP/1.1 200 OK\r\n", b"x" * (3 << 20)
    if path == "/slow":
        return "HTTP/1.1 200 OK\r\nSLOW\r\n", b"late"
    if path == "/trickle":
        return "HTTP/1.1 200 OK\r\nTRICKLE\r\n", b"x" * 30
    if path == "/bomb":
        return "HTTP/1.1 200 OK\r\nContent-Encoding: gzip, gzip\r\n", BOMB
    if path.startswith("/to/"):  # /to/<url>: a redirect there
        return f"HTTP/1.1 302 Found\r\nLocation: {path[4:]}\r\n", b""
    return "HTTP/1.1 200 OK\r\n", b"hello"


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    """A listener nothing may reach under the default policy."""
    server = await Listener().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def site(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Listener]:
    """A listener the allowlist opens, by its address and port."""
    server = await Listener(_site_route).start()
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"127.0.0.1:{server.port}")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection httpcore makes, recorded as it is attempted."""
    seen: list[tuple[str, int]] = []
    original = httpcore.AnyIOBackend.connect_tcp

    async def spy(self: Any, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        seen.append((host, port))
        return await original(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", spy)
    return seen


def _unchecked(url: str, **params: Any) -> HttpPollParams:
    """Params as if validated elsewhere (another manager, an older policy): the runtime check
    alone stands between them and the network."""
    return HttpPollParams.model_construct(url=url, **params)  # type: ignore[arg-type]


async def _poll(p: HttpPollParams) -> tuple[int, str]:
    async with client_for(p) as client:
        return await fetch(client, p)


async def _get(url: str, **params: Any) -> tuple[int, str]:
    return await _poll(HttpPollParams.model_validate({"url": url, **params}))


# ---------------------------------------------------------------- the old safety limits
async def test_a_body_is_read_up_to_its_cap(site: Listener) -> None:
    base = f"http://127.0.0.1:{site.port}"
    assert (await _get(f"{base}/small"))[0] == 200
    with pytest.raises(BodyTooLarge):
        await _get(f"{base}/big", max_bytes=1 << 20)


async def test_redirects_are_capped(site: Listener) -> None:
    base = f"http://127.0.0.1:{site.port}"
    assert (await _get(f"{base}/hop/3", max_redirects=5))[0] == 200
    with pytest.raises(httpx.TooManyRedirects):
        await _get(f"{base}/hop/9", max_redirects=5)


async def test_it_gives_up_after_its_timeout(site: Listener) -> None:
    with pytest.raises((httpx.TimeoutException, PollTimedOut)):
        await _get(f"http://127.0.0.1:{site.port}/slow", timeout=0.3)


async def test_a_trickled_answer_is_cut_at_the_timeout_of_the_whole_poll(site: Listener) -> None:
    # Each read is quick (a byte every 0.1 s), the whole answer is not: 3 s against 0.5 s.
    started = time.monotonic()
    with pytest.raises(PollTimedOut, match=r"no complete answer within 0\.5 s"):
        await _get(f"http://127.0.0.1:{site.port}/trickle", timeout=0.5)
    assert time.monotonic() - started < 2


async def test_a_compressed_body_is_hashed_as_sent_never_inflated(site: Listener) -> None:
    # 64 MiB of zeros in a few KiB of gzip, twice over: inflated, it would pass max_bytes by far.
    status, digest = await _get(f"http://127.0.0.1:{site.port}/bomb", max_bytes=1 << 20)
    assert status == 200
    assert digest == hashlib.sha256(BOMB).hexdigest()
    assert site.accept_encoding == ["identity"]


# ---------------------------------------------------------------- addresses
@pytest.mark.parametrize(
    "written",
    [
        "127.0.0.1",
        "2130706433",
        "0x7f000001",
        "0x7F.1",
        "127.1",
        "0177.0.0.1",
        "0177.1",
        "127.0.0.1.",
        "[::1]",
        "::ffff:127.0.0.1",
        "[::ffff:7f00:1]",
        "::127.0.0.1",
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "169.254.169.254",
        "0xa9fea9fe",  # 169.254.169.254
        "fe80::1",
        "fe80::1%eth0",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "0.0.0.0",
        "0",
        "::",
        "224.0.0.1",
        "239.255.255.250",
        "ff02::1",
        "240.0.0.1",
        "255.255.255.255",
        "fc00::1",
        "fd12:3456::1",
        "fec0::1",
        "192.0.2.1",
        "2001:db8::1",
        "198.18.0.1",
        "192.0.0.8",  # IETF protocol assignments
        "192.88.99.1",  # the 6to4 relay anycast
        "3fff::1",  # IPv6 documentation (RFC 9637)
    ],
)
def test_non_public_addresses_in_every_form_are_not_public(written: str) -> None:
    ip = parse_address(written)
    assert ip is not None
    assert not is_public(ip)


@pytest.mark.parametrize(
    "written", ["8.8.8.8", "134744072", "1.1.1.1", "2606:4700::1111", "64:ff9b::808:808"]
)
def test_public_addresses_are_public(written: str) -> None:
    ip = parse_address(written)
    assert ip is not None
    assert is_public(ip)


def test_names_and_malformed_numbers() -> None:
    assert parse_address("example.com") is None
    assert parse_address("1e100.net") is None
    assert parse_address("0x7f000001") == ipaddress.IPv4Address("127.0.0.1")
    for bad in ("1.2.3.4.5", "08.0.0.1", "256.1.1.1", "0x1g.1", "0x100000000"):
        with pytest.raises(ValueError, match="not an address"):
            parse_address(bad)


# ---------------------------------------------------------------- the allowlist
def test_the_allowlist_syntax() -> None:
    def ok(p: EgressPolicy, host: str, port: int) -> bool:
        """What is told before resolving."""
        try:
            p.check(host, port)
        except EgressRefused:
            return False
        return True

    names = EgressPolicy.parse("example.com, *.example.org, api.example.com:8443, *:8000")
    assert ok(names, "example.com", 443)
    assert ok(names, "example.com", 80)
    assert ok(names, "EXAMPLE.com.", 80)
    assert not ok(names, "example.com", 8443)  # no port: 80 and 443 only
    assert ok(names, "a.b.example.org", 443)
    assert ok(names, "example.org", 80)
    assert not ok(names, "badexample.org", 443)
    assert ok(names, "api.example.com", 8443)
    assert not ok(names, "api.example.com", 8444)
    assert not ok(names, "elsewhere.com", 443)
    assert ok(names, "elsewhere.com", 8000)
    assert ok(names, "8.8.8.8", 8000)
    assert not ok(names, "8.8.8.8", 8001)
    assert not ok(names, "127.0.0.1", 8000)  # "*" is any host, public addresses only

    nets = EgressPolicy.parse("10.0.0.0/8:443, 192.0.2.7:*, [fd00::/8]:8080, fd00:1::/32")
    assert ok(nets, "10.9.8.7", 443)
    assert not ok(nets, "10.9.8.7", 80)
    assert ok(nets, "192.0.2.7", 5432)
    assert ok(nets, "fd00::5", 8080)
    assert not ok(nets, "fd00::5", 443)
    assert ok(nets, "fd00:1::9", 443)
    assert not ok(nets, "8.8.8.8", 443)
    # A name may lead into an opened network: told only once it is resolved.
    assert ok(nets, "db.internal", 5432)

    default = EgressPolicy.parse("")
    assert default.allows_url("https://example.com/")
    assert default.allows_url("http://8.8.8.8/")
    assert not default.allows_url("https://example.com:8443/")
    assert not default.allows_url("http://127.0.0.1/")

    for bad in (
        "127.1",
        "10.0.0.1/8",
        "example.com:x",
        "example.com:0",
        "[::1",
        "a b",
        "1.2.3.4.5",
    ):
        with pytest.raises(ValueError, match="allowlist entry"):
            EgressPolicy.parse(bad)


def test_the_setting_keeps_its_name_and_refuses_a_bad_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "example.com, *.example.org")
    assert HttpPollSettings().allows("example.com")
    assert HttpPollSettings().allows("api.example.org")
    assert not HttpPollSettings().allows("example.net")
    assert not HttpPollSettings().allows("example.com", 5432)
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "example.com, 127.1")
    with pytest.raises(ValidationError, match=r"127\.0\.0\.1"):
        HttpPollSettings()


# ---------------------------------------------------------------- refused before connecting
DENIED_FORMS = [
    "127.0.0.1",
    "2130706433",
    "0x7f000001",
    "127.1",
    "0177.0.0.1",
    "[::ffff:127.0.0.1]",
    "localhost",
]


@pytest.mark.parametrize("host", DENIED_FORMS)
async def test_a_loopback_address_in_any_form_is_refused_before_connecting(
    host: str, listener: Listener, connects: list[tuple[str, int]]
) -> None:
    url = f"http://{host}:{listener.port}/"
    with pytest.raises(ValidationError, match=REFUSED):
        HttpPollParams.model_validate({"url": url})
    with pytest.raises((EgressRefused, httpx.InvalidURL)) as info:
        await _poll(_unchecked(url))
    if host != "0177.0.0.1":  # httpx itself will not parse that one
        assert isinstance(info.value, EgressRefused)
    assert connects == []
    assert listener.connections == 0


async def test_ipv6_loopback_is_refused_before_connecting(
    connects: list[tuple[str, int]],
) -> None:
    try:
        v6 = await Listener().start("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        with pytest.raises(EgressRefused, match=REFUSED):
            await _poll(_unchecked(f"http://[::1]:{v6.port}/"))
        assert connects == []
        assert v6.connections == 0
    finally:
        v6.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://10.0.0.1/",
        "http://0.0.0.0/",
        "http://[::]/",
    ],
)
async def test_metadata_and_private_addresses_are_refused(
    url: str, connects: list[tuple[str, int]]
) -> None:
    with pytest.raises(EgressRefused, match=REFUSED):
        await _poll(_unchecked(url, timeout=2))
    assert connects == []


async def test_a_name_that_resolves_to_loopback_is_refused(
    listener: Listener, connects: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[egress.IPAddress]:
        asked.append(host)
        return [ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("127.0.0.1")]

    monkeypatch.setattr(egress, "resolve", resolve)
    # The name is allowed, on this port too: the address it resolves to is not.
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"rebind.example.com:{listener.port}")
    p = HttpPollParams.model_validate({"url": f"http://rebind.example.com:{listener.port}/"})
    with pytest.raises(EgressRefused, match=REFUSED):
        await _poll(p)
    assert asked == ["rebind.example.com"]
    assert connects == []
    assert listener.connections == 0


async def test_a_name_that_does_not_exist_reads_as_one_that_is_private(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error does not tell a name nobody has from one that leads somewhere private."""

    async def resolve(host: str, port: int) -> list[egress.IPAddress]:
        if host.startswith("missing"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address("10.1.2.3")]

    monkeypatch.setattr(egress, "resolve", resolve)
    texts = []
    for host in ("missing.example.com", "private.example.com"):
        p = HttpPollParams.model_validate({"url": f"http://{host}/"})
        with pytest.raises(EgressRefused) as caught:
            await _poll(p)
        texts.append(str(caught.value).replace(host, "HOST"))
    assert texts == [f"{REFUSED}: HOST:80"] * 2


async def test_a_redirect_to_a_denied_address_is_refused(
    site: Listener, listener: Listener, connects: list[tuple[str, int]]
) -> None:
    for target in (
        f"http://127.0.0.1:{listener.port}/",
        f"http://2130706433:{listener.port}/",
        f"http://localhost:{listener.port}/",
        "http://169.254.169.254/",
    ):
        p = HttpPollParams.model_validate({"url": f"http://127.0.0.1:{site.port}/to/{target}"})
        with pytest.raises(EgressRefused, match=REFUSED):
            await _poll(p)
    assert site.connections == 4
    assert listener.connections == 0
    assert set(connects) == {("127.0.0.1", site.port)}


async def test_an_allowlisted_address_and_port_connects_and_polls(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"127.0.0.1:{listener.port}")
    assert await _get(f"http://127.0.0.1:{listener.port}/") == (
        200,
        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",  # sha256("hello")
    )
    # Written another way, it is the same address.
    assert (await _poll(_unchecked(f"http://2130706433:{listener.port}/")))[0] == 200
    assert listener.connections == 2


async def test_an_allowed_host_on_another_port_is_refused(
    listener: Listener, connects: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    other = await Listener().start()
    try:
        monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"127.0.0.1:{other.port}, localhost")
        for url in (f"http://127.0.0.1:{listener.port}/", f"http://localhost:{listener.port}/"):
            with pytest.raises(ValidationError, match=REFUSED):
                HttpPollParams.model_validate({"url": url})
            with pytest.raises(EgressRefused, match=REFUSED):
                await _poll(_unchecked(url))
        # A name entry never opens a loopback address, even on its ports.
        monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"localhost:{listener.port}")
        with pytest.raises(EgressRefused, match=REFUSED):
            await _poll(_unchecked(f"http://localhost:{listener.port}/"))
        assert connects == []
        assert listener.connections == 0
    finally:
        other.close()


async def test_open_and_closed_ports_are_refused_alike(listener: Listener) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens once it is closed
    errors = []
    for port in (listener.port, closed):
        with pytest.raises(EgressRefused) as info:
            await _poll(_unchecked(f"http://127.0.0.1:{port}/"))
        errors.append((type(info.value), str(info.value).replace(str(port), "PORT")))
    assert errors[0] == errors[1] == (EgressRefused, f"{REFUSED}: 127.0.0.1:PORT")
    assert NotAllowed is EgressRefused
    assert listener.connections == 0


# ---------------------------------------------------------------- secrets
async def test_secrets_in_the_url_never_reach_a_log_line(
    site: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    url = (
        f"http://alice:pw-s3cret@127.0.0.1:{site.port}/x"
        "?api_key=K-s3cret&Token=T-s3cret&mine=M-s3cret&page=2"
    )
    # httpx's own lines are off at the services' level (``orch_contracts.logs``): shown, as a user
    # debugging may have them, they are masked.
    with (
        caplog.at_level(logging.DEBUG),
        caplog.at_level(logging.DEBUG, logger="httpx"),
        caplog.at_level(logging.DEBUG, logger="httpcore"),
    ):
        assert (await _get(url, secret_query=["mine"]))[0] == 200
        p = HttpPollParams.model_validate(
            {"url": f"http://127.0.0.1:{site.port}/to/{url}", "secret_query": ["mine"]}
        )
        assert (await _poll(p))[0] == 200
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "/x?" in text
    assert "page=2" in text
    for secret in ("alice", "pw-s3cret", "K-s3cret", "T-s3cret", "M-s3cret"):
        assert secret not in text


async def test_secrets_in_the_url_never_reach_an_error(listener: Listener) -> None:
    url = f"http://bob:pw-s3cret@127.0.0.1:{listener.port}/?api_key=K-s3cret&sig=S-s3cret"
    with pytest.raises(ValidationError) as invalid:
        HttpPollParams.model_validate({"url": url})
    with pytest.raises(EgressRefused) as refused:
        await _poll(_unchecked(url))
    for text in (str(invalid.value), str(refused.value)):
        assert REFUSED in text
        for secret in ("bob", "pw-s3cret", "K-s3cret", "S-s3cret"):
            assert secret not in text

    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}")

    p = HttpPollParams.model_validate(
        {"url": "https://example.com/?token=T-s3cret&x=M-s3cret&page=1", "secret_query": ["x"]}
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(fail)) as client:
        with pytest.raises(PollFailed) as failed:
            await fetch(client, p)
    assert str(failed.value) == (
        "ConnectError: cannot reach https://example.com/?token=***&x=***&page=1"
    )
    assert failed.value.__suppress_context__  # no traceback shows the original either


async def test_only_an_address_entry_opens_a_private_address_a_name_resolves_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = ["10.1.2.3"]

    async def resolve(host: str, port: int) -> list[egress.IPAddress]:
        return [ipaddress.ip_address(a) for a in answer]

    monkeypatch.setattr(egress, "resolve", resolve)
    by_net = EgressPolicy.parse("10.0.0.0/8:5432")
    assert await by_net.addresses("db.internal", 5432) == [ipaddress.ip_address("10.1.2.3")]
    with pytest.raises(EgressRefused):
        await by_net.addresses("db.internal", 5433)
    by_name = EgressPolicy.parse("db.internal:5432")
    with pytest.raises(EgressRefused):
        await by_name.addresses("db.internal", 5432)
    answer[:] = ["10.1.2.3", "127.0.0.1"]  # one denied address refuses the name
    with pytest.raises(EgressRefused):
        await by_net.addresses("db.internal", 5432)

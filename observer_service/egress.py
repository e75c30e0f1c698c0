"""Where kind code may connect: an egress policy, checked on the address actually connected to.

By default only **public** addresses on ports **80 and 443** are reachable. Loopback, private,
link-local, shared (CGNAT), multicast, unspecified, reserved and documentation addresses are
refused, IPv4 and IPv6 alike, however they are written (``127.1``, ``0177.0.0.1``,
``0x7f000001``, ``2130706433``, ``[::ffff:127.0.0.1]``, ``[::1]``) and whatever the address
embeds (IPv4-mapped, 6to4, Teredo and NAT64 IPv6 forms are judged by their IPv4 address).

An allowlist (``ORCH_HTTP_POLL_ALLOW`` for ``http_poll``) replaces that default: comma-separated
entries ``HOST[:PORT]``, where

- ``HOST`` is a name (``example.com``), a name and its subdomains (``*.example.com``), any host
  (``*``), an address (``192.0.2.10``, ``[2001:db8::1]``) or a network (``10.0.0.0/8``,
  ``[fd00::/8]``; an IPv6 entry without a port may leave out the brackets);
- ``PORT`` is a number or ``*`` (any port); without one, only 80 and 443.

A name entry lets the name through, but the addresses it resolves to must still be public. Only
an address or network entry opens a non-public address (on its ports), whatever name led there.
An empty allowlist means ``*`` (any host, ports 80 and 443, public addresses only).

The check happens where the connection is made: the name is resolved here, every address is
checked, and the socket is connected to a checked address (the Host header and TLS SNI keep the
name). So a redirect, or a DNS answer that changes between checks (rebinding), cannot get around
it; a denied address is never connected to. Every refusal reads the same, "refused by the egress
policy", whether or not something listens there, and so does a name that does not resolve (an
error does not tell a name that does not exist from one that is private).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The ports an entry without one (and the empty allowlist) opens.
DEFAULT_PORTS = frozenset({80, 443})
REFUSED = "refused by the egress policy"

_SCHEME_PORTS = {"http": 80, "https": 443}
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_NUMBER = re.compile(r"^(0[xX][0-9a-fA-F]*|[0-9]+)$")

# Not always judged right by ``is_global`` (and never for embedded IPv4): checked explicitly.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
#: Special-purpose blocks that some Python versions' ``is_global`` calls global: shared address
#: space, IETF protocol assignments, the 6to4 relay anycast, IPv6 documentation (RFC 9637).
_NOT_GLOBAL: tuple[IPNetwork, ...] = (
    ipaddress.IPv4Network("100.64.0.0/10"),
    ipaddress.IPv4Network("192.0.0.0/24"),
    ipaddress.IPv4Network("192.88.99.0/24"),
    ipaddress.IPv6Network("3fff::/20"),
)


class EgressRefused(Exception):
    """A connection the egress policy does not allow; no connection was attempted."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"{REFUSED}: {_authority(host, port)}")


# --------------------------------------------------------------------------- addresses
def parse_address(host: str) -> IPAddress | None:
    """The address ``host`` denotes when it is one, in any of the forms a resolver or a browser
    accepts (``127.1``, ``0x7f000001``, ``2130706433``, ``0177.0.0.1``, ``[::1]``); None for a
    name. Raises ValueError for what is neither (``1.2.3.4.5``, ``foo.0x1g``)."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    labels = text.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if not labels or not _NUMBER.match(labels[-1]):
        if ":" in text:
            raise ValueError(f"not an address: {host!r}")
        return None  # a name
    # Ends in a number: the legacy (inet_aton, WHATWG) IPv4 forms, or nothing valid.
    if len(labels) > 4:
        raise ValueError(f"not an address: {host!r}")
    numbers = []
    for label in labels:
        if not _NUMBER.match(label):
            raise ValueError(f"not an address: {host!r}")
        if label[:2].lower() == "0x":
            numbers.append(int(label[2:] or "0", 16))
        elif len(label) > 1 and label.startswith("0"):
            if not set(label) <= set("01234567"):
                raise ValueError(f"not an address: {host!r}")
            numbers.append(int(label, 8))
        else:
            numbers.append(int(label))
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        raise ValueError(f"not an address: {host!r}")
    value = last
    for i, n in enumerate(head):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for: IPv4-mapped, IPv4-compatible, 6to4, Teredo
    (its client), NAT64 (well-known prefix)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or (int(ip) >> 32 == 0 and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IPAddress) -> bool:
    """A globally reachable unicast address (and, for IPv6, nothing it embeds is otherwise)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id or ip in _NAT64_LOCAL or ip.is_site_local:
            return False
        inner = embedded_ipv4(ip)
        if ip in _NAT64 and inner is not None:
            return is_public(inner)  # the prefix itself lies in ::/8, which counts as reserved
        if inner is not None and not is_public(inner):
            return False
    if any(ip in net for net in _NOT_GLOBAL):
        return False
    return bool(
        ip.is_global
        and not (
            ip.is_private
            or ip.is_loopback
            or ip.is_link_local
            or ip.is_multicast
            or ip.is_unspecified
            or ip.is_reserved
        )
    )


# --------------------------------------------------------------------------- the allowlist
@dataclass(frozen=True)
class Rule:
    """One allowlist entry. Exactly one of ``name``, ``suffix``, ``net`` is set, or none (``*``)."""

    name: str | None = None
    suffix: str | None = None  # "example.com" for "*.example.com"
    net: IPNetwork | None = None
    #: None: any port.
    ports: frozenset[int] | None = DEFAULT_PORTS

    def port_ok(self, port: int) -> bool:
        return self.ports is None or port in self.ports

    def names(self, host: str) -> bool:
        """It lets the name ``host`` through (then only to public addresses)."""
        if self.net is not None:
            return False
        if self.name is not None:
            return host == self.name
        if self.suffix is not None:
            return host == self.suffix or host.endswith("." + self.suffix)
        return True  # "*"

    def covers(self, ip: IPAddress) -> bool:
        """It opens the address ``ip``, public or not."""
        if self.net is None or ip.version != self.net.version:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            ip = ipaddress.IPv6Address(ip.compressed.split("%")[0])
        return ip in self.net


def _parse_port(text: str, entry: str) -> frozenset[int] | None:
    if text == "*":
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port in allowlist entry {entry!r}")
    return frozenset({int(text)})


def _parse_entry(entry: str) -> Rule:
    host = entry
    ports: frozenset[int] | None = DEFAULT_PORTS
    if entry.startswith("["):
        inside, bracket, rest = entry[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"bad allowlist entry {entry!r}")
        host = inside
        ports = _parse_port(rest[1:], entry) if rest else DEFAULT_PORTS
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
        ports = _parse_port(port, entry)
    host = host.lower()
    if host in ("", ".", "*.") or host.endswith(".."):
        raise ValueError(f"bad allowlist entry {entry!r}")
    host = host.rstrip(".")
    if host == "*":
        return Rule(ports=ports)
    if host.startswith("*."):
        if not _NAME.match(host[2:]):
            raise ValueError(f"bad name in allowlist entry {entry!r}")
        return Rule(suffix=host[2:], ports=ports)
    try:
        return Rule(net=ipaddress.ip_network(host, strict=True), ports=ports)
    except ValueError as exc:
        if "/" in host or ":" in host:
            raise ValueError(
                f"bad address or network in allowlist entry {entry!r}: {exc}"
            ) from None
    try:
        legacy = parse_address(host)
    except ValueError:
        legacy = None
        if _NAME.match(host) and _NUMBER.match(host.rsplit(".", 1)[-1]):
            raise ValueError(f"bad allowlist entry {entry!r}") from None
    if legacy is not None:
        raise ValueError(f"write the address of allowlist entry {entry!r} as {legacy}")
    if not _NAME.match(host):
        raise ValueError(f"bad name in allowlist entry {entry!r}")
    return Rule(name=host, ports=ports)


@dataclass(frozen=True)
class EgressPolicy:
    rules: tuple[Rule, ...] = (Rule(),)

    @classmethod
    def parse(cls, allow: str) -> EgressPolicy:
        """The policy of an allowlist (see the module's doc); empty: the default policy.
        Raises ValueError naming the bad entry."""
        entries = [e.strip() for e in allow.split(",") if e.strip()]
        return cls(tuple(_parse_entry(e) for e in entries)) if entries else cls()

    def _names(self, host: str, port: int) -> bool:
        return any(r.names(host) and r.port_ok(port) for r in self.rules)

    def _any_host(self, port: int) -> bool:
        return any(
            r.name is None and r.suffix is None and r.net is None and r.port_ok(port)
            for r in self.rules
        )

    def address_allowed(self, ip: IPAddress, port: int, *, named: bool) -> bool:
        """``named``: the name that led here is let through by a name entry."""
        if any(r.covers(ip) and r.port_ok(port) for r in self.rules):
            return True
        return named and is_public(ip)

    def check(self, host: str, port: int) -> IPAddress | None:
        """What can be decided without resolving: raises EgressRefused for a denied address or
        a name nothing could let through on that port; the address, when ``host`` is one."""
        host = host.lower().rstrip(".")
        try:
            ip = parse_address(host)
        except ValueError:
            raise EgressRefused(host, port) from None
        if ip is not None:
            if not self.address_allowed(ip, port, named=self._any_host(port)):
                raise EgressRefused(host, port)
            return ip
        if not self._names(host, port) and not any(
            r.net is not None and r.port_ok(port) for r in self.rules
        ):
            raise EgressRefused(host, port)
        return None

    def allows_url(self, url: str | httpx.URL) -> bool:
        """The static check (no resolution) of a URL."""
        url = httpx.URL(url) if isinstance(url, str) else url
        try:
            self.check(url.host, url.port or _SCHEME_PORTS.get(url.scheme, 0))
        except EgressRefused:
            return False
        return True

    async def addresses(self, host: str, port: int) -> list[IPAddress]:
        """The addresses to connect to for ``host``: resolved (once, here), every one checked.
        Raises EgressRefused if any of them is denied, and for a name that does not resolve:
        the same words, so that an error does not tell a name that does not exist from one
        that leads somewhere private."""
        ip = self.check(host, port)
        if ip is not None:
            return [ip]
        try:
            found = await resolve(host.rstrip("."), port)
        except OSError:  # socket.gaierror: no such name (or no answer)
            raise EgressRefused(host, port) from None
        named = self._names(host.lower().rstrip("."), port)
        if not found or not all(self.address_allowed(a, port, named=named) for a in found):
            raise EgressRefused(host, port)
        return found


async def _getaddrinfo(host: str, port: int) -> list[IPAddress]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    out: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            ip = ipaddress.ip_address(str(sockaddr[0]))
            if ip not in out:
                out.append(ip)
    return out


#: The one place names are resolved (tests replace it).
resolve: Callable[[str, int], Awaitable[list[IPAddress]]] = _getaddrinfo


# --------------------------------------------------------------------------- httpx wiring
class PolicyBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the policy allows."""

    def __init__(self, policy: EgressPolicy, inner: httpcore.AsyncNetworkBackend | None = None):
        self.policy = policy
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                found = await self.policy.addresses(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} took too long") from None
        error: Exception | None = None
        for ip in found:
            try:
                return await self.inner.connect_tcp(
                    str(ip),
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("unix socket", 0)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The one TLS context of every client here (made once: a context loads the CA bundle,
    about 40 ms of CPU and 830 KiB that a closed client kept until the process ended; a
    context serves any number of connections)."""
    return httpx.create_ssl_context()


class PolicyTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a ``PolicyBackend``; never through a proxy."""

    def __init__(self, policy: EgressPolicy, limits: httpx.Limits | None = None) -> None:
        super().__init__(verify=ssl_context(), trust_env=False)
        limits = limits or httpx.Limits()
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=PolicyBackend(policy),
        )


def client(policy: EgressPolicy, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client under ``policy``: every request and every redirect is checked before it
    is sent (the name and port), every connection where it is made (the resolved address).
    No proxies and no credentials from the environment."""

    async def check(request: httpx.Request) -> None:
        # The ASCII (IDNA) form, as it is resolved: allowlist entries are matched in it.
        host = request.url.raw_host.decode("ascii")
        policy.check(host, request.url.port or _SCHEME_PORTS.get(request.url.scheme, 0))

    hooks = kwargs.pop("event_hooks", {})
    hooks = {**hooks, "request": [check, *hooks.get("request", [])]}
    return httpx.AsyncClient(
        transport=PolicyTransport(policy), trust_env=False, event_hooks=hooks, **kwargs
    )


def _authority(host: str, port: int) -> str:
    host = host if ":" not in host or host.startswith("[") else f"[{host}]"
    return f"{host}:{port}" if port else host

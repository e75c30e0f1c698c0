"""PostgreSQL URLs with one host or several, in the forms people write and the forms drivers take.

Two ways to name several hosts are accepted:

- libpq's: ``postgresql://u@h1:5432,h2:5442/db?target_session_attrs=read-write``
- SQLAlchemy's: ``postgresql://u@/db?host=h1:5432&host=h2:5442&target_session_attrs=read-write``
  (also ``host=h1,h2&port=5432,5442``).

The one internal form (``ORCH_DATABASE_URL`` once validated, what SQLAlchemy engines and Alembic
are given) is SQLAlchemy's, with the asyncpg driver: one host stays in the authority
(``postgresql+asyncpg://u@h:5432/db``), several become repeated ``host=host:port`` parameters,
each with its port. Plain asyncpg gets libpq's form (``to_asyncpg``): asyncpg would keep only the
last of repeated ``host`` parameters. Both drivers honour ``target_session_attrs``.
"""

from __future__ import annotations

from urllib.parse import quote, urlencode

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

DEFAULT_PORT = 5432
_SCHEMES = ("postgresql", "postgres")


class BadDatabaseUrl(ValueError):
    """The URL cannot be read; the message never contains the URL itself."""


def parse(value: str) -> URL:
    """The canonical SQLAlchemy URL of ``value`` (either form, any postgres driver)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.partition("+")[0].lower() not in _SCHEMES:
        raise BadDatabaseUrl("is not a postgresql:// URL")
    authority_end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:authority_end], rest[authority_end:]
    creds, at, hostlist = authority.rpartition("@")
    listed: list[tuple[str, int | None]] = []
    if "," in hostlist:  # libpq's list in the authority: make_url cannot read it
        listed = [_host_port(spec) for spec in hostlist.split(",")]
        value = f"{scheme}://{creds}{at}{tail}"
    try:
        url = make_url(value)
    except (ArgumentError, ValueError) as exc:
        raise BadDatabaseUrl("cannot be parsed") from exc
    query = dict(url.query)
    from_query = _query_hosts(query)
    if from_query and (listed or url.host):
        raise BadDatabaseUrl("names hosts both before the path and in host= parameters")
    hosts = listed or from_query
    url = url.set(drivername="postgresql+asyncpg")
    if len(hosts) == 1 and not hosts[0][0].startswith("/"):
        host, port = hosts[0]
        return url.set(host=host, port=port, query=query)
    if len(hosts) > 1:
        for host, _ in hosts:
            if ":" in host:
                raise BadDatabaseUrl("an IPv6 address cannot be one of several hosts; use a name")
        query["host"] = tuple(f"{h}:{p or DEFAULT_PORT}" for h, p in hosts)
        return url.set(host=None, port=None, query=query)
    if hosts:  # one unix-socket directory: it stays a parameter
        query["host"] = hosts[0][0]
        if hosts[0][1] is not None:
            query["port"] = str(hosts[0][1])
    return url.set(query=query)


def normalize(value: str) -> str:
    """``value`` in the canonical form, as a string (password included)."""
    return parse(value).render_as_string(hide_password=False)


def hosts(url: str) -> list[tuple[str, int]]:
    """Every (host, port) ``url`` names, in order (a default port filled in)."""
    u = parse(url)
    listed = u.query.get("host")
    if isinstance(listed, tuple):
        return [_split_canonical(token) for token in listed]
    if isinstance(listed, str):
        return [(listed, int(str(u.query.get("port") or DEFAULT_PORT)))]
    return [(u.host or "localhost", u.port or DEFAULT_PORT)]


def to_asyncpg(url: str) -> str:
    """``url`` as plain asyncpg takes it: libpq's form, every host in the authority."""
    u = parse(url).set(drivername="postgresql")
    listed = u.query.get("host")
    if not isinstance(listed, tuple):
        return u.render_as_string(hide_password=False)
    query = {k: v for k, v in u.query.items() if k not in ("host", "port")}
    bare = u.set(host=None, port=None, query={}).render_as_string(hide_password=False)
    scheme, _, rest = bare.partition("://")
    creds, _, path = rest.partition("/")
    hostlist = ",".join(f"{quote(h, safe='')}:{p}" for h, p in map(_split_canonical, listed))
    params = f"?{urlencode(query, doseq=True)}" if query else ""
    return f"{scheme}://{creds}{hostlist}/{path}{params}"


def with_database(url: str, database: str) -> str:
    """The same servers and credentials, another database (canonical form)."""
    return parse(url).set(database=database).render_as_string(hide_password=False)


def _host_port(spec: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` of libpq's host list."""
    if spec.startswith("["):
        host, close, port = spec[1:].partition("]")
        if not close or (port and not port.startswith(":")):
            raise BadDatabaseUrl("has an IPv6 address without its closing bracket")
        port = port[1:]
    else:
        host, _, port = spec.partition(":")
    if not host:
        raise BadDatabaseUrl("has an empty host in its host list")
    return host, _port(port)


def _query_hosts(query: dict[str, str | tuple[str, ...]]) -> list[tuple[str, int | None]]:
    """The hosts of SQLAlchemy's ``host=`` parameters, taken out of ``query``."""
    raw = query.pop("host", None)
    if raw is None:
        return []
    raw_ports = query.pop("port", None)
    if isinstance(raw, tuple):  # host=h1:p1&host=h2:p2
        if raw_ports is not None:
            raise BadDatabaseUrl('mixes "host=h:p&host=…" with a port= parameter')
        return [_host_port(token) for token in raw]
    names = raw.split(",")
    ports = [] if raw_ports is None else ",".join(_as_tuple(raw_ports)).split(",")
    if len(names) == 1 and not ports and not names[0].startswith("/"):
        return [_host_port(names[0])]
    if ports and len(ports) not in (1, len(names)):
        raise BadDatabaseUrl("names a different number of hosts and ports")
    if len(ports) == 1:
        ports = ports * len(names)
    return [(name, _port(ports[i]) if ports else None) for i, name in enumerate(names)]


def _as_tuple(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return value if isinstance(value, tuple) else (value,)


def _port(text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise BadDatabaseUrl("has a port that is not a number from 1 to 65535")
    return int(text)


def _split_canonical(token: str) -> tuple[str, int]:
    host, _, port = token.rpartition(":")
    return host, int(port)


def each_host(url: str) -> list[str]:
    """One asyncpg DSN per host ``url`` names, in order, each otherwise the same."""
    u = parse(url)
    query = {k: v for k, v in u.query.items() if k not in ("host", "port")}
    out = []
    for host, port in hosts(url):
        if host.startswith("/"):  # a unix-socket directory stays a parameter
            one = u.set(host=None, port=None, query={**query, "host": host, "port": str(port)})
        else:
            one = u.set(host=host, port=port, query=query)
        out.append(to_asyncpg(one.render_as_string(hide_password=False)))
    return out

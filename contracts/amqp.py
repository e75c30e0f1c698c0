"""Connecting to one broker of several: ``ORCH_AMQP_URL`` may list the nodes of a RabbitMQ
cluster, comma-separated. A connection goes to the first node in the list that answers; after a
lost connection the node it was on is tried last, so a reconnect does not wait on a dead
node's timeout first. (To spread a fleet over the nodes, list them in a different order per
deployment, or put one load-balanced address in front of them.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aio_pika
from aio_pika.abc import AbstractConnection

from orch_contracts.errors import BrokerRefused, convert_broker_error
from orch_contracts.settings import split_urls, where

__all__ = ["connect_first", "split_urls"]


async def connect_first(
    urls: Sequence[str], *, lost: str | None = None, **kwargs: Any
) -> tuple[AbstractConnection, str]:
    """A connection to the first of ``urls`` that answers, and its URL; ``lost``, the URL of a
    connection just lost, is tried last. Raises the last node's error, naming every node tried
    when there are several."""
    if not urls:
        raise ValueError("no broker URL")
    errors: list[str] = []
    last: BaseException | None = None
    for url in sorted(urls, key=lambda u: u == lost):  # stable: the list's order otherwise
        try:
            connection: AbstractConnection = await aio_pika.connect(url, **kwargs)
        except Exception as exc:
            converted = convert_broker_error(exc)
            if converted is exc or isinstance(converted, BrokerRefused):
                raise  # a bug; or a refusal, which every node of a cluster gives alike
            errors.append(f"{where(url)}: {exc or type(exc).__name__}")
            last = exc
            continue
        return connection, url
    assert last is not None
    if len(urls) == 1:
        raise last
    raise ConnectionError("no broker node answered (" + "; ".join(errors) + ")") from last

"""Several broker nodes in ``ORCH_AMQP_URL``: the settings take the list, and a connection goes
to the first node that answers, the node of a lost connection last."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from orch_contracts.amqp import connect_first
from orch_contracts.errors import StartupError
from orch_contracts.preflight import check_broker
from orch_contracts.settings import CommonSettings
from tests.conftest import Servers


def closed_port() -> str:
    """The URL of a node that refuses connections (a port nobody listens on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"amqp://guest:guest@127.0.0.1:{port}/"


def test_the_settings_take_a_comma_separated_list_of_nodes() -> None:
    s = CommonSettings(amqp_url=" amqp://a:p@h1:5672/v , amqps://a:p@h2:5671/v?x=1 ,")
    assert s.amqp_urls == [
        "amqp://a:p@h1:5672/v?heartbeat=5",
        "amqps://a:p@h2:5671/v?x=1&heartbeat=5",
    ]
    with pytest.raises(ValidationError, match="ORCH_AMQP_URL must look like") as info:
        CommonSettings(amqp_url="amqp://a:secretpw@h1/,http://h2/")
    assert "secretpw" not in str(info.value)


async def test_a_connection_goes_to_the_first_node_that_answers(servers: Servers) -> None:
    dead = closed_port()
    connection, url = await connect_first([dead, servers.amqp_url], timeout=5)
    async with connection:
        assert url == servers.amqp_url
    # The node just lost is tried last, even when it is first in the list and answers.
    other = servers.amqp_url.replace("127.0.0.1", "localhost")
    connection, url = await connect_first([servers.amqp_url, other], lost=servers.amqp_url)
    async with connection:
        assert url == other


async def test_no_node_answering_names_every_node_and_no_password() -> None:
    nodes = [closed_port().replace("guest:guest", "u:secretpw"), closed_port()]
    with pytest.raises(StartupError) as info:
        await check_broker(CommonSettings(amqp_url=",".join(nodes)))
    message = str(info.value)
    assert all(n.split("@")[1] in message for n in nodes), message
    assert "secretpw" not in message

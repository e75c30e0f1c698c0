"""The error queue's length limit, set as a broker policy (queue arguments are fixed at
declaration, so a running deployment cannot be changed by redeclaring): ``orch broker-policy``.

Applied with ``rabbitmqctl`` on the broker's machine, or through the management API where it
runs (compose does); otherwise the command prints what to run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from urllib.parse import quote, urlsplit

import httpx

from orch_contracts.topology import Topology


def policy(topology: Topology, max_length: int) -> tuple[str, str, dict[str, object]]:
    """(name, queue pattern, definition): keep the newest ``max_length`` messages."""
    name = f"{topology.prefix}-errors-limit"
    pattern = f"^{re.escape(topology.error_queue)}$"
    return name, pattern, {"max-length": max_length, "overflow": "drop-head"}


def rabbitmqctl_args(topology: Topology, max_length: int, vhost: str) -> list[str]:
    name, pattern, definition = policy(topology, max_length)
    return [
        "rabbitmqctl",
        "set_policy",
        "-p",
        vhost,
        name,
        pattern,
        json.dumps(definition),
        "--apply-to",
        "queues",
        "--priority",
        "10",
    ]


def vhost_of(amqp_url: str) -> str:
    path = urlsplit(amqp_url).path
    return path[1:] if len(path) > 1 else "/"


def apply_with_rabbitmqctl(topology: Topology, max_length: int, vhost: str) -> str:
    if shutil.which("rabbitmqctl") is None:
        raise RuntimeError("rabbitmqctl is not on this machine")
    result = subprocess.run(
        rabbitmqctl_args(topology, max_length, vhost), capture_output=True, text=True, timeout=60
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip() or result.stdout.strip())
    return "applied with rabbitmqctl"


def apply_with_management(
    topology: Topology, max_length: int, amqp_url: str, management_url: str
) -> str:
    """PUT the policy through the management API, with the AMQP URL's user and password."""
    parts = urlsplit(amqp_url)
    name, pattern, definition = policy(topology, max_length)
    url = (
        f"{management_url.rstrip('/')}/api/policies/"
        f"{quote(vhost_of(amqp_url), safe='')}/{quote(name, safe='')}"
    )
    body = {"pattern": pattern, "definition": definition, "apply-to": "queues", "priority": 10}
    r = httpx.put(
        url, json=body, auth=(parts.username or "guest", parts.password or ""), timeout=30
    )
    if r.status_code >= 300:
        raise RuntimeError(f"the management API answered {r.status_code}: {r.text[:200]}")
    return "applied through the management API"

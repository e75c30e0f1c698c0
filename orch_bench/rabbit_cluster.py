"""A throw-away RabbitMQ cluster on this machine: extra nodes of the installed ``rabbitmq-server``,
each with its own node name, ports, data, logs and Erlang cookie, joined into one cluster. The
machine's own broker is never touched. The tests start one for the quorum-queue and node-loss
tests, and ``orch bench`` for its node-loss scenario.

Each node runs the server's own start script (not the ``/usr/sbin`` wrapper, which switches user
and resets HOME, where the cookie lives), configured only by the files and variables set here:
the machine's ``rabbitmq.conf``, ``rabbitmq-env.conf`` and enabled plugins are not read.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orch.cluster import free_port

SBIN = Path(os.environ.get("ORCH_RABBITMQ_SBIN", "/usr/lib/rabbitmq/bin"))


def available() -> str | None:
    """Why a cluster cannot be started here, or None when it can."""
    if not (SBIN / "rabbitmq-server").exists():
        return f"no rabbitmq-server in {SBIN} (set ORCH_RABBITMQ_SBIN)"
    if shutil.which("erl") is None and not Path("/usr/lib/erlang/bin/erl").exists():
        return "Erlang is not installed"
    return None


@dataclass
class Node:
    name: str
    port: int
    dist_port: int
    home: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def pid(self) -> int | None:
        path = self.home / "pid"
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None


@dataclass
class RabbitCluster:
    """``size`` nodes under ``root``; ``start()`` brings them up joined, ``stop()`` ends every
    one of them and removes their files."""

    size: int = 3
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-rabbit-")))
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        tag = secrets.token_hex(3)
        cookie = secrets.token_hex(16).upper()
        for i in range(self.size):
            home = self.root / f"n{i}"
            home.mkdir(parents=True)
            (home / ".erlang.cookie").write_text(cookie)
            (home / ".erlang.cookie").chmod(0o400)
            (home / "enabled_plugins").write_text("[].\n")
            port, dist = free_port(), free_port()
            # Fast failure detection: a lost node is seen by its peers in seconds, as a quorum
            # queue's leader election needs; the rest is the server's defaults.
            (home / "rabbitmq.conf").write_text(
                f"listeners.tcp.local = 127.0.0.1:{port}\n"
                "loopback_users = none\n"
                "cluster_partition_handling = pause_minority\n"
            )
            name = f"orch{tag}n{i}@localhost"
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))},
                "HOME": str(home),
                "RABBITMQ_NODENAME": name,
                "RABBITMQ_NODE_PORT": str(port),
                "RABBITMQ_DIST_PORT": str(dist),
                "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq.conf"),
                "RABBITMQ_CONF_ENV_FILE": "/dev/null",
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
                "RABBITMQ_LOG_BASE": str(home / "log"),
                "RABBITMQ_PID_FILE": str(home / "pid"),
                "ERL_EPMD_ADDRESS": "127.0.0.1",
                "ERL_FLAGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            }
            self.nodes.append(Node(name, port, dist, home, env))

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def amqp_url(self) -> str:
        """Every node, comma-separated, as ``ORCH_AMQP_URL`` takes them."""
        return ",".join(self.urls)

    def first(self, node: Node) -> str:
        """``ORCH_AMQP_URL`` for a process that should connect to ``node`` (the rest after)."""
        return ",".join([node.url, *(u for u in self.urls if u != node.url)])

    def queue(self, name: str) -> dict[str, Any]:
        """A queue's type, leader, members and online members, as the cluster reports them."""
        for node in self.nodes:
            try:
                out = self.ctl(
                    node, "list_queues", "name", "type", "leader", "members", "online",
                    "--formatter", "json", timeout=30,
                )  # fmt: skip
            except (RuntimeError, subprocess.TimeoutExpired):
                continue  # that node is down: ask another
            for q in json.loads(out):
                if q["name"] == name:
                    return dict(q)
            raise LookupError(f"no queue {name} on the cluster")
        raise RuntimeError("no node of the cluster answers")

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def ctl(self, node: Node, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl`` against one node; raises with its output when it fails."""
        result = subprocess.run(
            [str(SBIN / "rabbitmqctl"), "-n", node.name, *args],
            env=node.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {node.name}: "
                f"{(result.stderr or result.stdout).strip()[-500:]}"
            )
        return result.stdout

    def launch(self, node: Node) -> None:
        """Start a node's VM (returns at once; ``wait_up`` waits for it)."""
        subprocess.run(
            [str(SBIN / "rabbitmq-server"), "-detached"],
            env=node.env,
            check=True,
            capture_output=True,
            timeout=60,
        )

    def wait_up(self, node: Node) -> None:
        self.ctl(node, "wait", "--timeout", "60", str(node.home / "pid"), timeout=90)

    def start_node(self, node: Node) -> None:
        """Start a node that was stopped or killed; it rejoins its cluster by itself."""
        self.launch(node)
        self.wait_up(node)

    def start(self) -> None:
        """Start every node and join them to the first; on failure nothing is left running."""
        try:
            for node in self.nodes:
                self.launch(node)  # all at once: each takes seconds to boot
            for node in self.nodes:
                self.wait_up(node)
            first = self.nodes[0]
            for node in self.nodes[1:]:
                self.ctl(node, "stop_app")
                self.ctl(node, "join_cluster", first.name)
                self.ctl(node, "start_app")
            self.wait_running(len(self.nodes))
        except BaseException:
            self.stop()
            raise

    def running(self, via: Node | None = None) -> set[str]:
        """Names of the nodes the cluster counts as running, asked of ``via`` (default: the
        first node that answers)."""
        for node in [via] if via is not None else self.nodes:
            assert node is not None
            try:
                out = self.ctl(node, "cluster_status", "--formatter", "json", timeout=30)
            except (RuntimeError, subprocess.TimeoutExpired):
                continue
            return set(json.loads(out).get("running_nodes", []))
        return set()

    def wait_running(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.running()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster did not reach {count} running nodes")
            time.sleep(0.5)

    def kill(self, node: Node) -> None:
        """SIGKILL the node's Erlang VM: a machine lost, not a clean stop."""
        pid = node.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop every node (killed if it will not stop) and remove the files."""
        for node in self.nodes:
            pid = node.pid()
            if pid is None or not _alive(pid):
                continue
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.ctl(node, "stop", timeout=30)
            self.kill(node)
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our child, not reaped) counts as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True

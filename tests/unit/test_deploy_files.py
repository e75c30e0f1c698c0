"""compose.yaml and the Dockerfile, checked without Docker: services, settings, broker config."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from observer_service.kinds.http_poll import HttpPollSettings
from observer_service.settings import ServiceSettings
from orch_manager.settings import ManagerSettings

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def test_compose_has_the_services() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    assert {"postgres", "rabbitmq", "migrate", "manager", "observer-service"} <= set(services)
    scalable = services["observer-service"]
    assert "container_name" not in scalable, "a fixed name prevents --scale"
    assert "ports" not in scalable, "a published port prevents --scale"
    assert scalable["command"][0] == "service"
    assert services["migrate"]["command"] == ["migrate"]


def test_long_running_services_are_started_again_when_they_exit() -> None:
    """A manager stops on a bug in a background loop, any process after waiting too long for
    its servers: a supervisor must start it again. One-shot jobs are not restarted."""
    services = _compose()["services"]
    assert isinstance(services, dict)
    for name, spec in services.items():
        one_shot = name.startswith(("migrate", "broker-policy", "broker-users"))
        assert (spec.get("restart") == "unless-stopped") != one_shot, name


def orch_env_names() -> set[str]:
    """Every ORCH_ variable something reads: a settings field of either process, a built-in
    kind's own setting (``ORCH_HTTP_POLL_ALLOW``), or an option of the ``orch`` command
    (``ORCH_API``, ``ORCH_TOKEN``, ``ORCH_WAIT``)."""
    fields = {*ManagerSettings.model_fields, *ServiceSettings.model_fields}
    names = {f"ORCH_{n.upper()}" for n in fields}
    names |= {f"ORCH_HTTP_POLL_{n.upper()}" for n in HttpPollSettings.model_fields}
    stack = [_orch_group()]
    while stack:
        command = stack.pop()
        for p in command.params:
            names |= {p.envvar} if isinstance(p.envvar, str) else set(p.envvar or ())
        stack += getattr(command, "commands", {}).values()
    return names


def test_compose_env_names_are_settings() -> None:
    text = (ROOT / "compose.yaml").read_text()
    used = set(re.findall(r"\b(ORCH_[A-Z_]+)\s*:", text))
    assert used, "compose.yaml sets no ORCH_ variables"
    assert used <= orch_env_names(), f"unknown settings in compose.yaml: {used - orch_env_names()}"


def test_broker_config_raises_the_consumer_timeout() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    mounts = services["rabbitmq"]["volumes"]
    assert any("rabbitmq.conf" in m for m in mounts)
    conf = (ROOT / "deploy" / "rabbitmq.conf").read_text()
    value = int(re.search(r"^consumer_timeout\s*=\s*(\d+)", conf, re.M).group(1))  # type: ignore[union-attr]
    assert value >= 24 * 3600 * 1000


def _services_in(profile: str | None) -> dict[str, dict[str, Any]]:
    """compose's services that run with ``profile`` (None: the default, no profile)."""
    services = _compose()["services"]
    assert isinstance(services, dict)
    return {
        name: s
        for name, s in services.items()
        if (profile in s.get("profiles", ())) or (profile is None and "profiles" not in s)
    }


def test_the_default_profile_is_the_single_broker_setup() -> None:
    default = _services_in(None)
    assert set(default) == {
        "postgres",
        "rabbitmq",
        "migrate",
        "broker-users",
        "broker-policy",
        "manager",
        "observer-service",
    }
    for name, service in default.items():
        assert set(service.get("depends_on", ())) <= set(default), f"{name} needs a profile"


def test_the_rabbitmq_cluster_profile_clusters_three_nodes_with_quorum_queues() -> None:
    from orch_contracts.settings import CommonSettings

    profile = _services_in("rabbitmq-cluster")
    nodes = {n: s for n, s in profile.items() if _is_broker_node(s)}
    assert len(nodes) == 3
    hosts = {s["hostname"] for s in nodes.values()}
    assert len(hosts) == 3, "each node needs a hostname of its own (it is its node name)"
    cookies = {s["environment"]["RABBITMQ_ERLANG_COOKIE"] for s in nodes.values()}
    assert len(cookies) == 1, "nodes join only a cluster whose Erlang cookie they share"
    conf = (ROOT / "deploy" / "rabbitmq-cluster.conf").read_text()
    assert re.search(r"^cluster_formation\.peer_discovery_backend = classic_config$", conf, re.M)
    listed = set(re.findall(r"^cluster_formation\.classic_config\.nodes\.\d+ = (\S+)$", conf, re.M))
    assert listed == {f"rabbit@{h}" for h in hosts}
    for name, node in nodes.items():
        mounted = " ".join(node["volumes"])
        assert "rabbitmq-cluster.conf" in mounted, name
        assert "deploy/rabbitmq.conf" in mounted, f"{name}: the consumer timeout is needed too"
    clients = {n: s for n, s in profile.items() if "build" in s}
    assert {s["command"][0] for s in clients.values()} >= {"migrate", "manager", "service"}
    for name, client in clients.items():
        env = client["environment"]
        assert env["ORCH_QUEUE_TYPE"] == "quorum", name
        urls = env["ORCH_AMQP_URL"].split(",")
        assert {re.sub(r".*@([^:/]+).*", r"\1", u) for u in urls} == hosts, name
        assert not set(client.get("depends_on", ())) & (set(_services_in(None)) - {"postgres"}), (
            f"{name} waits for a service of the default profile"
        )
        filled = re.sub(r"\$\{[^}]*\}", "secret", env["ORCH_AMQP_URL"])
        assert CommonSettings(amqp_url=filled, queue_type="quorum").amqp_url == filled


def _is_broker_node(service: dict[str, Any]) -> bool:
    """A RabbitMQ node (not a one-shot that only runs the image's rabbitmqctl)."""
    return str(service.get("image", "")).startswith("rabbitmq:") and "entrypoint" not in service


#: The user each process connects to the broker as, by its command.
ROLE_USERS = {
    "migrate": "orch-manager",
    "manager": "orch-manager",
    "service": "orch-service",
    "broker-policy": "admin",
}


def test_each_process_connects_as_its_role_on_the_systems_own_vhost() -> None:
    """One vhost for the system, one broker user per role (deploy/rabbitmq-users.sh makes them
    before anything connects); the administrator only sets the policy."""
    services = _compose()["services"]
    assert isinstance(services, dict)
    setups = {n: s for n, s in services.items() if n.startswith("broker-users")}
    assert set(setups) == {"broker-users", "broker-users-cluster"}
    for setup in setups.values():
        assert setup["entrypoint"] == ["sh", "/deploy/rabbitmq-users.sh"]
        assert any(m.startswith("./deploy/rabbitmq-users.sh:") for m in setup["volumes"])
    vhosts = {s["environment"]["VHOST"] for s in setups.values()}
    assert vhosts == {"orchestrator"}
    for name, service in services.items():
        if "build" not in service:
            continue
        env = service["environment"]
        user = ROLE_USERS[service["command"][0]]
        for url in env["ORCH_AMQP_URL"].split(","):
            parts = re.match(r"amqp://([^:]+):[^@]+@[^/]+/(.*)$", url)
            assert parts is not None, f"{name}: {url}"
            assert parts.groups() == (user, "orchestrator"), f"{name} connects as {parts.groups()}"
        assert {s["environment"]["PREFIX"] for s in setups.values()} == {env["ORCH_PREFIX"]}
        if service["command"][0] != "migrate":  # the one that never touches the broker
            needs = set(service.get("depends_on", ()))
            assert needs & set(setups), f"{name} may connect before its user exists"
    for name, service in services.items():
        if _is_broker_node(service):
            assert service["environment"]["RABBITMQ_DEFAULT_USER"] == "admin", name


def _permissions(tmp_path: Path, prefix: str) -> dict[str, tuple[str, str, str]]:
    """What deploy/rabbitmq-users.sh grants, by user: (configure, write, read), run against a
    rabbitmqctl that only writes down what it is asked."""
    calls = tmp_path / "calls"
    fake = tmp_path / "rabbitmqctl"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" >> {calls}; printf "\\n" >> {calls}\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "PREFIX": prefix,
        "MANAGER_PASSWORD": "m",
        "SERVICE_PASSWORD": "s",
    }
    subprocess.run(["sh", str(ROOT / "deploy" / "rabbitmq-users.sh")], env=env, check=True)
    granted = {}
    for line in calls.read_text().splitlines():
        args = line.split("\0")[:-1]
        if args[:2] == ["-q", "set_permissions"]:
            assert args[2:4] == ["-p", "orchestrator"]
            granted[args[4]] = (args[5], args[6], args[7])
    return granted


@pytest.mark.parametrize("prefix", ["orch", "t1.2"])
def test_the_broker_users_get_only_their_roles_names(tmp_path: Path, prefix: str) -> None:
    granted = _permissions(tmp_path, prefix)
    assert set(granted) == {"orch-manager", "orch-service"}
    shared = [f"{prefix}.{n}" for n in ("work", "errors", "dead-letter", "control")]
    own = f"{prefix}.control.{uuid.uuid4()}"
    outside = [
        f"{prefix}.other",
        f"{prefix}.control.x",
        f"{prefix}.workers",
        f"x{prefix}.work",
        "amq.gen-1",
        "amq.topic",
        "other.work",
    ]
    if "." in prefix:  # an escaped dot: "t1x2.work" is not ours
        outside.append(prefix.replace(".", "x") + ".work")

    def allows(regex: str, name: str) -> bool:
        return re.search(regex, name) is not None

    manager, service = granted["orch-manager"], granted["orch-service"]
    for perms, extra in ((manager, []), (service, [own])):
        configure, write, _read = perms
        for name in [*shared, *extra]:
            assert allows(configure, name), name
            assert allows(write, name), name
        assert allows(write, "amq.default"), "starts are published to the default exchange"
        for name in outside:
            assert not any(allows(r, name) for r in perms), name
    # The manager consumes nothing and owns no control queue: read only what its
    # declarations need (the work queue's dead-lettering, the error queue's binding).
    assert not any(allows(r, own) for r in manager)
    assert not allows(manager[2], f"{prefix}.control")
    assert allows(service[2], own)
    assert allows(service[2], f"{prefix}.work")


def test_servers_keep_their_data_in_volumes() -> None:
    compose = _compose()
    services, declared = compose["services"], compose["volumes"]
    assert isinstance(services, dict)
    assert isinstance(declared, dict)
    data_dirs = {"postgres:": "/var/lib/postgresql/data", "rabbitmq:": "/var/lib/rabbitmq"}
    volumes: list[str] = []
    for name, service in services.items():
        mounts = [m.split(":") for m in service.get("volumes", [])]
        named = {target: source for source, target, *_ in mounts if not source.startswith(".")}
        volumes += named.values()
        for image, data_dir in data_dirs.items():
            if service.get("image", "").startswith(image) and "entrypoint" not in service:
                assert data_dir in named, f"{name} keeps its data in the container"
        if _is_broker_node(service):
            assert "hostname" in service, f"{name}: its node name (its data's name) must not change"
    assert set(volumes) == set(declared), "a volume is used but not declared, or not used"
    assert len(volumes) == len(set(volumes)), "two services share a data volume"


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for package in ("contracts", "manager", "observer_service", "migrations", "orch", "orch_bench"):
        assert f"COPY {package} {package}" in text
    assert "COPY src src" in text, "the links that give the folders their import names"
    assert 'ENTRYPOINT ["orch"]' in text


def _orch_group() -> Any:
    """The ``orch`` command as click sees it (typer's own copy of click: duck-typed here)."""
    import typer.main

    from orch.cli import app

    return typer.main.get_group(app)


def _orch_commands() -> set[str]:
    return set(_orch_group().commands)


def orch_command(argv: Sequence[str]) -> Any:
    """What ``orch *argv`` would run, parsed but not run (its click context: ``.params``); fails
    when there is no such command or it does not take those options and arguments."""
    command, words, path = _orch_group(), list(argv), ["orch"]
    while hasattr(command, "commands"):
        assert words, f"`{' '.join(path)}` needs a sub-command"
        name = words.pop(0)
        assert name in command.commands, f"`{' '.join(path)} {name}` is no command"
        command, path = command.commands[name], [*path, name]
    try:
        return command.make_context(" ".join(path), list(words))
    except Exception as exc:  # click's usage errors: an unknown option, a bad value
        raise AssertionError(f"`{' '.join([*path, *words])}`: {exc}") from exc


def test_every_compose_command_is_an_orch_command_and_every_file_exists() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    for name, service in services.items():
        if "build" in service:
            orch_command(service["command"])
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
        check = service.get("healthcheck", {}).get("test", [])
        if check[:2] == ["CMD", "orch"]:
            orch_command(check[2:])


def test_compose_variables_are_all_in_the_env_example() -> None:
    text = (ROOT / "compose.yaml").read_text()
    needed = set(re.findall(r"\$\{([A-Z_]+)[:?}]", text))
    example = (ROOT / ".env.example").read_text()
    defined = set(re.findall(r"^([A-Z_]+)=", example, re.M))
    assert needed, "compose.yaml takes nothing from .env"
    assert needed <= defined, f"missing from .env.example: {needed - defined}"
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_compose_publishes_nothing_beyond_this_machine() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    assert "guest" not in (ROOT / "compose.yaml").read_text()


def test_the_image_runs_unprivileged_with_a_healthcheck_and_cached_dependencies() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    text = "\n".join(lines)
    assert "USER orch" in lines
    assert lines.index("USER orch") > max(i for i, ln in enumerate(lines) if ln.startswith("RUN"))
    assert re.search(r'^HEALTHCHECK .*CMD \["orch", "health"\]', text, re.M)
    assert "health" in _orch_commands()
    lock_install = lines.index("RUN pip install -r requirements.lock")
    first_code = min(i for i, ln in enumerate(lines) if ln.startswith("COPY contracts"))
    assert lock_install < first_code, "dependencies must be a layer of their own, before the code"
    assert "COPY orch_bench orch_bench" in lines, "the image ships orch bench"
    for copied in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / copied).exists(), f"the Dockerfile copies {copied}, which is missing"


def test_the_lock_pins_every_dependency() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = (ROOT / "requirements.lock").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock, re.M))
    pinned = {k.lower().replace("_", "-"): v for k, v in pinned.items()}
    for requirement in project["dependencies"]:
        name = re.split(r"[\[><=!~ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pinned, f"{name} is not in requirements.lock (uv pip compile …)"


def _has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _has_compose(), reason="no docker compose here")
def test_docker_compose_config_accepts_the_compose_file() -> None:
    done = subprocess.run(
        ["docker", "compose", "config", "--quiet"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr

"""compose.yaml and the Dockerfile, checked without Docker: services, settings, broker config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from manager.settings import ManagerSettings
from observer_service.settings import ServiceSettings

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


def test_compose_env_names_are_settings() -> None:
    known = {f"ORCH_{n.upper()}" for n in ManagerSettings.model_fields} | {
        f"ORCH_{n.upper()}" for n in ServiceSettings.model_fields
    }
    text = (ROOT / "compose.yaml").read_text()
    used = set(re.findall(r"\b(ORCH_[A-Z_]+)\s*:", text))
    assert used, "compose.yaml sets no ORCH_ variables"
    assert used <= known, f"unknown settings in compose.yaml: {used - known}"


def test_broker_config_raises_the_consumer_timeout() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    mounts = services["rabbitmq"]["volumes"]
    assert any("rabbitmq.conf" in m for m in mounts)
    conf = (ROOT / "deploy" / "rabbitmq.conf").read_text()
    value = int(re.search(r"^consumer_timeout\s*=\s*(\d+)", conf, re.M).group(1))  # type: ignore[union-attr]
    assert value >= 24 * 3600 * 1000


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for package in ("contracts", "manager", "observer_service", "migrations", "orch", "orch_bench"):
        assert f"COPY {package} {package}" in text
    assert 'ENTRYPOINT ["orch"]' in text


def _orch_commands() -> set[str]:
    import typer.main

    from orch.cli import app

    group = typer.main.get_group(app)
    return set(group.commands)


def test_every_compose_command_is_an_orch_command_and_every_file_exists() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    commands = _orch_commands()
    for name, service in services.items():
        if "build" in service:
            assert service["command"][0] in commands, f"{name}: {service['command']}"
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"
        check = service.get("healthcheck", {}).get("test", [])
        if check[:2] == ["CMD", "orch"]:
            assert check[2] in commands, f"{name}'s healthcheck: {check}"


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

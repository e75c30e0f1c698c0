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
    for package in ("contracts", "manager", "observer_service", "migrations", "orch"):
        assert f"COPY {package} {package}" in text
    assert 'ENTRYPOINT ["orch"]' in text

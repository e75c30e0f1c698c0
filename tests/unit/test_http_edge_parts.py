"""Parts of the HTTP edge with no server: a redirect's Location made relative, the settings of
the edge refusing what they cannot use, and /metrics without service ids (two live services of
one name are one series). The edge itself is tried over sockets in
tests/acceptance/test_http_edge.py."""

from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError

from observer_service.settings import ServiceSettings
from orch_manager.auth import Role, new_token
from orch_manager.http import relative
from orch_manager.metrics import ManagerMetrics
from orch_manager.settings import ManagerSettings

TOKENS = new_token("t", Role.ADMIN)[1]


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("http://attacker.example/observers", "/observers"),
        ("https://attacker.example:8443/observers?limit=5", "/observers?limit=5"),
        ("/observers", "/observers"),
        ("//attacker.example/observers", "/observers"),
        ("http://t//attacker.example/observers", "/attacker.example/observers"),
        ("/\\attacker.example/observers", "/attacker.example/observers"),
        ("http://t/\\\\attacker.example", "/attacker.example"),
        ("http://attacker.example", "/"),
    ],
)
def test_a_location_is_made_relative_and_names_no_other_host(location: str, expected: str) -> None:
    assert relative(location) == expected


def test_the_edge_settings_have_safe_defaults_and_refuse_what_they_cannot_use() -> None:
    s = ManagerSettings(api_tokens=TOKENS)
    assert s.forwarded_allow_list == []  # nobody's forwarded headers, loopback's included
    assert s.max_connections == 1000
    assert s.metrics_auth == "open"
    ok = ManagerSettings(api_tokens=TOKENS, forwarded_allow_ips="10.0.0.0/8, 127.0.0.1,*")
    assert ok.forwarded_allow_list == ["10.0.0.0/8", "127.0.0.1", "*"]
    with pytest.raises(ValidationError, match="ORCH_FORWARDED_ALLOW_IPS"):
        ManagerSettings(api_tokens=TOKENS, forwarded_allow_ips="proxy.example")
    with pytest.raises(ValidationError):
        ManagerSettings(api_tokens=TOKENS, max_connections=0)
    with pytest.raises(ValidationError):
        ManagerSettings(api_tokens=TOKENS, metrics_auth="sometimes")
    service = ServiceSettings()
    assert service.metrics_host == "127.0.0.1"
    assert service.metrics_timeout > 0
    assert service.metrics_max_connections >= 1


def test_open_metrics_show_services_by_name_only() -> None:
    m = ManagerMetrics()
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    for sid, name, capacity, running, age in (
        (a, "web", 10, 4, 0.5),
        (b, "web", 5, 1, 2.5),  # a second live service of the same name
        (c, "batch", 3, 0, 1.0),
    ):
        m.capacity.labels(name, sid).set(capacity)
        m.running.labels(name, sid).set(running)
        m.lease_age.labels(name, sid).set(age)
    full = m.render().decode()
    assert f'service_id="{a}"' in full
    shown = m.render(service_ids=False).decode()
    for sid in (a, b, c):
        assert sid not in shown
    assert "service_id" not in shown
    assert 'orch_service_capacity{service="web"} 15.0' in shown
    assert 'orch_service_running{service="web"} 5.0' in shown
    assert 'orch_service_heartbeat_age_seconds{service="web"} 2.5' in shown  # the older lease
    assert 'orch_service_capacity{service="batch"} 3.0' in shown
    assert "orch_manager_info" in shown  # every other metric as it is

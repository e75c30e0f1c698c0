"""Every query of the Grafana dashboard and the alert rules names a metric that exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from observer_service.metrics import ServiceMetrics
from orch_manager.metrics import ManagerMetrics

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\borch_[a-z_]+\b")


SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", ""),
    "info": ("_info",),
}


def _families() -> list[tuple[str, str]]:
    return [
        (family.name, family.type)
        for registry in (ManagerMetrics().registry, ServiceMetrics().registry)
        for family in registry.collect()
    ]


def _exposed() -> set[str]:
    """The series names Prometheus sees, whether or not a labelled one has a sample yet."""
    return {name + suffix for name, kind in _families() for suffix in SUFFIXES[kind]}


def _dashboard_queries() -> list[str]:
    dash = json.loads((ROOT / "deploy/grafana/orchestrator.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def _alert_queries() -> list[str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_dashboard_and_alert_query_names_an_existing_metric() -> None:
    exposed = _exposed()
    queries = _dashboard_queries() + _alert_queries()
    assert len(queries) > 20
    for query in queries:
        names = METRIC.findall(query)
        assert names, f"no orchestrator metric in {query!r}"
        missing = [n for n in names if n not in exposed]
        assert missing == [], f"{query!r} names metrics that do not exist: {missing}"


def test_metric_names_follow_prometheus_conventions() -> None:
    for registry in (ManagerMetrics().registry, ServiceMetrics().registry):
        for name, metric in registry._names_to_collectors.items():
            labels = set(getattr(metric, "_labelnames", ()))
            assert not labels & {"observer_id", "observer", "id"}, f"{name} labels by observer"
    for name, kind in _families():
        assert name.startswith("orch_")
        if kind == "histogram":
            assert name.endswith(("_seconds", "_size")), f"{name}: base units"


def test_the_dashboard_covers_both_sides() -> None:
    queries = " ".join(_dashboard_queries())
    for name in ("orch_observers", "orch_observers_running", "orch_lease_renewal_seconds_bucket"):
        assert name in queries

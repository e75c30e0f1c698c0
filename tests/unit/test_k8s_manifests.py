"""deploy/k8s, checked without a cluster: every object well-formed, every command, variable and
probe path one that exists, and a termination grace period that covers a graceful stop."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Match

from observer_service.settings import ServiceSettings
from orch_manager.settings import ManagerSettings
from tests.unit.test_deploy_files import ROOT, orch_command, orch_env_names

K8S = ROOT / "deploy" / "k8s"


def _kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def _objects() -> list[dict[str, Any]]:
    """Every object of every manifest the kustomization lists."""
    return [
        doc
        for name in _kustomization()["resources"]
        for doc in yaml.safe_load_all((K8S / name).read_text())
        if doc is not None
    ]


def _of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == kind}


def _pods() -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every Deployment and Job."""
    for o in _objects():
        if o["kind"] in ("Deployment", "Job"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def _containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for workload, pod in _pods():
        for c in pod["containers"]:
            yield f"{workload}/{c['name']}", c


def _secret_example() -> dict[str, str]:
    """secrets.env.example, the file secrets.env (the Secret) is made from."""
    (generator,) = _kustomization()["secretGenerator"]
    (env_file,) = generator["envs"]
    text = (K8S / f"{env_file}.example").read_text()
    return dict(re.findall(r"^([A-Z_]+)=(.*)$", text, re.M))


def _orch_runs(argv: list[str]) -> list[list[str]]:
    """The arguments of each ``orch`` that ``argv`` runs: itself, or in a ``sh -c`` script."""
    if argv[0] == "orch":
        return [argv[1:]]
    if argv[:2] != ["sh", "-c"]:
        return []
    lexer = shlex.shlex(argv[2], posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    runs: list[list[str]] = [[]]
    for word in words:
        if word in (";", "&&", "||", "|", "&"):
            runs.append([])
        elif word != "exec" or runs[-1]:
            runs[-1].append(word)
    return [run[1:] for run in runs if run and run[0] == "orch"]


def _argv(container: dict[str, Any]) -> list[str]:
    """What the container runs: the image's entrypoint is ``orch``."""
    return [*(container.get("command") or ["orch"]), *container.get("args", [])]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    """The container's variables: a literal value, or where it comes from."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        env |= _of_kind("ConfigMap")[source["configMapRef"]["name"]]["data"]
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def _settings_of(container: dict[str, Any], cls: type[Any], **overrides: Any) -> Any:
    """The settings the container's process would read, its Secret filled from the example."""
    values: dict[str, Any] = {}
    for name, value in _env(container).items():
        if isinstance(value, dict) and "secretKeyRef" in value:
            value = _secret_example()[value["secretKeyRef"]["key"]]
        field = name.removeprefix("ORCH_").lower()
        if isinstance(value, str) and field in cls.model_fields:
            values[field] = value
    return cls(**(values | overrides))


def _container(workload: str) -> dict[str, Any]:
    """The one container of a workload."""
    containers: list[dict[str, Any]] = dict(_pods())[workload]["containers"]
    assert len(containers) == 1, workload
    return containers[0]


def test_every_manifest_is_listed_and_every_object_well_formed() -> None:
    kustomization = _kustomization()
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "the kustomization must list every manifest, and only those"
    for o in _objects():
        assert o.get("apiVersion"), o
        assert o.get("kind"), o
        assert o.get("metadata", {}).get("name"), f"a {o['kind']} without a name"
    names = [(o["kind"], o["metadata"]["name"]) for o in _objects()]
    assert len(names) == len(set(names)), "two objects of one kind share a name"


def test_secrets_come_from_a_file_kept_out_of_git() -> None:
    (generator,) = _kustomization()["secretGenerator"]
    (env_file,) = generator["envs"]
    assert (K8S / f"{env_file}.example").exists()
    assert env_file in (K8S / ".gitignore").read_text().split()
    for name, container in _containers():
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == generator["name"], f"{name}: {ref}"
                assert ref["key"] in _secret_example(), f"{name}: {ref['key']} is not in the file"
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in _of_kind("ConfigMap"), name
    image = _kustomization()["images"][0]["name"]
    assert {c["image"] for _, c in _containers()} == {image}


def test_every_orch_command_exists_with_its_options() -> None:
    runs = []
    for _, container in _containers():
        hook = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        for argv in (_argv(container), hook.get("command")):
            runs += _orch_runs(argv) if argv else []
    assert {run[0] for run in runs} >= {"migrate", "manager", "service", "services"}
    for run in runs:
        orch_command(run)


def test_every_orch_variable_is_read_by_something() -> None:
    used = set(_secret_example())
    for o in _of_kind("ConfigMap").values():
        used |= set(o["data"])
    for _, container in _containers():
        used |= {v["name"] for v in container.get("env", [])}
    used = {v for v in used if v.startswith("ORCH_")}
    assert used, "the manifests set no ORCH_ variables"
    assert used <= orch_env_names(), f"unknown settings: {used - orch_env_names()}"


def test_the_example_config_is_accepted_and_spans_clusters() -> None:
    from orch_manager.auth import Role, new_token

    _, entry = new_token("k8s", Role("admin"))
    manager = _settings_of(_container("orch-manager"), ManagerSettings, api_tokens=entry)
    service = _settings_of(_container("orch-observer-service"), ServiceSettings)
    for settings in (manager, service):
        assert settings.queue_type == "quorum"
        assert len(settings.amqp_url.split(",")) >= 2, "every RabbitMQ node, comma-separated"
    url = _secret_example()["ORCH_DATABASE_URL"]
    assert "target_session_attrs=read-write" in url
    assert re.match(r"postgresql://[^/]*@[^/,]+,[^/]+/", url), "several PostgreSQL hosts"


def test_each_role_connects_to_the_broker_as_its_own_user_on_one_vhost() -> None:
    """deploy/rabbitmq-users.sh makes the vhost and the users (README, "Security")."""
    from orch_manager.auth import Role, new_token

    _, entry = new_token("k8s", Role("admin"))
    manager = _settings_of(_container("orch-manager"), ManagerSettings, api_tokens=entry)
    service = _settings_of(_container("orch-observer-service"), ServiceSettings)
    users: dict[str, set[str]] = {}
    for role, settings in (("manager", manager), ("service", service)):
        for url in settings.amqp_url.split(","):
            found = re.match(r"amqp://([^:]+):[^@]+@[^/]+/(.+)$", url)
            assert found is not None, url
            assert found[2] == "orchestrator", f"{role} is not on the system's own vhost"
            users.setdefault(role, set()).add(found[1])
    assert users == {"manager": {"orch-manager"}, "service": {"orch-service"}}


async def test_manager_probes_ask_routes_that_need_no_token() -> None:
    from orch_manager.app import create_app
    from orch_manager.auth import Role, new_token

    _, entry = new_token("k8s", Role("admin"))
    app = create_app(ManagerSettings(api_tokens=entry))
    # No lifespan: nothing connects; a route that needs the runtime fails, but not with 401.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    def served(path: str) -> bool:
        scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "app": app}
        return any(route.matches(scope)[0] == Match.FULL for route in app.routes)

    deployment = _of_kind("Deployment")["orch-manager"]
    assert deployment["spec"]["replicas"] == 2
    container = _container("orch-manager")
    ports = {p["name"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    async with httpx.AsyncClient(transport=transport, base_url="http://manager") as client:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container.get(probe, {}).get("httpGet")
            if get:
                assert served(get["path"]), f"{probe}: the manager has no {get['path']}"
                answer = await client.get(get["path"])
                assert answer.status_code not in (401, 403), f"{probe} needs a token"
                assert get["port"] in ports, probe
    (service,) = _of_kind("Service").values()
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_a_service_drains_itself_within_its_termination_grace_period() -> None:
    pod = dict(_pods())["orch-observer-service"]
    container = _container("orch-observer-service")
    env = _env(container)
    (drain,) = _orch_runs(container["lifecycle"]["preStop"]["exec"]["command"])
    params = orch_command(drain).params
    assert drain[:2] == ["services", "drain"]
    assert params["wait"], "the hook must return only once the service runs nothing"
    assert params["name"] == "$ORCH_NAME", "it drains its own service, by the pod's name"
    assert env["ORCH_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (manager,) = _of_kind("Service").values()
    api = f"http://{manager['metadata']['name']}:{manager['spec']['ports'][0]['port']}"
    assert env["ORCH_API"] == api, "the drain asks the manager's Service"
    assert "secretKeyRef" in env["ORCH_TOKEN"]
    # The grace period runs from the hook's start: the drain, then SIGTERM's stop, which waits
    # up to the shutdown timeout twice (starts in flight, then copies).
    shutdown = _settings_of(container, ServiceSettings).shutdown_timeout
    assert pod["terminationGracePeriodSeconds"] > params["timeout"] + 2 * shutdown


def test_a_job_migrates() -> None:
    runs = [
        _orch_runs(_argv(c))
        for job in _of_kind("Job").values()
        for c in job["spec"]["template"]["spec"]["containers"]
    ]
    assert [["migrate"]] in runs, "a one-shot Job runs `orch migrate`"


def test_pods_run_unprivileged_with_resources() -> None:
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    for name, pod in _pods():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] == uid, f"{name}: the image's user"
        for c in pod["containers"]:
            context = c["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            assert "memory" in c["resources"]["limits"], name


def test_a_metrics_port_a_pod_declares_listens_beyond_the_pod() -> None:
    # A service's metrics listen on loopback unless ORCH_METRICS_HOST says otherwise; a pod
    # whose metrics Prometheus scrapes (a declared containerPort) must say so.
    assert ServiceSettings.model_fields["metrics_host"].default == "127.0.0.1"
    declared = 0
    for name, container in _containers():
        env = _env(container)
        if "ORCH_METRICS_PORT" not in env:
            continue
        port = int(env["ORCH_METRICS_PORT"])
        if port in {p["containerPort"] for p in container.get("ports", [])}:
            declared += 1
            settings = _settings_of(container, ServiceSettings)
            assert settings.metrics_host == "0.0.0.0", f"{name}: set ORCH_METRICS_HOST=0.0.0.0"
    assert declared, "the observer service declares its metrics port"


def test_the_objects_are_valid_against_the_kubernetes_schemas() -> None:
    """Each object against the schema of the newest Kubernetes release the validator knows,
    strictly (an unknown field, a misspelt one, fails)."""
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    objects = _objects()
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Job", "ConfigMap", "Service", "PodDisruptionBudget"} <= kinds, kinds
    for o in objects:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{o['kind']} {o['metadata']['name']}: {exc.message}") from None
    # The check bites: a misspelt field of a container is refused.
    deployment = next(iter(_of_kind("Deployment").values()))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, version, strict=True)

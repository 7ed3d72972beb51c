"""The Kubernetes manifests (``deploy/k8s``), checked without a cluster: both overlays render with
``kubectl kustomize``; the core objects pass ``kubernetes-validate`` (strict: no unknown field) and the KEDA
objects the CRDs of KEDA kept in ``deploy/k8s/schemas``; and everything the manifests name exists in the
code: every environment variable is a setting of its process (which accepts the values), every port and
probe path is one the process serves, every stream a scaler watches is an intake stream of its pool's
home buckets, every metric the dashboard queries is exported, every Redis user is in the ACL the Redis
container writes. The processes get the same settings as in ``docker-compose.yml``, with API keys on.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings

from api import auth
from api.app import create_app
from api.settings import ApiSettings
from jobs.settings import JobsSettings
from queues.keys import BUCKETS, TIERS, WORKER_GROUP, Keys
from tailcut import cli, jobs_cli
from tailcut.exposition import metrics_app
from tailcut.settings import CommonSettings
from tests.unit import test_deploy as compose
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu")
SCHEMAS = K8S / "schemas"
KEDA_VERSION = "2.20.2"
README = ROOT / "README.md"
NAMESPACE = "tailcut"
# The Secret the operator creates (README "Kubernetes"); the test gives each key a value of its own.
SECRET_NAME = "tailcut-secrets"
# Core objects are validated against the oldest and the newest Kubernetes kubernetes-validate knows of
# that these manifests claim (README "Kubernetes").
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

# What each tailcut process reads its settings from, and which Redis user it is (as in the compose file).
SETTINGS_OF: dict[str, tuple[type[BaseSettings], ...]] = {
    "api": (ApiSettings, JobsSettings),
    "jobs": (JobsSettings,),
    "worker": (WorkerSettings,),
}
COMMAND_OF = {"api": cli.cmd_api, "jobs": jobs_cli.cmd_jobs, "worker": cli.cmd_worker}
# Variables of a tailcut container that are not settings: the parts its TAILCUT_REDIS_URL is built from.
PLUMBING = {"REDIS_ADDRESS", "REDIS_PASSWORD"}
# Settings whose value differs from the compose file's, on purpose: the Redis URL (Kubernetes builds it
# from the ConfigMap and the Secret; its user and password are checked against the ACL below), the keys'
# secret (the Secret, not .env) and the GPU share (a pod has its own GPU; compose shares one).
DIFFERS_FROM_COMPOSE = {"TAILCUT_REDIS_URL", "TAILCUT_AUTH_SECRET", "TAILCUT_ENGINE__GPU_MEMORY_UTILIZATION"}

# KEDA v2.20.2's redis-streams scaler (pkg/scalers/redis_streams_scaler.go, redis_scaler.go): the trigger
# metadata it reads (a `xFromEnv` key names a variable of the scaled container for `x`) and the
# parameters it takes from a TriggerAuthentication.
REDIS_STREAMS_METADATA = {
    "stream",
    "consumerGroup",
    "lagCount",
    "activationLagCount",
    "pendingEntriesCount",
    "streamLength",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
    *(
        f"{name}{suffix}"
        for name in ("address", "addresses", "host", "hosts", "port", "ports")
        for suffix in ("", "FromEnv")
    ),
    *(f"{name}{suffix}" for name in ("username", "password") for suffix in ("", "FromEnv")),
}
REDIS_STREAMS_AUTH_PARAMS = {
    "address",
    "addresses",
    "host",
    "hosts",
    "port",
    "ports",
    "username",
    "password",
    "sentinelUsername",
    "sentinelPassword",
    "sentinelMaster",
    "tls",
    "ca",
    "cert",
    "Cert",
    "key",
    "keyPassword",
}
# What the scaler sends in lagCount mode: PING when it connects, INFO (it wants Redis 7+), XINFO GROUPS,
# XLEN (a stream whose group does not exist yet). HELLO and AUTH need no ACL rule; a refused CLIENT
# SETINFO is ignored by go-redis.
KEDA_LAG_COMMANDS = {"+ping", "+info", "+xinfo|groups", "+xlen"}


# --- rendering ---------------------------------------------------------------------------------------


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed: ./scripts/test installs it (scripts/ensure-tools)")
    return found


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize deploy/k8s/overlays/{overlay}:\n{done.stderr}"
    return tuple(document for document in yaml.safe_load_all(done.stdout) if document)


@dataclass(frozen=True)
class Rendered:
    overlay: str
    objects: tuple[dict[str, Any], ...]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [obj for obj in self.of_kind(kind) if obj["metadata"]["name"] == name] or [None]
        assert found is not None, f"{self.overlay}: no {kind} {name}"
        return found

    def config_map(self, name: str) -> dict[str, str]:
        data: dict[str, str] = self.get("ConfigMap", name).get("data", {})
        return data

    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")

    def tailcut_containers(self) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(process, workload, container) of every tailcut container; process as its command says."""
        for workload in self.workloads():
            for container in workload["spec"]["template"]["spec"]["containers"]:
                if container.get("command", [None])[0] == "tailcut":
                    yield container["command"][1], workload, container

    def workers(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [
            (workload, container) for process, workload, container in self.tailcut_containers() if process == "worker"
        ]

    def one(self, process: str) -> tuple[dict[str, Any], dict[str, Any]]:
        (found,) = [(w, c) for p, w, c in self.tailcut_containers() if p == process]
        return found

    def redis(self) -> tuple[dict[str, Any], dict[str, Any]]:
        statefulset = self.get("StatefulSet", "tailcut-redis")
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        return statefulset, container


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param, render(request.param))


# --- environment as the kubelet builds it ------------------------------------------------------------


def secret_value(key: str) -> str:
    """The value the test gives the Secret's ``key`` (URL-safe, as the README's `openssl rand -hex 32`)."""
    return hashlib.sha256(key.encode()).hexdigest()


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a variable defined before (envFrom, earlier env) is replaced,
    ``$$`` is one ``$``, anything else stays as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group() == "$$":
            return "$"
        return defined.get(match[1], match.group())

    return _REFERENCE.sub(replace, value)


def secret_keys_of(container: dict[str, Any]) -> dict[str, str]:
    """Variable → Secret key of each variable a container takes from a Secret."""
    found = {}
    for variable in container.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == SECRET_NAME, f"{variable['name']} comes from Secret {ref['name']}, not {SECRET_NAME}"
            found[variable["name"]] = ref["key"]
    return found


def resolved_env(rendered: Rendered, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, the Secret holding ``secret_value(key)``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"envFrom {source}: ConfigMaps only"
        env.update(rendered.config_map(source["configMapRef"]["name"]))
    for variable in container.get("env", []):
        name = variable["name"]
        if "value" in variable:
            env[name] = expand(str(variable["value"]), env)
        elif "configMapKeyRef" in variable.get("valueFrom", {}):
            ref = variable["valueFrom"]["configMapKeyRef"]
            data = rendered.config_map(ref["name"])
            assert ref["key"] in data, f"{name}: ConfigMap {ref['name']} has no key {ref['key']}"
            env[name] = data[ref["key"]]
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            assert variable["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME, name
            env[name] = secret_value(variable["valueFrom"]["secretKeyRef"]["key"])
        else:
            raise AssertionError(f"{name}: a value, a ConfigMap key or a Secret key only ({variable})")
        assert "$(" not in env[name], f"{name}={env[name]!r} refers to a variable not defined before it"
    return env


def settings_from(env: dict[str, str], settings_class: type[BaseSettings], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``settings_class`` built from ``env`` alone, as the process in the container would build it."""
    with monkeypatch.context() as patch:
        for key in [key for key in os.environ if key.upper().startswith("TAILCUT_")]:
            patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return settings_class()


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [item["containerPort"] for item in container.get("ports", []) if item.get("name") == port] or [None]
    assert number is not None, f"container {container['name']} has no port named {port}"
    return int(number)


def probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {kind: container[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in container}


def pod_annotations(workload: dict[str, Any]) -> dict[str, str]:
    annotations: dict[str, str] = workload["spec"]["template"]["metadata"].get("annotations", {})
    return annotations


def compose_service(workload: dict[str, Any]) -> str:
    """The compose service a Kubernetes workload stands for."""
    component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
    return f"worker-{workload['metadata']['labels']['pool']}" if component == "worker" else component


# --- rendering and schemas ---------------------------------------------------------------------------


def test_both_overlays_render_everything_in_one_namespace(rendered: Rendered) -> None:
    kinds = {(obj["kind"], obj["metadata"]["name"]) for obj in rendered.objects}
    for expected in [
        ("Deployment", "tailcut-api"),
        ("Service", "tailcut-api"),
        ("Deployment", "tailcut-jobs"),
        ("StatefulSet", "tailcut-redis"),
        ("Service", "tailcut-redis"),
        ("TriggerAuthentication", "tailcut-redis-keda"),
        ("ConfigMap", "tailcut-dashboard"),
    ]:
        assert expected in kinds, f"{rendered.overlay} renders no {expected}"
    assert rendered.workers(), f"{rendered.overlay} has no worker pool"
    for obj in rendered.objects:
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']} {obj['metadata']['name']}: namespace"
        assert obj["metadata"]["labels"].get("app.kubernetes.io/part-of") == "tailcut", obj["metadata"]["name"]
    for workload in rendered.workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels.get("app.kubernetes.io/part-of") == "tailcut", f"{workload['metadata']['name']}'s pods"
    assert not rendered.of_kind("Secret"), "the Secret is the operator's (README), never in the manifests"


def test_core_objects_pass_kubernetes_validate(rendered: Rendered) -> None:
    core = [obj for obj in rendered.objects if not obj["apiVersion"].startswith("keda.sh/")]
    for version in KUBERNETES_VERSIONS:
        for obj in core:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                raise AssertionError(
                    f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): {error}"
                ) from None


def keda_crds() -> dict[str, dict[str, Any]]:
    """Kind → the vendored KEDA CRD of that kind, after checking each file is the copy its README names."""
    source = (SCHEMAS / "README.md").read_text()
    crds = {}
    for path in sorted(SCHEMAS.glob(f"keda-{KEDA_VERSION}-*.yaml")):
        assert hashlib.sha256(path.read_bytes()).hexdigest() in source, (
            f"{path.name} differs from the copy its README names"
        )
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "keda.sh"
        crds[crd["spec"]["names"]["kind"]] = crd
    assert {"ScaledObject", "TriggerAuthentication"} <= set(crds)
    return crds


def closed(schema: Any) -> Any:
    """An OpenAPI schema with every object closed to the fields it names (strict field validation, as
    ``kubectl apply`` does by default), unless it keeps unknown fields."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            result["additionalProperties"] = False
    return result


def cel_rules(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations", []):
            yield path, rule["rule"]
        for key, value in schema.items():
            yield from cel_rules(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for item in schema:
            yield from cel_rules(item, path)


# The CEL rules of KEDA's CRDs this test evaluates itself (jsonschema knows no CEL).
MIN_LE_MAX = (
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount)\n? self.maxReplicaCount : 100)"
)


def check_cel(rule: str, spec: dict[str, Any]) -> bool:
    if " ".join(rule.split()) == " ".join(MIN_LE_MAX.split()):
        return "minReplicaCount" not in spec or spec["minReplicaCount"] <= spec.get("maxReplicaCount", 100)
    raise AssertionError(f"a CEL rule this test cannot evaluate: {rule!r} (add it to check_cel)")


def test_keda_objects_match_keda_crds(rendered: Rendered) -> None:
    crds = keda_crds()
    keda = [obj for obj in rendered.objects if obj["apiVersion"].startswith("keda.sh/")]
    assert {obj["kind"] for obj in keda} == {"ScaledObject", "TriggerAuthentication"}
    for obj in keda:
        crd = crds[obj["kind"]]
        (version,) = [v for v in crd["spec"]["versions"] if f"keda.sh/{v['name']}" == obj["apiVersion"]] or [None]
        assert version is not None and version["served"], f"{obj['kind']}: KEDA serves no {obj['apiVersion']}"
        schema = version["schema"]["openAPIV3Schema"]
        errors = list(jsonschema.Draft4Validator(closed(schema)).iter_errors(obj))
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(
            f"{'/'.join(map(str, error.path))}: {error.message}" for error in errors
        )
        for path, rule in cel_rules(schema):
            assert path == "/properties/spec", f"a CEL rule at {path}, which check_cel does not know how to apply"
            assert check_cel(rule, obj["spec"]), f"{obj['kind']} {obj['metadata']['name']} breaks {rule!r}"


# --- settings, ports, probes -------------------------------------------------------------------------


def test_every_variable_is_a_setting_of_its_process_and_accepted(
    rendered: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = set()
    for process, workload, container in rendered.tailcut_containers():
        seen.add(process)
        env = resolved_env(rendered, container)
        known = set().union(*(compose.setting_variables(settings) for settings in SETTINGS_OF[process]))
        unknown = {name for name in env if name.startswith("TAILCUT_")} - known
        assert not unknown, (
            f"{workload['metadata']['name']} sets {sorted(unknown)}, which no setting of {process} reads"
        )
        others = {name for name in env if not name.startswith("TAILCUT_")} - PLUMBING
        assert not others, (
            f"{workload['metadata']['name']}: {sorted(others)} are neither settings nor the Redis URL's parts"
        )
        for settings_class in SETTINGS_OF[process]:
            settings_from(env, settings_class, monkeypatch)
        args = cli.build_parser().parse_args(container["command"][1:] + container.get("args", []))
        assert args.func is COMMAND_OF[process], f"{workload['metadata']['name']} runs {container['command']}"
    assert seen == set(SETTINGS_OF), f"{rendered.overlay}: processes {sorted(seen)}"


def test_the_same_settings_as_the_compose_file(rendered: Rendered) -> None:
    services = compose.services()
    for _process, workload, container in rendered.tailcut_containers():
        service = compose_service(workload)
        assert service in services, f"{workload['metadata']['name']} stands for no compose service ({service})"
        ours = {k: v for k, v in resolved_env(rendered, container).items() if k.startswith("TAILCUT_")}
        theirs = compose.environment(services[service])
        assert set(ours) == set(theirs), (
            f"{workload['metadata']['name']} vs compose's {service}: only here {sorted(set(ours) - set(theirs))}, "
            f"only in compose {sorted(set(theirs) - set(ours))}"
        )
        for name in set(ours) - DIFFERS_FROM_COMPOSE:
            assert ours[name] == theirs[name], (
                f"{workload['metadata']['name']}: {name}={ours[name]!r}, compose {theirs[name]!r}"
            )
        assert container["image"] == services[service]["image"], f"{workload['metadata']['name']}: image"


def test_the_api_serves_its_ports_and_probes(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    workload, container = rendered.one("api")
    settings = settings_from(resolved_env(rendered, container), ApiSettings, monkeypatch)
    assert settings.host == "0.0.0.0", "the API binds every interface, or nothing outside the pod reaches it"
    assert port_number(container, "http") == settings.port
    assert settings.api_metrics_port and port_number(container, "metrics") == settings.api_metrics_port
    # Probes: liveness /healthz, readiness /readyz, on the main port; routes of the app, no key needed.
    found = probes(container)
    assert found["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert found["readinessProbe"]["httpGet"]["path"] == "/readyz"
    routes = {route.path: route for route in create_app(settings).routes if isinstance(route, APIRoute)}
    guards = {auth.check_auth, auth.require_operator, auth.require_admin_route, auth.require_admin}
    for kind, probe in found.items():
        path = probe["httpGet"]["path"]
        assert port_number(container, probe["httpGet"]["port"]) == settings.port, f"{kind} on the API port"
        assert path in routes and "GET" in routes[path].methods, f"{kind}: the API has no GET {path}"
        calls = {dependency.call for dependency in routes[path].dependant.dependencies}
        assert not calls & guards, f"{kind}: {path} needs an API key, which a probe does not send"
    # Prometheus scrapes the keyless metrics port, which the Service does not expose.
    annotations = pod_annotations(workload)
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == settings.api_metrics_port != settings.port
    assert "/metrics" in routes
    service = rendered.get("Service", "tailcut-api")
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    targets = [port_number(container, port["targetPort"]) for port in service["spec"]["ports"]]
    assert targets == [settings.port], "the Service exposes the API's port and not its keyless metrics port"


def served(path: str) -> bool:
    """Whether a worker's or jobs process's metrics server answers ``path`` with a 200."""
    status: list[str] = []
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    list(metrics_app(CollectorRegistry())(environ, lambda code, headers: status.append(code)))
    return status[0].startswith("200")


@pytest.mark.parametrize("process", ["worker", "jobs"])
def test_workers_and_jobs_serve_their_metrics_port_and_probes(
    rendered: Rendered, process: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not served("/healthz"), "the metrics server answers only /metrics"
    pairs = rendered.workers() if process == "worker" else [rendered.one("jobs")]
    for workload, container in pairs:
        name = workload["metadata"]["name"]
        settings_class = WorkerSettings if process == "worker" else JobsSettings
        settings = settings_from(resolved_env(rendered, container), settings_class, monkeypatch)
        port = settings.metrics_port if process == "worker" else settings.jobs_metrics_port
        assert port and settings.metrics_host == "0.0.0.0", f"{name}: Prometheus and the kubelet reach it"
        assert port_number(container, "metrics") == port, f"{name}: the metrics container port is not {port}"
        found = probes(container)
        assert {"startupProbe", "readinessProbe"} <= set(found), f"{name}: readiness from its own server"
        for kind, probe in found.items():
            assert port_number(container, probe["httpGet"]["port"]) == port, f"{name} {kind}"
            assert served(probe["httpGet"]["path"]), f"{name} {kind}: {probe['httpGet']['path']} is not served"
        annotations = pod_annotations(workload)
        assert annotations["prometheus.io/scrape"] == "true" and served(annotations["prometheus.io/path"]), name
        assert int(annotations["prometheus.io/port"]) == port, name


def test_grace_periods_cover_each_process_drain(rendered: Rendered) -> None:
    services = compose.services()
    for _process, workload, container in rendered.tailcut_containers():
        spec = workload["spec"]["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        stop = int(services[compose_service(workload)]["stop_grace_period"].removesuffix("s"))
        assert grace >= stop + sleep_s, (
            f"{workload['metadata']['name']}: {grace} s < compose's {stop} s + preStop {sleep_s} s"
        )
        assert spec.get("shareProcessNamespace"), f"{workload['metadata']['name']}: orphans are reaped (compose's init)"


# --- auth and secrets --------------------------------------------------------------------------------


def test_api_keys_are_on_with_the_secret_from_the_operators_secret(
    rendered: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    _workload, container = rendered.one("api")
    api = settings_from(resolved_env(rendered, container), ApiSettings, monkeypatch)
    assert api.auth_required, "the API needs keys (TAILCUT_AUTH_REQUIRED=true)"
    assert secret_keys_of(container)["TAILCUT_AUTH_SECRET"] == "auth-secret"
    assert api.auth_secret == secret_value("auth-secret")
    assert not api.admin_key and not api.api_keys, "admin keys are API keys made with `tailcut keys create --admin`"
    for process, workload, other in rendered.tailcut_containers():
        auth_variables = [name for name in resolved_env(rendered, other) if name.startswith("TAILCUT_AUTH")]
        assert process == "api" or not auth_variables, f"{workload['metadata']['name']} checks no keys"


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_every_secret_comes_from_the_secret_the_readme_creates(rendered: Rendered) -> None:
    section = readme_section("Kubernetes")
    created = set(re.findall(r"--from-literal=([a-z0-9-]+)=", section))
    assert f"create secret generic {SECRET_NAME}" in section and f"create namespace {NAMESPACE}" in section
    used: set[str] = set()
    for workload in rendered.workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            used |= set(secret_keys_of(container).values())
            for variable in container.get("env", []):
                if re.search(r"PASSWORD|SECRET|_KEYS?$", variable["name"]):
                    assert "secretKeyRef" in variable.get("valueFrom", {}), f"{variable['name']} is not from the Secret"
    for auth_object in rendered.of_kind("TriggerAuthentication"):
        for ref in auth_object["spec"].get("secretTargetRef", []):
            assert ref["name"] == SECRET_NAME
            used.add(ref["key"])
    assert used == created, f"the README creates {sorted(created)}; the manifests use {sorted(used)}"


# --- Redis -------------------------------------------------------------------------------------------


def redis_url_of(rendered: Rendered, container: dict[str, Any]) -> Any:
    return urlsplit(resolved_env(rendered, container)["TAILCUT_REDIS_URL"])


def test_redis_runs_the_compose_stacks_files_and_every_url_reaches_it(rendered: Rendered) -> None:
    statefulset, container = rendered.redis()
    assert container["image"] == compose.services()["redis"]["image"]
    volumes = {volume["name"]: volume for volume in statefulset["spec"]["template"]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    files = rendered.config_map(volumes[mounts["/usr/local/etc/redis"]]["configMap"]["name"])
    for name in ("entrypoint.sh", "redis.conf", "users.acl.template"):
        assert files[name] == (compose.REDIS_DIR / name).read_text(), f"{name} differs from deploy/redis/{name}"
    assert "/data" in mounts and mounts["/data"] in {
        claim["metadata"]["name"] for claim in statefulset["spec"]["volumeClaimTemplates"]
    }
    port = int(compose.redis_config()["port"])
    assert port_number(container, "redis") == port
    service = rendered.get("Service", "tailcut-redis")
    (service_port,) = service["spec"]["ports"]
    assert port_number(container, service_port["targetPort"]) == port
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    for _process, workload, tailcut in rendered.tailcut_containers():
        url = redis_url_of(rendered, tailcut)
        where = (url.scheme, url.hostname, url.port, url.path)
        expected = ("redis", service["metadata"]["name"], service_port["port"], "/0")
        assert where == expected, f"{workload['metadata']['name']}: Redis at {where}, the Service is {expected}"
        assert url.username == compose.REDIS_USER_OF[compose_service(workload)], workload["metadata"]["name"]


def run_redis_command(rendered: Rendered, tmp_path: Path) -> dict[str, list[str]]:
    """The Redis container's own command, run here: its ConfigMaps written where it mounts them, the
    Secret's values in its environment, ``true`` for redis-server; returns the ACL file it wrote."""
    statefulset, container = rendered.redis()
    volumes = {volume["name"]: volume for volume in statefulset["spec"]["template"]["spec"]["volumes"]}
    script = (
        " ".join(container["command"][2:] + container["args"]) if container["command"][:2] == ["/bin/sh", "-c"] else ""
    )
    assert script, "the Redis container runs a /bin/sh -c script"
    # Longest mount path first, so that no replacement rewrites part of another.
    mounts = sorted(container["volumeMounts"], key=lambda mount: -len(mount["mountPath"]))
    for index, mount in enumerate(mounts):
        folder = tmp_path / f"mount{index}"
        folder.mkdir()
        volume = volumes.get(mount["name"], {})  # else a volume claim (the data): empty here
        if "configMap" in volume:
            for name, text in rendered.config_map(volume["configMap"]["name"]).items():
                (folder / name).write_text(text)
        script = script.replace(mount["mountPath"], str(folder))
    script = script.replace("/tmp/tailcut-redis", str(tmp_path / "tmp"))
    env = {key: value for key, value in os.environ.items() if not key.startswith("REDIS_")}
    env |= resolved_env(rendered, container)
    env |= {"REDIS_ACL_FILE": str(tmp_path / "users.acl"), "REDIS_SERVER": "true"}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    users = {}
    for line in (tmp_path / "users.acl").read_text().splitlines():
        word, name, *rules = line.split()
        assert word == "user", line
        users[name] = rules
    return users


def test_redis_users_match_every_process_and_keda(rendered: Rendered, tmp_path: Path) -> None:
    users = run_redis_command(rendered, tmp_path)
    assert "off" in users["default"] and "on" not in users["default"]
    prefix = CommonSettings.model_fields["key_prefix"].default
    for _process, workload, container in rendered.tailcut_containers():
        prefix_here = resolved_env(rendered, container).get("TAILCUT_KEY_PREFIX", prefix)
        assert prefix_here == prefix, f"{workload['metadata']['name']}: the ACL's key patterns are for {prefix}"
        url = redis_url_of(rendered, container)
        assert f"#{compose.sha256(url.password or '')}" in users[url.username], (
            f"{workload['metadata']['name']}: wrong password for Redis user {url.username}"
        )
    # The probes PING as the healthcheck user, with its password.
    _statefulset, redis = rendered.redis()
    redis_env = resolved_env(rendered, redis)
    for kind, probe in probes(redis).items():
        command = " ".join(probe["exec"]["command"])
        (user,) = re.findall(r"--user (\S+)", command)
        (variable,) = re.findall(r"REDISCLI_AUTH=\"\$(\w+)\"", command)
        assert "+ping" in users[user] and f"#{compose.sha256(redis_env[variable])}" in users[user], kind
    # KEDA: its user from the TriggerAuthentication, read-only, the commands of lagCount mode, intake only.
    (trigger_auth,) = rendered.of_kind("TriggerAuthentication")
    params = {}
    for ref in trigger_auth["spec"].get("configMapTargetRef", []):
        params[ref["parameter"]] = rendered.config_map(ref["name"])[ref["key"]]
    for ref in trigger_auth["spec"].get("secretTargetRef", []):
        params[ref["parameter"]] = secret_value(ref["key"])
    assert set(params) <= REDIS_STREAMS_AUTH_PARAMS, (
        f"parameters KEDA's scaler does not read: {set(params) - REDIS_STREAMS_AUTH_PARAMS}"
    )
    keda = users[params["username"]]
    assert f"#{compose.sha256(params['password'])}" in keda, "KEDA's password is not its user's"
    assert "-@all" in keda and {rule for rule in keda if rule[0] in "+-" and rule != "-@all"} == KEDA_LAG_COMMANDS
    streams = Keys(prefix).intake_all()
    patterns = compose.grants(keda, "~")
    assert patterns and all(pattern.startswith(f"{prefix}q:") for pattern in patterns), f"KEDA reaches {patterns}"
    assert all(any(fnmatch.fnmatchcase(stream, pattern) for pattern in patterns) for stream in streams)
    assert not compose.grants(keda, "&"), "KEDA subscribes to nothing"
    # KEDA's address is the processes' Redis.
    _workload, api = rendered.one("api")
    url = redis_url_of(rendered, api)
    assert params["address"] == f"{url.hostname}:{url.port}"


# --- worker pools and their scaling -------------------------------------------------------------------


def test_each_pool_scales_on_the_lag_of_its_home_streams(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    scaled = {obj["spec"]["scaleTargetRef"]["name"]: obj for obj in rendered.of_kind("ScaledObject")}
    auth_names = {obj["metadata"]["name"] for obj in rendered.of_kind("TriggerAuthentication")}
    assert len(scaled) == len(rendered.of_kind("ScaledObject")), "one ScaledObject per pool"
    homes: set[str] = set()
    kept = 0
    for workload, container in rendered.workers():
        name = workload["metadata"]["name"]
        assert "replicas" not in workload["spec"], f"{name}: KEDA owns the replica count; an apply must not reset it"
        assert name in scaled, f"{name} has no ScaledObject"
        target = scaled.pop(name)["spec"]
        assert target["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        settings = settings_from(resolved_env(rendered, container), WorkerSettings, monkeypatch)
        keys = Keys(settings.key_prefix)
        expected = [keys.intake(tier, bucket) for bucket in settings.home_buckets for tier in TIERS]
        streams = []
        lag_of_tier: dict[str, set[int]] = {}
        for trigger in target["triggers"]:
            metadata = trigger["metadata"]
            assert trigger["type"] == "redis-streams", f"{name}: {trigger['type']}"
            assert set(metadata) <= REDIS_STREAMS_METADATA, (
                f"{name}: KEDA reads no {set(metadata) - REDIS_STREAMS_METADATA}"
            )
            assert metadata["consumerGroup"] == WORKER_GROUP, f"{name}: the workers' consumer group"
            assert not {"pendingEntriesCount", "streamLength"} & set(metadata), f"{name}: lagCount mode only"
            assert int(metadata["lagCount"]) > 0 and int(metadata["activationLagCount"]) >= 0, name
            assert trigger["authenticationRef"]["name"] in auth_names, f"{name}: no such TriggerAuthentication"
            assert trigger["authenticationRef"].get("kind", "TriggerAuthentication") == "TriggerAuthentication"
            streams.append(metadata["stream"])
            tier = metadata["stream"].removeprefix(keys.prefix).split(":")[1]
            lag_of_tier.setdefault(tier, set()).add(int(metadata["lagCount"]))
        assert sorted(streams) == sorted(expected) and len(set(streams)) == len(streams), (
            f"{name} watches {streams}; its intake streams are {expected}"
        )
        # More urgent work asks for replicas sooner.
        lags = [max(lag_of_tier[tier]) for tier in TIERS]
        assert lags == sorted(lags) and [min(lag_of_tier[tier]) for tier in TIERS] == lags, f"{name}: {lag_of_tier}"
        homes |= set(settings.home_buckets)
        kept += target.get("minReplicaCount", 0) >= 1
    assert not scaled, f"ScaledObjects without a worker pool: {sorted(scaled)}"
    assert homes == set(BUCKETS), f"{rendered.overlay}: every bucket is the home of some pool"
    assert kept, "no pool keeps a worker: the API's readiness (/readyz) wants one, so nothing would reach Redis"


def test_gpu_pools_get_a_gpu_and_the_cpu_pool_none(rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    for workload, container in rendered.workers():
        name = workload["metadata"]["name"]
        settings = settings_from(resolved_env(rendered, container), WorkerSettings, monkeypatch)
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        if rendered.overlay == "gpu":
            assert gpus == 1, f"{name}: one GPU per pod"
            assert settings.engine.device != "cpu"
            assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, (
                f"{name}: no surge pod waits for a GPU"
            )
        else:
            assert gpus is None and settings.engine.device == "cpu", name
        volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
        (shm,) = [mount["name"] for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
        assert volumes[shm]["emptyDir"]["medium"] == "Memory", f"{name}: vLLM's shared memory"
    if rendered.overlay == "gpu":
        pools = {workload["metadata"]["labels"]["pool"] for workload, _container in rendered.workers()}
        assert pools == {"realtime", "background"}


# --- Prometheus and Grafana ---------------------------------------------------------------------------


def test_the_dashboard_is_the_compose_stacks_and_queries_exported_metrics(rendered: Rendered) -> None:
    config_map = rendered.get("ConfigMap", "tailcut-dashboard")
    assert config_map["metadata"]["labels"].get("grafana_dashboard") == "1", "the Grafana sidecar's label"
    (text,) = config_map["data"].values()
    assert text == compose.DASHBOARD.read_text(), "the ConfigMap holds deploy/grafana/dashboards/tailcut.json"
    exported = compose.exported_names() | compose.PROMETHEUS_OWN
    vllm = compose.vllm_names()
    used = 0
    for panel in json.loads(text)["panels"]:
        for target in panel.get("targets", []):
            for name in compose.promql_metric_names(target["expr"]):
                used += 1
                if name.startswith("vllm:"):
                    assert vllm is None or name in vllm, f"panel {panel['title']!r}: vLLM exports no {name}"
                else:
                    assert name in exported, f"panel {panel['title']!r}: no tailcut process exports {name}"
    assert used > 30
    # The dashboard groups workers by `pool`: every worker pod carries it (the scrape copies pod labels).
    for workload, _container in rendered.workers():
        assert workload["spec"]["template"]["metadata"]["labels"].get("pool"), workload["metadata"]["name"]


def test_readme_says_how_to_deploy_each_overlay() -> None:
    section = readme_section("Kubernetes")
    for overlay in OVERLAYS:
        assert re.search(rf"kubectl apply -k deploy/k8s/overlays/{overlay}(\s|$)", section), f"no apply of {overlay}"
    assert "Sentinel" in section, "the README says Sentinel is not there yet"

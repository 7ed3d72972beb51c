"""The Kubernetes manifests (``deploy/k8s``), checked without a cluster: every overlay renders with
``kubectl kustomize``; the core objects pass ``kubernetes-validate`` (strict: no unknown field) and the KEDA
objects the CRDs of KEDA kept in ``deploy/k8s/schemas``; and everything the manifests name exists in the
code: every environment variable is a setting of its process (which accepts the values), every port and
probe path is one the process serves, every stream a scaler watches is an intake stream of its pool's
home buckets, every metric the dashboard queries is exported, every Redis user is in the ACL the Redis
container writes. The processes get the same settings as in ``docker-compose.yml``, with API keys on.

The ``gpu-ha`` overlay (``deploy/k8s/components/sentinel``) also: every process and KEDA reach Redis through
the three Sentinels under the master name their configuration monitors, the Redis pods and the
Sentinels start from what ``redis-ha.sh`` writes (run here with a stand-in ``redis-cli``), every user and
password of the Sentinels' and Redis's ACLs agree, and a real ``redis-sentinel`` loads that configuration.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import redis as redis_py
import yaml
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from pydantic_settings import BaseSettings
from redis.sentinel import Sentinel

from api import auth
from api.app import create_app
from api.settings import ApiSettings
from jobs.settings import JobsSettings
from queues.keys import BUCKETS, TIERS, WORKER_GROUP, Keys
from tailcut import cli, jobs_cli
from tailcut.exposition import metrics_app
from tailcut.processes import free_port
from tailcut.settings import CommonSettings, parse_sentinels
from tests.unit import test_deploy as compose
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu", "gpu-ha")
# Overlays with Redis Sentinel (deploy/k8s/components/sentinel), and the workers each overlay runs.
HA_OVERLAYS = ("gpu-ha",)
WORKERS_OF = {"gpu": "gpu", "cpu": "cpu", "gpu-ha": "gpu"}
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
# parameters it takes from a TriggerAuthentication. The same code is the redis-sentinel-streams scaler
# (pkg/scaling/scalers_builder.go: NewRedisStreamsScaler with isSentinel), whose redisConnectionInfo also
# reads sentinelUsername, sentinelPassword and sentinelMaster from the trigger's metadata.
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
REDIS_SENTINEL_STREAMS_METADATA = REDIS_STREAMS_METADATA | {
    f"{name}{suffix}"
    for name in ("sentinelUsername", "sentinelPassword", "sentinelMaster")
    for suffix in ("", "FromEnv")
}
# What redis-sentinel-streams needs from the TriggerAuthentication here: the Sentinels, the master's name,
# the Sentinels' user and Redis's (getRedisSentinelClient's FailoverOptions).
KEDA_SENTINEL_PARAMS = {"addresses", "sentinelMaster", "sentinelUsername", "sentinelPassword", "username", "password"}

# Redis with Sentinel. What the Sentinels send to Redis as their user (`sentinel auth-user`; Redis's
# Sentinel documentation, "Redis Access Control List authentication", and a failover watched in ACL LOG):
SENTINEL_ON_REDIS_COMMANDS = {
    "+ping",
    "+info",
    "+role",
    "+client|setname",
    "+client|kill",
    "+multi",
    "+exec",
    "+slaveof",
    "+config|rewrite",
    "+script|kill",
    "+subscribe",
    "+publish",
}
SENTINEL_HELLO_CHANNEL = "__sentinel__:hello"
# ... and a replica to its primary (`masteruser`).
REPLICATION_COMMANDS = {"+psync", "+replconf", "+ping"}
# What the Sentinels' client user must allow: redis-py's Sentinel (SENTINEL MASTERS, PING), KEDA's go-redis
# v9 FailoverClient (SENTINEL GET-MASTER-ADDR-BY-NAME and SENTINELS, SUBSCRIBE to its two channels, PING
# on the subscription), redis-ha.sh (GET-MASTER-ADDR-BY-NAME, MASTER), the probes (PING) ...
SENTINEL_CLIENT_NEEDS = {
    "+ping",
    "+sentinel|masters",
    "+sentinel|master",
    "+sentinel|get-master-addr-by-name",
    "+sentinel|sentinels",
    "+subscribe",
}
SENTINEL_CLIENT_CHANNELS = {"+switch-master", "+replica-reconf-done"}
# ... and what else it may: read-only questions, never SENTINEL SET, FAILOVER, REMOVE, CONFIG, RESET.
SENTINEL_CLIENT_MAY = SENTINEL_CLIENT_NEEDS | {
    "+role",
    "+sentinel|replicas",
    "+sentinel|slaves",
    "+sentinel|myid",
    "+unsubscribe",
}
# Settings only the HA overlay gives a process (none is in the compose file).
HA_SETTINGS_OF = {
    "api": {
        "TAILCUT_REDIS_SENTINELS",
        "TAILCUT_REDIS_SENTINEL_MASTER",
        "TAILCUT_REDIS_SENTINEL_USERNAME",
        "TAILCUT_REDIS_SENTINEL_PASSWORD",
        "TAILCUT_INTAKE_DURABILITY",
    },
    "jobs": {
        "TAILCUT_REDIS_SENTINELS",
        "TAILCUT_REDIS_SENTINEL_MASTER",
        "TAILCUT_REDIS_SENTINEL_USERNAME",
        "TAILCUT_REDIS_SENTINEL_PASSWORD",
        "TAILCUT_INTAKE_DURABILITY",
    },
    "worker": {
        "TAILCUT_REDIS_SENTINELS",
        "TAILCUT_REDIS_SENTINEL_MASTER",
        "TAILCUT_REDIS_SENTINEL_USERNAME",
        "TAILCUT_REDIS_SENTINEL_PASSWORD",
    },
}


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

    @property
    def ha(self) -> bool:
        return self.overlay in HA_OVERLAYS

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        (found,) = [obj for obj in self.of_kind(kind) if obj["metadata"]["name"] == name] or [None]
        assert found is not None, f"{self.overlay}: no {kind} {name}"
        return found

    def config_map(self, name: str) -> dict[str, str]:
        data: dict[str, str] = self.get("ConfigMap", name).get("data", {})
        return data

    def generated(self, name: str) -> dict[str, str]:
        """The data of the ConfigMap a configMapGenerator named ``name`` (its name carries a hash)."""
        (found,) = [
            obj["metadata"]["name"]
            for obj in self.of_kind("ConfigMap")
            if re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", obj["metadata"]["name"])
        ] or [None]
        assert found is not None, f"{self.overlay}: no generated ConfigMap {name}"
        return self.config_map(found)

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


@pytest.fixture(scope="module", params=HA_OVERLAYS)
def ha(request: pytest.FixtureRequest) -> Rendered:
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


def resolved_env(rendered: Rendered, container: dict[str, Any], *, pod: str = "") -> dict[str, str]:
    """The container's environment as the kubelet builds it, the Secret holding ``secret_value(key)``,
    in the pod named ``pod`` (the downward API's metadata.name)."""
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
        elif variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            assert pod, f"{name} is the pod's name: say which pod"
            env[name] = pod
        else:
            raise AssertionError(f"{name}: a value, a ConfigMap key, a Secret key or the pod's name only ({variable})")
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
        *(
            [
                ("StatefulSet", "tailcut-redis-sentinel"),
                ("Service", "tailcut-redis-sentinel"),
                ("PodDisruptionBudget", "tailcut-redis"),
                ("PodDisruptionBudget", "tailcut-redis-sentinel"),
            ]
            if rendered.ha
            else []
        ),
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
    assert not [obj for obj in rendered.objects if obj["kind"] == "ConfigMap" and "local-config" in str(obj)], (
        "kustomize's local-config objects stay out of the manifests"
    )


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
    for process, workload, container in rendered.tailcut_containers():
        service = compose_service(workload)
        assert service in services, f"{workload['metadata']['name']} stands for no compose service ({service})"
        ours = {k: v for k, v in resolved_env(rendered, container).items() if k.startswith("TAILCUT_")}
        theirs = compose.environment(services[service])
        if rendered.ha:  # Sentinel's settings, and the replica durability; checked by the HA tests
            assert HA_SETTINGS_OF[process] <= set(ours) and not HA_SETTINGS_OF[process] & set(theirs)
            ours = {k: v for k, v in ours.items() if k not in HA_SETTINGS_OF[process]}
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


def secret_keys_in_readme() -> tuple[set[str], set[str]]:
    """The Secret's keys the README's commands create: those of every overlay (``create secret``), and
    those it adds for Sentinel (a loop of ``kubectl patch secret`` over the keys)."""
    section = readme_section("Kubernetes")
    assert f"create secret generic {SECRET_NAME}" in section and f"create namespace {NAMESPACE}" in section
    created = set(re.findall(r"--from-literal=([a-z0-9-]+)=", section))
    (loop,) = re.findall(r"for key in ([a-z0-9 -]+); do\s+kubectl -n (\S+) patch secret (\S+) ", section) or [None]
    assert loop is not None, "the README adds Sentinel's keys with `for key in ...; do kubectl -n ... patch secret`"
    keys, namespace, secret = loop
    assert (namespace, secret) == (NAMESPACE, SECRET_NAME)
    return created, set(keys.split())


def test_every_secret_comes_from_the_secret_the_readme_creates(rendered: Rendered) -> None:
    created, for_sentinel = secret_keys_in_readme()
    assert not created & for_sentinel
    if rendered.ha:
        created |= for_sentinel
    used: set[str] = set()
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
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
        # Under `<namespace>.svc`: KEDA's scalers connect from KEDA's namespace. (With Sentinel the host
        # is not used: test_ha_every_process_reaches_redis_through_the_sentinels.)
        expected = ("redis", f"{service['metadata']['name']}.{NAMESPACE}.svc", service_port["port"], "/0")
        assert where == expected, f"{workload['metadata']['name']}: Redis at {where}, the Service is {expected}"
        assert url.username == compose.REDIS_USER_OF[compose_service(workload)], workload["metadata"]["name"]


# A stand-in for redis-cli, for the start-up scripts run here: it logs each call (user, password,
# address, command) to $STUB_LOG and prints the reply in $STUB_REPLIES named after the address and the
# command's first two words (a `.once` file first, then removed); no file: nothing answers (exit 1).
STUB_REDIS_CLI = r"""#!/bin/sh
user= host= port=
while [ $# -gt 0 ]; do
    case $1 in
        --user) user=$2; shift 2 ;;
        -h) host=$2; shift 2 ;;
        -p) port=$2; shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
printf '%s\t%s\t%s\t%s\n' "$user" "${REDISCLI_AUTH-}" "$host:$port" "$*" >>"$STUB_LOG"
key=$(printf '%s' "${host}_${port}_${1-}_${2-}" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9_.-' '_')
if [ -f "$STUB_REPLIES/$key.once" ]; then cat "$STUB_REPLIES/$key.once"; rm "$STUB_REPLIES/$key.once"; exit 0; fi
if [ -f "$STUB_REPLIES/$key" ]; then cat "$STUB_REPLIES/$key"; exit 0; fi
echo "Could not connect to Redis at $host:$port: Connection refused" >&2
exit 1
"""


def reply_name(address: str, *command: str) -> str:
    """The stand-in's reply file for ``command`` at ``address`` (host:port)."""
    host, port = address.rsplit(":", 1)
    words = [*command[:2], ""][:2]
    return re.sub(r"[^a-z0-9_.-]", "_", f"{host}_{port}_{words[0]}_{words[1]}".lower())


@dataclass
class Ran:
    """What a container's command left: its mounts (and /tmp/tailcut-redis) as local folders, and the
    stand-in redis-cli's calls as (user, password, address, command)."""

    folders: dict[str, Path]
    calls: list[tuple[str, str, str, str]]

    def file(self, path: str) -> Path:
        for mount, folder in sorted(self.folders.items(), key=lambda item: -len(item[0])):
            if path.startswith(mount + "/"):
                return folder / path.removeprefix(mount + "/")
        raise AssertionError(f"{path} is in no mount")


def run_container(
    rendered: Rendered,
    workload: dict[str, Any],
    container: dict[str, Any],
    tmp_path: Path,
    *,
    pod: str,
    replies: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> Ran:
    """The container's own command, run here as pod ``pod``: its ConfigMaps written where it mounts them
    (other volumes empty), the Secret's values in its environment, ``true`` for redis-server, the
    stand-in for redis-cli answering ``replies`` (reply file name → reply) and ``getent`` resolving all."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
    folders: dict[str, Path] = {}
    for index, mount in enumerate(container.get("volumeMounts", [])):
        folder = tmp_path / f"mount{index}"
        folder.mkdir()
        volume = volumes.get(mount["name"], {})  # else a volume claim (the data): empty here
        if "configMap" in volume:
            for name, text in rendered.config_map(volume["configMap"]["name"]).items():
                (folder / name).write_text(text)
        folders[mount["mountPath"]] = folder
    folders["/tmp/tailcut-redis"] = tmp_path / "tmp"
    argv = container.get("command", []) + container.get("args", [])
    assert argv[:1] == ["/bin/sh"], f"{container['name']} runs a /bin/sh script"
    # Longest path first, so that no replacement rewrites part of another.
    for path, folder in sorted(folders.items(), key=lambda item: -len(item[0])):
        argv = [arg.replace(path, str(folder)) for arg in argv]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "redis-cli").write_text(STUB_REDIS_CLI)
    (stubs / "getent").write_text("#!/bin/sh\nexit 0\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    answers = tmp_path / "replies"
    answers.mkdir()
    for name, text in (replies or {}).items():
        (answers / name).write_text(text)
    log = tmp_path / "redis-cli.log"
    log.touch()
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("REDIS_", "SENTINEL"))}
    run_env = clean | resolved_env(rendered, container, pod=pod) | (env or {})
    run_env |= {
        "REDIS_ACL_FILE": str(tmp_path / "users.acl"),
        "REDIS_SERVER": "true",
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_LOG": str(log),
        "STUB_REPLIES": str(answers),
    }
    done = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = []
    for line in log.read_text().splitlines():
        user, password, address, command = line.split("\t")
        calls.append((user, password, address, command))
    return Ran(folders, calls)


def acl_users(path: Path) -> dict[str, list[str]]:
    """User → rules of an ACL file (or of the `user` lines of a sentinel.conf)."""
    users = {}
    for line in path.read_text().splitlines():
        if line.startswith("user "):
            _word, name, *rules = line.split()
            users[name] = rules
    return users


def run_redis_command(
    rendered: Rendered, tmp_path: Path, *, ordinal: int = 0, replies: dict[str, str] | None = None
) -> tuple[dict[str, list[str]], Ran]:
    """The Redis container's own command, run here (``run_container``) as pod ``ordinal``; returns the
    ACL file it wrote, and what it left."""
    statefulset, container = rendered.redis()
    ran = run_container(
        rendered, statefulset, container, tmp_path, pod=f"{statefulset['metadata']['name']}-{ordinal}", replies=replies
    )
    lines = (tmp_path / "users.acl").read_text().splitlines()
    assert all(line.startswith("user ") for line in lines), lines
    return acl_users(tmp_path / "users.acl"), ran


def test_redis_users_match_every_process_and_keda(rendered: Rendered, tmp_path: Path) -> None:
    users, _ran = run_redis_command(rendered, tmp_path)
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
    statefulset, redis = rendered.redis()
    redis_env = resolved_env(rendered, redis, pod=f"{statefulset['metadata']['name']}-0")
    for kind, probe in probes(redis).items():
        command = " ".join(probe["exec"]["command"])
        (user,) = re.findall(r"--user (\S+)", command)
        (variable,) = re.findall(r"REDISCLI_AUTH=\"\$(\w+)\"", command)
        assert "+ping" in users[user] and f"#{compose.sha256(redis_env[variable])}" in users[user], kind
    # KEDA: its user from the TriggerAuthentication, read-only, the commands of lagCount mode, intake only.
    params = keda_params(rendered)
    keda = users[params["username"]]
    assert f"#{compose.sha256(params['password'])}" in keda, "KEDA's password is not its user's"
    assert "-@all" in keda and {rule for rule in keda if rule[0] in "+-" and rule != "-@all"} == KEDA_LAG_COMMANDS
    streams = Keys(prefix).intake_all()
    patterns = compose.grants(keda, "~")
    assert patterns and all(pattern.startswith(f"{prefix}q:") for pattern in patterns), f"KEDA reaches {patterns}"
    assert all(any(fnmatch.fnmatchcase(stream, pattern) for pattern in patterns) for stream in streams)
    assert not compose.grants(keda, "&"), "KEDA subscribes to nothing"
    # KEDA's address is the processes' Redis; with Sentinel, the processes' Sentinels and master name.
    _workload, api = rendered.one("api")
    if rendered.ha:
        env = resolved_env(rendered, api)
        assert set(params) == KEDA_SENTINEL_PARAMS, f"redis-sentinel-streams: {sorted(params)}"
        assert parse_sentinels(params["addresses"]) == parse_sentinels(env["TAILCUT_REDIS_SENTINELS"])
        assert params["sentinelMaster"] == env["TAILCUT_REDIS_SENTINEL_MASTER"]
        assert (params["sentinelUsername"], params["sentinelPassword"]) == (
            env["TAILCUT_REDIS_SENTINEL_USERNAME"],
            env["TAILCUT_REDIS_SENTINEL_PASSWORD"],
        ), "KEDA asks the Sentinels as the processes do (their user `client`: test_ha_sentinels_...)"
    else:
        url = redis_url_of(rendered, api)
        assert params["address"] == f"{url.hostname}:{url.port}"


def keda_params(rendered: Rendered) -> dict[str, str]:
    """The parameters KEDA's scalers get from the TriggerAuthentication (ConfigMap values, and the
    Secret's as ``secret_value``), after checking the scaler reads each."""
    (trigger_auth,) = rendered.of_kind("TriggerAuthentication")
    params = {}
    for ref in trigger_auth["spec"].get("configMapTargetRef", []):
        params[ref["parameter"]] = rendered.config_map(ref["name"])[ref["key"]]
    for ref in trigger_auth["spec"].get("secretTargetRef", []):
        params[ref["parameter"]] = secret_value(ref["key"])
    assert set(params) <= REDIS_STREAMS_AUTH_PARAMS, (
        f"parameters KEDA's scaler does not read: {set(params) - REDIS_STREAMS_AUTH_PARAMS}"
    )
    return params


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
        # With Sentinel every trigger finds the primary through the Sentinels (keda_params).
        trigger_type, readable = (
            ("redis-sentinel-streams", REDIS_SENTINEL_STREAMS_METADATA)
            if rendered.ha
            else ("redis-streams", REDIS_STREAMS_METADATA)
        )
        for trigger in target["triggers"]:
            metadata = trigger["metadata"]
            assert trigger["type"] == trigger_type, f"{name}: {trigger['type']}, not {trigger_type}"
            assert set(metadata) <= readable, f"{name}: KEDA reads no {set(metadata) - readable}"
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
        if WORKERS_OF[rendered.overlay] == "gpu":
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
    if WORKERS_OF[rendered.overlay] == "gpu":
        pools = {workload["metadata"]["labels"]["pool"] for workload, _container in rendered.workers()}
        assert pools == {"realtime", "background"}


# --- Redis with Sentinel (the gpu-ha overlay) ----------------------------------------------------------


def entries(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def pod_addresses(rendered: Rendered, statefulset_name: str, port_name: str) -> list[str]:
    """host:port of each pod of a StatefulSet, by ordinal, by the names its headless Service gives them
    (under ``<namespace>.svc``, which resolves from every namespace), on the Service's port — after
    checking the Service: headless, also for pods not ready yet, selecting the pods, onto their port."""
    statefulset = rendered.get("StatefulSet", statefulset_name)
    service = rendered.get("Service", statefulset["spec"]["serviceName"])
    spec = service["spec"]
    assert spec.get("clusterIP") == "None", f"{service['metadata']['name']}: headless (each pod by its name)"
    assert spec.get("publishNotReadyAddresses") is True, f"{service['metadata']['name']}: names before readiness"
    assert spec["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    (port,) = [item for item in spec["ports"] if item["name"] == port_name]
    assert port_number(container, port["targetPort"]) == port["port"], "the Service's port is the container's"
    name = statefulset["metadata"]["name"]
    service_name = service["metadata"]["name"]
    return [f"{name}-{i}.{service_name}.{NAMESPACE}.svc:{port['port']}" for i in range(statefulset["spec"]["replicas"])]


def commands(rules: list[str]) -> set[str]:
    return {rule for rule in rules if rule[0] in "+-" and rule != "-@all"}


@dataclass
class Conf:
    """A Redis or Sentinel configuration file: its directives (comments dropped) and its `user` lines."""

    lines: list[list[str]]
    users: dict[str, list[str]]
    text: str

    @classmethod
    def read(cls, path: Path) -> Conf:
        text = path.read_text()
        lines = [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        return cls([line for line in lines if line[0] != "user"], acl_users(path), text)

    def all(self, *prefix: str) -> list[list[str]]:
        return [line[len(prefix) :] for line in self.lines if tuple(line[: len(prefix)]) == prefix]

    def one(self, *prefix: str) -> list[str]:
        (found,) = self.all(*prefix) or [None]
        assert found is not None, f"no one {' '.join(prefix)} line"
        return found


def sentinel_conf(
    rendered: Rendered, tmp_path: Path, ordinal: int, replies: dict[str, str] | None = None
) -> tuple[Conf, Ran]:
    """The sentinel.conf the Sentinels' init container writes for pod ``ordinal`` (``run_container``)."""
    statefulset = rendered.get("StatefulSet", "tailcut-redis-sentinel")
    (init,) = statefulset["spec"]["template"]["spec"]["initContainers"]
    ran = run_container(rendered, statefulset, init, tmp_path, pod=f"tailcut-redis-sentinel-{ordinal}", replies=replies)
    return Conf.read(ran.file(init["command"][-1])), ran


def redis_conf(
    rendered: Rendered, tmp_path: Path, ordinal: int, replies: dict[str, str] | None = None
) -> tuple[Conf, dict[str, list[str]], Ran]:
    """The redis.conf the Redis container of pod ``ordinal`` starts with, and its ACL (``run_container``)."""
    users, ran = run_redis_command(rendered, tmp_path, ordinal=ordinal, replies=replies)
    _statefulset, container = rendered.redis()
    (path,) = re.findall(r"export REDIS_CONFIG=(\S+)", " ".join(container["args"]))
    return Conf.read(ran.file(path)), users, ran


def sentinel_reports(sentinel: str, primary: str, *, flags: str = "master", once: bool = False) -> dict[str, str]:
    """Replies of the Sentinel at ``sentinel`` naming ``primary`` (``flags``: its view of it)."""
    host, port = primary.rsplit(":", 1)
    suffix = ".once" if once else ""
    return {
        reply_name(sentinel, "SENTINEL", "get-master-addr-by-name") + suffix: f"{host}\n{port}\n",
        reply_name(sentinel, "SENTINEL", "master") + suffix: f"name\nmymaster\nflags\n{flags}\n",
    }


def test_ha_every_process_reaches_redis_through_the_sentinels(
    ha: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sentinels = [
        (host, int(port))
        for host, port in (item.rsplit(":", 1) for item in pod_addresses(ha, "tailcut-redis-sentinel", "sentinel"))
    ]
    conf, _ran = sentinel_conf(ha, tmp_path, 0)
    (master, *_rest) = conf.one("sentinel", "monitor")
    seen = set()
    for process, workload, container in ha.tailcut_containers():
        name = workload["metadata"]["name"]
        env = resolved_env(ha, container)
        for settings_class in SETTINGS_OF[process]:
            settings = settings_from(env, settings_class, monkeypatch)
            endpoint = settings.redis
            assert list(endpoint.sentinels) == sentinels, f"{name}: Sentinels {endpoint.sentinels}, not {sentinels}"
            assert endpoint.master == master, f"{name}: master {endpoint.master!r}, the Sentinels monitor {master!r}"
            client = conf.users.get(endpoint.sentinel_username or "", [])
            assert f"#{compose.sha256(endpoint.sentinel_password or '')}" in client, (
                f"{name}: no Sentinel user {endpoint.sentinel_username} with that password"
            )
            if process in ("api", "jobs"):
                assert settings.intake_durability == "replica" and settings.intake_replicas == 1, (
                    f"{name}: a request is accepted once a replica has it"
                )
        seen.add(process)
    assert seen == set(SETTINGS_OF)


def test_ha_sentinels_monitor_the_redis_pods_with_users_that_agree(ha: Rendered, tmp_path: Path) -> None:
    nodes = pod_addresses(ha, "tailcut-redis", "redis")
    sentinels = pod_addresses(ha, "tailcut-redis-sentinel", "sentinel")
    data = ha.generated("tailcut-redis")
    assert entries(data["redis-nodes"]) == nodes and entries(data["sentinels"]) == sentinels
    assert len(sentinels) >= 3, "a failover needs a quorum and a majority of the Sentinels, with one down"
    redis_users, _ran = run_redis_command(ha, tmp_path / "redis")
    statefulset = ha.get("StatefulSet", "tailcut-redis-sentinel")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    client_name = data["sentinel-client-user"]
    for ordinal, own in enumerate(sentinels):
        conf, _ran = sentinel_conf(ha, tmp_path / f"sentinel{ordinal}", ordinal)
        host, port = own.rsplit(":", 1)
        assert conf.one("port") == [port] and port_number(container, "sentinel") == int(port)
        assert conf.one("sentinel", "resolve-hostnames") == ["yes"] and conf.one("sentinel", "announce-hostnames") == [
            "yes"
        ]
        assert conf.one("sentinel", "announce-ip") == [host] and conf.one("sentinel", "announce-port") == [port]
        master, primary_host, primary_port, quorum = conf.one("sentinel", "monitor")
        assert master == data["sentinel-master"]
        assert f"{primary_host}:{primary_port}" == nodes[0], "nobody answers: pod 0 is the primary"
        assert len(sentinels) // 2 < int(quorum) <= len(sentinels), f"quorum {quorum} of {len(sentinels)}"
        down_after = int(conf.one("sentinel", "down-after-milliseconds", master)[0])
        assert 0 < down_after < int(conf.one("sentinel", "failover-timeout", master)[0])
        # The Sentinels' user on Redis: what they send there, the hello channel, no key.
        (user,) = conf.one("sentinel", "auth-user", master)
        (password,) = conf.one("sentinel", "auth-pass", master)
        rules = redis_users[user]
        assert f"#{compose.sha256(password)}" in rules, f"sentinel auth-pass is not Redis user {user}'s password"
        assert "-@all" in rules and commands(rules) == SENTINEL_ON_REDIS_COMMANDS, commands(rules)
        assert compose.grants(rules, "&") == [SENTINEL_HELLO_CHANNEL] and not compose.grants(rules, "~")
        # The Sentinels among themselves: `admin`; nobody without a user.
        (peer,) = conf.one("sentinel", "sentinel-user")
        (peer_password,) = conf.one("sentinel", "sentinel-pass")
        assert f"#{compose.sha256(peer_password)}" in conf.users[peer] and "+@all" in conf.users[peer]
        assert "off" in conf.users["default"] and "on" not in conf.users["default"]
        # The processes' and KEDA's user: where the primary is and its changes, nothing that changes anything.
        client = conf.users[client_name]
        assert f"#{compose.sha256(secret_value('sentinel-client-password'))}" in client
        assert "-@all" in client and SENTINEL_CLIENT_NEEDS <= commands(client) <= SENTINEL_CLIENT_MAY, commands(client)
        assert set(compose.grants(client, "&")) == SENTINEL_CLIENT_CHANNELS
    # The probes PING as the client user, on the Sentinel's port.
    for kind, probe in probes(container).items():
        command = " ".join(probe["exec"]["command"])
        assert re.findall(r"--user (\S+)", command) == [client_name] and "ping" in command, kind
        (variable,) = re.findall(r"REDISCLI_AUTH=\"\$(\w+)\"", command)
        assert resolved_env(ha, container)[variable] == secret_value("sentinel-client-password"), kind
        assert re.findall(r"-p (\d+)", command) == [str(port_number(container, "sentinel"))], kind
    # A new Sentinel follows the others' primary (asked as the client user, never itself) ...
    conf, ran = sentinel_conf(ha, tmp_path / "follows", 0, sentinel_reports(sentinels[1], nodes[2]))
    assert conf.one("sentinel", "monitor")[1:3] == nodes[2].rsplit(":", 1)
    assert {(user, password) for user, password, _address, _command in ran.calls} == {
        (client_name, secret_value("sentinel-client-password"))
    }
    assert sentinels[0] not in {address for _user, _password, address, _command in ran.calls}
    # ... or, with no Sentinel answering, the Redis pod that says it is the primary (asked as `sentinel`).
    replies = {reply_name(nodes[0], "ROLE"): "slave\n", reply_name(nodes[1], "ROLE"): "master\n0\n"}
    conf, ran = sentinel_conf(ha, tmp_path / "role", 0, replies)
    assert conf.one("sentinel", "monitor")[1:3] == nodes[1].rsplit(":", 1)
    role_calls = [(user, password) for user, password, _address, command in ran.calls if command == "ROLE"]
    assert role_calls and all(
        "+role" in redis_users[user] and f"#{compose.sha256(password)}" in redis_users[user]
        for user, password in role_calls
    )


def test_ha_redis_pods_start_as_the_primary_or_a_replica_of_it(ha: Rendered, tmp_path: Path) -> None:
    nodes = pod_addresses(ha, "tailcut-redis", "redis")
    sentinels = pod_addresses(ha, "tailcut-redis-sentinel", "sentinel")
    statefulset, _container = ha.redis()
    assert statefulset["spec"]["replicas"] == len(nodes) >= 3, "a replica may restart while the primary has another"
    assert statefulset["spec"].get("podManagementPolicy") == "Parallel", "no pod waits for a dead lower ordinal"
    base = (compose.REDIS_DIR / "redis.conf").read_text()

    def replica_of(conf: Conf) -> str | None:
        found = conf.all("replicaof")
        assert len(found) <= 1
        return ":".join(found[0]) if found else None

    # A new deployment: nobody answers, pod 0 is the primary, the others its replicas.
    for ordinal, own in enumerate(nodes):
        conf, users, _ran = redis_conf(ha, tmp_path / f"new{ordinal}", ordinal)
        assert conf.text.startswith(base), "deploy/redis/redis.conf, then this pod's replication settings"
        assert replica_of(conf) == (None if ordinal == 0 else nodes[0]), f"pod {ordinal}"
        host, port = own.rsplit(":", 1)
        assert conf.one("replica-announce-ip") == [host] and conf.one("replica-announce-port") == [port]
        assert port == compose.redis_config()["port"]
        (user,) = conf.one("masteruser")
        (password,) = conf.one("masterauth")
        assert f"#{compose.sha256(password)}" in users[user], "masterauth is not the replication user's password"
        assert "-@all" in users[user] and commands(users[user]) == REPLICATION_COMMANDS
        assert not compose.grants(users[user], "~") and not compose.grants(users[user], "&")
        # Writes need a replica's acknowledgement, and one replica may be down.
        to_write = int(conf.one("min-replicas-to-write")[0])
        assert 1 <= to_write <= len(nodes) - 2 and int(conf.one("min-replicas-max-lag")[0]) > 0
    # After a failover to pod 2: the others follow it, pod 2 stays the primary.
    reports = sentinel_reports(sentinels[0], nodes[2])
    for ordinal, expected in ((0, nodes[2]), (1, nodes[2]), (2, None)):
        conf, _users, ran = redis_conf(ha, tmp_path / f"after{ordinal}", ordinal, reports)
        assert replica_of(conf) == expected, f"pod {ordinal} after a failover to pod 2"
        assert {(user, password) for user, password, _address, _command in ran.calls} == {
            (ha.generated("tailcut-redis")["sentinel-client-user"], secret_value("sentinel-client-password"))
        }
    # No Sentinel answers: the pod that says it is the primary.
    conf, _users, _ran = redis_conf(ha, tmp_path / "role", 1, {reply_name(nodes[2], "ROLE"): "master\n0\n"})
    assert replica_of(conf) == nodes[2]
    # Pod 0 restarts while the Sentinels hold it for down: it waits for the new primary instead of
    # starting as a second one.
    replies = sentinel_reports(sentinels[0], nodes[0], flags="s_down,master", once=True)
    replies |= sentinel_reports(sentinels[0], nodes[1])
    conf, _users, _ran = redis_conf(ha, tmp_path / "doubt", 0, replies)
    assert replica_of(conf) == nodes[1]


def test_ha_disruptions_and_spread_take_one_pod_at_a_time(ha: Rendered) -> None:
    budgets = ha.of_kind("PodDisruptionBudget")
    for name in ("tailcut-redis", "tailcut-redis-sentinel"):
        statefulset = ha.get("StatefulSet", name)
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert budget["spec"].get("maxUnavailable") == 1, f"{name}: one pod at a time"
        (term,) = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname", name
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items(), name


def test_ha_a_real_sentinel_loads_its_configuration_and_watches_redis(ha: Rendered, tmp_path: Path) -> None:
    """redis-server with the ACL the Redis container writes, and redis-sentinel with the configuration
    the init container writes (its names pointed at 127.0.0.1): Sentinel starts, reaches Redis as its
    user (INFO answered, no ACL refusal), answers the client user and refuses it a change."""
    server, sentinel_binary = shutil.which("redis-server"), shutil.which("redis-sentinel")
    if server is None or sentinel_binary is None:
        pytest.fail("redis-server and redis-sentinel are needed: ./scripts/ensure-tools installs them")
    _users, _ran = run_redis_command(ha, tmp_path / "redis")
    conf, _ran = sentinel_conf(ha, tmp_path / "sentinel", 0)
    redis_port, sentinel_port = free_port(), free_port()
    master = conf.one("sentinel", "monitor")[0]
    lines = []
    for line in conf.text.splitlines():
        words = line.split()
        if words[:1] == ["port"]:
            line = f"port {sentinel_port}"
        elif words[:2] == ["sentinel", "monitor"]:
            line = f"sentinel monitor {master} 127.0.0.1 {redis_port} {words[-1]}"
        elif words[:2] == ["sentinel", "announce-ip"]:
            line = "sentinel announce-ip 127.0.0.1"
        elif words[:2] == ["sentinel", "announce-port"]:
            line = f"sentinel announce-port {sentinel_port}"
        lines.append(line)
    local_conf = tmp_path / "sentinel.conf"
    local_conf.write_text("\n".join(lines) + "\nbind 127.0.0.1\n")
    data = tmp_path / "data"
    data.mkdir()
    argv = [
        server,
        "--port",
        str(redis_port),
        "--bind",
        "127.0.0.1",
        "--aclfile",
        str(tmp_path / "redis" / "users.acl"),
    ]
    argv += ["--dir", str(data), "--save", "", "--appendonly", "no"]
    children = [subprocess.Popen(argv, stdout=subprocess.DEVNULL)]
    children.append(subprocess.Popen([sentinel_binary, str(local_conf)], stdout=subprocess.DEVNULL))
    admin = redis_py.Redis(port=redis_port, username="admin", password=secret_value("redis-admin-password"))
    client_name = ha.generated("tailcut-redis")["sentinel-client-user"]
    client_password = secret_value("sentinel-client-password")
    client = redis_py.Redis(port=sentinel_port, username=client_name, password=client_password, decode_responses=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert all(child.poll() is None for child in children), "redis-server or redis-sentinel exited"
            with contextlib.suppress(redis_py.RedisError):
                state = client.sentinel_master(master)
                if int(state["info-refresh"]) < 5000 and state["role-reported"] == "master":
                    break
            assert time.monotonic() < deadline, "Sentinel did not get Redis's INFO as its user"
            time.sleep(0.1)
        assert not state["is_sdown"] and not state["is_odown"]
        refused = [entry for entry in admin.acl_log(count=100) if entry.get("object") != "client|setinfo"]
        assert not refused, f"Redis refused the Sentinel: {refused}"
        # The processes' way in (redis-py's Sentinel, SENTINEL MASTERS): the API's user on the primary.
        found = Sentinel(
            [("127.0.0.1", sentinel_port)], sentinel_kwargs={"username": client_name, "password": client_password}
        )
        api = found.master_for(master, username="api", password=secret_value("redis-api-password"))
        assert api.ping()
        api.close()
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            client.execute_command("SENTINEL", "SET", master, "quorum", "1")
        with pytest.raises(redis_py.RedisError):
            redis_py.Redis(port=sentinel_port).ping()
    finally:
        client.close()
        admin.close()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=10)


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
    assert "Not there yet**: Redis Sentinel" not in section, "Sentinel is there: the gpu-ha overlay"
    for key in secret_keys_in_readme()[1]:
        assert f"`{key}`" in section, f"the README says what the Secret's {key} is for"

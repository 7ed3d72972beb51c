"""``tailcut up``: the whole stack on one machine, for trying tailcut out.

Settings come as everywhere else: a flag wins over its ``TAILCUT_*`` variable, which wins over the
default of the settings class (``--model``/``TAILCUT_MODEL``, ``--redis-url``/``TAILCUT_REDIS_URL``,
``--port``/``TAILCUT_PORT``; ``TAILCUT_HOST`` too). Starts a private ``redis-server`` (temporary folder,
free port) unless a Redis URL is given or a Redis answers on the default address, then the worker(s),
one batch-job process (``tailcut jobs``) and the API as child processes; waits until ``/readyz`` says
ready, prints the URL and a curl to paste, and on Ctrl-C (or SIGTERM) stops everything in reverse
order. The children die with it even when it is killed with SIGKILL (``tailcut.processes``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from rich.console import Console

from tailcut.errors import ConfigError, FatalError
from tailcut.models import resolve_model, served_name
from tailcut.processes import (
    Child,
    free_port,
    interrupt_on_signals,
    private_redis,
    redis_answers,
    start_child,
    stop_child,
    stop_together,
    wait_until_ready,
)
from tailcut.settings import CommonSettings

READY_TIMEOUT_S = 600.0
# Beyond each process's own grace time (the API's TAILCUT_SHUTDOWN_GRACE_S, the workers'
# TAILCUT_DRAIN_TIMEOUT_S): what it needs to hand back what is left and close.
STOP_MARGIN_S = 15.0
WILDCARD_HOSTS = ("", "0.0.0.0", "::")

console = Console(stderr=True, highlight=False)


def _given(**values: object) -> dict[str, object]:
    """The flags that were given: they win over TAILCUT_* variables, which win over the defaults."""
    return {name: value for name, value in values.items() if value is not None}


def _base_url(host: str, port: int) -> str:
    """Where this process reaches the API bound to ``host``."""
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _wait_ready(url: str, children: list[Child]) -> None:
    with console.status("starting: loading the model into the worker(s)") as status:

        def show(_status: int, body: str) -> None:
            status.update(f"starting: {body[:120]}")

        try:
            wait_until_ready(f"{url}/readyz", children, timeout_s=READY_TIMEOUT_S, what="the stack", on_answer=show)
        except FatalError as exc:
            raise ConfigError(exc.message) from exc


def stop_order(children: list[Child], *, api_grace_s: float, drain_s: float) -> None:
    for name in ("api", "jobs"):
        for child in children:
            if child.name == name:
                stop_child(child, timeout_s=api_grace_s + STOP_MARGIN_S, progress=console.log)
    workers = [child for child in children if child.name not in ("api", "jobs")]
    stop_together(workers, timeout_s=drain_s + STOP_MARGIN_S, progress=console.log)


def up(*, model: str | None, port: int | None, redis_url: str | None, num_workers: int) -> int:
    from api.settings import ApiSettings
    from workers.settings import WorkerSettings

    interrupt_on_signals()  # the stack stops in order
    settings = CommonSettings(**_given(model=model, redis_url=redis_url))  # type: ignore[arg-type]
    api_settings = ApiSettings(**_given(port=port))  # type: ignore[arg-type]
    # What the workers read from the same environment: their metrics ports and their drain time.
    worker_settings = WorkerSettings()
    listen_port = api_settings.port or free_port()  # 0: a free one, known here so readiness can be polled
    with console.status("preparing the model"):
        model_dir = resolve_model(settings.model, settings.cache_dir, progress=console.log)
    name = served_name(model_dir, settings.served_model_name)
    with contextlib.ExitStack() as stack:
        url_of_redis = settings.redis_url
        chosen = "redis_url" in settings.model_fields_set or settings.redis_sentinels
        if not chosen and not redis_answers(url_of_redis):
            url_of_redis = stack.enter_context(private_redis()).url
            console.log(f"started a private redis-server at {url_of_redis}")
        where = str(settings.redis) if settings.redis_sentinels else url_of_redis
        env = {**os.environ, "TAILCUT_REDIS_URL": url_of_redis, "TAILCUT_MODEL": str(model_dir)}
        children: list[Child] = []
        try:
            command = [sys.executable, "-m", "tailcut"]
            metrics_port = worker_settings.metrics_port
            for index in range(num_workers):
                worker_env = {**env, "TAILCUT_METRICS_PORT": str(metrics_port + index if metrics_port else 0)}
                children.append(start_child(f"worker {index + 1}", [*command, "worker"], worker_env))
            children.append(start_child("jobs", [*command, "jobs"], env))
            api_env = {**env, "TAILCUT_PORT": str(listen_port), "TAILCUT_HOST": api_settings.host}
            children.append(start_child("api", [*command, "api"], api_env))
            url = _base_url(api_settings.host, listen_port)
            _wait_ready(url, children)
            console.print(f"\n[bold green]tailcut is up[/] at {url} — model {name}, Redis {where}\n")
            console.print(
                f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{name}", "stream": true, "messages": '
                '[{"role": "user", "content": "What is the capital of France?"}]}\'\n',
                soft_wrap=True,
            )
            console.print(f"Batch log analysis: tailcut jobs submit FILE --url {url}")
            console.print(f"Live status: {url}/status · Prometheus metrics: {url}/metrics\n")
            console.print("Ctrl-C stops everything.")
            while all(child.process.poll() is None for child in children):
                time.sleep(0.5)
            for child in children:
                if child.process.returncode is not None:
                    console.log(f"{child.name} exited with status {child.process.returncode}; stopping")
            return 1
        except KeyboardInterrupt:
            console.print("\nstopping")
            return 0
        finally:
            # The API stops taking requests first (its open replies finish or are handed to their
            # clients), then the jobs process cancels its requests and hands its jobs back to the
            # queue, then the workers drain, all at once.
            stop_order(children, api_grace_s=api_settings.shutdown_grace_s, drain_s=worker_settings.drain_timeout_s)

"""Serving the API from one process or several on one port (``TAILCUT_API_PROCESSES``).

One process runs uvicorn in place. Several are started by a small supervisor: it binds the socket
(and TAILCUT_API_METRICS_PORT's, ``api.metrics_port``) once, empties the metrics folder
(prometheus-client's multiprocess mode, see ``api.metrics``), starts the processes (spawned, so each
builds its own app, its own Redis clients and its own reply channel), restarts one that dies
(stopping instead past ``MAX_RESTARTS_PER_MINUTE``), and on SIGTERM or SIGINT passes one SIGTERM on and
waits: each process drains as a single one does (``api.shutdown``). The processes die with the
supervisor, even a SIGKILLed one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from api.metrics import MULTIPROC_DIR_ENV, forget_dead_processes, wipe_multiprocess_dir
from api.settings import ApiSettings
from tailcut import logs
from tailcut.logs import log_event
from tailcut.processes import die_with_parent

log = logging.getLogger("tailcut.api")

# More restarts than this within a minute stop the supervisor: the processes fail as they start.
MAX_RESTARTS_PER_MINUTE = 5


def serve(overrides: dict[str, Any]) -> None:
    """Run the API with ``ApiSettings(**overrides)`` until SIGTERM or SIGINT."""
    settings = ApiSettings(**overrides)
    logs.configure(settings.log_format)
    if settings.api_processes == 1:
        # uvicorn binds the port itself, unless there are two: then both sockets are this one server's.
        _run_server(settings, sockets=listen_all(settings) if settings.api_metrics_port else None)
        return
    folder = settings.metrics_dir or Path(tempfile.gettempdir()) / f"tailcut-api-metrics-{settings.port}"
    wipe_multiprocess_dir(folder)
    # Read by prometheus-client when each spawned process imports it.
    os.environ[MULTIPROC_DIR_ENV] = str(folder)
    Supervisor(settings, overrides, listen_all(settings)).run()


def listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listen_all(settings: ApiSettings) -> list[socket.socket]:
    """The API's port, then TAILCUT_API_METRICS_PORT's when set (on the same host)."""
    ports = [settings.port] + ([settings.api_metrics_port] if settings.api_metrics_port else [])
    return [listen(settings.host, port) for port in ports]


class Supervisor:
    def __init__(self, settings: ApiSettings, overrides: dict[str, Any], sockets: list[socket.socket]) -> None:
        self._settings = settings
        self._overrides = overrides
        self._sockets = sockets
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._restarts: list[float] = []
        self._stopping = False

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        port = self._sockets[0].getsockname()[1]
        log_event(log, "api_supervisor_started", processes=self._settings.api_processes, port=port)
        self._processes = [self._start() for _ in range(self._settings.api_processes)]
        while not self._stopping:
            time.sleep(0.5)
            for index, process in enumerate(self._processes):
                if process.is_alive() or self._stopping:
                    continue
                log_event(log, "api_process_died", logging.ERROR, pid=process.pid, exitcode=process.exitcode)
                now = time.monotonic()
                self._restarts = [at for at in self._restarts if at > now - 60] + [now]
                if len(self._restarts) > MAX_RESTARTS_PER_MINUTE:
                    log_event(log, "api_processes_failing", logging.ERROR, restarts_in_last_minute=len(self._restarts))
                    self._stop(signal.SIGTERM, None)
                    break
                self._processes[index] = self._start()
        for process in self._processes:
            process.join()
        for sock in self._sockets:
            sock.close()
        log_event(log, "api_supervisor_stopped")

    def _start(self) -> BaseProcess:
        process = self._context.Process(
            target=_child, args=(self._overrides, self._sockets, os.getpid()), name="tailcut-api", daemon=False
        )
        process.start()
        return process

    def _stop(self, signum: int, _frame: FrameType | None) -> None:
        if self._stopping:
            return
        self._stopping = True
        for process in self._processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)


def _child(overrides: dict[str, Any], sockets: list[socket.socket], parent_pid: int) -> None:
    # A group of its own: a terminal's Ctrl-C reaches the supervisor alone, which passes on one SIGTERM
    # (a second signal would make uvicorn skip the drain).
    os.setpgid(0, 0)
    die_with_parent(parent_pid)
    settings = ApiSettings(**overrides)
    if "TAILCUT_API_ID" in os.environ or "api_id" in overrides:
        # Each process needs a reply channel of its own.
        settings = settings.model_copy(update={"api_id": f"{settings.api_id}-{os.getpid()}"})
    logs.configure(settings.log_format)
    forget_dead_processes(Path(os.environ[MULTIPROC_DIR_ENV]))
    _run_server(settings, sockets=sockets)


def _run_server(settings: ApiSettings, *, sockets: list[socket.socket] | None) -> None:
    from api.app import create_app
    from api.shutdown import ApiServer, server_config
    from jobs.settings import JobsSettings

    shared = ("model", "redis_url", "redis_sentinels", "redis_sentinel_master")
    jobs_settings = JobsSettings(**{name: getattr(settings, name) for name in shared})
    config = server_config(
        create_app(settings, jobs_settings=jobs_settings),
        host=settings.host,
        port=settings.port,
        grace_s=settings.shutdown_grace_s,
        keep_alive_s=settings.keep_alive_s,
        log_level="warning",
        access_log=False,
    )
    ApiServer(config).run(sockets=sockets)

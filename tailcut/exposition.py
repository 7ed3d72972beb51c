"""Serving a process's Prometheus registry on its own port (the worker and jobs processes; the API has a
route of its own)."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from tailcut.logs import log_event

log = logging.getLogger("tailcut.metrics")


def serve_metrics(registry: CollectorRegistry, *, host: str, port: int) -> WSGIServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` from a thread (``shutdown()`` stops it); None,
    and one log line, when the port cannot be bound: the worker serves requests all the same."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log_event(log, "metrics_not_served", logging.ERROR, port=port, error=str(exc))
        return None
    log_event(log, "metrics_served", url=f"http://{host}:{server.server_port}/metrics")
    return server

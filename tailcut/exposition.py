"""Serving a process's Prometheus registry on its own port (the worker and jobs processes; the API has a
route of its own).

Always in the classic text format (``text/plain; version=0.0.4``), whatever the scraper's ``Accept``
asks: prometheus-client's OpenMetrics writer rewrites the ``:`` of vLLM's ``vllm:*`` sample names to
``_`` while keeping them in the ``# TYPE`` lines, and Prometheus (which asks for OpenMetrics first) then
stores them under other names than the dashboards query, or drops them.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tailcut.logs import log_event

log = logging.getLogger("tailcut.metrics")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def metrics_app(registry: CollectorRegistry) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(registry: CollectorRegistry, *, host: str, port: int) -> WSGIServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` from a thread (``shutdown()`` stops it); None,
    and one log line, when the port cannot be bound: the worker serves requests all the same."""
    server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
    try:
        server: WSGIServer = make_server(host, port, metrics_app(registry), server_class, handler_class=_QuietHandler)
    except OSError as exc:
        log_event(log, "metrics_not_served", logging.ERROR, port=port, error=str(exc))
        return None
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    log_event(log, "metrics_served", url=f"http://{host}:{server.server_port}/metrics")
    return server

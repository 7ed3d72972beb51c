"""TAILCUT_API_METRICS_PORT: a second port of the API that serves ``/metrics`` and nothing else, with no key
even when TAILCUT_AUTH_REQUIRED is on — Prometheus's, on a network only it reaches — while ``/metrics`` on
the main port needs an admin key once keys are on (``api.auth.require_operator``).

Both ports are sockets of the same server (``api.supervisor``), so several API processes share the metrics
port as they share the main one, and any of them answers for all (the multiprocess mode of
``api.metrics``). A connection is told apart by the port it came to (the ASGI scope's ``server``).
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

NOT_HERE = orjson.dumps(
    {"error": {"message": "this port serves /metrics only", "type": "not_found_error", "param": None, "code": None}}
)


class MetricsPortOnly:
    def __init__(self, app: ASGIApp, *, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] == "http" and server is not None and server[1] == self.port and scope["path"] != "/metrics":
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(NOT_HERE)).encode())]
            await send({"type": "http.response.start", "status": 404, "headers": headers})
            await send({"type": "http.response.body", "body": NOT_HERE})
            return
        await self.app(scope, receive, send)

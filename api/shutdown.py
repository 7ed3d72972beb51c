"""Graceful stop of an API process: stop intake, let open replies finish, hand the rest to their clients.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections; ``ApiServer`` tells the app first. From then
on the process is **draining**: ``/readyz`` answers 503, a new request gets a 503 ``server_shutting_down``
(with ``Retry-After``: another instance takes it), and every open reply may run to its end for
``shutdown_grace_s``. A reply still running then ends with one error event saying how to resume it
(``GET /v1/requests/{id}`` with ``Last-Event-ID``), and its request is *not* cancelled: the worker
finishes it into its durable output, where any API instance reads it. uvicorn's own limit on the stop
(``timeout_graceful_shutdown``) lies a little beyond the grace time, so replies end this way, not cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn

from tailcut.errors import ShuttingDownError

# uvicorn waits this much longer than the grace time before it cancels what is left.
UVICORN_MARGIN_S = 3.0


class Drain:
    """Whether this process is stopping, and the one deadline every open reply shares."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._loop = asyncio.get_running_loop()
        self._deadline: float | None = None
        self._bounds: set[asyncio.Timeout] = set()

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self) -> None:
        """Start draining (idempotent): open replies have ``grace_s`` from now."""
        if self._deadline is not None:
            return
        self._deadline = self._loop.time() + self.grace_s
        for bound in self._bounds:
            bound.reschedule(self._deadline)

    def begin_threadsafe(self) -> None:
        """``begin`` from a signal handler or another thread."""
        self._loop.call_soon_threadsafe(self.begin)

    def refuse_if_draining(self) -> None:
        if self._deadline is not None:
            raise ShuttingDownError("this API instance is shutting down; send the request again")

    @contextlib.asynccontextmanager
    async def bounded(self) -> AsyncIterator[asyncio.Timeout]:
        """Run the body until the drain deadline (none until draining begins); past it the body is
        cancelled and ``TimeoutError`` raised, as ``asyncio.timeout`` does."""
        async with asyncio.timeout(self._deadline) as bound:
            self._bounds.add(bound)
            try:
                yield bound
            finally:
                self._bounds.discard(bound)


def resume_where(request_id: str, *, last_seq: int | None = None, stream: bool = True) -> str:
    """How a client reads the rest of a reply that was cut after position ``last_seq``."""
    if stream:
        return f"GET /v1/requests/{request_id}" + (f" with the header `Last-Event-ID: {last_seq}`" if last_seq else "")
    return f"GET /v1/requests/{request_id}?stream=false"


def resume_hint(request_id: str, *, last_seq: int | None = None, stream: bool = True) -> ShuttingDownError:
    """The error that ends a reply cut by the stop: where to pick it up again."""
    where = resume_where(request_id, last_seq=last_seq, stream=stream)
    return ShuttingDownError(
        f"this API instance is shutting down; request {request_id} runs on: read its reply with {where} "
        "(on any instance)"
    )


class ApiServer(uvicorn.Server):
    """uvicorn's server, which tells the app's ``Drain`` (``app.state.tailcut.drain``) when a stop
    begins, before it stops listening."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "tailcut", None)
        drain = getattr(state, "drain", None)
        if isinstance(drain, Drain):
            drain.begin_threadsafe()
        super().handle_exit(sig, frame)


def server_config(
    app: object, *, host: str, port: int, grace_s: float, keep_alive_s: int, **options: object
) -> uvicorn.Config:
    """uvicorn's configuration for the API: its stop waits out the grace time, plus a margin; an idle
    connection stays open ``keep_alive_s`` (``ApiSettings.keep_alive_s``)."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        timeout_graceful_shutdown=int(grace_s + UVICORN_MARGIN_S),
        timeout_keep_alive=keep_alive_s,
        **options,  # type: ignore[arg-type]
    )

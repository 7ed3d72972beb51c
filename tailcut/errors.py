"""One rooted error hierarchy: recoverable errors (retry, shed, report) apart from fatal ones.

The errors know nothing of HTTP: ``api/errors.py`` is the one place they become status codes,
headers and OpenAI-shaped bodies. ``code`` is a stable machine-readable name a client can act on.
"""

from __future__ import annotations


class TailcutError(Exception):
    """Root of every error tailcut raises on purpose."""

    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request field the error is about, if any.
        self.param = param
        if code is not None:
            self.code = code


class RecoverableError(TailcutError):
    """The request failed but the process is healthy; the caller may retry."""


class FatalError(TailcutError):
    """The process cannot go on (bad configuration, dead engine); it should stop with this message."""


class InvalidRequestError(RecoverableError):
    """The client sent something we will not run; the message says what to fix."""


class AuthenticationError(RecoverableError):
    code = "invalid_api_key"


class KeyPromptError(AuthenticationError):
    """As ``AuthenticationError``, on a page a browser opens (the status page): the client should ask its
    user for the key (an HTTP edge asks for it as a password)."""


class PermissionDeniedError(RecoverableError):
    """The key is valid but does not allow this (a tier it may not use, an admin route)."""

    code = "permission_denied"


class ModelNotFoundError(RecoverableError):
    code = "model_not_found"


class ServiceUnavailableError(RecoverableError):
    """A dependency (Redis) does not answer, or a request failed in a way a retry may fix."""

    code = "service_unavailable"


class ShuttingDownError(ServiceUnavailableError):
    """This API process is stopping: a new request is refused (retry: another instance takes it), and
    a reply still running when the grace time ends is handed to the client to resume elsewhere."""

    code = "server_shutting_down"


class OverloadedError(RecoverableError):
    """The tier's queue is at its limit: the request was not accepted; retry after ``retry_after_s``."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, tier: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.tier = tier
        self.retry_after_s = retry_after_s


class DeadlineExceededError(RecoverableError):
    """The request's tier deadline passed before it could start."""

    code = "expired"  # the code of the worker's error event too, streamed or not


class RequestNotFoundError(RecoverableError):
    """No request with this id for the caller (never accepted, another tenant's, or expired)."""

    code = "request_not_found"


class WorkerNotFoundError(RecoverableError):
    """No live worker with this id (never started here, stopped, or its heartbeat stopped)."""

    code = "worker_not_found"


class DeadLetterNotFoundError(RecoverableError):
    """No dead-letter entry with this id (never there, replayed already, or trimmed)."""

    code = "dead_letter_not_found"


class NotReplayableError(RecoverableError):
    """A dead-lettered request no client could read any more (its record expired, or a batch job's chunk,
    whose job already counted the error): it stays in the dead-letter stream."""

    code = "not_replayable"


class JobNotFoundError(RecoverableError):
    """No batch job with this id (never submitted here, or its result expired)."""

    code = "job_not_found"


class JobFailedError(RecoverableError):
    """A batch job stopped with an error; the message names the original exception."""

    code = "job_failed"


class ConfigError(FatalError):
    """Configuration that cannot work; the message names the setting and how to fix it."""


class EngineDeadError(FatalError):
    """The inference engine stopped answering; the worker must restart."""

"""One rooted error hierarchy: recoverable errors (retry, shed, report) apart from fatal ones.

Only the HTTP edge (``api/errors.py``) turns these into OpenAI-shaped JSON bodies.
"""

from __future__ import annotations


class TailcutError(Exception):
    """Root of every error tailcut raises on purpose."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        """HTTP headers that go with the error response."""
        return {}


class RecoverableError(TailcutError):
    """The request failed but the process is healthy; the caller may retry."""


class FatalError(TailcutError):
    """The process cannot go on (bad configuration, dead engine); it should stop with this message."""


class InvalidRequestError(RecoverableError):
    """The client sent something we will not run; the message says what to fix."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(RecoverableError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFoundError(RecoverableError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class ServiceUnavailableError(RecoverableError):
    """A dependency (Redis) does not answer; the request was not accepted."""

    status_code = 503
    error_type = "service_unavailable"
    code = "service_unavailable"


class OverloadedError(RecoverableError):
    """The tier's queue is at its limit: the request was not accepted; retry after a moment."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class DeadlineExceededError(RecoverableError):
    """The request's tier deadline passed before it could run."""

    status_code = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"


class JobNotFoundError(RecoverableError):
    """No batch job with this id (never submitted here, or its result expired)."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "job_not_found"


class JobFailedError(RecoverableError):
    """A batch job stopped with an error; the message names the original exception."""

    error_type = "job_failed"
    code = "job_failed"


class ConfigError(FatalError):
    """Configuration that cannot work; the message names the setting and how to fix it."""


class EngineDeadError(FatalError):
    """The inference engine stopped answering; the worker must restart."""

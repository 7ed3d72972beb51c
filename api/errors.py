"""The one place errors become HTTP: an OpenAI-shaped body and the right status, never a traceback."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api.responses import OrjsonResponse
from tailcut.errors import (
    AuthenticationError,
    DeadLetterNotFoundError,
    DeadlineExceededError,
    InvalidRequestError,
    JobFailedError,
    JobNotFoundError,
    KeyPromptError,
    ModelNotFoundError,
    NotReplayableError,
    OverloadedError,
    PermissionDeniedError,
    RequestNotFoundError,
    ServiceUnavailableError,
    ShuttingDownError,
    TailcutError,
    WorkerNotFoundError,
)
from tailcut.logs import log_event

log = logging.getLogger("tailcut.api")

# HTTP status and OpenAI error type of each error class; a subclass not listed takes its parent's.
HTTP_SHAPES: dict[type[TailcutError], tuple[int, str]] = {
    InvalidRequestError: (400, "invalid_request_error"),
    AuthenticationError: (401, "authentication_error"),
    PermissionDeniedError: (403, "permission_error"),
    ModelNotFoundError: (404, "invalid_request_error"),
    JobNotFoundError: (404, "invalid_request_error"),
    RequestNotFoundError: (404, "invalid_request_error"),
    WorkerNotFoundError: (404, "invalid_request_error"),
    DeadLetterNotFoundError: (404, "invalid_request_error"),
    NotReplayableError: (409, "invalid_request_error"),
    OverloadedError: (429, "rate_limit_error"),
    JobFailedError: (500, "job_failed"),
    ServiceUnavailableError: (503, "service_unavailable"),
    DeadlineExceededError: (504, "timeout_error"),
    TailcutError: (500, "internal_error"),
}


def http_shape(exc: TailcutError) -> tuple[int, str]:
    """Status code and error type of ``exc``: those of its nearest listed class."""
    for cls in type(exc).__mro__:
        if cls in HTTP_SHAPES:
            return HTTP_SHAPES[cls]
    return HTTP_SHAPES[TailcutError]


def http_headers(exc: TailcutError) -> dict[str, str]:
    if isinstance(exc, OverloadedError):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, ShuttingDownError):
        return {"Retry-After": "1", "Connection": "close"}
    if isinstance(exc, KeyPromptError):
        # A browser asks its user, and sends the key as the password from then on.
        return {"WWW-Authenticate": 'Basic realm="tailcut", charset="UTF-8"'}
    return {}


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_body_of(exc: TailcutError) -> dict[str, Any]:
    return error_body(exc.message, http_shape(exc)[1], param=exc.param, code=exc.code)


def error_response(exc: TailcutError, headers: dict[str, str] | None = None) -> OrjsonResponse:
    return OrjsonResponse(
        error_body_of(exc), status_code=http_shape(exc)[0], headers={**http_headers(exc), **(headers or {})} or None
    )


def unexpected_response(exc: Exception) -> OrjsonResponse:
    """A 500 for an exception nothing expected: logged here, its details kept from the client."""
    log_event(log, "unexpected_error", logging.ERROR, error=repr(exc))
    return OrjsonResponse(error_body("internal error; see the server log", "internal_error"), status_code=500)


# Parts of a validation error's location that name a union's branch, not a field ("constrained-str", "list[str]").
TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
# Where a parameter came from, the first part of its location: the parameter is named without it.
PARAMETER_PLACES = {"path", "query", "header", "cookie"}


def _field_part(part: object) -> bool:
    return isinstance(part, int) or (
        isinstance(part, str)
        and part != "body"
        and part not in TYPE_NAMES
        and re.fullmatch(r"[A-Za-z_]\w*", part) is not None
    )


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    # A value that fits no branch of a union fails each branch; the branch of its own type says what is wrong
    # (a list too long), the others only that it is not of theirs.
    first = next((error for error in errors if not str(error.get("type", "")).endswith("_type")), errors[0])
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    parts = list(first.get("loc", ()))
    if parts and parts[0] in PARAMETER_PLACES:
        parts = parts[1:]
    location = [str(part) for part in parts if _field_part(part)]
    param = ".".join(location) or None
    if first.get("type") == "missing":
        if param is None:  # the body itself is missing
            return "the request needs a JSON body (Content-Type: application/json)", None
        return f"missing required field `{param}`", param
    kind, context = first.get("type"), first.get("ctx") or {}
    if param is None and kind in ("model_attributes_type", "dict_type"):  # a list, a number, a form
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if param and kind == "string_too_short" and context.get("min_length") == 1:
        return f"`{param}` is empty; send some text", param
    if param and kind == "too_long" and context.get("max_length") == 1:
        return f"only one {param} per request is supported; send one request per {param}", param
    if param and kind == "string_pattern_mismatch" and context.get("pattern") == r"\S":
        return f"`{param}` is blank; send some text", param
    message = first.get("msg", "invalid value")
    if param:
        message = f"`{param}`: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and isinstance(route, APIRoute):
            methods |= route.methods or set()
    return sorted(methods)


def install(app: FastAPI) -> None:
    @app.exception_handler(TailcutError)
    async def _tailcut_error(_request: Request, exc: TailcutError) -> OrjsonResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> OrjsonResponse:
        message, param = _describe_validation(list(exc.errors()))
        return OrjsonResponse(error_body(message, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> OrjsonResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Every method of the path, not only the first route's (Starlette stops at the first that matches).
            headers["Allow"] = ", ".join(allowed_methods(_request))
        return OrjsonResponse(
            error_body(str(exc.detail), error_type), status_code=exc.status_code, headers=headers or None
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> OrjsonResponse:
        return unexpected_response(exc)

"""The OpenAPI document says what the server does: every route's error statuses with the OpenAI-shaped
error body (and not FastAPI's 422, which tailcut answers as a 400), the streaming routes' event streams,
and ``/metrics`` as Prometheus text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
STATUS_TEXT = {
    400: "Bad input: the message says what to fix, `param` which field.",
    401: "Missing, unknown or revoked API key (with keys on).",
    403: "The key may not do this (a tier it may not use, an admin route).",
    404: "Unknown model, an id that does not exist (for this tenant), or an admin route where no admin exists.",
    409: "The dead-lettered request cannot be replayed: no client could read its reply any more.",
    413: "The body is larger than TAILCUT_MAX_BODY_BYTES.",
    429: "A queue or the tenant is at its limit; retry after `Retry-After` seconds.",
    503: "Redis does not answer, or this process is stopping; retry.",
    504: "The request's deadline passed before it could start.",
}
API = (400, 401, 403, 404, 413, 429, 503)
# The admin routes (``api.admin``): no admin at all is a 404, as is an unknown worker or entry.
ADMIN = (401, 403, 404, 503)
# The statuses each route answers besides its success; a path not listed answers API.
ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "/healthz": (),
    "/health": (),
    "/version": (),
    "/readyz": (503,),
    "/metrics": (401, 403),
    "/status/data": (401, 403, 503),
    "/debug/stacks": (401, 403, 404),
    "/admin/workers": ADMIN,
    "/admin/workers/{worker_id}/drain": (400, *ADMIN),
    "/admin/dlq": (400, *ADMIN),
    "/admin/dlq/{entry_id}/replay": (400, *ADMIN, 409),
    "/admin/breakers/{tier}/reset": (400, *ADMIN),
    "/v1/chat/completions": (*API, 504),
    "/v1/completions": (*API, 504),
    "/v1/requests/{request_id}": (*API, 504),
}
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/requests/{request_id}")


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                for status in ROUTE_ERRORS.get(path, API):
                    responses[str(status)] = {"description": STATUS_TEXT[status], "content": error}
                if path in STREAMING and "200" in responses:
                    # Server-sent events, each a JSON chunk (or [DONE]): documented, not schema-typed.
                    responses["200"].setdefault("content", {})["text/event-stream"] = {}
        _bound_token_ids(schema, app)
        for path, text in (
            ("/metrics", "Prometheus text format."),
            ("/debug/stacks", "Every task's and thread's stack."),
        ):
            operation = schema["paths"].get(path, {}).get("get")
            if operation is not None:
                operation["responses"]["200"] = {
                    "description": text,
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound_token_ids(schema: dict[str, Any], app: FastAPI) -> None:
    """Token ids lie in the served model's vocabulary, and replies within its context: say so."""
    state = getattr(app.state, "tailcut", None)
    if state is None or state.admitter.tokenizer is None:
        return  # not started (the document built offline): no model to bound by
    tokenizer = state.admitter.tokenizer
    bounds = {"type": "integer", "minimum": 0, "maximum": tokenizer.vocab_size - 1}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            items = node.get("items")
            if node.get("type") == "array" and isinstance(items, dict) and items.get("type") == "integer":
                node["items"] = {**items, **bounds}
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    components = schema["components"]["schemas"]
    # And no reply is longer than the context.
    longest = {"maximum": state.model.max_model_len}
    for name, field in (
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
        ("JobRequest", "max_tokens"),
    ):
        for branch in components.get(name, {}).get("properties", {}).get(field, {}).get("anyOf", []):
            if branch.get("type") == "integer":
                branch.update(longest)
    visit(components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}))
    visit(components.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {}))

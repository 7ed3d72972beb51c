"""Schemathesis hooks for tests/integration/test_openapi_fuzz.py (``SCHEMATHESIS_HOOKS``).

``positive_data_acceptance`` demands that every schema-valid body be accepted. One rule of tailcut's no
schema can state: the prompt's tokens plus ``max_tokens`` must fit the model's context (each is bounded
in the document; their sum depends on the tokenizer). This check is that one, less exactly that
refusal: a 400 whose code is ``context_length_exceeded``. Every other refusal of valid data fails.

Draining the stack's only worker (``POST /admin/workers/{id}/drain``, with the live id schemathesis may
read from ``GET /admin/workers``) would stop it, and every later generation would wait for a worker: the
drain is fuzzed with the ids of no live worker (a 404), and ``tests/integration/test_admin_routes.py``
drains a real one.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


@schemathesis.check
def positive_data_accepted_unless_over_the_context(ctx, response, case):  # type: ignore[no-untyped-def]
    if response.status_code == 400:
        try:
            code = json.loads(response.content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code == "context_length_exceeded":
            return None
    return positive_data_acceptance(ctx, response, case)


@schemathesis.hook
def before_call(ctx, case, **kwargs):  # type: ignore[no-untyped-def]
    if case.operation.path == "/admin/workers/{worker_id}/drain":
        parameters = case.path_parameters or {}
        parameters["worker_id"] = "not-live-" + str(parameters.get("worker_id", ""))[:40]
        case.path_parameters = parameters

"""Schemathesis hooks for tests/integration/test_openapi_fuzz.py (``SCHEMATHESIS_HOOKS``).

``positive_data_acceptance`` demands that every schema-valid body be accepted. One rule of tailcut's no
schema can state: the prompt's tokens plus ``max_tokens`` must fit the model's context (each is bounded
in the document; their sum depends on the tokenizer). This check is that one, less exactly that
refusal: a 400 whose code is ``context_length_exceeded``. Every other refusal of valid data fails.
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

"""Request bodies of the OpenAI-compatible routes.

Unknown fields are ignored (as OpenAI-compatible servers do); known fields of the wrong type or out of
range are refused with a 400 that names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from tailcut.errors import InvalidRequestError


def _clean(value: Any) -> Any:
    """Strings as Unicode: JSON may carry a lone surrogate (\\ud800), which no tokenizer, log or Redis entry
    takes; it becomes U+FFFD, as a decoder would make of it. Surrogate pairs stay what they are."""
    if isinstance(value, str):
        if value.isascii():
            return value
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_clean(item) for item in value]
    if isinstance(value, dict):
        return {key: _clean(item) for key, item in value.items()}
    return value


class RequestModel(BaseModel):
    """Every request body: unknown fields ignored, no type coercion beyond JSON's own, strings cleaned."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return _clean(data)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _json_int(value: object) -> object:
    """An integer as JSON has it: 3 and 3.0, never "3" or true."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict (no "3" for 3, no true for 1) but JSON's own integers (3.0 is 3), as the OpenAPI schema says.
JsonInt = Annotated[int, BeforeValidator(_json_int)]
# (A bound goes before the validator, or the OpenAPI document loses it.)
# Integers are bounded: what is stored or sent on is a 64-bit (or 32-bit) integer, never a 400-digit one.
INT32 = 2**31 - 1
SAFE_INT = 2**53 - 1  # the largest integer every JSON reader holds exactly
PositiveJsonInt = Annotated[int, Field(ge=1, le=INT32), BeforeValidator(_json_int)]
TokenId = Annotated[int, Field(ge=0, le=INT32), BeforeValidator(_json_int)]


# Bounds on what one request may carry (each a clear 400; the OpenAPI document states them).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 2048
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


# ``response_format`` as tailcut serves it: absent, or plain text.
_NONE_OR_TEXT_FORMAT = {
    "anyOf": [
        {"type": "null"},
        {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
    ]
}
# ``tool_choice`` and ``function_call`` that ask for no tool (tools themselves are refused).
_NO_TOOL_CHOICE = {"anyOf": [{"type": "null"}, {"enum": ["none", "auto"]}]}
_NO_TOOLS = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}


class GenerationFields(RequestModel):
    """Fields shared by chat and text completions, including the vLLM extensions benchmarks send."""

    model: str | None = None
    max_tokens: PositiveJsonInt | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1, le=INT32), BeforeValidator(_json_int)] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Annotated[int, Field(ge=-SAFE_INT, le=SAFE_INT), BeforeValidator(_json_int)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[JsonInt, WithJsonSchema({"type": "integer", "const": 1})] = 1  # n > 1: a 400 says why
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32), BeforeValidator(_json_int)] = 0
    # Not supported (a 400 says so): the schema admits only the values that mean "none".
    logprobs: Annotated[
        bool | JsonInt | None, WithJsonSchema({"anyOf": [{"type": "null"}, {"const": False}, {"const": 0}]})
    ] = None
    # Not supported either, and refused rather than ignored: a reply that silently dropped one of these
    # (free text where JSON was asked for, one sample where the best of several was) would look like an
    # answer to the request that was sent. The schema admits only the values that mean "none".
    best_of: Annotated[JsonInt | None, WithJsonSchema({"anyOf": [{"type": "null"}, {"const": 1}]})] = None
    logit_bias: Annotated[
        dict[str, Any] | None, WithJsonSchema({"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]})
    ] = None
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(_NONE_OR_TEXT_FORMAT)] = None
    use_beam_search: Annotated[bool, WithJsonSchema({"type": "boolean", "const": False})] = False
    # vLLM's extensions for constrained output and prompt log-probabilities.
    structured_outputs: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    guided_json: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    guided_regex: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    guided_choice: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    guided_grammar: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    prompt_logprobs: Annotated[Any, WithJsonSchema({"type": "null"})] = None
    user: str | None = None
    # tailcut: the SLO tier (also header X-Tailcut-Tier) and token ids in every chunk.
    tier: Annotated[
        str | None, WithJsonSchema({"anyOf": [{"enum": ["realtime", "normal", "background"]}, {"type": "null"}]})
    ] = None
    return_token_ids: bool = False


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: PositiveJsonInt | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=INT32), BeforeValidator(_json_int)] | None = None
    # Tool calling is not supported (a 400 says so); an empty list and a choice of no tool are no-ops.
    tools: Annotated[list[Any] | None, WithJsonSchema(_NO_TOOLS)] = None
    functions: Annotated[list[Any] | None, WithJsonSchema(_NO_TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(_NO_TOOL_CHOICE)] = None
    function_call: Annotated[str | dict[str, Any] | None, WithJsonSchema(_NO_TOOL_CHOICE)] = None


NonEmptyText = Annotated[str, Field(min_length=1)]
NonEmptyIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(GenerationFields):
    prompt: (
        NonEmptyText
        | NonEmptyIds
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
        | Annotated[list[NonEmptyIds], Field(min_length=1, max_length=1)]
    )
    # Not supported (a 400 says so): the schema admits only their defaults.
    echo: Annotated[bool, WithJsonSchema({"type": "boolean", "const": False})] = False
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None


# Text with something besides white space in it.
SOME_TEXT = r"\S"
# Python's str.isspace() also counts the separators U+001C..U+001F; the schema's \S (JSON Schema's and
# pydantic's regex: Unicode White_Space) does not. The route checks as the schema does.
SEPARATORS = "\x1c\x1d\x1e\x1f"


def has_text(text: str) -> bool:
    return any(not char.isspace() or char in SEPARATORS for char in text)


class JobRequest(RequestModel):
    """Body of ``POST /v1/jobs``: exactly one of ``logs`` and ``lines``, holding some text; unknown fields are
    ignored. The schema says so (``oneOf``), as the route checks it (``log_lines``)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["logs"], "properties": {"logs": {"type": "string"}, "lines": {"type": "null"}}},
                {"required": ["lines"], "properties": {"lines": {"type": "array"}, "logs": {"type": "null"}}},
            ]
        },
    )

    logs: str | None = Field(None, pattern=SOME_TEXT)
    lines: list[str] | None = Field(None, json_schema_extra={"contains": {"type": "string", "pattern": SOME_TEXT}})
    instruction: str = Field(min_length=1, pattern=SOME_TEXT)
    chunk_lines: Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_json_int)] | None = None
    max_tokens: PositiveJsonInt | None = None
    temperature: float = Field(0.0, ge=0, le=2)
    model: str | None = None
    tenant: str | None = None
    ignore_eos: bool = False
    reduce: bool = False

    def log_lines(self) -> list[str]:
        """The log as lines; refuses a body with no log, two logs, or nothing but blank lines."""
        if (self.logs is None) == (self.lines is None):
            raise InvalidRequestError(
                "send exactly one of `logs` (the log as text) or `lines` (the log as a list of lines)", param="logs"
            )
        if not has_text(self.instruction):
            raise InvalidRequestError("`instruction` is blank; say what to look for in the log", param="instruction")
        lines = self.logs.splitlines() if self.logs is not None else list(self.lines or [])
        if not any(has_text(line) for line in lines):
            param = "logs" if self.logs is not None else "lines"
            raise InvalidRequestError(f"`{param}` holds no text; send the log to analyse", param=param)
        return lines

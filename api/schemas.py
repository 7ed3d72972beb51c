"""Request bodies of the OpenAI-compatible routes.

Unknown fields are ignored (as OpenAI-compatible servers do); known fields of the wrong type or out of
range are refused with a 400 that names the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailcut.errors import InvalidRequestError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Bounds on what one request may carry (each a clear 400; the OpenAPI document states them).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 2048
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class GenerationFields(BaseModel):
    """Fields shared by chat and text completions, including the vLLM extensions benchmarks send."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logprobs: bool | int | None = None
    user: str | None = None
    # tailcut: the SLO tier (also header X-Tailcut-Tier) and token ids in every chunk.
    tier: str | None = None
    return_token_ids: bool = False


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None


class JobRequest(BaseModel):
    """Body of ``POST /v1/jobs``; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    logs: str | None = None
    lines: list[str] | None = None
    instruction: str = Field(min_length=1)
    chunk_lines: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
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
        if not self.instruction.strip():
            raise InvalidRequestError("`instruction` is blank; say what to look for in the log", param="instruction")
        lines = self.logs.splitlines() if self.logs is not None else list(self.lines or [])
        if not any(line.strip() for line in lines):
            param = "logs" if self.logs is not None else "lines"
            raise InvalidRequestError(f"`{param}` holds no text; send the log to analyse", param=param)
        return lines

"""A request as admission sees it: whatever protocol it came in by (OpenAI HTTP, a batch job, a trace)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from queues.messages import SamplingOptions
from tailcut.models import max_model_len, served_name
from tailcut.settings import CommonSettings

# The tenant of a request that names none.


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Chat messages (``role``, ``content``), rendered with the model's chat template."""

    messages: list[dict[str, str]]
    param: str = "messages"  # the field an error about the prompt names


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    param: str = "prompt"


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """Token ids, taken as they are (the simulator's synthetic ids are checked against no vocabulary)."""

    token_ids: list[int]
    param: str = "prompt"


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(slots=True)
class GenerationRequest:
    prompt: Prompt
    # Reply channel id of the process that reads the output (an API process, a jobs process).
    reply_to: str
    # As the caller named it; checked at admission. None: the configured default tier.
    tier: str | None = None
    # Where the tier came from, for the message that refuses an unknown one.
    tier_source: str = "tier"
    tenant: str | None = None
    # None: whatever the context length leaves after the prompt.
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    max_model_len: int

    @classmethod
    def of(cls, model_dir: Path, settings: CommonSettings) -> ServedModel:
        """The model in ``model_dir`` under the name and context length the settings give."""
        return cls(
            name=served_name(model_dir, settings.served_model_name),
            max_model_len=settings.max_model_len or max_model_len(model_dir),
        )

"""The output token of the engines that run no model (``null``, ``sim``): one real vocabulary entry.

Their tokens must still make sense downstream: the API checks token ids against the served model's
vocabulary, clients may detokenize ``token_ids``, and a continuation sends the tokens generated so
far back to the engine as part of its prompt. So every generated token is the same real token of the
served model's tokenizer, and its text is that token's own decoding (``" x"`` or the like).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailcut.errors import ConfigError

# Tried in order; the first that is one token of the tokenizer wins (a word with a leading space
# reads as words in a client: " x x x").
CANDIDATE_TEXTS = (" x", " ok", " the", " a", "x", ".")


@dataclass(frozen=True, slots=True)
class FillerToken:
    """The one token a model-free engine generates: its id in the served vocabulary and its text."""

    token_id: int
    text: str


def filler_token(model_dir: Path) -> FillerToken:
    """Pick the filler token from the served model's tokenizer (``tokenizer.json``, milliseconds;
    falls back to ``transformers`` for a folder without one)."""
    tokenizer = _load(model_dir)
    fallback: FillerToken | None = None
    for text in CANDIDATE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = list(getattr(ids, "ids", ids))
        if not ids:
            continue
        token = FillerToken(int(ids[0]), str(tokenizer.decode([ids[0]])))
        if len(ids) == 1 and token.text:
            return token
        fallback = fallback or token
    if fallback is None:
        raise ConfigError(f"the tokenizer in {model_dir} encodes none of {CANDIDATE_TEXTS}: no output token to use")
    return fallback


def _load(model_dir: Path) -> Any:
    path = model_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

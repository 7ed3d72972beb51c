"""Token lengths of dataset conversations, shipped as a compact table for the simulator (pure).

The simulator needs how long prompts and replies are, not their text. A length table holds, per sampled
conversation of a dataset, its id (to find the text again in the dataset file) and the token lengths of
its turns as (question, reply) pairs, counted with the served model's tokenizer. ``sharegpt-smollm2``
ships in ``bench/workloads/data/``: ShareGPT (the file ``vllm bench serve --dataset-name sharegpt``
reads) tokenised with SmolLM2, written by ``scripts/make-sharegpt-lengths``, whose docstring says
exactly how. A workload names a table per tier (``bench.workloads.DatasetLengths``) and filters it.

File format (JSON)::

    {"name": "...", "source": "...", "tokenizer": "...", "how": "...",
     "num_complete_conversations": N, "seed": S,
     "conversations": [["<dataset id>", [q1, r1, q2, r2, ...]], ...]}
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

TABLES_DIR = Path(__file__).with_name("workloads") / "data"


class LengthTableError(ValueError):
    """A table name that is not shipped, or a file that is not a length table."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One exchange of a conversation: the user's message and the reply, in tokens."""

    question_tokens: int
    reply_tokens: int


@dataclass(frozen=True, slots=True)
class ConversationLengths:
    id: str  # the conversation's id in the dataset file
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class LengthTable:
    name: str
    source: str  # the dataset file and where it came from
    tokenizer: str
    how: str  # how the table was made (the script and its arguments)
    num_complete_conversations: int  # in the dataset file, before sampling
    seed: int
    conversations: tuple[ConversationLengths, ...]


class DatasetTurn(Protocol):
    """One message of a dataset conversation (``bench.datasets.Turn``)."""

    @property
    def role(self) -> str: ...  # ShareGPT's ``from``: ``human``, ``gpt``, ...

    @property
    def text(self) -> str: ...


class DatasetConversation(Protocol):
    """A dataset conversation (``bench.datasets.Conversation``)."""

    @property
    def id(self) -> str: ...

    @property
    def turns(self) -> Sequence[DatasetTurn]: ...


def exchanges(conversation: DatasetConversation, max_turns: int | None = None) -> list[tuple[str, str]]:
    """(question, reply) texts of a conversation as the length table counts them: from its first
    ``human`` turn on, each ``human`` turn followed by a ``gpt`` turn, until a turn breaks that
    alternation or a question is empty (at most ``max_turns``). Exchange k is turn k of a table row."""
    turns = conversation.turns
    start = next((i for i, turn in enumerate(turns) if turn.role == "human"), len(turns))
    pairs: list[tuple[str, str]] = []
    for i in range(start, len(turns) - 1, 2):
        question, reply = turns[i], turns[i + 1]
        if question.role != "human" or reply.role != "gpt" or not question.text.strip():
            break
        if max_turns is not None and len(pairs) == max_turns:
            break
        pairs.append((question.text, reply.text))
    return pairs


def chat_messages(conversation: DatasetConversation, turn: int) -> list[dict[str, str]]:
    """The OpenAI chat messages of turn ``turn`` of a session drawn from ``conversation``
    (``Arrival.source`` names it, ``Arrival.turn`` is the turn): every earlier question and reply, then
    the turn's own question — the text behind the lengths the table gives that request."""
    pairs = exchanges(conversation)
    if not 0 <= turn < len(pairs):
        raise IndexError(f"conversation {conversation.id!r} has {len(pairs)} exchanges, not a turn {turn}")
    messages = []
    for question, reply in pairs[:turn]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": pairs[turn][0]})
    return messages


def shipped_tables() -> list[str]:
    return sorted(path.stem for path in TABLES_DIR.glob("*.json"))


def table_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix:
        return path
    path = TABLES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise LengthTableError(
            f"no length table named {name_or_path!r}; shipped: {', '.join(shipped_tables()) or 'none'} "
            "(or give a .json path)"
        )
    return path


def load_table(name_or_path: str) -> LengthTable:
    """A shipped table by name (``sharegpt-smollm2``) or a table file by path; read once per process."""
    return _load(table_path(name_or_path).resolve())


@functools.cache
def _load(path: Path) -> LengthTable:
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise LengthTableError(f"cannot read length table {path}: {exc.strerror}") from exc
    except orjson.JSONDecodeError as exc:
        raise LengthTableError(f"{path} is not JSON: {exc}") from exc
    try:
        conversations = tuple(
            ConversationLengths(
                str(conversation_id),
                tuple(Turn(int(lengths[i]), int(lengths[i + 1])) for i in range(0, len(lengths) - 1, 2)),
            )
            for conversation_id, lengths in data["conversations"]
        )
        table = LengthTable(
            name=str(data["name"]),
            source=str(data["source"]),
            tokenizer=str(data["tokenizer"]),
            how=str(data["how"]),
            num_complete_conversations=int(data["num_complete_conversations"]),
            seed=int(data["seed"]),
            conversations=conversations,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LengthTableError(f"{path} is not a length table ({type(exc).__name__}: {exc})") from exc
    bad = [c.id for c in conversations if not c.turns or any(t.question_tokens < 1 for t in c.turns)]
    if bad:
        raise LengthTableError(f"{path}: conversations without a whole turn or with an empty question: {bad[:5]}")
    return table


def table_json(table: LengthTable) -> bytes:
    """The file ``load_table`` reads back (one conversation a line, so a diff of two tables reads)."""
    head = {
        "name": table.name,
        "source": table.source,
        "tokenizer": table.tokenizer,
        "how": table.how,
        "num_complete_conversations": table.num_complete_conversations,
        "seed": table.seed,
    }
    lines = [
        orjson.dumps([c.id, [n for turn in c.turns for n in (turn.question_tokens, turn.reply_tokens)]])
        for c in table.conversations
    ]
    body = orjson.dumps(head)[:-1] + b', "conversations": [\n' + b",\n".join(lines) + b"\n]}\n"
    return body

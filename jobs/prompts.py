"""The prompts of a batch job: one per chunk of the log, and the one that combines their answers."""

from __future__ import annotations

from queues.jobs import Chunk

SYSTEM_PROMPT = (
    "You analyse application logs. Follow the instruction for the log excerpt you are given, briefly, "
    "using only what the excerpt shows."
)


def chunk_messages(instruction: str, chunk: Chunk, num_chunks: int) -> list[dict[str, str]]:
    excerpt = "\n".join(chunk.lines)
    user = (
        f"{instruction}\n\nLog lines {chunk.first_line}-{chunk.last_line} "
        f"(part {chunk.index + 1} of {num_chunks}):\n{excerpt}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def reduce_messages(instruction: str, answers: list[str]) -> list[dict[str, str]]:
    parts = "\n\n".join(f"Part {number}:\n{answer}" for number, answer in enumerate(answers, start=1))
    user = (
        f"{instruction}\n\nThe log was analysed in {len(answers)} consecutive parts; their answers follow. "
        f"Combine them into one answer for the whole log.\n\n{parts}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

"""The conversations `dtrain tokenize --chat` reads: rows of `{"messages": [{"role": ...,
"content": ...}, ...]}` from JSON lines, parquet files or saved datasets (the `--column`,
default `messages`), each checked before the chat template sees it.

A row is named in messages by its file and line (JSON lines, counted from 1 as editors do) or
its file and row (parquet and datasets, counted from 0 as `dataset[i]` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtrain.commands.tokenize.inputs import Source, column_chunks, jsonl_fields
from dtrain.core.errors import UserError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One row: where it is (for messages), its messages (checked), the UTF-8 bytes of their
    content, and the bytes of the input reading it took (for the progress line)."""

    where: str
    messages: list[dict[str, Any]]
    nbytes: int
    advance: int


def conversations(source: Source, column: str) -> Iterator[Conversation]:
    """The source's conversations in order; a row that is not one is one line naming it."""
    if source.kind == "jsonl":
        yield from _jsonl_conversations(source.path, column)
        return
    chunks, rows = column_chunks(source, column)
    row = 0
    for chunk in chunks:
        advance = source.size * len(chunk) // max(1, rows)
        for value in chunk.to_pylist():
            yield _conversation(f"{source.path} row {row}", value, column, advance)
            advance, row = 0, row + 1


def _jsonl_conversations(path: str, column: str) -> Iterator[Conversation]:
    for where, value, advance in jsonl_fields(path, column, "messages"):
        yield _conversation(where, value, column, advance)


def _conversation(where: str, value: Any, column: str, advance: int) -> Conversation:
    """`value` checked to be a list of messages, each with a known role and text content."""
    if value is None or value == []:
        said = "null" if value is None else "empty"
        raise UserError(f"input error: {where}: '{column}' is {said}: no messages")
    if not isinstance(value, list):
        raise UserError(
            f"input error: {where}: '{column}' is {type(value).__name__}, not a list of messages"
        )
    nbytes = 0
    for number, message in enumerate(value, 1):
        if not isinstance(message, dict):
            raise UserError(
                f"input error: {where}: message {number} is {type(message).__name__}, not an "
                f"object with a role and a content"
            )
        role = message.get("role")
        if role is None:
            raise UserError(f"input error: {where}: message {number} has no 'role'")
        if role not in ROLES:
            raise UserError(
                f"input error: {where}: message {number} has the role {role!r}; a role is one "
                f"of {', '.join(ROLES)}"
            )
        content = message.get("content")
        if content is None:  # (Arrow gives a field a row lacks as null)
            raise UserError(f"input error: {where}: message {number} ({role}) has no 'content'")
        if not isinstance(content, str):
            raise UserError(
                f"input error: {where}: message {number} ({role}): 'content' is "
                f"{type(content).__name__}, not text"
            )
        try:
            nbytes += len(content.encode("utf-8"))
        except UnicodeEncodeError:  # JSON may spell a lone surrogate, which no text holds
            raise UserError(
                f"input error: {where}: message {number} ({role}): 'content' is not valid Unicode"
            ) from None
    return Conversation(where, value, nbytes, advance)

"""The text side of `dtrain generate`: the prompts (--prompt, a file of one per line, or a
terminal's lines); the run's tokenizer is `models.tokenizer`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from dtrain.core.errors import UserError, first_line

COMMAND = "generate"


# ---------------------------------------------------------------------------------------------
# The prompts


def prompts_in(path: str) -> list[str]:
    """The prompts of a file: one per line (empty lines skipped), UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UserError(
            f"{COMMAND} error: --prompts {path}: {e.strerror or first_line(e)}"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(
            f"{COMMAND} error: --prompts {path} is not UTF-8 text (line {line}, byte "
            f"{e.start}); save it as UTF-8"
        ) from None
    found = [line for line in text.splitlines() if line.strip()]
    if not found:
        raise UserError(f"{COMMAND} error: --prompts {path} holds no prompt (one per line)")
    return found


def check_terminal() -> None:
    """--interactive reads a person's lines: refused when stdin is not a terminal."""
    if not sys.stdin.isatty():
        raise UserError(
            f"{COMMAND} error: --interactive reads prompts from a terminal and stdin is not "
            f"one; give --prompt TEXT or --prompts FILE"
        )


def typed_lines() -> Iterator[str]:
    """A terminal's lines, each after a prompt sign, until end of input (Ctrl-D) or Ctrl-C."""
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if line.strip():
            yield line

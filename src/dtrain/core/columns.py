"""Text a person reads, fitted to the width of a terminal: long lines cut where they list
things, tables that leave out what does not fit (and say what)."""

from __future__ import annotations

# The width a line a person reads fits in (a log line's timestamp included), and where a longer
# one is cut: between its sections first, then its clauses, then its items (with what ends a
# line cut there).
COLUMNS = 120
_STAMP = len("2026-12-03 14:02:00 ")
_CUTS = ((" | ", " |"), ("; ", ";"), (", ", ","))
_INDENT = "  "


def fitted(text: str, width: int = COLUMNS - _STAMP) -> list[str]:
    """`text` as lines of at most `width` characters, cut where it lists things (never inside
    brackets), the lines after the first indented; a part that alone is too long (a path)
    stays whole."""
    lines = _cut(text, width, width - len(_INDENT), 0)
    return [lines[0], *(_INDENT + line for line in lines[1:])]


def _cut(text: str, first: int, rest: int, level: int) -> list[str]:
    """`text` in lines of at most `first` (the first line) and `rest` characters, cut at the
    separators of `level` and finer ones."""
    if len(text) <= first or level == len(_CUTS):
        return [text]
    separator, end = _CUTS[level]
    parts = _split(text, separator)
    packed = [parts[0]]
    for part in parts[1:]:
        limit = first if len(packed) == 1 else rest
        if len(packed[-1]) + len(separator) + len(part) <= limit:
            packed[-1] += separator + part
        else:
            packed[-1] += end
            packed.append(part)
    lines: list[str] = []
    for line in packed:
        lines += _cut(line, first if not lines else rest, rest, level + 1)
    return lines


def _split(text: str, separator: str) -> list[str]:
    """`text` split at `separator` where no bracket is open."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i = i + len(separator)
            continue
        i += 1
    parts.append(text[start:])
    return parts


def aligned(header: list[str], rows: list[list[str]], droppable: list[int], rest: str) -> list[str]:
    """`rows` under `header` in columns two spaces apart, no wider than COLUMNS where leaving
    out the columns of `droppable` (indexes, the first to go first) makes it so; then a line
    naming the columns left out and `rest`, where they are ('runs/runs.csv has them')."""
    shown = list(range(len(header)))
    dropped: list[int] = []

    def lines() -> list[str]:
        table = [[r[i] for i in shown] for r in [header, *rows]]
        widths = [max(len(r[i]) for r in table) for i in range(len(shown))]
        return [
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in table
        ]

    text = lines()
    for index in droppable:
        if max(map(len, text)) <= COLUMNS:
            break
        shown.remove(index)
        dropped.append(index)
        text = lines()
    if dropped:
        names = ", ".join(header[i] for i in dropped)
        text += fitted(f"not shown, to fit {COLUMNS} columns: {names}; {rest}", COLUMNS)
    return text

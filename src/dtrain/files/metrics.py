"""A run's `metrics.jsonl`: one JSON object per line, each with its integer `step`, appended as
the run goes (training records and evaluations alike). Read by a resume (which keeps the records
up to its step), by the trackers (what they missed) and by `dtrain runs`."""

from __future__ import annotations

import json
from typing import Any


def read(path: str) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """Each readable record of the file at `path`, with its line as written, in file order; and
    how many lines were left out: torn by a kill mid-write, or damaged (not UTF-8, not a JSON
    object with an integer step). Nothing for a file that is not there."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return [], 0
    kept: list[tuple[str, dict[str, Any]]] = []
    skipped = 0
    with f:
        for raw in f:
            try:
                line = raw.decode("utf-8")
                record = json.loads(line)
                if not (isinstance(record, dict) and _is_step(record.get("step"))):
                    raise ValueError("no step")
            except ValueError:  # (UnicodeDecodeError and JSON's errors are ValueErrors)
                skipped += 1
                continue
            kept.append((line if line.endswith("\n") else line + "\n", record))
    return kept, skipped


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""How a config key is declared: its default, allowed values or range check, and its doc."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

Check = tuple[Callable[[Any], bool], str]


def option(
    default: Any,
    *,
    choices: tuple | None = None,
    check: Check | None = None,
    parse: Callable[[Any], Any] | None = None,
    doc: str = "",
) -> Any:
    """A config field with its allowed values or a range check (used by validation), what reads
    numbers inside a list or mapping value (`parse`), and the sentence the configuration
    reference prints for it."""
    meta = {"choices": choices, "check": check, "parse": parse, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


POSITIVE: Check = (lambda v: v > 0, "must be > 0")
NON_NEGATIVE: Check = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_ONE: Check = (lambda v: v >= 1, "must be >= 1")
FRACTION: Check = (lambda v: 0 <= v < 1, "must be in [0, 1)")

# A collective's timeout, a rendezvous's, the time between uploads: Python's and torch's clocks
# overflow far above this, and nothing a run waits for is meant to take longer.
MAX_DURATION_S = 365 * 24 * 3600
DURATION: Check = (
    lambda v: 0 < v <= MAX_DURATION_S,
    f"must be > 0 and at most {MAX_DURATION_S} s (a year)",
)

# YAML 1.1 reads a number with an exponent but no dot (`7e-1`, `1e-4`) or an unsigned exponent
# (`1.5e3`) as text.
_EXPONENT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def number(value: Any) -> float | None:
    """`value` as the number the config means by it, wherever the config takes a number: an
    int or a float (never a bool), or an exponent that YAML 1.1 left as text (`7e-1`); None for
    anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _EXPONENT_TEXT.fullmatch(value):
        return float(value)
    return None


def read_number(value: Any) -> Any:
    """`value`, or where it is an exponent that YAML 1.1 left as text (`7e-1`) the number it
    means; anything else as it is, for the checks to name."""
    parsed = number(value) if isinstance(value, str) else None
    return value if parsed is None else parsed


def numbers_read(values: list) -> list:
    """A list value's items, each as `read_number` reads it."""
    return [read_number(v) for v in values]

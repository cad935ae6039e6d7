"""How a config key is declared: its default, allowed values or range check, and its doc."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

Check = tuple[Callable[[Any], bool], str]


def option(
    default: Any, *, choices: tuple | None = None, check: Check | None = None, doc: str = ""
) -> Any:
    """A config field with its allowed values or a range check (used by validation) and the
    sentence the configuration reference prints for it."""
    meta = {"choices": choices, "check": check, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


POSITIVE: Check = (lambda v: v > 0, "must be > 0")
NON_NEGATIVE: Check = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_ONE: Check = (lambda v: v >= 1, "must be >= 1")
FRACTION: Check = (lambda v: 0 <= v < 1, "must be in [0, 1)")

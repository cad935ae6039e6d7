"""What every export format shares: the check that an exported model reproduces the
checkpoint's, the line that reports it, and the removal of a file that failed it."""

from __future__ import annotations

import os
from typing import Any

import torch

from dtrain.core.errors import UserError
from dtrain.process import compat

TOLERANCE = 1e-5


class CheckFailed(UserError):
    """The export was written but does not reproduce the checkpoint's model: one line, exit 1."""

    exit_code = 1


def difference(a: Any, b: Any) -> float:
    """The largest difference between the tensors of two outputs (tensors, tuples, dicts, ...)."""
    left, right = compat.tensor_leaves(a), compat.tensor_leaves(b)
    tensors = [(x, y) for x, y in zip(left, right, strict=False) if isinstance(x, torch.Tensor)]
    if len(left) != len(right) or not tensors:
        return float("inf")
    return max((x.float() - y.float()).abs().max().item() for x, y in tensors)


def report(path: str, out: str, fmt: str, found: float, what: str) -> tuple[float, str]:
    """The figure and the line that say the export matches (printed once the files are in
    place), or the error that it does not (nothing is then written)."""
    if not found <= TOLERANCE:  # NaN fails too
        discard(out)
        raise CheckFailed(
            f"export error: the exported model's {what} differ from the checkpoint's "
            f"by {found:.3g} (> {TOLERANCE}); {out} was not written"
        )
    return found, (
        f"exported {path} -> {out} ({fmt}); {what} match the checkpoint"
        f"{' on a batch' if what == 'outputs' else ''} (max difference {found:.2g})"
    )


def discard(*paths: str) -> None:
    """Remove files that failed their check: a file left behind would be taken for good."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

"""Which value of a monitored metric is the better one: the one rule that checkpoints' `best`,
early stopping, the plateau schedule, the run's best value and `dtrain runs`' order all follow.
`mode` is "max" for a metric to maximise (accuracy), "min" for one to minimise (a loss)."""

from __future__ import annotations


def improves(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` (None: nothing yet) by more than `min_delta`."""
    if best is None:
        return True
    return value > best + min_delta if mode == "max" else value < best - min_delta


def best_first(mode: str) -> float:
    """The sign that makes an ascending sort put the best value first (`sign * value`)."""
    return -1.0 if mode == "max" else 1.0

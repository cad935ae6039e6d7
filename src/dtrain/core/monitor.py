"""Which value of a monitored metric is the better one: the one rule that checkpoints' `best`,
early stopping, the plateau schedule, the run's best value and `dtrain runs`' order all follow.
On a tie the earlier step is the better: the first to reach a value reached it.
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


def best_order(value: float, step: int, mode: str) -> tuple[float, int]:
    """The key that sorts (value, step) pairs best first: the best value, and among equal values
    the earliest step (as `improves`, which a later equal value does not beat)."""
    return best_first(mode) * value, step

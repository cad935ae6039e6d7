"""Stragglers: a rank slower than the others, named while the run goes on.

Each check of the loop gathers every rank's step time and data wait over the steps since the
previous check (in the all-reduce the check makes anyway). The step time compared is a rank's own:
the whole step less its gradient exchange, where every rank waits for the slowest, so that the
whole step lasts the same everywhere and only this part tells the slow rank from the ones waiting
for it. A rank slower than `RATIO` times the median for `CHECKS` checks in a row is named once,
with its host and its data wait (a high share points at its input pipeline or disk), and again
when it is back to the others' pace.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from dtrain.core.logs import log

RATIO = 1.5
CHECKS = 3
# Below this a slower rank costs little, and short steps on a busy host differ by more.
MIN_EXCESS_S = 0.01


class Stragglers:
    """Keeps, per rank, how many checks in a row it was slow, and the last check's figures for
    the records: `step_time_max`, `step_time_min` (seconds) and `slowest_rank`."""

    def __init__(self, host_of: Callable[[int], str]) -> None:
        self.host_of = host_of
        self.slow_checks: dict[int, int] = {}
        self.named: set[int] = set()
        self.figures: dict[str, float | int] = {}

    def check(self, step_s: Sequence[float], data_wait: Sequence[float]) -> None:
        """One check: each rank's mean step time (seconds, without the gradient exchange) and
        data wait (a fraction of its whole step time) since the previous check."""
        if len(step_s) < 2:
            return
        slowest = max(range(len(step_s)), key=step_s.__getitem__)
        self.figures = {
            "step_time_max": step_s[slowest],
            "step_time_min": min(step_s),
            "slowest_rank": slowest,
        }
        # With two ranks the median of both would halve any ratio: the other rank is the measure.
        median = statistics.median(step_s) if len(step_s) > 2 else min(step_s)
        for rank, seconds in enumerate(step_s):
            slow = seconds > RATIO * median and seconds - median > MIN_EXCESS_S
            if not slow:
                if rank in self.named:
                    log.info(f"straggler: rank {rank} is back to the median step time")
                self.slow_checks.pop(rank, None)
                self.named.discard(rank)
                continue
            self.slow_checks[rank] = self.slow_checks.get(rank, 0) + 1
            if self.slow_checks[rank] >= CHECKS and rank not in self.named:
                self.named.add(rank)
                ratio = seconds / median if median > 0 else float("inf")
                log.warning(
                    f"straggler: rank {rank} (host {self.host_of(rank)}) step time "
                    f"{ratio:.1f}x the median, data wait {100 * data_wait[rank]:.0f} %"
                )

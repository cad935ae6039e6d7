"""Early stopping (`train.early_stop`): end a run whose `ckpt.monitor` has stopped improving.

Each evaluation of the schedule (`train.eval_every_epochs`, `train.eval_every_steps`) is counted:
a value that beats the best so far by more than `min_delta`, in `ckpt.monitor_mode`'s direction,
becomes the best and resets the count; any other value (a non-finite one included) adds one. The
run stops once the count reaches `patience`.

The count lives in `TrainState`, so every checkpoint carries it and a resumed run stops where an
uninterrupted one would; the decision is not stored but taken again from the count under the
current config, so a resume with a larger patience (or none) trains on. The evaluation that ends a
run outside the schedule (at `train.max_steps` between scheduled ones) is not counted: a run
extended from there must count what an uninterrupted run counts. Every rank takes the same
decision without a collective: an evaluation's metrics come from one all-reduce of the sums and
are the same numbers on every rank.
"""

from __future__ import annotations

import math

from dtrain.config import CkptConfig, EarlyStopConfig
from dtrain.core.monitor import improves
from dtrain.loop.state import TrainState


class EarlyStop:
    """The count and the decision, over the run's `TrainState`."""

    def __init__(self, rule: EarlyStopConfig, ckpt: CkptConfig, state: TrainState) -> None:
        self.rule, self.state = rule, state
        self.monitor, self.mode = ckpt.monitor, ckpt.monitor_mode

    def count(self, value: float | None) -> None:
        """One scheduled evaluation at the state's step, with its monitored value. The count goes
        on with early stopping off too: turned on at a resume, it knows the run's history."""
        if value is None:  # the task does not report the monitor (refused before the start)
            return
        state = self.state
        if self._improves(value):
            state.early_stop_best, state.early_stop_best_step = value, state.step
            state.evals_since_best = 0
        else:
            state.evals_since_best += 1

    def _improves(self, value: float) -> bool:
        best, delta = self.state.early_stop_best, self.rule.min_delta
        if not math.isfinite(value):
            return False
        return improves(value, best, self.mode, delta)

    @property
    def due(self) -> bool:
        """Whether the run is to stop: `patience` evaluations in a row without an improvement."""
        patience = self.rule.patience
        return patience is not None and self.state.evals_since_best >= patience

    def line(self) -> str:
        """The one line a stopped run logs (and logs again when resumed)."""
        state = self.state
        best = (
            f"best {state.early_stop_best:.6g} at step {state.early_stop_best_step}"
            if state.early_stop_best is not None
            else "no finite value so far"
        )
        return (
            f"stopped early at step {state.step}: {self.monitor} did not improve by "
            f"{self.rule.min_delta:g} for {state.evals_since_best} evaluations; {best}"
        )

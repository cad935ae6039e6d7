"""Where a run is (`TrainState`, checkpointed), and what the steps since the ranks last agreed
left on the device (`Pending`) and in the current record's window (`Window`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain.process import dist


@dataclass
class TrainState:
    """Where the run is. `samples_in_epoch` counts samples consumed by all ranks together.
    The `early_stop_*` fields and `evals_since_best` are early stopping's count (`early_stop`):
    the best `ckpt.monitor` value by train.early_stop.min_delta, its step, and the evaluations
    since."""

    epoch: int = 0
    step: int = 0
    samples_in_epoch: int = 0
    consecutive_skips: int = 0
    skipped_steps: int = 0
    best_metric: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    early_stop_best: float | None = None
    early_stop_best_step: int | None = None
    evals_since_best: int = 0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def reached(self, epochs: int, max_steps: int | None) -> bool:
        """Whether the run is at or past the length asked (train.epochs, train.max_steps)."""
        return self.epoch >= epochs or (max_steps is not None and self.step >= max_steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint of an older version lacks the newer fields: they get their defaults."""
        fresh = TrainState()
        for f in dataclasses.fields(self):
            setattr(self, f.name, state.get(f.name, getattr(fresh, f.name)))


@dataclass
class StepTimes:
    """One step's wall times on this rank: the whole step, its wait for data, and its gradient
    exchange (the last micro-batch's backward, where every rank waits for the slowest)."""

    data_wait_s: float
    step_time_s: float
    exchange_s: float = 0.0


@dataclass
class Agreed:
    """What one agreement of the ranks read: the steps' loss (sum and count of finite steps, all
    ranks), whether any rank got a stop signal, each pending step's non-finite verdict, the last
    gradient norm, the bad samples all ranks replaced so far, and each rank's pace since the
    last agreement: its mean step time without the gradient exchange, and its data wait share."""

    loss_sum: float
    loss_count: float
    stop: bool
    skipped: list[bool]
    grad_norm: float | None
    replaced: int
    step_s: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)


class Pending:
    """What the steps since the last agreement left on the device: each step's loss, whether it
    was non-finite, and the last gradient norm. A step only keeps references to its tensors
    (no device work, no read): `agree` reduces them all at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.skips: list[torch.Tensor] = []
        self.norm: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return len(self.losses)

    def add(self, loss: torch.Tensor, skip: torch.Tensor, norm: torch.Tensor | None) -> None:
        """One step's loss, its non-finite flag (bool or float, non-zero: skipped) and its
        gradient norm where it was computed (the last one computed is what a check reads)."""
        self.losses.append(loss)
        self.skips.append(skip)
        if norm is not None:
            self.norm = norm

    def _skipped(self) -> torch.Tensor:
        return torch.stack(self.skips).view(-1) != 0

    def _loss_sum_count(self) -> torch.Tensor:
        """The finite steps' loss sum (float64, in step order) and their count, on the device."""
        if not self.losses:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        skipped = self._skipped()
        losses = torch.where(skipped, 0.0, torch.stack(self.losses).view(-1).double())
        # A running sum in step order (on the CPU, the rounding of adding step by step).
        total = losses.cumsum(0)[-1:]
        return torch.cat([total, (~skipped).double().sum().view(1)])

    def agree(self, stop_flag: bool, replaced: int, pace: tuple[float, float]) -> Agreed:
        """Sum what every rank has (losses, stop flags, replaced samples) in one all-reduce and
        read it with this rank's verdicts in one transfer; then start empty. Each rank's `pace`
        (`Window.pace`) travels in its own slots of the same all-reduce, zeros in the others'."""
        norm = (
            self.norm.float().view(1).double()
            if self.norm is not None
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        world, rank = dist.world_size(), dist.rank()
        host = torch.zeros(2 + 2 * world, dtype=torch.float64)
        host[0], host[1] = float(stop_flag), float(replaced)
        host[2 + rank], host[2 + world + rank] = pace
        skipped = (
            self._skipped().double()
            if self.skips
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        )
        shared = torch.cat([self._loss_sum_count(), host.to(self.device)])
        dist.all_reduce_sum(shared)
        values = torch.cat([shared, norm, skipped]).tolist()
        loss_sum, loss_count, stop, replaced_total = values[:4]
        paces, values = values[4 : 4 + 2 * world], values[4 + 2 * world :]
        agreed = Agreed(
            loss_sum=loss_sum,
            loss_count=loss_count,
            stop=stop > 0,
            skipped=[v > 0 for v in values[1:]],
            grad_norm=values[0] if self.norm is not None else None,
            replaced=int(replaced_total),
            step_s=paces[:world],
            data_wait=paces[world:],
        )
        self.losses, self.skips = [], []
        self.norm = None
        return agreed


class Window:
    """Figures since the last record: times and samples (host), loss (from the agreements), and
    the last loss any agreement read, with its step, for console lines between them."""

    def __init__(self) -> None:
        self.last_loss: tuple[float, int] | None = None  # kept across windows
        # Since the last agreement (not the last record): this rank's pace for the next one.
        self.pace_steps = 0
        self.pace_step_time = 0.0
        self.pace_exchange = 0.0
        self.pace_data_wait = 0.0
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.loss_count = 0.0
        self.grad_norm: float | None = None
        self.steps = 0
        self.samples = 0
        self.step_time = 0.0
        self.data_wait = 0.0
        self.started = time.perf_counter()

    def add(self, times: StepTimes, samples: int) -> None:
        self.steps += 1
        self.samples += samples
        self.step_time += times.step_time_s
        self.data_wait += times.data_wait_s
        self.pace_steps += 1
        self.pace_step_time += times.step_time_s
        self.pace_exchange += times.exchange_s
        self.pace_data_wait += times.data_wait_s

    def pace(self) -> tuple[float, float]:
        """This rank's mean step time without the gradient exchange, and its share of the step
        time spent waiting for data, over the steps since the last agreement."""
        own = self.pace_step_time - self.pace_exchange
        return (
            own / max(1, self.pace_steps),
            self.pace_data_wait / max(1e-9, self.pace_step_time),
        )

    def agreed(self, agreed: Agreed, step: int) -> None:
        self.pace_steps = 0
        self.pace_step_time = self.pace_exchange = self.pace_data_wait = 0.0
        self.loss_sum += agreed.loss_sum
        self.loss_count += agreed.loss_count
        if agreed.grad_norm is not None:
            self.grad_norm = agreed.grad_norm
        if agreed.loss_count:
            self.last_loss = (agreed.loss_sum / agreed.loss_count, step)

    def mean_loss(self) -> float:
        """Mean over the finite steps and all ranks (nan when every step was skipped)."""
        return self.loss_sum / self.loss_count if self.loss_count else float("nan")

    def samples_per_s(self) -> float:
        return self.samples / max(1e-9, time.perf_counter() - self.started)

    def mean_step_time(self) -> float:
        return self.step_time / max(1, self.steps)

    def data_wait_pct(self) -> float:
        return 100.0 * self.data_wait / max(1e-9, self.step_time)

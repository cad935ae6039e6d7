"""Where a run is (`TrainState`, checkpointed), and what the steps since the ranks last agreed
left on the device (`Pending`) and in the current record's window (`Window`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dtrain import dist


@dataclass
class TrainState:
    """Where the run is. `samples_in_epoch` counts samples consumed by all ranks together."""

    epoch: int = 0
    step: int = 0
    samples_in_epoch: int = 0
    consecutive_skips: int = 0
    skipped_steps: int = 0
    best_metric: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])


@dataclass
class StepTimes:
    data_wait_s: float
    step_time_s: float


@dataclass
class Agreed:
    """What one agreement of the ranks read: the steps' loss (sum and count of finite steps, all
    ranks), whether any rank got a stop signal, each pending step's non-finite verdict, the last
    gradient norm, and the bad samples all ranks replaced so far."""

    loss_sum: float
    loss_count: float
    stop: bool
    skipped: list[bool]
    grad_norm: float | None
    replaced: int


class Pending:
    """What the steps since the last agreement left on the device: their loss sum and count (of
    finite steps), which were non-finite, the last gradient norm. Nothing here reads the device
    until `agree`."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.loss = torch.zeros(2, dtype=torch.float64, device=device)  # sum, count
        self.skipped = torch.zeros(size, dtype=torch.bool, device=device)
        self.norm: torch.Tensor | None = None
        self.steps = 0

    def add(self, loss: torch.Tensor, skip: torch.Tensor, norm: torch.Tensor) -> None:
        if self.steps == len(self.skipped):  # an agreement is due every `size` steps: never full
            self.skipped = torch.cat([self.skipped, torch.zeros_like(self.skipped)])
        finite = (~skip).double()
        self.loss += torch.stack([torch.where(skip, 0.0, loss.double()), finite])
        self.skipped[self.steps] = skip
        self.norm = norm
        self.steps += 1

    def agree(self, stop_flag: bool, replaced: int) -> Agreed:
        """Sum what every rank has (losses, stop flags, replaced samples) in one all-reduce and
        read it with this rank's verdicts in one transfer; then start empty."""
        norm = (
            self.norm.float().view(1).double()
            if self.norm is not None
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        host = torch.tensor([float(stop_flag), float(replaced)], dtype=torch.float64)
        shared = torch.cat([self.loss, host.to(self.device)])
        dist.all_reduce_sum(shared)
        values = torch.cat([shared, norm, self.skipped[: self.steps].double()]).tolist()
        loss_sum, loss_count, stop, replaced_total, last_norm = values[:5]
        agreed = Agreed(
            loss_sum=loss_sum,
            loss_count=loss_count,
            stop=stop > 0,
            skipped=[v > 0 for v in values[5:]],
            grad_norm=last_norm if self.norm is not None else None,
            replaced=int(replaced_total),
        )
        self.loss.zero_()
        self.norm = None
        self.steps = 0
        return agreed


class Window:
    """Figures since the last record: times and samples (host), loss (from the agreements), and
    the last loss any agreement read, with its step, for console lines between them."""

    def __init__(self) -> None:
        self.last_loss: tuple[float, int] | None = None  # kept across windows
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

    def agreed(self, agreed: Agreed, step: int) -> None:
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

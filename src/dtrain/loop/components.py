"""What the assembly (`dtrain.run`) hands the `Trainer`, built outside it: what learns
(`Learner`), where batches come from (`Feed`), what watches the loop (`Observers`), and what
else runs between steps (`Callbacks`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain.data import Datasets, Loaders, to_device
from dtrain.loop.optim import LRSchedule, UserSchedule
from dtrain.loop.state import TrainState
from dtrain.observe import RunLog, Throughput
from dtrain.observe.stragglers import Stragglers
from dtrain.parallel import average_buffers
from dtrain.parallel.precision import Precision
from dtrain.process.whereabouts import Whereabouts
from dtrain.tasks import Task


@dataclass(frozen=True)
class Learner:
    """What a step trains and how: the (wrapped) model, the task that turns a batch into its
    loss and metrics, the optimizer, its learning-rate schedule, the precision (autocast,
    backward, the fp16 grad scaler), and whether BatchNorm statistics are synchronised."""

    model: nn.Module
    task: Task
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule | UserSchedule
    precision: Precision
    sync_batchnorm: bool

    def consistent_buffers(self) -> None:
        """Without sync_batchnorm every rank's BatchNorm statistics follow its own batches: use
        their mean for evaluation and checkpoints, the same on every rank."""
        if not self.sync_batchnorm:
            average_buffers(self.model)


@dataclass(frozen=True)
class Feed:
    """Where batches come from: the datasets (which count the bad samples they replaced), the
    loaders and their samplers, and how a batch goes to the device (model.channels_last)."""

    datasets: Datasets
    loaders: Loaders
    channels_last: bool

    def to_device(self, batch: Any, device: torch.device) -> Any:
        return to_device(batch, device, self.datasets.on_device, self.channels_last)


@dataclass(frozen=True)
class Observers:
    """What watches the loop: the run's records, console lines and progress (`run_log`), the
    throughput figures of each record, which rank is slow (`stragglers`), and what this rank is
    doing, for ranks left waiting on it (`where`)."""

    run_log: RunLog
    throughput: Throughput
    stragglers: Stragglers
    where: Whereabouts


@dataclass
class Callbacks:
    """What else may run between steps, each hook a list that concerns subscribe to (run/
    fills them in): a new concern is a new entry, not an edit of the loop.

    - `first_step`: after the first optimizer step of an attempt (state sizes exist only then);
      what they return joins the next logged record.
    - `step_end`: after every optimizer step (the profiler's schedule).
    - `evaluation_metrics`: at every evaluation, after the validation metrics, on every rank
      together, with the weights the model holds (and again, suffixed `_ema`, with the
      averaged weights where train.ema evaluates them); what they return joins that
      evaluation's metrics before anything reads them (`ckpt.monitor`, early stopping, the
      record): the tasks of train.eval_tasks.
    - `evaluated(state, metrics)`: after every evaluation, with its metrics.
    - `saved(state)`: after every checkpoint (the run record).
    - `before_stop_save(last_save_s)`: before the checkpoint of a stop signal, with how long the
      last save took (None before the first): under SLURM, whether it fits the time left.
    """

    first_step: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    step_end: list[Callable[[], None]] = field(default_factory=list)
    evaluation_metrics: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    evaluated: list[Callable[[TrainState, dict[str, float]], None]] = field(default_factory=list)
    saved: list[Callable[[TrainState], None]] = field(default_factory=list)
    before_stop_save: list[Callable[[float | None], None]] = field(default_factory=list)

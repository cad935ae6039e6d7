"""The training loop. It reads top to bottom: epochs, optimizer steps made of micro-batches,
logging, evaluation, checkpoints, and the decisions every rank must take together.

It never reads the environment or asks for its rank itself: it uses `dist`'s helpers. It knows
nothing about images or tokens: the task turns a batch into a loss and into metrics. Everything
else that may run between steps is one of the `Callbacks`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain import dist, parallel, signals
from dtrain.config import Config
from dtrain.data import Datasets, to_device
from dtrain.errors import TrainingStopped
from dtrain.observe import RunLog, Throughput, log, memory_stats
from dtrain.optim import LRSchedule
from dtrain.parallel import average_buffers
from dtrain.tasks import Task, batch_size


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


@dataclass
class Callbacks:
    """Everything besides training that may run between steps, in one place (run.py fills it in).

    - `first_step()`: after the first optimizer step of an attempt (state sizes exist only
      then); what it returns joins the next logged record.
    - `step_end()`: after every optimizer step (the profiler's schedule).
    - `saved(state)`: after every checkpoint (the run record).
    - `before_stop_save(last_save_s)`: before the checkpoint of a stop signal, with how long the
      last save took (None before the first): under SLURM, whether it fits the time left.
    """

    first_step: Callable[[], dict[str, Any]] = lambda: {}
    step_end: Callable[[], None] = lambda: None
    saved: Callable[[TrainState], None] = lambda state: None
    before_stop_save: Callable[[float | None], None] = lambda last_save_s: None


@dataclass
class StepTimes:
    data_wait_s: float
    step_time_s: float


class Trainer:
    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        task: Task,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        scaler: Any | None,
        loaders: tuple,
        device: torch.device,
        is_fsdp: bool,
        run_log: RunLog,
        checkpoints: Any,
        state: TrainState,
        callbacks: Callbacks,
        throughput: Throughput,
        datasets: Datasets,
    ) -> None:
        self.cfg, self.model, self.task, self.optimizer = cfg, model, task, optimizer
        self.schedule, self.scaler = schedule, scaler
        self.callbacks, self.throughput = callbacks, throughput
        self.datasets = datasets
        self.train_loader, self.train_sampler, self.val_loader, self.val_sampler = loaders
        self.device, self.is_fsdp = device, is_fsdp
        self.run_log, self.checkpoints, self.state = run_log, checkpoints, state
        self.accum = cfg.train.grad_accum
        self.samples_per_step = cfg.data.batch_size * self.accum * dist.world_size()
        # An optimizer that takes `found_inf` skips a non-finite step on the device itself
        # (fused kernels; the grad scaler's way): no step ever waits for the device to decide.
        self.masked_step = scaler is None and masked_step_supported(optimizer)
        self.pending = _Pending(cfg.train.check_every_steps, device)
        self.window = _Window()
        self.stop_requested: str | None = None
        self._first_step_done = False
        self._pending_record: dict[str, Any] = {}
        self.last_save_s: float | None = None

    # -----------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end, or until a stop signal; returns 'finished' or 'preempted'."""
        cfg, state = self.cfg, self.state
        max_steps = cfg.train.max_steps or math.inf
        while state.epoch < cfg.train.epochs and state.step < max_steps and not self.stop_requested:
            self.train_sampler.set_epoch(state.epoch, state.samples_in_epoch)
            steps_this_epoch = len(self.train_loader) // self.accum
            done_before = state.samples_in_epoch // self.samples_per_step
            self.run_log.progress.start_epoch(state.epoch, done_before + steps_this_epoch)
            batches = iter(self.train_loader)
            epoch_finished = True
            for done in range(done_before + 1, done_before + steps_this_epoch + 1):
                self._sync_debug(state.step >= 2)
                times = self._train_step(batches)
                if not self._first_step_done:
                    self._pending_record = self.callbacks.first_step()
                    self._first_step_done = True
                state.step += 1
                state.samples_in_epoch += self.samples_per_step
                self.window.add(times, self.samples_per_step)
                last_in_epoch = done == done_before + steps_this_epoch
                self._log_step(done, last_in_epoch)
                self.callbacks.step_end()
                if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                    self._evaluate()
                # A save due on an epoch's last step waits for the epoch's end, so that the
                # checkpoint says "next epoch" and holds that epoch's evaluation.
                if self._save_due_by_steps() and not last_in_epoch and not self.stop_requested:
                    self._save()
                if self.stop_requested or state.step >= max_steps:
                    epoch_finished = last_in_epoch
                    break
            del batches  # stops the loader workers of an unfinished epoch
            self.run_log.progress.end_epoch()
            if epoch_finished:
                state.epoch += 1
                state.samples_in_epoch = 0
                if cfg.train.eval_every_epochs and state.epoch % cfg.train.eval_every_epochs == 0:
                    self._evaluate()
                due_by_epochs = cfg.ckpt.every_epochs and state.epoch % cfg.ckpt.every_epochs == 0
                if (due_by_epochs or self._save_due_by_steps()) and not self.stop_requested:
                    self._save()
        self._check()
        if self.stop_requested:
            log.info(
                f"stop requested ({self.stop_requested}) at step {state.step}: saving a "
                f"checkpoint and exiting"
            )
            self.callbacks.before_stop_save(self.last_save_s)
            if self.checkpoints.last_saved_step != state.step:  # (a save's check may have seen it)
                self._save()
            self.checkpoints.wait()
            return "preempted"
        if state.last_eval.get("step") != state.step:
            self._evaluate()
        if self.checkpoints.last_saved_step != state.step:
            self._save()
        self.checkpoints.wait()
        return "finished"

    # -----------------------------------------------------------------------------------------
    def _train_step(self, batches: Iterator) -> StepTimes:
        """One optimizer step. Between checks it never waits for the device: the loss, whether
        the step was non-finite, and the gradient norm stay on the device (`_Pending`)."""
        model = self.model
        started = time.perf_counter()
        model.train()
        self.schedule.apply(self.state.step)
        step_loss = torch.zeros((), device=self.device, dtype=torch.float32)
        data_wait = 0.0
        for micro in range(self.accum):
            waited = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - waited
            batch = self._to_device(batch)
            last = micro == self.accum - 1
            with self._gradient_sync(last), self._autocast():
                loss = self.task.loss(model, batch) / self.accum
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            step_loss += loss.detach()
        norm = self._grad_norm()
        # A step is non-finite when its gradients are (checked on every step, clipped or not;
        # a non-finite loss makes them so). The norm is global (DDP averaged the gradients,
        # FSDP's is reduced over the shards): every rank reaches the same verdict. Under fp16
        # the grad scaler decides (an overflow lowers the scale) instead.
        skip = (
            ~torch.isfinite(norm)
            if self.scaler is None
            else torch.zeros((), dtype=torch.bool, device=self.device)
        )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.masked_step:
            self.optimizer.found_inf = skip.float()
            self.optimizer.grad_scale = None
            self.optimizer.step()
            del self.optimizer.found_inf, self.optimizer.grad_scale
        elif not bool(skip):  # an optimizer without a masked step: one wait per step
            self.optimizer.step()
        # Freed now, not at the next step: evaluations and saves run without them.
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.add(step_loss, skip, norm)
        return StepTimes(data_wait_s=data_wait, step_time_s=time.perf_counter() - started)

    def _sync_debug(self, on: bool) -> None:
        """train.sync_debug on CUDA: torch warns at every synchronisation while a step runs
        (from the third step on; the checks turn it off while they read)."""
        if self.cfg.train.sync_debug and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if on else "default")

    def _check(self) -> None:
        """Where the host waits for the device, and the ranks agree: every
        train.check_every_steps steps, at records, evaluations and saves. Reads the steps since
        the last check (their loss, which were non-finite) and whether any rank got a stop
        signal, in one all-reduce; applies train.nan_policy to the non-finite steps."""
        self._sync_debug(False)
        pending = self.pending
        flag = float(signals.received() is not None)
        loss_sum, loss_count, stop, skipped, norm = pending.read(flag)
        self.window.loss_sum += loss_sum
        self.window.loss_count += loss_count
        if norm is not None:
            self.window.grad_norm = norm
        if stop and not self.stop_requested:
            self.stop_requested = signals.received() or "a stop signal on another rank"
        first_step = self.state.step - len(skipped) + 1
        for offset, was_skipped in enumerate(skipped):
            self._count_skip(first_step + offset, was_skipped)

    def _count_skip(self, step: int, skipped: bool) -> None:
        state, train = self.state, self.cfg.train
        if not skipped:
            state.consecutive_skips = 0
            return
        if train.nan_policy == "stop":
            raise TrainingStopped(
                f"non-finite loss or gradients at step {step}; stopping "
                f"(train.nan_policy=stop); the last good checkpoint is kept"
            )
        state.consecutive_skips += 1
        state.skipped_steps += 1
        log.warning(
            f"step {step}: non-finite loss or gradients, optimizer step skipped "
            f"({state.consecutive_skips} in a row, {state.skipped_steps} in all)"
        )
        if state.consecutive_skips > train.max_consecutive_skips:
            raise TrainingStopped(
                f"{state.consecutive_skips} non-finite steps in a row at step "
                f"{step}, more than train.max_consecutive_skips="
                f"{train.max_consecutive_skips}; stopping"
            )

    def _to_device(self, batch: Any) -> Any:
        return to_device(batch, self.device, self.datasets.on_device, self.cfg.model.channels_last)

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Synchronise gradients only on the last micro-batch of an accumulated step."""
        if self.accum == 1:
            return contextlib.nullcontext()
        if self.is_fsdp:
            self.model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if not sync and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return parallel.autocast(self.cfg.train.precision, self.is_fsdp, self.device)

    def _grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the whole (unsharded) model, as a tensor on the device;
        clipped to train.clip_grad_norm when set. Under fp16 it is the norm of the unscaled
        gradients (those the optimizer will apply)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_grad_norm
        if max_norm is not None:
            norm = nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the full value is the global norm
            norm = norm.full_tensor()
        return norm

    # -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's metrics over the whole validation set as `val_<name>`, each sample counted
        once over all ranks; identical on every rank (one all-reduce of all the sums)."""
        model = self.model
        self._consistent_buffers()
        model.eval()
        names: list[str] = []
        sums: torch.Tensor | None = None  # one per metric, then the count of samples
        position = 0  # this rank's sample number; the padding beyond valid_count is ignored
        for batch in self.val_loader:
            batch = self._to_device(batch)
            with self._autocast():
                values = self.task.metrics(model, batch)
            if sums is None:  # the task's own order (every rank runs the same task)
                names = list(values)
                sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
            size = batch_size(batch)
            valid = (
                torch.arange(position, position + size, device=self.device)
                < self.val_sampler.valid_count
            )
            position += size
            for i, name in enumerate(names):
                sums[i] += torch.where(valid, values[name].double(), 0.0).sum()
            sums[-1] += valid.double().sum()
        assert sums is not None  # the loaders refuse an empty validation set
        dist.all_reduce_sum(sums)
        *totals, count = sums.tolist()
        means = {name: total / count for name, total in zip(names, totals, strict=False)}
        summarize = getattr(self.task, "summarize", None)
        if summarize is not None:
            means.update(summarize(dict(means)))
        return {f"val_{name}": value for name, value in means.items()}

    def _evaluate(self) -> None:
        self._check()
        metrics = self.evaluate()
        state = self.state
        state.last_eval = {"step": state.step, **metrics}
        value = metrics.get(self.cfg.ckpt.monitor)
        self.schedule.on_eval(value)
        if value is not None and _improves(value, state.best_metric, self.cfg.ckpt.monitor_mode):
            state.best_metric = value
        self.run_log.evaluation({"step": state.step, "epoch": state.epoch, **metrics})

    def _save_due_by_steps(self) -> bool:
        every = self.cfg.ckpt.every_steps
        return bool(every) and self.state.step % every == 0

    def _consistent_buffers(self) -> None:
        """Without sync_batchnorm every rank's BatchNorm statistics follow its own batches: use
        their mean for evaluation and checkpoints, the same on every rank."""
        if not self.cfg.parallel.sync_batchnorm:
            average_buffers(self.model)

    def _save(self) -> None:
        started = time.perf_counter()
        self._check()  # the non-finite policy first: a checkpoint never follows a bad step unseen
        self._consistent_buffers()
        if dist.any_rank(not _all_finite(self.model), self.device):
            raise TrainingStopped(
                f"the weights are not finite at step {self.state.step}; not "
                f"saving them (the last good checkpoint is kept)"
            )
        self.checkpoints.save(self.state)
        self.last_save_s = time.perf_counter() - started
        self.callbacks.saved(self.state)

    # -----------------------------------------------------------------------------------------
    def _log_step(self, done_in_epoch: int, last_in_epoch: bool) -> None:
        """A record every train.log_every steps (and a console line when log.every_s passes
        without one); checks every train.check_every_steps; between them only the progress
        bar's counter moves, with the figures of the last record."""
        state, progress = self.state, self.run_log.progress
        at_log_step = state.step % self.cfg.train.log_every == 0
        # Checks are collectives: only what every rank sees alike may call for one (the console
        # line of log.every_s follows each rank's own clock, so it shows the last check's loss).
        if at_log_step or state.step % self.cfg.train.check_every_steps == 0 or last_in_epoch:
            self._check()
        if not (at_log_step or progress.line_due()):
            progress.tick(done_in_epoch)
            return
        window = self.window
        samples_per_s = window.samples_per_s()
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": window.mean_loss(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples_per_s,
            **self.throughput.figures(samples_per_s),
        }
        if window.grad_norm is not None:
            record["grad_norm"] = window.grad_norm
        if at_log_step:
            record.update(step_time_s=window.mean_step_time(), data_wait_pct=window.data_wait_pct())
            if state.skipped_steps:
                record["skipped_steps"] = state.skipped_steps
            record.update(self._pending_record)
            replaced = self.datasets.replaced()  # the same None or not on every rank
            if replaced is not None:
                total = int(
                    dist.all_reduce_sum(torch.tensor([float(replaced)], device=self.device)).item()
                )
                if total:
                    record["bad_samples_replaced"] = total
            self._pending_record = {}
            if self.scaler is not None:
                record["loss_scale"] = float(self.scaler.get_scale())
        extra = {f"mem/{k}": v for k, v in memory_stats(self.device).items()} if at_log_step else {}
        self.run_log.train(record, extra, done_in_epoch, at_log_step)
        if at_log_step:
            window.reset()


def masked_step_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `found_inf` (a device flag that turns the whole step
    into a no-op): fused optimizers do; torch has no DTensor rule for fused SGD, so SGD under
    FSDP is not one."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return not any(hasattr(p, "to_local") for g in optimizer.param_groups for p in g["params"])
    return True


class _Pending:
    """What the steps since the last check left on the device: their loss sum and count (of
    finite steps), which were non-finite, the last gradient norm. Nothing here reads the device
    until `read`."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.loss = torch.zeros(2, dtype=torch.float64, device=device)  # sum, count
        self.skipped = torch.zeros(size, dtype=torch.bool, device=device)
        self.norm: torch.Tensor | None = None
        self.steps = 0

    def add(self, loss: torch.Tensor, skip: torch.Tensor, norm: torch.Tensor) -> None:
        if self.steps == len(self.skipped):  # a check is due every `size` steps: never full
            self.skipped = torch.cat([self.skipped, torch.zeros_like(self.skipped)])
        finite = (~skip).double()
        self.loss += torch.stack([torch.where(skip, 0.0, loss.double()), finite])
        self.skipped[self.steps] = skip
        self.norm = norm
        self.steps += 1

    def read(self, stop_flag: float) -> tuple[float, float, bool, list[bool], float | None]:
        """(loss sum and count over all ranks, any rank's stop flag, each pending step's
        verdict, the last norm), in one all-reduce and one read; then empty."""
        norm = (
            self.norm.float().view(1).double()
            if self.norm is not None
            else torch.zeros(1, dtype=torch.float64, device=self.device)
        )
        shared = torch.cat(
            [self.loss, torch.tensor([stop_flag], dtype=torch.float64, device=self.device)]
        )
        dist.all_reduce_sum(shared)
        values = torch.cat([shared, norm, self.skipped[: self.steps].double()]).tolist()
        loss_sum, loss_count, stop, last_norm = values[:4]
        skipped = [v > 0 for v in values[4:]]
        had_norm = self.norm is not None
        self.loss.zero_()
        self.norm = None
        self.steps = 0
        return loss_sum, loss_count, stop > 0, skipped, last_norm if had_norm else None


@torch.no_grad()
def _all_finite(model: nn.Module) -> bool:
    """Whether this rank's parameters (its shards under FSDP) are all finite: one fused check."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    local = [t for t in local if t.numel()]
    return not local or bool(torch.isfinite(nn.utils.get_total_norm(local, norm_type=math.inf)))


def _improves(value: float, best: float | None, mode: str) -> bool:
    return best is None or (value > best if mode == "max" else value < best)


class _Window:
    """Figures since the last record: times and samples (host), loss (from the checks)."""

    def __init__(self) -> None:
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

    def mean_loss(self) -> float:
        """Mean over the finite steps and all ranks (nan when every step was skipped)."""
        return self.loss_sum / self.loss_count if self.loss_count else float("nan")

    def samples_per_s(self) -> float:
        return self.samples / max(1e-9, time.perf_counter() - self.started)

    def mean_step_time(self) -> float:
        return self.step_time / max(1, self.steps)

    def data_wait_pct(self) -> float:
        return 100.0 * self.data_wait / max(1e-9, self.step_time)

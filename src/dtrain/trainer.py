"""The training loop. It reads top to bottom: epochs, optimizer steps made of micro-batches,
logging, evaluation, checkpoints, and the decisions every rank must take together.

It never reads the environment or asks for its rank itself: it uses `dist`'s helpers.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from dtrain import dist, signals
from dtrain.config import Config
from dtrain.errors import TrainingStopped
from dtrain.observe import RunLog, log, memory_stats
from dtrain.optim import LRSchedule
from dtrain.parallel import PRECISION_DTYPES, average_buffers


@dataclass
class TrainState:
    """Where the run is. `samples_in_epoch` counts samples consumed by all ranks together."""
    epoch: int = 0
    step: int = 0
    samples_in_epoch: int = 0
    consecutive_skips: int = 0
    skipped_steps: int = 0
    best_metric: Optional[float] = None
    last_eval: dict[str, float] = field(default_factory=dict)


@dataclass
class StepResult:
    loss: float  # mean over ranks and micro-batches
    grad_norm: float
    skipped: bool
    stop_signal: bool
    data_wait_s: float
    step_time_s: float


class Trainer:
    def __init__(self, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: LRSchedule, scaler: Optional[Any], loaders: tuple,
                 device: torch.device, is_fsdp: bool, run_log: RunLog, checkpoints: Any,
                 state: TrainState) -> None:
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.schedule, self.scaler = schedule, scaler
        self.train_loader, self.train_sampler, self.val_loader, self.val_sampler = loaders
        self.device, self.is_fsdp = device, is_fsdp
        self.run_log, self.checkpoints, self.state = run_log, checkpoints, state
        self.accum = cfg.train.grad_accum
        self.samples_per_step = cfg.data.batch_size * self.accum * dist.world_size()
        # FSDP applies the precision through its mixed-precision policy; other modes autocast.
        dtype = PRECISION_DTYPES[cfg.train.precision]
        self.autocast_dtype = None if dtype == torch.float32 or is_fsdp else dtype
        # Called once after this attempt's first step (state sizes exist only then); its result
        # joins the next logged record.
        self.on_first_step: Optional[Callable[[], dict[str, Any]]] = None
        self._pending_record: dict[str, Any] = {}
        # Called after every optimizer step (the profiler's schedule) and after every checkpoint
        # save (the run record).
        self.after_step: Callable[[], None] = lambda: None
        self.after_save: Callable[[TrainState], None] = lambda state: None
        # Called before the checkpoint of a stop signal, with how long the last save took (None
        # before the first): under SLURM, whether it fits before the time limit.
        self.before_stop_save: Callable[[Optional[float]], None] = lambda last_save_s: None
        self.last_save_s: Optional[float] = None

    # -----------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end, or until a stop signal; returns 'finished' or 'preempted'."""
        cfg, state = self.cfg, self.state
        max_steps = cfg.train.max_steps or math.inf
        stopped_by: Optional[str] = None
        window = _Window()
        while state.epoch < cfg.train.epochs and state.step < max_steps and not stopped_by:
            self.train_sampler.set_epoch(state.epoch, state.samples_in_epoch)
            steps_this_epoch = len(self.train_loader) // self.accum
            done_before = state.samples_in_epoch // self.samples_per_step
            self.run_log.progress.start_epoch(state.epoch, done_before + steps_this_epoch)
            batches = iter(self.train_loader)
            epoch_finished = True
            for done in range(done_before + 1, done_before + steps_this_epoch + 1):
                result = self._train_step(batches)
                if self.on_first_step is not None:
                    self._pending_record = self.on_first_step()
                    self.on_first_step = None
                state.step += 1
                state.samples_in_epoch += self.samples_per_step
                window.add(result, self.samples_per_step)
                self._log_step(result, window, done)
                self.after_step()
                if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                    self._evaluate()
                if result.stop_signal:
                    stopped_by = signals.received() or "a stop signal on another rank"
                last_in_epoch = done == done_before + steps_this_epoch
                # A save due on an epoch's last step waits for the epoch's end, so that the
                # checkpoint says "next epoch" and holds that epoch's evaluation.
                if self._save_due_by_steps() and not last_in_epoch and not stopped_by:
                    self._save()
                if stopped_by or state.step >= max_steps:
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
                if (due_by_epochs or self._save_due_by_steps()) and not stopped_by:
                    self._save()
        if stopped_by:
            log.info(f"stop requested ({stopped_by}) at step {state.step}: saving a checkpoint "
                     f"and exiting")
            self.before_stop_save(self.last_save_s)
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
    def _train_step(self, batches: Iterator) -> StepResult:
        model = self.model
        started = time.perf_counter()
        model.train()
        self.schedule.apply(self.state.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        data_wait = 0.0
        for micro in range(self.accum):
            waited = time.perf_counter()
            images, labels = next(batches)
            data_wait += time.perf_counter() - waited
            images, labels = self._to_device(images, labels)
            last = micro == self.accum - 1
            with self._gradient_sync(last), self._autocast():
                loss = F.cross_entropy(model(images).float(), labels) / self.accum
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = self._grad_norm()
        # One all-reduce per step carries the loss and the decisions every rank must share:
        # whether the step is non-finite (its gradients, on every step: a finite loss can still
        # give inf/NaN gradients), and whether any rank got a stop signal. The gradient norm is
        # already global (DDP averaged the gradients; FSDP's is reduced over the shards), so
        # every rank reaches the same verdict.
        grad_nonfinite = (~torch.isfinite(grad_norm)).double() if self.scaler is None \
            else torch.zeros((), dtype=torch.float64, device=self.device)
        flags = torch.tensor([float(signals.received() is not None)], dtype=torch.float64,
                             device=self.device)
        loss64 = loss_sum.double().view(1)
        shared = torch.cat([loss64, (~torch.isfinite(loss64)).double(), grad_nonfinite.view(1),
                            flags, grad_norm.double().view(1)])
        dist.all_reduce_sum(shared)
        loss_value, loss_nonfinite, any_grad_nonfinite, any_stop, norm_sum = shared.tolist()
        skipped = self._step_or_skip(loss_nonfinite + any_grad_nonfinite > 0)
        return StepResult(loss=loss_value / dist.world_size(),
                          grad_norm=norm_sum / dist.world_size(), skipped=skipped,
                          stop_signal=any_stop > 0, data_wait_s=data_wait,
                          step_time_s=time.perf_counter() - started)

    def _step_or_skip(self, nonfinite: bool) -> bool:
        state = self.state
        if not nonfinite:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            state.consecutive_skips = 0
            return False
        step = state.step + 1
        if self.cfg.train.nan_policy == "stop":
            raise TrainingStopped(f"non-finite loss or gradients at step {step}; stopping "
                                  f"(train.nan_policy=stop); the last good checkpoint is kept")
        state.consecutive_skips += 1
        state.skipped_steps += 1
        log.warning(f"step {step}: non-finite loss or gradients, optimizer step skipped "
                    f"({state.consecutive_skips} in a row, {state.skipped_steps} in all)")
        if state.consecutive_skips > self.cfg.train.max_consecutive_skips:
            raise TrainingStopped(f"{state.consecutive_skips} non-finite steps in a row at step "
                                  f"{step}, more than train.max_consecutive_skips="
                                  f"{self.cfg.train.max_consecutive_skips}; stopping")
        return True

    def _to_device(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        non_blocking = self.device.type == "cuda"
        images = images.to(self.device, non_blocking=non_blocking)
        if self.cfg.model.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device, non_blocking=non_blocking)

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
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

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
        """Loss and accuracy over the whole validation set, each sample counted once; identical
        on every rank."""
        model = self.model
        self._consistent_buffers()
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, count
        position = 0  # this rank's sample number; the padding beyond valid_count is ignored
        for images, labels in self.val_loader:
            images, labels = self._to_device(images, labels)
            with self._autocast():
                logits = model(images).float()
            valid = torch.arange(position, position + len(labels), device=self.device) < \
                self.val_sampler.valid_count
            position += len(labels)
            losses = F.cross_entropy(logits, labels, reduction="none")
            sums[0] += losses[valid].double().sum()
            sums[1] += (logits.argmax(dim=1) == labels)[valid].double().sum()
            sums[2] += valid.double().sum()
        dist.all_reduce_sum(sums)
        loss_sum, correct, count = sums.tolist()
        return {"val_loss": loss_sum / count, "val_acc": correct / count}

    def _evaluate(self) -> None:
        metrics = self.evaluate()
        state = self.state
        state.last_eval = {"step": state.step, **metrics}
        self.schedule.on_eval(metrics.get(self.cfg.ckpt.monitor, metrics["val_acc"]))
        value = metrics.get(self.cfg.ckpt.monitor)
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
        self._consistent_buffers()
        if dist.any_rank(not _all_finite(self.model), self.device):
            raise TrainingStopped(f"the weights are not finite at step {self.state.step}; not "
                                  f"saving them (the last good checkpoint is kept)")
        self.checkpoints.save(self.state)
        self.last_save_s = time.perf_counter() - started
        self.after_save(self.state)

    # -----------------------------------------------------------------------------------------
    def _log_step(self, result: StepResult, window: "_Window", done_in_epoch: int) -> None:
        state = self.state
        at_log_step = state.step % self.cfg.train.log_every == 0
        record = {"step": state.step, "epoch": state.epoch, "loss": window.mean_loss(),
                  "lr": self.optimizer.param_groups[0]["lr"],
                  "samples_per_s": window.samples_per_s()}
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if at_log_step:
            record.update(step_time_s=window.mean_step_time(), data_wait_pct=window.data_wait_pct())
            if state.skipped_steps:
                record["skipped_steps"] = state.skipped_steps
            record.update(self._pending_record)
            self._pending_record = {}
            if self.scaler is not None:
                record["loss_scale"] = float(self.scaler.get_scale())
        extra = {f"mem/{k}": v for k, v in memory_stats(self.device).items()} if at_log_step else {}
        self.run_log.train(record, extra, done_in_epoch, at_log_step)
        if at_log_step:
            window.reset()


@torch.no_grad()
def _all_finite(model: nn.Module) -> bool:
    """Whether this rank's parameters (its shards under FSDP) are all finite: one fused check."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    local = [t for t in local if t.numel()]
    return not local or bool(torch.isfinite(nn.utils.get_total_norm(local, norm_type=math.inf)))


def _improves(value: float, best: Optional[float], mode: str) -> bool:
    return best is None or (value > best if mode == "max" else value < best)


class _Window:
    """Running figures since the last logged record."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.steps = 0
        self.samples = 0
        self.step_time = 0.0
        self.data_wait = 0.0
        self.started = time.perf_counter()

    def add(self, result: StepResult, samples: int) -> None:
        if not result.skipped:
            self.losses.append(result.loss)
        self.steps += 1
        self.samples += samples
        self.step_time += result.step_time_s
        self.data_wait += result.data_wait_s

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def samples_per_s(self) -> float:
        return self.samples / max(1e-9, time.perf_counter() - self.started)

    def mean_step_time(self) -> float:
        return self.step_time / max(1, self.steps)

    def data_wait_pct(self) -> float:
        return 100.0 * self.data_wait / max(1e-9, self.step_time)

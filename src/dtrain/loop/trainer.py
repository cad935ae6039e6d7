"""The training loop. It reads top to bottom: epochs, optimizer steps made of micro-batches,
logging, evaluation, checkpoints, and the decisions every rank must take together.

It never reads the environment or asks for its rank itself: it uses `dist`'s helpers. It knows
nothing about images or tokens: the task turns a batch into a loss and into metrics. It builds
none of its helpers between steps: the run hands it its components (`components`, `saving`,
early stopping, the EMA weights), and everything else that may run between steps is one of the
`Callbacks`.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from dtrain import parallel
from dtrain.config import TrainConfig
from dtrain.core import signals
from dtrain.core.errors import TrainingStopped
from dtrain.core.monitor import improves
from dtrain.loop import evaluation, grads
from dtrain.loop.components import Callbacks, Feed, Learner, Observers
from dtrain.loop.early_stop import EarlyStop
from dtrain.loop.ema import SUFFIX, EmaWeights
from dtrain.loop.micro_batches import MicroBatches
from dtrain.loop.saving import Saving
from dtrain.loop.state import Pending, StepTimes, TrainState, Window
from dtrain.observe import log, memory_stats
from dtrain.parallel.replicas import Groups
from dtrain.process import compat
from dtrain.process.layout import Layout


class Trainer:
    """The loop over `state` (the run's position, which the checkpoints save), with the
    components the assembly built: what learns, where batches come from, the checkpoints,
    early stopping, the averaged weights (None without train.ema), what watches the loop, the
    callbacks between steps, and the replica groups it trains with (or one group alone)."""

    def __init__(
        self,
        *,
        train: TrainConfig,
        layout: Layout,
        state: TrainState,
        learner: Learner,
        feed: Feed,
        saving: Saving,
        early_stop: EarlyStop,
        ema: EmaWeights | None,
        observers: Observers,
        callbacks: Callbacks,
        replicas: Groups,
    ) -> None:
        self.train, self.layout, self.state, self.replicas = train, layout, state, replicas
        self.learner, self.feed, self.saving = learner, feed, saving
        self.early_stop, self.ema = early_stop, ema
        self.observers, self.callbacks = observers, callbacks
        self.model, self.task = learner.model, learner.task
        self.device, self.accum = layout.device, layout.grad_accum
        self.samples_per_step = layout.effective_batch
        # An optimizer that takes `found_inf` skips a non-finite step on the device itself
        # (fused kernels; the grad scaler's way): no step ever waits for the device to decide.
        optimizer = learner.optimizer
        self.masked_step = not learner.precision.scaled and compat.masked_step_supported(optimizer)
        self.pending = Pending(self.device)
        # A pipeline's steps run through its schedule (parallel.pp), with the task's loss.
        self.pipe = parallel.pipeline_of(self.model)
        if self.pipe is not None:
            self.pipe.use_task(self.task, learner.precision.scaler)
        self.micro_batches = MicroBatches(learner, layout)
        params = list(self.model.parameters())
        self.check_gradients = grads.Check(params, optimizer, self.device, self.pipe)
        self.window = Window()
        self.stop_requested: str | None = None
        self._first_step_done = False
        self._pending_record: dict[str, Any] = {}
        self._replaced = 0  # bad samples replaced by all ranks, as of the last agreement
        if self.ema is not None and not self.ema.loaded:  # from the starting weights
            self.ema.reset()

    # -----------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train to the end, until a stop signal or until early stopping decides; returns
        'finished', 'preempted' or 'stopped_early'.

        The ranks meet only where `_agree()` is called (and inside evaluations and saves, which
        every rank runs together): at steps that are the same on every rank, never on one rank's
        clock. Everything else here runs without waiting for the device or the other ranks."""
        # What exists now (the modules imported, the model, the data) lives as long as the run.
        # Frozen, it is out of the cyclic collector's sight: a full collection no longer walks
        # its ~0.33 M objects (over 0.1 s on a CPU here, on some step of some rank, which the
        # others then wait for), and forked loader workers do not write to its pages.
        gc.collect()
        gc.freeze()
        try:
            return self._fit()
        finally:
            gc.unfreeze()

    def _fit(self) -> str:
        train, state = self.train, self.state
        max_steps = train.max_steps or math.inf
        while (
            not state.reached(train.epochs, train.max_steps)
            and not self.stop_requested
            and not self.early_stop.due  # (a resumed run that had stopped early ends at once)
        ):
            # The next step's replica groups (a heal moves the state): the epoch's rest is
            # then split over the groups present, from where the run is.
            self.replicas.regroup(state.step)
            if state.reached(train.epochs, train.max_steps):
                break
            if self._epoch(max_steps):
                self._end_epoch()
        self._agree()
        if self.stop_requested:
            log.info(
                f"stop requested ({self.stop_requested}) at step {state.step}: saving a "
                f"checkpoint and exiting"
            )
            for before_save in self.callbacks.before_stop_save:
                before_save(self.saving.last_save_s)
            self.saving.save_last(state)  # (a save's check may have saved this step already)
            return "preempted"
        # Early stopping ends a run only before its end: one whose last scheduled evaluation
        # comes at its end has finished (a longer resume of it stops at once).
        stopped_early = self.early_stop.due and state.epoch < train.epochs
        stopped_early = stopped_early and state.step < max_steps
        if state.last_eval.get("step") != state.step:
            self._evaluate(scheduled=False)
        self.saving.save_last(state)
        if stopped_early:
            log.info(self.early_stop.line())
            return "stopped_early"
        return "finished"

    def _epoch(self, max_steps: float) -> bool:
        """The rest of the epoch from where the run is, split over the replica groups present.
        True when the epoch is finished; False when it ends part-way: a stop, the run's length,
        early stopping, or the groups changed (split again, from the same place)."""
        train, state, loaders, layout = self.train, self.state, self.feed.loaders, self.layout
        progress = self.observers.run_log.progress
        split = self.replicas.split(loaders.train_sampler, layout.data_ranks, layout.data_rank)
        self.samples_per_step = self.layout.effective_batch * split
        loaders.train_sampler.set_epoch(state.epoch, state.samples_in_epoch)
        steps_this_epoch = len(loaders.train) // self.accum
        done_before = state.samples_in_epoch // self.samples_per_step
        last_done = done_before + steps_this_epoch
        progress.start_epoch(state.epoch, last_done)
        self.model.train()
        batches = iter(loaders.train)
        epoch_finished = True
        for done in range(done_before + 1, last_done + 1):
            if self.replicas.regroup(state.step):  # the groups changed: split again
                epoch_finished = False
                break
            self._sync_debug(state.step >= 2)
            last_in_epoch = done == last_done
            at_log_step = (state.step + 1) % train.log_every == 0
            check = (state.step + 1) % train.check_every_steps == 0 or last_in_epoch
            times = self._train_step(batches, at_log_step or check, last_in_epoch)
            if times is None:  # not committed by every group: trained again after a regroup
                epoch_finished = False
                break
            if not self._first_step_done:
                hooks = self.callbacks.first_step
                self._pending_record = {k: v for hook in hooks for k, v in hook().items()}
                self._first_step_done = True
            state.step += 1
            state.samples_in_epoch += self.samples_per_step
            self.window.add(times, self.samples_per_step)
            if at_log_step or check:
                self._agree()
            self._log_step(done, at_log_step)
            for hook in self.callbacks.step_end:
                hook()
            if train.eval_every_steps and state.step % train.eval_every_steps == 0:
                self._agree()
                self._evaluate()
            # A save due on an epoch's last step waits for the epoch's end, so that the
            # checkpoint says "next epoch" and holds that epoch's evaluation.
            due = self.saving.due_by_steps(state.step)
            if due and not last_in_epoch and not self.stop_requested:
                self._agree()
                self._save()
            if self.stop_requested or state.step >= max_steps or self.early_stop.due:
                epoch_finished = last_in_epoch
                break
        del batches  # stops the loader workers of an unfinished epoch
        progress.end_epoch()
        return epoch_finished

    def _end_epoch(self) -> None:
        """An epoch finished: the next one begins, after its evaluation and save if due."""
        train, state = self.train, self.state
        state.epoch += 1
        state.samples_in_epoch = 0
        if train.eval_every_epochs and state.epoch % train.eval_every_epochs == 0:
            self._evaluate()
        if self.saving.due_at_epoch_end(state) and not self.stop_requested:
            self._save()

    # -----------------------------------------------------------------------------------------
    def _train_step(
        self, batches: Iterator, wants_norm: bool = True, last_in_epoch: bool = False
    ) -> StepTimes | None:
        """One optimizer step. Between checks it never waits for the device: the loss, whether
        the step was non-finite, and the gradient norm stay on the device (`Pending`). The norm
        is computed where clipping needs it or `wants_norm` (a check follows, which reads it)."""
        model, where, accum = self.model, self.observers.where, self.accum
        precision, optimizer = self.learner.precision, self.learner.optimizer
        started = time.perf_counter()
        # Training mode is set at each epoch's start; an evaluation between steps leaves the
        # model in eval mode, which this restores (a walk over every module: not every step).
        if not model.training:
            model.train()
        self.learner.schedule.apply(self.state.step)
        data_wait = 0.0

        def fetch() -> Any:
            nonlocal data_wait
            where.phase = "data"
            waited = time.perf_counter()
            batch = next(batches)
            data_wait += time.perf_counter() - waited
            return self._to_device(batch)

        if self.pipe is not None:  # the step's micro-batches through the stages at once
            fetched = [fetch() for _ in range(accum)]
            where.phase = "pipeline"
            began = time.perf_counter()
            with precision.autocast(), parallel.loss_context(self.model):
                step_loss = self.pipe.train(fetched)
            # The stages wait for each other throughout: the whole schedule counts as exchange.
            exchange = time.perf_counter() - began
        else:
            step_loss, exchange = self.micro_batches.forward_backward(fetch, where)
        where.phase = "replica groups"
        if not self._taken_by_every_group(last_in_epoch):
            return None
        where.phase = "optimizer"
        # A step is non-finite when its gradients are (checked on every step, clipped or not;
        # a non-finite loss makes them so). DDP averaged the gradients and FSDP's norm is
        # reduced over the shards: every rank reaches the same verdict. Under fp16 the grad
        # scaler decides (an overflow lowers the scale) instead.
        skip, norm = self.check_gradients(wants_norm, self.train.clip_grad_norm, precision)
        # What the average skips: nothing under nan_policy=stop (a non-finite step ends the run
        # at the next check, before any evaluation or save), else the steps that changed nothing.
        ema_skip = None
        if self.ema is not None and self.train.nan_policy == "skip":
            ema_skip = (skip != 0).view(())
        if precision.scaled:
            overflowed = precision.step(optimizer)
            if self.ema is not None:
                ema_skip = overflowed
        elif self.masked_step:
            compat.masked_step(optimizer, skip)
        elif not bool(skip):  # an optimizer without a masked step: one wait per step
            optimizer.step()
        # Freed now, not at the next step: evaluations and saves run without them.
        optimizer.zero_grad(set_to_none=True)
        # After the gradients are freed: a masked update's temporaries take their place.
        if self.ema is not None:
            self.ema.update(self.state.step + 1, ema_skip)
        self.pending.add(step_loss, skip, norm)
        where.phase = "logging/callbacks"
        return StepTimes(data_wait, time.perf_counter() - started, exchange)

    def _taken_by_every_group(self, last_in_epoch: bool) -> bool:
        """The gradients averaged over the replica groups present, the step's samples logged;
        whether every group finished the exchange (if not, nothing of the step is kept)."""
        self.replicas.average(self.model)
        sampler = self.feed.loaders.train_sampler
        self.replicas.trained(self.state.step + 1, sampler, last_in_epoch)
        if self.replicas.commit():
            return True
        self.learner.optimizer.zero_grad(set_to_none=True)
        return False

    def _sync_debug(self, on: bool) -> None:
        """train.sync_debug on CUDA: torch warns at every synchronisation while a step runs
        (from the third step on; the checks turn it off while they read)."""
        if self.train.sync_debug and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if on else "default")

    def _agree(self) -> None:
        """The one place where the host waits for the device and the ranks agree (fit calls it
        at the same steps on every rank): reads the steps since the last agreement (their loss,
        which were non-finite), whether any rank got a stop signal, how many bad samples were
        replaced and each rank's pace, in one all-reduce; applies train.nan_policy to the
        non-finite steps and names a straggler."""
        self._sync_debug(False)
        replaced = self.feed.datasets.replaced()
        stop = signals.received() is not None
        agreed = self.pending.agree(stop, replaced or 0, self.window.pace())
        self.window.agreed(agreed, self.state.step)
        if agreed.skipped:  # there were steps since the last agreement: each rank's pace
            self.observers.stragglers.check(agreed.step_s, agreed.data_wait)
        if replaced is not None:
            self._replaced = agreed.replaced
        if agreed.stop and not self.stop_requested:
            self.stop_requested = signals.received() or "a stop signal on another rank"
        first_step = self.state.step - len(agreed.skipped) + 1
        for offset, was_skipped in enumerate(agreed.skipped):
            self._count_skip(first_step + offset, was_skipped)

    def _count_skip(self, step: int, skipped: bool) -> None:
        state, train = self.state, self.train
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
        return self.feed.to_device(batch, self.device)

    # -----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Validation metrics (`val_<name>`) of the weights the model holds, then callbacks'."""
        self.learner.consistent_buffers()
        loaders = self.feed.loaders
        # A pipeline's stages run one after another; only its last stage's ranks count metrics.
        model = parallel.runnable(self.model)
        metrics = evaluation.evaluate(
            cast(nn.Module, model),
            self.task,
            loaders.val,
            loaders.val_sampler.valid_count,
            self.device,
            self._to_device,
            self.learner.precision.autocast,
            counts=getattr(model, "counts", True),
        )
        for more in self.callbacks.evaluation_metrics:
            metrics.update(more())
        return metrics

    def _evaluate(self, scheduled: bool = True) -> None:
        """Evaluate and record; early stopping counts the `scheduled` evaluations, once per step
        (an epoch's end may evaluate again the step that eval_every_steps just evaluated)."""
        assert not self.pending.steps, "an evaluation follows an agreement of the ranks"
        with self.observers.where.doing("evaluation"):
            metrics = self.evaluate()
            if self.ema is not None and self.ema.evaluates:
                with self.ema.swapped():
                    metrics.update({k + SUFFIX: v for k, v in self.evaluate().items()})
        state = self.state
        again = state.last_eval.get("step") == state.step
        state.last_eval = {"step": state.step, **metrics}
        # The metric ckpt.monitor names, better in ckpt.monitor_mode (early stopping's too).
        value = metrics.get(self.early_stop.monitor)
        self.learner.schedule.on_eval(value)
        if scheduled and not again:
            self.early_stop.count(value)
        if value is not None and improves(value, state.best_metric, self.early_stop.mode):
            state.best_metric = value
        self.observers.run_log.evaluation({"step": state.step, "epoch": state.epoch, **metrics})
        for hook in self.callbacks.evaluated:
            hook(state, metrics)

    def _save(self) -> None:
        # The non-finite policy first: a checkpoint never follows a bad step unseen.
        assert not self.pending.steps, "a save follows an agreement of the ranks"
        self.saving.save(self.state)

    # -----------------------------------------------------------------------------------------
    def _log_step(self, done_in_epoch: int, at_log_step: bool) -> None:
        """A record every train.log_every steps (and a console line when log.every_s passes
        without one); between them only the progress bar's counter moves, with the figures of
        the last record. No collectives: what it shows comes from the last agreement."""
        state, window, observers = self.state, self.window, self.observers
        progress = observers.run_log.progress
        if not (at_log_step or progress.line_due()):
            progress.tick(done_in_epoch)
            return
        samples_per_s = window.samples_per_s()
        record: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
        if at_log_step:  # the record: the mean over its window's steps
            record["loss"] = window.mean_loss()
        elif window.last_loss is not None:  # a line between records: the last loss read
            record["loss"], record["loss_step"] = window.last_loss
        record.update(
            lr=self.learner.optimizer.param_groups[0]["lr"],
            samples_per_s=samples_per_s,
            **observers.throughput.figures(samples_per_s),
        )
        if window.grad_norm is not None:
            record["grad_norm"] = window.grad_norm
        if at_log_step:
            record.update(step_time_s=window.mean_step_time(), data_wait_pct=window.data_wait_pct())
            record.update(observers.stragglers.figures)  # each rank's step time, at the last check
            if state.skipped_steps:
                record["skipped_steps"] = state.skipped_steps
            record.update(self._pending_record)
            if self._replaced:
                record["bad_samples_replaced"] = self._replaced
            self._pending_record = {}
            if self.learner.precision.scaled:
                record["loss_scale"] = self.learner.precision.loss_scale()
        extra = {f"mem/{k}": v for k, v in memory_stats(self.device).items()} if at_log_step else {}
        observers.run_log.train(record, extra, done_in_epoch, at_log_step)
        if at_log_step:
            window.reset()

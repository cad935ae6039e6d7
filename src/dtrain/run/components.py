"""The trainer's components as a run builds them from its config: what learns (the optimizer
and its schedule), the checkpointer and the parts it saves, the callbacks between steps, and
the loop's other components (`dtrain.loop.components`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtrain import models, parallel
from dtrain.checkpoint import POSITION, Checkpointer, Contents, Resumed, Stateful
from dtrain.config import Config, to_dict
from dtrain.core.logs import log_fitted
from dtrain.files.store_protocol import CheckpointStore
from dtrain.loop import ema as ema_mod
from dtrain.loop import optim
from dtrain.loop.components import Callbacks, Feed, Learner, Observers
from dtrain.loop.early_stop import EarlyStop
from dtrain.loop.ema import EmaWeights
from dtrain.loop.saving import Saving
from dtrain.loop.state import TrainState
from dtrain.loop.trainer import Trainer
from dtrain.models.spec import ModelSpec
from dtrain.observe import RunLog, StartupClock, Throughput, log, peak_flops, profiling
from dtrain.observe.stragglers import Stragglers
from dtrain.parallel.replicas import Groups
from dtrain.process import compat, dist, slurm
from dtrain.process.layout import Layout
from dtrain.process.whereabouts import Whereabouts
from dtrain.run import records
from dtrain.run.eval_tasks import EvalTasks, task_scores
from dtrain.run.pieces import Pieces
from dtrain.run.weights import base_identity


def build_learner(cfg: Config, pieces: Pieces) -> Learner:
    """The model and task of `pieces` with their optimizer and learning-rate schedule."""
    optimizer = optim.build_optimizer(pieces.model, cfg.optim)
    schedule = optim.build_schedule(
        optimizer, cfg.sched, cfg.optim.lr, pieces.steps.total, cfg.ckpt.monitor_mode
    )
    return Learner(
        pieces.model,
        pieces.task,
        optimizer,
        schedule,
        pieces.precision,
        cfg.parallel.sync_batchnorm,
    )


def build_checkpointer(
    cfg: Config,
    layout: Layout,
    store: CheckpointStore,
    pieces: Pieces,
    learner: Learner,
    spec: ModelSpec,
    state: TrainState,
    ema: EmaWeights | None,
) -> Checkpointer:
    """The checkpointer of the run, and what its checkpoints hold: the loop's position (saved as
    "train_state"), the schedule and the grad scaler in the metadata, the averaged weights
    beside the model's."""
    parts: dict[str, Stateful] = {POSITION: state, "schedule": learner.schedule}
    parts.update(pieces.precision.checkpoint_parts())
    contents = Contents(
        model=learner.model,
        optimizer=learner.optimizer,
        spec=spec,
        parts=parts,
        sharded={ema_mod.KEY: ema} if ema is not None else {},
        config=to_dict(cfg),
        model_info={
            **models.model_info(cfg.model, pieces.datasets.info),
            **base_identity(cfg.model, cfg.run.seed, pieces.starting_weights),
        },
        seed=cfg.run.seed,
    )
    return Checkpointer(ckpt=cfg.ckpt, layout=layout, store=store, contents=contents)


def build_callbacks(
    layout: Layout,
    record: records.RunRecord,
    clock: StartupClock,
    resumed: Resumed | None,
    learner: Learner,
    ema: EmaWeights | None,
    profiler: profiling.Profiler,
    spec: ModelSpec,
    state: TrainState,
    eval_tasks: EvalTasks | None,
) -> Callbacks:
    """What runs between steps: the first step's line and figures (start-up time, state sizes,
    the world size), the profiler's schedule, fake quantization from train.qat's start step,
    the tasks of train.eval_tasks at each evaluation, the run record after each checkpoint, and
    under SLURM whether a stop's checkpoint fits the job's time left."""
    # Each attempt's first record says the world size it trains at (metrics.jsonl, TensorBoard),
    # and where it changed since the checkpoint, from what: an elastic run shows its changes.
    world: dict[str, Any] = {"world_size": layout.world_size}
    if resumed and resumed.world_size != layout.world_size:
        world["world_size_from"] = resumed.world_size
        record.world_size_changed(resumed.world_size, layout.world_size, resumed.step)

    def first_step() -> dict[str, Any]:
        clock.mark("first step")
        log_fitted(clock.line())
        return {**world, **_log_state_bytes(learner.model, learner.optimizer, ema)}

    callbacks = Callbacks(first_step=[first_step], step_end=[profiler.step], saved=[record.update])
    if spec.qat is not None:
        callbacks.step_end.append(_fake_quantization_from_its_step(spec, learner.model, state))
    if eval_tasks is not None:
        scores = task_scores(eval_tasks, learner, layout)
        callbacks.evaluation_metrics.append(scores)
    if layout.env.slurm_job_id and dist.is_main():
        job_id = layout.env.slurm_job_id
        callbacks.before_stop_save.append(
            lambda last_save_s: slurm.check_grace(job_id, last_save_s)
        )
    return callbacks


def _fake_quantization_from_its_step(
    spec: ModelSpec, model: nn.Module, state: TrainState
) -> Callable[[], None]:
    """Fake quantization as it is at the run's step, which the step alone decides (so a resumed
    run, at any world size, trains as an uninterrupted one): set now for the step an attempt
    starts at, then switched on after the step that reaches train.qat's start step, before
    that step's evaluation and save."""
    inner = parallel.unwrap(model)
    on = spec.switch_fake_quantization(inner, state.step)

    def after_step() -> None:
        nonlocal on
        if not on and spec.fake_quantizes_at(state.step):
            on = spec.switch_fake_quantization(inner, state.step)
            log.info(f"step {state.step}: fake quantization on from here (train.qat)")

    return after_step


def build_trainer(
    cfg: Config,
    layout: Layout,
    pieces: Pieces,
    learner: Learner,
    state: TrainState,
    ema: EmaWeights | None,
    checkpoints: Checkpointer,
    run_log: RunLog,
    callbacks: Callbacks,
    replicas: Groups,
) -> Trainer:
    """The loop with its components: the checkpoints on the schedule of `ckpt`, early stopping,
    and what watches it (records, throughput, stragglers, this rank's whereabouts)."""
    # What this rank is doing, for ranks left waiting on it; and which rank is slow.
    where = Whereabouts(state)
    dist.publish_whereabouts(where)
    peak = peak_flops(layout.device, cfg.train.precision)
    throughput = Throughput(
        getattr(pieces.task, "tokens_per_sample", None),
        pieces.num_params,
        peak * layout.world_size if peak else None,
    )
    return Trainer(
        train=cfg.train,
        layout=layout,
        state=state,
        learner=learner,
        feed=Feed(pieces.datasets, pieces.loaders, cfg.model.channels_last),
        saving=Saving(
            checkpoints, cfg.ckpt, learner, where, callbacks.saved, writes=replicas.group == 0
        ),
        early_stop=EarlyStop(cfg.train.early_stop, cfg.ckpt, state),
        ema=ema,
        observers=Observers(run_log, throughput, Stragglers(dist.host_of), where),
        callbacks=callbacks,
        replicas=replicas,
    )


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EmaWeights | None = None
) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (EMA weights count
    as such), and what the same state would take unsharded (DDP holds all of it on every rank)."""

    def local_and_full(t: torch.Tensor) -> tuple[int, int]:
        local = compat.local_part(t)
        return local.numel() * local.element_size(), t.numel() * t.element_size()

    totals = {"params": 0, "grads": 0, "optimizer": 0, "unsharded": 0}
    for p in model.parameters():
        local, full = local_and_full(p)
        totals["params"] += local
        totals["unsharded"] += full
        if p.requires_grad:  # its gradient, as large, exists from each backward to the step
            totals["grads"] += local
            totals["unsharded"] += full
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local, full = local_and_full(value)
                totals["optimizer"] += local
                totals["unsharded"] += full
    for average in ema.average if ema is not None else []:
        local, full = local_and_full(average)
        totals["optimizer"] += local
        totals["unsharded"] += full
    totals["total"] = totals["params"] + totals["grads"] + totals["optimizer"]
    return totals


def _log_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EmaWeights | None
) -> dict[str, int]:
    sizes = state_bytes(model, optimizer, ema)
    mib = {k: v / 2**20 for k, v in sizes.items()}
    log_fitted(
        f"state per rank: {mib['total']:.2f} MiB (params {mib['params']:.2f}, grads "
        f"{mib['grads']:.2f}, optimizer {mib['optimizer']:.2f}); unsharded, as under DDP: "
        f"{mib['unsharded']:.2f} MiB"
    )
    return {"state_bytes": sizes["total"], "state_bytes_unsharded": sizes["unsharded"]}

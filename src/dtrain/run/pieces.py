"""A run's pieces, built and checked before anything is written: data, task, the model in its
precision and parallel mode, and the starting weights; for `dtrain eval`, the validation split
alone."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dtrain import data, parallel, tasks
from dtrain.config import Config
from dtrain.core.errors import UserError, first_line
from dtrain.data.sampler import epoch_steps
from dtrain.loop.ema import monitored_metric
from dtrain.models.spec import ModelSpec, spec_of
from dtrain.observe import StartupClock
from dtrain.parallel.precision import Precision
from dtrain.process import dist, rng
from dtrain.process import layout as layout_mod
from dtrain.process.env import Env
from dtrain.process.layout import Layout, Steps
from dtrain.run.weights import StartingWeights


@dataclass
class Pieces:
    """What a run trains, built and checked before anything is written."""

    datasets: data.Datasets
    loaders: data.Loaders
    steps: Steps
    task: tasks.Task
    model: nn.Module  # wrapped for the parallel mode
    precision: Precision  # its dtype, autocast, FSDP policy and (fp16) grad scaler
    num_params: int
    notes: list[str]  # what the banner adds: image sizes and transforms, loader workers, ...
    starting_weights: StartingWeights | None  # model.init_from / pretrained, checked
    spec: ModelSpec  # what kind of model trains (adapters, fake quantization), made once


@dataclass
class EvalPieces:
    """What an evaluation of a run's checkpoint reads: its validation split, task and model."""

    datasets: data.Datasets  # the validation split (and a training split only where built)
    val_loader: Any
    val_sampler: data.EvalSampler
    task: tasks.Task
    model: nn.Module  # wrapped for the parallel mode
    precision: Precision
    notes: list[str]
    spec: ModelSpec  # what kind of model trained (fake quantization from a step on)

    def as_trained_at(self, step: int | None) -> None:
        """The model as training evaluated it after `step` (with fake quantization on once a
        quantization-aware run had switched it on)."""
        if step is not None:
            self.spec.switch_fake_quantization(parallel.unwrap(self.model), step)


def layout_of(cfg: Config, env: Env, device: torch.device | None = None) -> Layout:
    """Where this process stands in the job (world, device, groups, batch), as the parallel
    strategy lays out the ranks; the same for a run, `dtrain eval` and `dtrain plan`."""
    return layout_mod.resolve(
        env,
        parallel.mesh(cfg.parallel, env),
        backend=cfg.dist.backend,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.train.grad_accum,
        checkpoint_format=cfg.ckpt.format,
        device=device,
    )


def build_pieces(cfg: Config, layout: Layout, clock: StartupClock) -> Pieces:
    """Data, task and model, wrapped for the parallel mode, and the task tried once on a
    validation batch: a task or model that cannot work ends here, with nothing written."""
    spec = spec_of(cfg.model, cfg.train.qat)
    set_torch_flags(cfg)
    rng.reseed(cfg.run.seed)
    overfit = cfg.train.overfit_batches
    data_cfg = cfg.data
    if overfit:  # overfitting a fixed set of batches: the same samples every time
        data_cfg = dataclasses.replace(data_cfg, augment=False)
    datasets = data.build(data_cfg, cfg.run.seed, cfg.model.args)
    workers, why = data.workers_for(data_cfg, layout.ranks_per_node)
    notes = [*datasets.notes, f"data.num_workers {workers} ({why})"]
    loaders = data.loaders(
        datasets.train,
        datasets.val,
        cfg=data_cfg,
        seed=cfg.run.seed,
        rank=layout.data_rank,
        world_size=layout.data_ranks,
        device=layout.device,
        overfit_batches=overfit,
        workers=workers,
    )
    if overfit:
        notes.append(
            f"overfit check: the same {overfit} batch(es) per rank every epoch, "
            f"augmentation off; the training loss should fall towards 0"
        )
    steps = epoch_steps(layout, cfg.train, cfg.data, len(datasets.train))
    clock.mark("data")
    task, wrapped, precision, num_params = _model_and_task(
        cfg, layout, spec, datasets, loaders.val, notes, clock
    )
    starting = (
        StartingWeights(wrapped, cfg.model, cfg.run.storage_options)
        if cfg.model.init_from or cfg.model.pretrained
        else None
    )
    clock.mark("task check")
    return Pieces(
        datasets, loaders, steps, task, wrapped, precision, num_params, notes, starting, spec
    )


def build_eval_pieces(cfg: Config, layout: Layout, clock: StartupClock) -> EvalPieces:
    """What `dtrain eval` needs of a run: the validation split alone (a dataset of that split
    only can be evaluated), the task and the model, built and checked as training builds them."""
    set_torch_flags(cfg)
    rng.reseed(cfg.run.seed)
    datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args, val_only=True)
    workers, why = data.workers_for(cfg.data, layout.ranks_per_node)
    notes = [*datasets.notes, f"data.num_workers {workers} ({why})"]
    val_loader, val_sampler = data.validation_loader(
        datasets.val,
        cfg=cfg.data,
        rank=layout.data_rank,
        world_size=layout.data_ranks,
        device=layout.device,
        workers=workers,
    )
    clock.mark("data")
    spec = spec_of(cfg.model, cfg.train.qat)  # a quantization-aware run: evaluated as trained
    task, model, precision, _ = _model_and_task(
        cfg, layout, spec, datasets, val_loader, notes, clock
    )
    return EvalPieces(datasets, val_loader, val_sampler, task, model, precision, notes, spec)


def _model_and_task(
    cfg: Config,
    layout: Layout,
    spec: ModelSpec,
    datasets: data.Datasets,
    val_loader: Any,
    notes: list[str],
    clock: StartupClock,
) -> tuple[tasks.Task, nn.Module, Precision, int]:
    """The task, the model wrapped in the run's precision and parallel mode and prepared as
    `spec` says (its number of parameters; how it was built joins `notes`), checked once on a
    validation batch."""
    task = tasks.build(cfg.task, datasets.info)
    precision = Precision.for_run(cfg.train.precision, cfg.train.loss_scale_init, layout)
    strategy = parallel.strategy(cfg.parallel, layout)
    # Fake quantization swaps layers before DDP or FSDP wraps them: the wrappers hold the
    # parameters of the layers that compute.
    wrapped, num_params, model_notes = strategy.build(
        cfg.model, datasets.info, cfg.run.seed, precision, prepare=spec.fake_quantize
    )
    notes += model_notes
    described = spec.describe(wrapped)
    if described:
        notes.append(described)
    clock.mark("model and wrap")
    runnable = cast(nn.Module, parallel.runnable(wrapped))
    _check_task(cfg, layout, task, runnable, precision, val_loader, datasets.on_device)
    strategy.settle(wrapped)
    return task, wrapped, precision, num_params


def _check_task(
    cfg: Config,
    layout: Layout,
    task: tasks.Task,
    model: nn.Module,
    precision: Precision,
    val_loader: Any,
    on_device: Any,
) -> None:
    """The task once on the first validation batch, on every rank; the first problem any rank
    finds ends every rank with the same line (exit 2)."""
    batch = data.to_device(
        next(iter(val_loader)), layout.device, on_device, cfg.model.channels_last
    )
    try:
        with precision.autocast():
            problem = tasks.check(task, model, batch, monitored_metric(cfg.ckpt, cfg.train.ema))
    except UserError as e:
        problem = str(e)
    except (RuntimeError, ValueError) as e:  # e.g. a layer of width 0: torch refuses the batch
        problem = (
            f"model error: {cfg.model.name} fails on the first validation batch "
            f"({first_line(e)}); check model.args ({cfg.model.args}) against the data"
        )
    problems = [p for p in dist.gather_objects(problem) if p]
    if problems:
        raise UserError(problems[0])


def set_torch_flags(cfg: Config) -> None:
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(cfg.train.detect_anomaly)

"""The rules of a config that involve more than one key, checked once every section has been
built and its own keys checked: the names the extension points know, places in object stores,
and the optimizer's, model's, run's and training's combinations of keys."""

from __future__ import annotations

import difflib

from dtrain.config import registry
from dtrain.config.data import MIX_METRICS, check_mix, mix_names
from dtrain.config.model import ModelConfig
from dtrain.config.parallel import ParallelConfig
from dtrain.config.schema import (
    QAT_SCHEMES,
    QUANTIZATION_SCHEMES,
    Config,
    OptimConfig,
    QatConfig,
    RunConfig,
)
from dtrain.core import urls
from dtrain.core.errors import UserError

# torch's generators take seeds up to 2**64 - 1, and the run adds the rank (and 1) to its seed.
MAX_SEED = 2**63 - 1
# The datasets that read data.root in an object store (the others read a disk).
STORE_DATA = ("tokens", "hf")
# What the metrics of train.eval_tasks begin with (`task_<name>_<metric>`).
TASK_METRIC = "task_"


def cross_checks(cfg: Config) -> None:
    """Rules that involve more than one key."""
    registry.check_names(cfg)
    _check_locations(cfg)
    _check_optimizer(cfg.optim)
    _check_run(cfg.run)
    _check_model(cfg.model)
    _check_qat(cfg.train.qat)
    _check_replicas(cfg.parallel)
    _check_tensor_parallel(cfg)
    _check_pipeline(cfg)
    wrap = cfg.parallel.fsdp.wrap
    if isinstance(wrap, str) and wrap != "auto":
        raise UserError(
            f"config error: parallel.fsdp.wrap: expected 'auto' or a list of class "
            f"names, got {wrap!r}"
        )
    if cfg.ckpt.resume not in ("auto", "none") and not cfg.ckpt.resume.strip():
        raise UserError("config error: ckpt.resume: expected auto, none or a checkpoint path")
    train = cfg.train
    if train.early_stop.patience is not None and not (
        train.eval_every_epochs or train.eval_every_steps
    ):
        raise UserError(
            "config error: train.early_stop.patience is set but nothing is evaluated during the "
            "run; set train.eval_every_epochs or train.eval_every_steps, or drop train.early_stop"
        )
    _check_monitor(cfg)


def _check_locations(cfg: Config) -> None:
    """What names a place, local or in an object store, and what the store may be told."""
    urls.check_location(cfg.run.out_dir, "run.out_dir")
    if cfg.ckpt.resume not in ("auto", "none"):
        urls.check_location(cfg.ckpt.resume, "ckpt.resume")
    if cfg.model.init_from:
        urls.check_location(cfg.model.init_from, "model.init_from")
    urls.check_options(cfg.run.storage_options)
    if cfg.log.mlflow.tracking_uri:
        urls.check_no_userinfo(
            cfg.log.mlflow.tracking_uri, "log.mlflow.tracking_uri", urls.MLFLOW_CREDENTIALS
        )
    if urls.is_url(cfg.data.root) and cfg.data.name not in STORE_DATA:
        urls.check_location(cfg.data.root, "data.root")
        raise UserError(
            f"config error: data.root: {cfg.data.root}: of an object store, dtrain reads token "
            f"files (data.name: tokens) and datasets saved by save_to_disk (data.name: hf); "
            f"data.name {cfg.data.name} reads a disk: copy it to a node-local folder first "
            f"(aws s3 sync {cfg.data.root} DIR) and set data.root=DIR"
        )
    if cfg.data.name in STORE_DATA:
        urls.check_location(cfg.data.root, "data.root")
    check_mix(cfg.data)


def _check_optimizer(optim: OptimConfig) -> None:
    betas = optim.betas
    if len(betas) != 2 or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas
    ):
        raise UserError(f"config error: optim.betas: expected two numbers, got {betas!r}")
    if not all(0 <= b < 1 for b in betas):
        raise UserError(f"config error: optim.betas: each must be in [0, 1), got {betas!r}")
    if optim.nesterov and optim.momentum == 0:
        raise UserError(
            "config error: optim.nesterov: Nesterov momentum needs optim.momentum > 0; set "
            "one or drop optim.nesterov"
        )
    no_decay = optim.no_decay
    if (isinstance(no_decay, str) and no_decay != "auto") or (
        isinstance(no_decay, list) and not all(isinstance(g, str) for g in no_decay)
    ):
        raise UserError(
            f"config error: optim.no_decay: expected auto or a list of name globs, got {no_decay!r}"
        )


def _check_run(run: RunConfig) -> None:
    if run.seed > MAX_SEED:
        raise UserError(f"config error: run.seed: at most {MAX_SEED} (2**63 - 1), got {run.seed}")
    name = run.name
    if name is not None and (
        not name
        or name in (".", "..")
        or "/" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise UserError(f"config error: run.name: {name!r} is not a plain directory name")


def _check_model(model: ModelConfig) -> None:
    """Starting weights: named once, and pretrained ones only where a library has them."""
    if model.pretrained and not model.name.startswith(("tv:", "timm:")):
        raise UserError(
            f"config error: model.pretrained: only torchvision and timm models (tv:NAME, "
            f"timm:NAME) have pretrained weights here; use model.init_from=PATH for "
            f"{model.name}"
        )
    if model.pretrained and model.init_from:
        raise UserError(
            "config error: model.pretrained and model.init_from both name starting "
            "weights; keep one"
        )


def _check_qat(qat: QatConfig) -> None:
    """A scheme that exists and that quantization-aware training has fake quantization for."""
    if qat.scheme is None:
        if qat.start_step:
            raise UserError(
                "config error: train.qat.start_step is set but train.qat.scheme is not; name "
                f"the scheme ({', '.join(QAT_SCHEMES)}) or drop train.qat"
            )
        return
    if qat.scheme not in QUANTIZATION_SCHEMES:
        close = difflib.get_close_matches(qat.scheme, QUANTIZATION_SCHEMES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(
            f"config error: train.qat.scheme: unknown scheme '{qat.scheme}'{hint}; "
            f"quantization-aware training trains for {', '.join(QAT_SCHEMES)}"
        )
    if qat.scheme not in QAT_SCHEMES:
        raise UserError(
            f"config error: train.qat.scheme: {qat.scheme} has no fake quantization to train "
            f"with; quantization-aware training trains for {', '.join(QAT_SCHEMES)} (quantize "
            f"a trained run with {qat.scheme} by dtrain export instead)"
        )


def _check_replicas(parallel: ParallelConfig) -> None:
    replicas = parallel.replicas
    if not replicas.groups:
        return
    if replicas.groups == 1:
        raise UserError(
            "config error: parallel.replicas.groups=1: one group is a plain run; set 0 (off) "
            "or the 2 or more groups the job is launched as"
        )
    if replicas.min_groups > replicas.groups:
        raise UserError(
            f"config error: parallel.replicas.min_groups={replicas.min_groups} is more than "
            f"the {replicas.groups} groups of parallel.replicas.groups"
        )


def _check_tensor_parallel(cfg: Config) -> None:
    """What tensor parallelism does not compose with yet: one line each, before any launch."""
    tp = cfg.parallel.tp
    if tp.size == 1:
        for option, what in (("sequence_parallel", "activations"), ("loss_parallel", "logits")):
            if getattr(tp, option):
                raise UserError(
                    f"config error: parallel.tp.{option} splits {what} over the tp group, and "
                    f"parallel.tp.size is 1; set parallel.tp.size > 1 or drop it"
                )
        return
    if tp.loss_parallel and cfg.task.name != "language_model":
        raise UserError(
            f"config error: parallel.tp.loss_parallel: the split logits go to the built-in "
            f"language_model task's cross-entropy, not to task {cfg.task.name}; drop the option"
        )
    refused = {
        "model.lora": cfg.model.lora.r is not None,
        "train.qat": cfg.train.qat.scheme is not None,
        "parallel.replicas": cfg.parallel.replicas.groups > 0,
        "model.compile": cfg.model.compile,
        "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
    }
    for key, on in refused.items():
        if on:
            raise UserError(
                f"config error: parallel.tp.size={cfg.parallel.tp.size} with {key}: the two do "
                f"not compose in dtrain; drop {key} or set parallel.tp.size=1"
            )


def _check_pipeline(cfg: Config) -> None:
    """What pipeline parallelism needs of the rest of the config, and what it does not compose
    with yet: one line each, before any launch."""
    pp = cfg.parallel.pp
    if pp.size == 1:
        return
    refused = {
        "model.lora": cfg.model.lora.r is not None,
        "train.qat": cfg.train.qat.scheme is not None,
        "parallel.replicas": cfg.parallel.replicas.groups > 0,
        "model.compile": cfg.model.compile,
        "parallel.sync_batchnorm": cfg.parallel.sync_batchnorm,
    }
    for key, on in refused.items():
        if on:
            raise UserError(
                f"config error: parallel.pp.size={pp.size} with {key}: the two do not compose "
                f"in dtrain; drop {key} or set parallel.pp.size=1"
            )
    if pp.schedule != "gpipe" and pp.microbatches < pp.size:
        raise UserError(
            f"config error: parallel.pp.microbatches: {pp.schedule} needs at least one "
            f"micro-batch per stage rank ({pp.size}), got {pp.microbatches}; raise it or use "
            f"schedule gpipe"
        )
    if pp.schedule in ("gpipe", "1f1b") and pp.stages_per_rank > 1:
        raise UserError(
            "config error: parallel.pp.stages_per_rank: gpipe and 1f1b hold one stage per rank; "
            "use schedule interleaved_1f1b or zero_bubble for more"
        )
    if cfg.data.batch_size % pp.microbatches:
        raise UserError(
            f"config error: parallel.pp.microbatches: {pp.microbatches} does not divide "
            f"data.batch_size {cfg.data.batch_size}; choose a batch size it divides"
        )


def _check_monitor(cfg: Config) -> None:
    """ckpt.monitor is a metric the task reports: a built-in task's, a mix's per source, and
    with train.ema.eval the averaged weights' too (a user's task is taken at its word). A task
    metric (`task_...`) needs train.eval_tasks; which tasks the files hold is read at start-up."""
    if cfg.ckpt.monitor.startswith(TASK_METRIC):
        if not cfg.train.eval_tasks:
            raise UserError(
                f"config error: ckpt.monitor: '{cfg.ckpt.monitor}' is a task's metric but "
                f"train.eval_tasks names no task; add the task's file to train.eval_tasks"
            )
        return
    reported = registry.builtin_metrics(cfg.task.name)
    if reported is None:
        return
    if cfg.task.name == "language_model":  # a mix's, per source
        reported = (*reported, *(f"val_{m}_{n}" for n in mix_names(cfg.data) for m in MIX_METRICS))
    if cfg.train.ema.decay is not None and cfg.train.ema.eval:
        reported = (*reported, *(f"{m}_ema" for m in reported))  # the averaged weights' too
    if cfg.ckpt.monitor not in reported:
        close = difflib.get_close_matches(cfg.ckpt.monitor, reported, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(
            f"config error: ckpt.monitor: '{cfg.ckpt.monitor}' is not a metric the "
            f"{cfg.task.name} task reports; use one of {', '.join(reported)}{hint}"
        )

"""`dtrain eval --tasks FILE_OR_DIR[,...]`: a checkpoint scored on language-model tasks in
lm-eval's format (`loop.lm_tasks`), instead of the validation split.

The model is built from the checkpoint's own record of the data's vocabulary and window (no data
is read), as `dtrain generate` builds it, by the run's strategy at this world size (every rank
takes part); the tokenizer is the run's. Rank 0 prints the metrics and writes them, as
`task_<name>_<metric>`, to `DIR/evals/<checkpoint>-<time>.json` like any evaluation.
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.loop import lm_tasks
from dtrain.models.tokenizer import run_tokenizer
from dtrain.observe import log
from dtrain.process import dist
from dtrain.process.layout import Layout
from dtrain.run.trained import Chosen, trained_model

WHERE = "eval error: --tasks"


def task_files(option: str) -> lm_tasks.TaskSet:
    """The task files --tasks names (comma-separated), checked before any model is built."""
    paths = [p.strip() for p in option.split(",") if p.strip()]
    if not paths:
        raise UserError("usage error: --tasks names no task file; give FILE_OR_DIR[,...]")
    return lm_tasks.read_tasks(paths, WHERE)


def scored(
    cfg: Config, layout: Layout, chosen: Chosen, tasks: lm_tasks.TaskSet, weights: str
) -> dict[str, float]:
    """The checkpoint's model (its EMA weights with `weights` ema) on every task, on every rank."""
    tokenizer = run_tokenizer(cfg.data, cfg.model, "eval")
    model, precision = trained_model(cfg, layout, chosen, "eval", weights)
    log.info(
        f"scoring {chosen.shown} (step {chosen.step}, {chosen.fmt}; {weights} weights) on "
        f"{len(tasks.names)} task(s) ({', '.join(tasks.names)}) with {tokenizer.where}, at "
        f"world size {dist.world_size()}"
    )
    return lm_tasks.evaluate_tasks(
        tasks, model, tokenizer, layout.device, cfg.data.batch_size, precision.autocast
    )


def result_of(
    args: argparse.Namespace, chosen: Chosen, metrics: dict[str, float], overrides: list[str]
) -> dict[str, Any]:
    """What the result file keeps."""
    return {
        **metrics,
        "checkpoint": chosen.url or os.path.abspath(chosen.folder),
        "step": chosen.step,
        "weights": args.weights,
        "tasks": [os.path.abspath(p.strip()) for p in args.tasks.split(",") if p.strip()],
        "world_size": dist.world_size(),
        "config": args.config,
        "overrides": overrides,
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }

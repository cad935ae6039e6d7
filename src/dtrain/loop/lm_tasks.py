"""Language-model tasks in lm-eval's own format, scored by a trained model: `dtrain eval --tasks`
and `train.eval_tasks`.

A task is a YAML file of lm-eval's task format (or a folder of them) whose dataset is a local
file: `dataset_path: json` (or csv, parquet, text, arrow) with `dataset_kwargs.data_files`, a
relative path read from the YAML's folder. Nothing is downloaded: a task whose dataset is named
on the Hugging Face hub is refused before anything runs. Multiple choice is scored by
log-likelihood, generation by the task's own metric (exact match, say), through `DtrainLM`
(lm_adapter.py) on every rank; the harness's numbers come back as `task_<name>_<metric>` (a
metric of a filter other than the task's plain answers: `task_<name>_<metric>_<filter>`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from dtrain import parallel
from dtrain.config.checks import TASK_METRIC
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.models.tokenizer import RunTokenizer
from dtrain.process import dist

PREFIX = TASK_METRIC
# The dataset builders that read local files (the `datasets` library's packaged ones).
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class TaskSet:
    """The tasks read from the files named: each one's config as the harness takes it (its data
    files made absolute), and its name."""

    configs: tuple[dict[str, Any], ...]

    @property
    def names(self) -> list[str]:
        return [str(c["task"]) for c in self.configs]

    def owns(self, metric: str) -> bool:
        """Whether `metric` (a `task_...` name) can come from one of these tasks."""
        return any(metric.startswith(f"{PREFIX}{clean(name)}_") for name in self.names)


def harness(feature: str) -> Any:
    """lm-eval, or the one line that names the extra bringing it."""
    return require("lm_eval", "tasks", feature)


def read_tasks(paths: Sequence[str], where: str) -> TaskSet:
    """The task files `paths` name (a file, or a folder's YAML files), each checked: a task
    config of lm-eval's format whose data is a local file. `where`: how the lines name the
    setting ("eval error: --tasks", "config error: train.eval_tasks")."""
    harness(f"{where.split(': ', 1)[-1]} (lm-eval tasks)")
    from lm_eval.tasks._yaml_loader import load_yaml

    configs: list[dict[str, Any]] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(f for f in os.listdir(path) if f.endswith(YAML_SUFFIXES))
            if not found:
                raise UserError(f"{where} {path}: the folder holds no task file (*.yaml)")
            files = [os.path.join(path, f) for f in found]
        elif os.path.isfile(path):
            files = [path]
        else:
            raise UserError(f"{where} {path}: no such file or folder")
        for file in files:
            try:
                config = load_yaml(file)
            except Exception as e:  # noqa: BLE001 - YAML, an include or a !function that fails
                raise UserError(f"{where} {file} is not a task file ({first_line(e)})") from None
            configs.append(_checked(config, file, where))
    names = [str(c["task"]) for c in configs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{where}: the task {twice[0]} is named twice; give each task once")
    return TaskSet(tuple(configs))


def _checked(config: dict[str, Any], file: str, where: str) -> dict[str, Any]:
    if not isinstance(config.get("task"), str) or "output_type" not in config:
        raise UserError(
            f"{where} {file} is not a task file: lm-eval's task config names its `task` and "
            f"`output_type` (multiple_choice, generate_until, loglikelihood, ...)"
        )
    builder = config.get("dataset_path")
    if builder not in LOCAL_BUILDERS:
        raise UserError(
            f"{where} {file}: task {config['task']}: dataset_path {builder} is not a local "
            f"file's reader; nothing is downloaded: use dataset_path: json (or "
            f"{', '.join(LOCAL_BUILDERS[1:])}) with dataset_kwargs.data_files"
        )
    folder = os.path.dirname(os.path.abspath(file))
    options = dict(config.get("dataset_kwargs") or {})
    if "data_files" not in options:
        raise UserError(
            f"{where} {file}: task {config['task']} names no dataset_kwargs.data_files (the "
            f"local file its questions are in)"
        )
    options["data_files"] = _local(options["data_files"], folder, file, where)
    return {**config, "dataset_kwargs": options}


def _local(files: Any, folder: str, file: str, where: str) -> Any:
    """`data_files` (a path, a list or a split's mapping) with each path made absolute from the
    task file's folder, each one there."""
    if isinstance(files, dict):
        return {split: _local(v, folder, file, where) for split, v in files.items()}
    if isinstance(files, list):
        return [_local(v, folder, file, where) for v in files]
    path = os.path.join(folder, os.path.expanduser(str(files)))
    if not os.path.isfile(path):
        raise UserError(f"{where} {file}: its data file {path} does not exist")
    return path


def clean(name: str) -> str:
    """A name as a metric's part: letters, digits, `_`, `-` and `.`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """The harness's results as dtrain's metrics (standard errors and counts left out)."""
    out: dict[str, float] = {}
    for task, row in results.get("results", {}).items():
        for key, value in row.items():
            metric, comma, kind = key.partition(",")  # (a metric is "name,filter")
            if not comma or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            name = f"{PREFIX}{clean(task)}_{clean(metric)}"
            out[name if kind in ("", "none") else f"{name}_{clean(kind)}"] = float(value)
    return out


def evaluate_tasks(
    tasks: TaskSet,
    model: nn.Module,
    tokenizer: RunTokenizer,
    device: torch.device,
    batch_size: int,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    spread: parallel.Spread | None = None,
) -> dict[str, float]:
    """Every task scored by `model` (in eval mode for the call) on every rank together, `spread`
    over them as the layout's mesh runs batches (None: each rank its own); the metrics, the same
    on every rank. The process's random state is left as it was (the
    harness's seeding is not asked for: nothing here draws)."""
    lm_eval = harness("task evaluation")
    from lm_eval.tasks import TaskManager

    from dtrain.loop.decode import is_built_in, window_of
    from dtrain.loop.lm_adapter import DtrainLM

    was_training = model.training
    model.eval()
    adapter = DtrainLM(
        cast(nn.Module, parallel.runnable(model)),  # (a pipeline's stages one after another)
        tokenizer,
        window_of(model),
        device,
        is_built_in(model),
        batch_size,
        autocast,
        spread,
    )
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # (its own progress lines, per task and per request kind)
    try:
        # The harness's `evaluate` on the tasks as its `simple_evaluate` prepares them: not that
        # function itself, which ends by recording the machine (`git describe` in the working
        # folder, which prints git's "fatal: not a git repository" outside one, and torch's
        # environment report, subprocesses each time), none of which a score needs.
        loaded = TaskManager(include_defaults=False).load([dict(c) for c in tasks.configs])
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=None)
        results = lm_eval.evaluate(
            lm=adapter,
            task_dict=loaded,
            bootstrap_iters=0,
            log_samples=False,
            fewshot_as_multiturn=True,
        )
    finally:
        quiet.setLevel(level)
        model.train(was_training)
    return dist.broadcast_object(metrics_of(results) if dist.is_main() else None)

"""`train.eval_tasks`: the language-model tasks a run scores at each of its evaluations, after
the validation metrics, as `task_<name>_<metric>` (`loop.lm_tasks`). The task files and the
run's tokenizer are read and checked at start-up, before any process group: a file that is not
a task, a `ckpt.monitor` that none of the tasks reports, a run without a tokenizer is one line."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtrain import parallel
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.loop import lm_tasks
from dtrain.loop.components import Learner
from dtrain.models.tokenizer import RunTokenizer, run_tokenizer
from dtrain.process.layout import Layout

WHERE = "config error: train.eval_tasks"
COMMAND = "train"  # how the tokenizer's lines begin ("train error: ..."), reworded to WHERE


@dataclass(frozen=True)
class EvalTasks:
    """The tasks of train.eval_tasks and the tokenizer they are scored with."""

    tasks: lm_tasks.TaskSet
    tokenizer: RunTokenizer

    def line(self) -> str:
        return (
            f"tasks scored at each evaluation: {', '.join(self.tasks.names)} (train.eval_tasks), "
            f"with {self.tokenizer.where}"
        )


def read_eval_tasks(cfg: Config) -> EvalTasks | None:
    """The tasks train.eval_tasks names, checked, and the run's tokenizer; None without any."""
    if not cfg.train.eval_tasks:
        return None
    tasks = lm_tasks.read_tasks(cfg.train.eval_tasks, WHERE)
    monitor = cfg.ckpt.monitor
    if monitor.startswith(lm_tasks.PREFIX) and not tasks.owns(monitor):
        raise UserError(
            f"config error: ckpt.monitor: '{monitor}' is no metric of the tasks of "
            f"train.eval_tasks ({', '.join(tasks.names)}); theirs are task_<name>_<metric>"
        )
    try:
        tokenizer = run_tokenizer(cfg.data, cfg.model, COMMAND)
    except UserError as e:
        said = str(e)
        if not said.startswith(f"{COMMAND} error: "):
            raise
        raise UserError(f"{WHERE}: {said.split(': ', 1)[1]}") from None
    return EvalTasks(tasks, tokenizer)


def task_scores(
    found: EvalTasks, learner: Learner, layout: Layout
) -> Callable[[], dict[str, float]]:
    """The hook that scores the tasks with the model as it is, on every rank together (the
    trained weights, in the run's precision, a batch of texts per forward as `dtrain eval
    --tasks` scores them, each tp group or pipeline running its batches between its ranks)."""

    def scores() -> dict[str, float]:
        return lm_tasks.evaluate_tasks(
            found.tasks,
            learner.model,
            found.tokenizer,
            layout.device,
            layout.batch_size,
            learner.precision.autocast,
            parallel.spread(layout, learner.model),
        )

    return scores

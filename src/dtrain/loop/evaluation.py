"""The evaluation: a task's metrics over a whole validation set, each sample counted once over
all ranks. Training's scheduled evaluations and `dtrain eval` both call `evaluate`, so that a
checkpoint's metrics from `dtrain eval` equal the run's own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dtrain.process import dist
from dtrain.tasks import Task, batch_size


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    batches: Iterable[Any],
    valid_count: int,
    device: torch.device,
    to_device: Callable[[Any], Any],
    autocast: Callable[[], contextlib.AbstractContextManager],
    counts: bool = True,
) -> dict[str, float]:
    """The task's metrics over `batches` (this rank's share of the validation set, padded by
    its sampler to an equal count on every rank) as `val_<name>`: the first `valid_count`
    samples count, the padding beyond does not; none of them where not `counts` (a pipeline's
    ranks before its last stage, whose model gives no logits of its own). Identical on every
    rank (one all-reduce of all the sums). Leaves the model in eval mode."""
    model.eval()
    names: list[str] = []
    sums: torch.Tensor | None = None  # one per metric, then the count of samples
    position = 0  # this rank's sample number; the padding beyond valid_count is ignored
    for batch in batches:
        batch = to_device(batch)
        with autocast():
            values = task.metrics(model, batch)
        if sums is None:  # the task's own order (every rank runs the same task)
            names = list(values)
            sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)
        size = batch_size(batch)
        valid = torch.arange(position, position + size, device=device) < valid_count
        if not counts:
            valid = torch.zeros_like(valid)
        position += size
        for i, name in enumerate(names):
            sums[i] += torch.where(valid, values[name].double(), 0.0).sum()
        sums[-1] += valid.double().sum()
    assert sums is not None  # the loaders refuse an empty validation set
    dist.all_reduce_sum(sums)
    *totals, count = sums.tolist()
    means = {name: total / count for name, total in zip(names, totals, strict=False)}
    summarize = getattr(task, "summarize", None)
    if summarize is not None:
        means.update(summarize(dict(means)))
    return {f"val_{name}": value for name, value in means.items()}

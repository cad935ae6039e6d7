"""What is learned: a task turns a batch into a loss, and into per-sample metrics for evaluation.

The loop knows nothing about images or tokens: it calls `task.loss(model, batch)` for each
micro-batch, and `task.metrics(model, batch)` over the validation set. A task is any object with
these two methods; `task.name` picks a built-in one or imports the user's (`module:function`,
called with the task config, `task.args` inside). A full example of a user's task:

    class Regression:
        def loss(self, model, batch):                       # a scalar
            return torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])

        def metrics(self, model, batch):                    # each of shape (batch,)
            error = model(batch["x"]).squeeze(-1) - batch["y"]
            return {"loss": error.square(), "abs_error": error.abs()}

    def regression(cfg):                                    # task.name: mypkg.tasks:regression
        return Regression()

dtrain reports `val_<name>` for each metric: its mean over the whole validation set, every sample
counted once over all ranks. Optional members, used where present:
- `example_input(info, batch_size)`: a model input like the data's (for `dtrain export` and
  `dtrain plan`); `info` is what the datasets declare (e.g. `in_channels`, `image_size`).
- `summarize(means)`: more validation figures derived from the means (`perplexity`, ...).
- `tokens_per_sample`: tokens in a sample, for tokens/s and FLOP/s in the records.
- `model_input(batch)`: what the model is called with for a batch (for `dtrain export --format
  onnx`'s check on real data; built-in tasks need none).
- `counted(batch)` with `loss(model, batch, over)`: a task whose loss is a mean over some of a
  batch's targets (a loss mask) says how many a batch counts (a tensor; None where all do);
  the loop then adds the counts of a step's micro-batches over every rank and each micro-batch's
  loss is its sum divided by `over`, so that the step's gradient is the mean over every counted
  target, not a mean of micro-batch means (which would weigh a micro-batch that counts few
  targets as much as one that counts many).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.config import TaskConfig, registry
from dtrain.config.checks import TASK_METRIC
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import load_callable
from dtrain.files.names import MASK_COUNTED, MASK_STARTS
from dtrain.process import compat


class Task(Protocol):
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]: ...


# How far a document's logits may move with its neighbour in check_documents: rounding, also in
# bfloat16; a model that attends across documents moves them by far more.
_DOCUMENT_TOLERANCE = 1e-2

# ---------------------------------------------------------------------------------------------
# What a model returns


def logits_of(output: Any) -> torch.Tensor:
    """The predictions in a model's output: the output itself, the first element of a tuple or
    list, `output["logits"]`, or `output.logits`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    raise UserError(
        f"task error: cannot find the predictions in the model's output "
        f"({type(output).__name__}): return a tensor, a tuple, or something with "
        f"'logits'"
    )


def loss_of(output: Any) -> torch.Tensor:
    """The loss a model computed itself: `output["loss"]`, `output.loss`, or the output."""
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if not isinstance(output, torch.Tensor) and hasattr(output, "loss"):
        return output.loss
    if isinstance(output, torch.Tensor):
        return output
    raise UserError(
        f"task error: the model's output ({type(output).__name__}) has no loss: "
        f"return it as output['loss'] or output.loss"
    )


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document: 0 where `starts` (nonzero where a document
    begins) marks one, counting up from there; the window's first token starts one."""
    index = torch.arange(starts.shape[1], device=starts.device).expand(starts.shape[0], -1)
    begins = torch.where(starts != 0, index, torch.zeros_like(index))
    return index - begins.cummax(dim=1).values


def _counted(mask: torch.Tensor) -> torch.Tensor:
    """Which tokens a mask counts (its MASK_COUNTED flag; a bool mask counts where it is True)."""
    return mask if mask.dtype == torch.bool else mask & MASK_COUNTED


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss of logits split by vocabulary (`parallel.tp.loss_parallel`: a DTensor, the same on
    every rank of the tp group) as a plain tensor, as the loop takes a loss."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def call(model: nn.Module, inputs: Any) -> Any:
    """A dict batch goes in as keyword arguments (Hugging Face style), anything else as is."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


# ---------------------------------------------------------------------------------------------
# Built-in tasks


class Classification:
    """(inputs, labels) batches; cross-entropy; reports val_loss and val_acc."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(logits_of(call(model, inputs)).float(), labels)

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, labels = batch
        logits = logits_of(call(model, inputs)).float()
        return {
            "loss": F.cross_entropy(logits, labels, reduction="none"),
            "acc": (logits.argmax(dim=1) == labels).float(),
        }

    def example_input(self, info: dict[str, Any], batch_size: int) -> torch.Tensor:
        size = info["image_size"]
        gen = torch.Generator().manual_seed(0)
        return torch.randn(batch_size, info["in_channels"], size, size, generator=gen)


class LanguageModel:
    """Batches of token windows (batch, seq_len + 1): predict each next token. Reports val_loss
    (nats per token), val_perplexity and val_bits_per_byte: the loss in bits over the bytes of
    text a token stands for (`bytes_per_token`: 1 for bytes, the validation split's ratio from
    a token folder's meta.json), so that models with different tokenizers compare on one scale.
    Without a ratio (token files without meta.json) bits per byte is not reported.

    A batch may also be the pair (windows, mask) of a token folder with loss masks (the
    assistant's replies of chat data; their flags: data/masks.py): only the targets the mask
    counts count, the loss being their mean. Evaluation then reports, per window, the counted
    targets' loss summed and their share of the window (`counted`), so that val_loss, their
    ratio over the whole validation set, is the mean over every counted token, and a window that
    counts none weighs nothing. Where the masks also mark where documents start (`documents`:
    a packed folder), the model is called as `model(inputs, position_ids=...)`, the positions
    restarting at 0 at each document's first token: Hugging Face models read that as packed
    sequences (attention within each), and the built-in `gpt` likewise (`check_documents`
    makes sure, at start, that a model does).

    The validation batches of a mix of token folders (data/mix.py) end with each window's source
    index, a 1-D tensor: with the sources' `sources` names, evaluation also reports
    val_loss_<name>, the loss over that source's windows alone, as the ratio of two means over
    the whole set (`loss_<name>`, the loss of the source's windows and 0 elsewhere, over
    `share_<name>`, the windows' or counted tokens' share that are the source's)."""

    def __init__(
        self,
        seq_len: int | None = None,
        bytes_per_token: float | None = 1.0,
        sources: list[str] | None = None,
        documents: bool = False,
    ) -> None:
        self.tokens_per_sample = seq_len
        self.bytes_per_token = bytes_per_token
        self.sources = sources or []
        self.documents = documents

    @staticmethod
    def _parts(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The windows, the mask (or None) and the source of each window (or None)."""
        if not isinstance(batch, (tuple, list)):
            return batch, None, None
        windows, *rest = batch
        source = rest.pop() if rest and rest[-1].dim() == 1 else None
        return windows, rest[0] if rest else None, source

    def _split(
        self, batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Inputs, targets, with a mask which targets count (position t's target is token t + 1,
        so the mask of token t + 1 is the one that applies), and in a packed folder each
        input's position in its document."""
        windows, mask, _ = self._parts(batch)
        tokens = windows.long()  # bytes cross to the device as uint8
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if mask is None:
            return inputs, targets, None, None
        positions = document_positions(mask[:, :-1] & MASK_STARTS) if self.documents else None
        return inputs, targets, _counted(mask[:, 1:]), positions

    def model_input(self, batch: Any) -> torch.Tensor:
        return self._split(batch)[0]

    def counted(self, batch: Any) -> torch.Tensor | None:
        """How many targets of the batch count (a mask's), or None where every one does."""
        mask = self._parts(batch)[1]  # (not _split: no copy of the windows for this)
        return None if mask is None else _counted(mask[:, 1:]).sum()

    @staticmethod
    def _logits(model: nn.Module, inputs: torch.Tensor, positions: torch.Tensor | None) -> Any:
        output = model(inputs) if positions is None else model(inputs, position_ids=positions)
        return logits_of(output).float()

    def loss(self, model: nn.Module, batch: Any, over: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over the targets that count; with `over`, their sum divided by it."""
        inputs, targets, counts, positions = self._split(batch)
        logits = self._logits(model, inputs, positions)
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if counts is None:
            return _plain(F.cross_entropy(flat_logits, flat_targets))
        weights = counts.reshape(-1).float()
        per_token = _plain(F.cross_entropy(flat_logits, flat_targets, reduction="none"))
        # A batch that counts no target gives 0 (and no gradient), not 0 / 0.
        divisor = weights.sum().clamp(min=1.0) if over is None else over
        return (per_token * weights).sum() / divisor

    def check_documents(self, model: nn.Module, batch: Any) -> str | None:
        """With packed windows: that the model keeps documents apart. A document B of the
        first window's tokens is given once after a neighbour A and once before another, C:
        its logits must not change (beyond rounding) with its neighbour or its place."""
        inputs = self._split(batch)[0][:1]
        if not self.documents or inputs.shape[1] < 2:
            return None
        half = inputs.shape[1] // 2
        doc, neighbour = inputs[:, half:], inputs[:, :half]
        size = doc.shape[1]
        positions = torch.cat([torch.arange(half), torch.arange(size)]).to(inputs.device)
        try:
            after = self._logits(model, torch.cat([neighbour, doc], 1), positions[None])
            swapped = torch.cat([positions[half:], positions[:half]])[None]
            before = self._logits(model, torch.cat([doc, neighbour.flip(1)], 1), swapped)
        except TypeError as e:
            return (
                f"model error: the model does not take position_ids ({first_line(e)}), which "
                f"tell it where the documents of a packed window start; give its forward a "
                f"position_ids argument, or set task.args.documents: false to let attention "
                f"cross the documents"
            )
        change = (after[:, half:] - before[:, :size]).abs().max()
        relative = float((change / after[:, half:].abs().max().clamp(min=1e-12)).detach())
        if relative > _DOCUMENT_TOLERANCE:
            return (
                f"model error: the model lets the documents of a packed window see each other "
                f"(a document's logits change by {relative:.1e} of their size with its "
                f"neighbour): it must read position_ids as Hugging Face's packed sequences do "
                f"(attention within a document, positions from its start); use such a model, "
                f"or set task.args.documents: false to let attention cross the documents"
            )
        return None

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets, counts, positions = self._split(batch)
        logits = self._logits(model, inputs, positions)
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        if counts is None:
            values = {"loss": per_token.mean(dim=1)}
            counted = torch.ones_like(values["loss"])
        else:
            weights = counts.float()
            values = {"loss": (per_token * weights).mean(dim=1), "counted": weights.mean(dim=1)}
            counted = values["counted"]
        source = self._parts(batch)[2]
        if source is not None:
            for index, name in enumerate(self.sources):
                mine = (source == index).float()
                values[f"loss_{name}"] = values["loss"] * mine
                values[f"share_{name}"] = counted * mine
        return values

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        figures: dict[str, float] = {}
        for name in self.sources:
            if f"share_{name}" in means:  # a source's loss: see the docstring
                share = means[f"share_{name}"]
                figures[f"loss_{name}"] = means[f"loss_{name}"] / share if share else math.nan
        loss = means["loss"]
        if "counted" in means:  # masked: the mean over the counted tokens (see the docstring)
            loss = figures["loss"] = loss / means["counted"] if means["counted"] else math.nan
        figures["perplexity"] = math.exp(min(loss, 700.0))
        if self.bytes_per_token:
            figures["bits_per_byte"] = loss / math.log(2) / self.bytes_per_token
        return figures

    def example_input(self, info: dict[str, Any], batch_size: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, info["vocab_size"], (batch_size, info["seq_len"]), generator=gen)


class ModelLoss:
    """The model computes its own loss (`model(batch)`, a dict batch as keyword arguments, returns
    the loss or something with `.loss` / `["loss"]`). Reports val_loss: each sample is given its
    batch's loss, so a batch's share of the mean is its size."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_of(call(model, batch))

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": self.loss(model, batch).float().expand(batch_size(batch))}


def build(cfg: TaskConfig, info: dict[str, Any]) -> Task:
    """The task named by `task.name` (see registry.TASKS), with `task.args`."""
    return registry.TASKS.builder(cfg.name)(cfg, info)


def _with_args(cls: Callable[..., Task], args: dict[str, Any]) -> Task:
    try:
        return cls(**args)
    except TypeError as e:
        raise UserError(f"config error: task.args: {e}") from None


def classification(cfg: TaskConfig, info: dict[str, Any]) -> Task:
    return _with_args(Classification, dict(cfg.args))


def language_model(cfg: TaskConfig, info: dict[str, Any]) -> Task:
    known = {
        "seq_len": info.get("seq_len"),
        "bytes_per_token": info.get("bytes_per_token", 1.0),
        "sources": info.get("sources"),
        "documents": info.get("documents", False),
    }
    return _with_args(LanguageModel, {**known, **cfg.args})


def model_loss(cfg: TaskConfig, info: dict[str, Any]) -> Task:
    return _with_args(ModelLoss, dict(cfg.args))


def build_user(cfg: TaskConfig, info: dict[str, Any]) -> Task:
    """A user's task builder by import path, called with the task config."""
    task = load_callable(cfg.name, "task.name")(cfg)
    missing = [m for m in ("loss", "metrics") if not callable(getattr(task, m, None))]
    if missing:
        raise UserError(
            f"config error: task.name: {cfg.name} returned {type(task).__name__}, "
            f"which has no {' or '.join(missing)}(model, batch) method"
        )
    return task


# ---------------------------------------------------------------------------------------------
# Batches


def batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in a batch (tensors, tuples, lists, dicts)."""
    for leaf in compat.tensor_leaves(batch):
        if leaf.dim() > 0:
            return leaf.shape[0]
    raise UserError("task error: a batch holds no tensor with a batch dimension")


def check(task: Task, model: nn.Module, batch: Any, monitor: str) -> str | None:
    """Try the task once on a batch (evaluation mode, no gradients: nothing changes): the loss
    must be a scalar, the metrics per-sample, and `monitor` among what it reports (a task
    metric of train.eval_tasks is checked against its tasks). Returns the problem as one line,
    or None."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            documents = getattr(task, "check_documents", None)
            problem = documents(model, batch) if documents is not None else None
            if problem:
                return problem
            loss = task.loss(model, batch)
            values = task.metrics(model, batch)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the model, data and task do not fit together
        return (
            f"task error: the {type(task).__name__} task failed on a validation batch: "
            f"{type(e).__name__}: {first_line(e)} (do the model's outputs fit the data, e.g. "
            f"model.num_classes?)"
        )
    finally:
        model.train(was_training)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        return (
            f"task error: loss(model, batch) returned {shape}, not a scalar tensor; reduce "
            f"it to one number (e.g. .mean())"
        )
    size = batch_size(batch)
    if not isinstance(values, dict) or not values:
        return "task error: metrics(model, batch) must return a non-empty dict of name -> tensor"
    for name, value in values.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (size,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return (
                f"task error: metrics(model, batch)['{name}'] has shape {shape}; metrics "
                f"must be per-sample, of shape ({size},) for this batch"
            )
    reported = reported_metrics(task, values)
    if monitor not in reported and not monitor.startswith(TASK_METRIC):
        return (
            f"config error: ckpt.monitor: '{monitor}' is not reported by the task; it "
            f"reports {', '.join(reported)}"
        )
    return None


def reported_metrics(task: Task, values: dict[str, torch.Tensor]) -> list[str]:
    """The `val_` names an evaluation gives, derived ones included."""
    names = list(values)
    summarize = getattr(task, "summarize", None)
    if summarize is not None:  # (a derived figure may replace a metric of the same name)
        names += [n for n in summarize({name: 1.0 for name in values}) if n not in names]
    return [f"val_{name}" for name in names]

"""`dtrain export`: a checkpoint's model as a file that loads without dtrain, checked on a batch.

A checkpoint is named by its path (`--checkpoint`) or by its run directory (`--run`: the newest
complete checkpoint there). Formats: `state_dict` (plain tensors by parameter name, from full and
sharded checkpoints alike), `torchscript` (torch.jit.trace) and `exported` (torch.export). After
writing, the file is loaded back the way a user would and its outputs are compared with the
checkpoint's model on a batch.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from dtrain import checkpoint, compat, config, models, tasks
from dtrain.checkpoint.state import load_checked, read_sharded
from dtrain.errors import UserError, first_line

TOLERANCE = 1e-5


def newest_checkpoint(run_dir: str) -> str:
    """The folder of the run directory's newest complete checkpoint: the last one saved, as
    resuming counts it (not the largest step in a name)."""
    store = checkpoint.Store(run_dir)
    if not os.path.isdir(store.dir):
        raise UserError(
            f"export error: --run {run_dir}: not a run directory ({store.dir} does not "
            f"exist); name a checkpoint itself with --checkpoint PATH"
        )
    saved = store.complete()
    if not saved:
        raise UserError(f"export error: --run {run_dir}: no complete checkpoint in {store.dir}")
    return saved[0].path


def load_model(path: str) -> tuple[nn.Module, dict]:
    """The model of the checkpoint at `path` (a checkpoint directory or its checkpoint.pt), in
    eval mode on the CPU, and the checkpoint's metadata. Every file read is checked against the
    marker's digests: a damaged checkpoint is refused (exit 2), not exported."""
    folder, fmt = checkpoint.open_checkpoint(path)
    sharded = fmt == "sharded"
    meta_path = os.path.join(folder, checkpoint.META_FILE if sharded else checkpoint.FULL_FILE)
    meta = load_checked(path if os.path.isfile(path) else meta_path)
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    if sharded:
        state = {"model": model.state_dict()}
        read_sharded(folder, state)
        weights = state["model"]
    else:
        weights = meta["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise UserError(f"checkpoint error: {path}: {first_line(e)}") from None
    return model.eval(), meta


def example_input(meta: dict, size: int = 4) -> Any:
    """A model input like the run's data, from the task (None when the task cannot say)."""
    cfg = config.from_dict(meta["config"])
    task = tasks.build(cfg.task, meta["model_info"])
    make = getattr(task, "example_input", None)
    return make(meta["model_info"], size) if make is not None else None


def _difference(a: Any, b: Any) -> float:
    """The largest difference between the tensors of two outputs (tensors, tuples, dicts, ...)."""
    left, right = compat.tensor_leaves(a), compat.tensor_leaves(b)
    tensors = [(x, y) for x, y in zip(left, right, strict=False) if isinstance(x, torch.Tensor)]
    if len(left) != len(right) or not tensors:
        return float("inf")
    return max((x.float() - y.float()).abs().max().item() for x, y in tensors)


def export(path: str, out: str, fmt: str = "state_dict") -> float:
    """Write the export, load it back, and return the largest output difference on a batch (the
    weights' difference for a state_dict of a task that cannot make an input)."""
    model, meta = load_model(path)
    inputs = example_input(meta)
    if inputs is None and fmt != "state_dict":
        raise UserError(
            f"export error: --format {fmt} traces the model on an input, and this "
            f"task has no example_input(info, batch_size); add one, or export a "
            f"state_dict"
        )
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notes are not the user's business
        expected = tasks.call(model, inputs) if inputs is not None else None
        if fmt == "state_dict":
            torch.save(model.state_dict(), out)
            reloaded = _reload_state_dict(meta, out)
            if inputs is None:
                difference = _difference(
                    list(model.state_dict().values()), list(reloaded.state_dict().values())
                )
                return _report(path, out, fmt, difference, "weights")
        elif fmt == "torchscript":
            torch.jit.save(torch.jit.trace(model, inputs), out)
            reloaded = torch.jit.load(out)
        elif fmt == "exported":
            torch.export.save(torch.export.export(model, (inputs,)), out)
            reloaded = torch.export.load(out).module()
        else:
            raise UserError(f"export error: unknown format '{fmt}'")
        difference = _difference(tasks.call(reloaded, inputs), expected)
    return _report(path, out, fmt, difference, "outputs")


def _report(path: str, out: str, fmt: str, difference: float, what: str) -> float:
    if difference > TOLERANCE:
        raise UserError(
            f"export error: the exported model's {what} differ from the checkpoint's "
            f"by {difference:.3g} (> {TOLERANCE}); {out} is not trustworthy"
        )
    print(
        f"exported {path} -> {out} ({fmt}); {what} match the checkpoint"
        f"{' on a batch' if what == 'outputs' else ''} (max difference {difference:.2g})"
    )
    return difference


def _reload_state_dict(meta: dict, out: str) -> nn.Module:
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    model.load_state_dict(torch.load(out, weights_only=True))
    return model.eval()

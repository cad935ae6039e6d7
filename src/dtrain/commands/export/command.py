"""`dtrain export`: a checkpoint's model as a file that loads without dtrain, checked on a batch.

A checkpoint is named by its path (`--checkpoint`) or by its run directory (`--run`: the newest
complete checkpoint there); full and sharded checkpoints alike are read in this one process (no
process group), every file checked against the marker's digests. `--weights ema` exports the
checkpoint's moving average of the weights instead of the trained ones.

Formats: `state_dict` (plain tensors by parameter name), `torchscript` (torch.jit.trace),
`exported` (torch.export), `onnx` (onnx_file: checked under onnxruntime on a validation batch)
and `safetensors` (safetensors_file: the weights with the config beside them). After writing,
the file is loaded back the way a user would and its outputs (or weights) are compared with the
checkpoint's model; a file that fails the check is removed and the command exits 1.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtrain import checkpoint, config, models, tasks
from dtrain.checkpoint.state import load_checked, read_sharded
from dtrain.commands.export.check import difference, report
from dtrain.core.errors import UserError, first_line
from dtrain.files import names, outputs

FORMATS = ("state_dict", "torchscript", "exported", "onnx", "safetensors")
WEIGHTS = ("model", "ema")


def newest_checkpoint(run_dir: str) -> str:
    """The folder of the run directory's newest complete checkpoint: the last one saved, as
    resuming counts it (not the largest step in a name)."""
    store = checkpoint.Store(run_dir)
    if not os.path.isdir(store.dir):
        raise UserError(
            f"export error: --run-dir {run_dir}: not a run directory ({store.dir} does not "
            f"exist); name a checkpoint itself with --checkpoint PATH"
        )
    saved = store.complete()
    if not saved:
        raise UserError(f"export error: --run-dir {run_dir}: no complete checkpoint in {store.dir}")
    return saved[0].path


def load_model(path: str, weights: str = "model") -> tuple[nn.Module, dict]:
    """The model of the checkpoint at `path` (a checkpoint directory or its checkpoint.pt), in
    eval mode on the CPU, and the checkpoint's metadata; with `weights` "ema", holding the
    checkpoint's moving average of the weights. Every file read is checked against the marker's
    digests: a damaged checkpoint is refused (exit 2), not exported."""
    folder, fmt = checkpoint.open_checkpoint(path)
    sharded = fmt == "sharded"
    meta_path = os.path.join(folder, checkpoint.META_FILE if sharded else checkpoint.FULL_FILE)
    meta = load_checked(path if os.path.isfile(path) else meta_path)
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    if sharded:
        state = {"model": model.state_dict()}
        with _one_process():
            read_sharded(folder, state)
        saved = state["model"]
    else:
        saved = meta["model"]
    try:
        model.load_state_dict(saved)
    except RuntimeError as e:
        raise UserError(f"checkpoint error: {path}: {first_line(e)}") from None
    if weights == "ema":
        with _one_process():
            _load_ema(model, folder)
    return model.float().eval(), meta


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it reads in a single process when no process group exists: that is what
    export means to do, so the user is not told."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load_ema(model: nn.Module, folder: str) -> None:
    # Imported here: only `--weights ema` needs the EMA module.
    from dtrain.loop import ema

    if not ema.has_ema(folder):
        raise UserError(
            f"export error: {folder} was saved without EMA weights (train.ema.decay unset); "
            f"use --weights model"
        )
    ema.load_ema_into(model, folder)


def example_input(meta: dict, size: int = 4) -> Any:
    """A model input like the run's data, from the task (None when the task cannot say)."""
    cfg = config.from_dict(meta["config"])
    task = tasks.build(cfg.task, meta["model_info"])
    make = getattr(task, "example_input", None)
    return make(meta["model_info"], size) if make is not None else None


def _required(fmt: str) -> None:
    """The optional packages a format needs, before any checkpoint is read: a missing one is
    one line naming the extra (exit 2)."""
    from dtrain.core.imports import require

    needs = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}
    for module in needs.get(fmt, ()):
        require(module, "export", f"dtrain export --format {fmt} ({module})")


def export(
    path: str,
    out: str,
    fmt: str = "state_dict",
    weights: str = "model",
    overrides: list[str] | tuple[str, ...] = (),
) -> float:
    """Write the export, load it back, and return the largest difference found by the check.
    `overrides` (data.* keys) steer where the ONNX check reads its validation batch."""
    if fmt not in FORMATS:
        raise UserError(f"export error: unknown format '{fmt}'; one of {', '.join(FORMATS)}")
    if weights not in WEIGHTS:
        raise UserError(f"export error: unknown --weights '{weights}'; model or ema")
    if overrides and fmt != "onnx":
        raise UserError(
            "export error: data.* overrides steer the validation batch of --format onnx's "
            "check only; drop them"
        )
    _required(fmt)
    if not os.path.exists(path):
        raise UserError(f"export error: --checkpoint {path}: no such checkpoint folder or file")
    if os.path.isdir(os.path.join(path, names.CHECKPOINTS)):
        raise UserError(
            f"export error: --checkpoint {path} is a run directory; give it as --run-dir {path} "
            f"(its newest checkpoint) or name one of its checkpoints"
        )
    if fmt != "safetensors" and os.path.isdir(out):
        raise UserError(f"export error: --out {out} is a directory; name the file to write")
    model, meta = load_model(path, weights)
    what = f"{path} ({weights} weights)" if weights == "ema" else path
    # Written beside the final files under a hidden name, checked, then renamed into place: a
    # failure (a full disk, a failed check) leaves an earlier export at --out as it was.
    if fmt == "safetensors":
        from dtrain.commands.export import safetensors_file as export_safetensors

        final = export_safetensors.paths(out)[0]
    else:
        final = out
    folder = os.path.dirname(final)
    with outputs.staged(folder, "export") as stage:
        staging = os.path.join(stage, os.path.basename(final))
        try:
            found, line = _write(fmt, model, meta, what, staging, list(overrides), weights)
        except UserError as e:
            raise type(e)(_final_paths(str(e), stage, folder)) from None
    print(_final_paths(line, stage, folder))
    return found


def _write(
    fmt: str,
    model: nn.Module,
    meta: dict,
    what: str,
    out: str,
    overrides: list[str],
    weights: str,
) -> tuple[float, str]:
    if fmt == "onnx":
        from dtrain.commands.export import onnx_file as export_onnx

        return export_onnx.export(model, meta, what, out, overrides, weights)
    if fmt == "safetensors":
        from dtrain.commands.export import safetensors_file as export_safetensors

        return export_safetensors.export(model, meta, what, out, weights)
    return _export_torch(model, meta, what, out, fmt)


def _final_paths(text: str, stage: str, folder: str) -> str:
    """A message about the staged files, naming them where they go."""
    return text.replace(os.path.join(stage, ""), os.path.join(folder, "") if folder else "")


def _export_torch(model: nn.Module, meta: dict, path: str, out: str, fmt: str) -> tuple[float, str]:
    inputs = example_input(meta)
    if inputs is None and fmt != "state_dict":
        raise UserError(
            f"export error: --format {fmt} traces the model on an input, and this "
            f"task has no example_input(info, batch_size); add one, or export a "
            f"state_dict"
        )
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notes are not the user's business
        expected = tasks.call(model, inputs) if inputs is not None else None
        if fmt == "state_dict":
            torch.save(model.state_dict(), out)
            reloaded = _reload_state_dict(meta, out)
            if inputs is None:
                found = difference(
                    list(model.state_dict().values()), list(reloaded.state_dict().values())
                )
                return report(path, out, fmt, found, "weights")
        elif fmt == "torchscript":
            torch.jit.save(torch.jit.trace(model, inputs), out)
            reloaded = torch.jit.load(out)
        else:
            torch.export.save(torch.export.export(model, (inputs,)), out)
            reloaded = torch.export.load(out).module()
        found = difference(tasks.call(reloaded, inputs), expected)
    return report(path, out, fmt, found, "outputs")


def _reload_state_dict(meta: dict, out: str) -> nn.Module:
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    model.load_state_dict(torch.load(out, weights_only=True))
    return model.eval()

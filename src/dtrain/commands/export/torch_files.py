"""The formats that PyTorch itself loads: `state_dict` (torch.save of the tensors by name),
`torchscript` (torch.jit.trace) and `exported` (torch.export, its JSON records deflated:
`save_compact`), each on the task's example input.
Read back, the file's outputs on that input are compared with the checkpoint's model (a
state_dict of a task without an example input: its weights).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain import config, models, tasks
from dtrain.commands.export.check import difference, report
from dtrain.commands.export.checkpoint_model import example_input
from dtrain.core.errors import UserError

COPY_CHUNK = 1 << 20


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notes are not the user's business
        yield


def _traced_input(meta: dict, fmt: str) -> Any:
    inputs = example_input(meta)
    if inputs is None:
        raise UserError(
            f"export error: --format {fmt} traces the model on an input, and this "
            f"task has no example_input(info, batch_size); add one, or export a "
            f"state_dict"
        )
    return inputs


def write_state_dict(model: nn.Module, meta: dict, out: str, fmt: str) -> Any:
    """The tensors by name; returns the input the check runs (None: the task has none)."""
    inputs = example_input(meta)
    with _quiet():
        torch.save(model.state_dict(), out)
    return inputs


def write_torchscript(model: nn.Module, meta: dict, out: str, fmt: str) -> Any:
    inputs = _traced_input(meta, fmt)
    with _quiet():
        torch.jit.save(torch.jit.trace(model, inputs), out)
    return inputs


def write_exported(model: nn.Module, meta: dict, out: str, fmt: str) -> Any:
    inputs = _traced_input(meta, fmt)
    with _quiet():
        save_compact(torch.export.export(model, (inputs,)), out)
    return inputs


def save_compact(program: Any, out: str) -> None:
    """torch.export.save with the archive's JSON records (the graph, the weights' and constants'
    lists) deflated and its tensors stored as torch writes them: an int8 graph's many small
    operators (some thirty added to each Linear layer's forward) are text that compresses about
    tenfold, and torch.export.load reads deflated records as it reads stored ones. torch's
    archive is written to a file of its own beside `out` first (on disk rather than in memory:
    a model's weights may not fit twice), under a fresh name that no file of the user's has."""
    handle, raw = tempfile.mkstemp(prefix=".", suffix=".pt2.part", dir=os.path.dirname(out) or ".")
    os.close(handle)
    try:
        torch.export.save(program, raw)
        with zipfile.ZipFile(raw) as source, zipfile.ZipFile(out, "w") as target:
            for entry in source.infolist():
                packed = entry.filename.endswith(".json")
                info = zipfile.ZipInfo(entry.filename, entry.date_time)
                info.compress_type = zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED
                with source.open(entry) as read, target.open(info, "w", force_zip64=True) as put:
                    shutil.copyfileobj(read, put, COPY_CHUNK)
    finally:
        os.remove(raw)


def reload_state_dict(meta: dict, out: str) -> nn.Module:
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    model.load_state_dict(torch.load(out, weights_only=True))
    return model.eval()


def reload_torchscript(meta: dict, out: str) -> nn.Module:
    return torch.jit.load(out)


def reload_exported(meta: dict, out: str) -> nn.Module:
    return torch.export.load(out).module()


def read_back(
    model: nn.Module,
    meta: dict,
    shown: str,
    out: str,
    fmt: str,
    inputs: Any,
    reload: Callable[[dict, str], nn.Module],
) -> tuple[float, str]:
    """`out` loaded back by `reload`, its outputs on `inputs` compared with `model`'s (no
    inputs: the weights by name); `shown`: the checkpoint in the line."""
    with _quiet():
        reloaded = reload(meta, out)
        if inputs is None:
            found = difference(
                list(model.state_dict().values()), list(reloaded.state_dict().values())
            )
            return report(shown, out, fmt, found, "weights")
        found = difference(tasks.call(reloaded, inputs), tasks.call(model, inputs))
    return report(shown, out, fmt, found, "outputs")

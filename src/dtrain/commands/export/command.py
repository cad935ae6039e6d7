"""`dtrain export`: a checkpoint's model as a file that loads without dtrain, checked on a batch.

A checkpoint is named by its path (`--checkpoint`) or by its run directory (`--run`: the newest
complete checkpoint there); full and sharded checkpoints alike are read in this one process (no
process group), every file checked against the marker's digests. `--weights ema` exports the
checkpoint's moving average of the weights instead of the trained ones.

Formats: `state_dict` (plain tensors by parameter name), `torchscript` (torch.jit.trace),
`exported` (torch.export), `onnx` (onnx_file: checked under onnxruntime on a validation batch)
and `safetensors` (safetensors_file: the weights with the config beside them). After writing,
the file is loaded back the way a user would and its outputs (or weights) are compared with the
checkpoint's model; a file that fails the check is removed and the command exits 1. An export
never replaces anything: --out, and every file written beside it, must be new (check_out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtrain import checkpoint, config, models, tasks
from dtrain.checkpoint.load import trained_shapes
from dtrain.checkpoint.state import load_checked, read_sharded, shape_mismatch
from dtrain.commands.export.check import difference, report
from dtrain.config import registry
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url, join
from dtrain.files import names, outputs, remote_copies
from dtrain.models.spec import spec_of
from dtrain.run.weights import prepare_base

FORMATS = ("state_dict", "torchscript", "exported", "onnx", "safetensors", "hf", "peft")
WEIGHTS = ("model", "ema")
FOLDERS = ("hf", "peft")  # formats that write a folder of files
# Uploaded last, after the files beside them (safetensors' config): an export interrupted in the
# upload has no new weights beside an old config.
WEIGHT_FILES = (".safetensors", ".onnx", ".pt", ".pth")


def newest_checkpoint(run_dir: str, listing_dir: str = "") -> str:
    """The folder (or, in an object store, the URL) of the run directory's newest complete
    checkpoint: the last one saved, as resuming counts it (not the largest step in a name)."""
    if is_url(run_dir):
        remote = remote_copies.listing(run_dir, {}, listing_dir)
        newest = remote_copies.checkpoints(remote, "export", run_dir)
        if not newest:
            raise UserError(
                f"export error: --run-dir {run_dir}: no complete checkpoint in {remote.location}"
            )
        return newest[0].path
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


def main(
    run: str | None,
    path: str | None,
    out: str,
    fmt: str = "state_dict",
    weights: str = "model",
    overrides: list[str] | tuple[str, ...] = (),
    shard_size: str | None = None,
    trusted: bool = False,
) -> float:
    """The command: the checkpoint at `path` (or the newest of the run `run`) exported to `out`;
    code that the checkpoint's config names runs only when `trusted` (--trust-remote-code).
    Either may be in an object store: a checkpoint there is fetched to a temporary folder (each
    file checked by its digest as it is read), an export is made and checked here, then uploaded
    (the weights file last: an interrupted upload leaves no new weights beside an old config)."""
    check_request(fmt, weights, overrides)
    if is_url(out):
        parent, name = out.rstrip("/").rsplit("/", 1)
        for rel in [name, *named_after(name, fmt)]:
            remote_copies.check_new(join(parent, rel), {}, "export", "an export never replaces")
    with tempfile.TemporaryDirectory(prefix="dtrain-export-") as copies:
        source = path if path is not None else newest_checkpoint(str(run), copies)
        local = source
        if is_url(source):
            remote_copies.marker_of(source, {}, "export")  # a missing or damaged one: its line
            folder = remote_copies.checkpoint_folder(source)
            local = remote_copies.fetch_checkpoint(folder, os.path.join(copies, "checkpoint"), {})
        if not is_url(out):
            return export(
                local, out, fmt, weights, overrides, source, shard_size=shard_size, trusted=trusted
            )
        parent, name = out.rstrip("/").rsplit("/", 1)
        made = os.path.join(copies, "out")
        os.makedirs(made)
        found = export(
            local,
            os.path.join(made, name),
            fmt,
            weights,
            overrides,
            shown=source,
            where=(made, parent),
            shard_size=shard_size,
            trusted=trusted,
        )
        objects = remote_copies.ObjectStore(parent, {})
        files = sorted(names_below(made), key=lambda n: n.endswith(WEIGHT_FILES))
        with objects.failing_as("write to"):
            for rel in files:
                objects.put(os.path.join(made, rel), rel)
        return found


def names_below(folder: str) -> list[str]:
    """Every file below `folder`, by its name relative to it."""
    return [
        os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
        for d, _, files in os.walk(folder)
        for f in files
    ]


def load_model(
    path: str,
    weights: str = "model",
    adapters: bool = False,
    untrusted: tuple[str, ...] = (),
    shown: str | None = None,
) -> tuple[nn.Module, dict]:
    """The model of the checkpoint at `path` (a checkpoint directory or its checkpoint.pt), in
    eval mode on the CPU, and the checkpoint's metadata; with `weights` "ema", holding the
    checkpoint's moving average of the weights. Every file read is checked against the marker's
    digests: a damaged checkpoint is refused (exit 2), not exported. A LoRA run's adapters go
    onto their base (checked by its digest), then are merged into it: the model and the config
    in `meta` are the base's; with `adapters`, the model keeps them apart (peft's model). Code
    that the checkpoint's config names for the keys `untrusted` is refused (`refuse_code`)."""
    folder, fmt = checkpoint.open_checkpoint(path)
    sharded = fmt == "sharded"
    meta_path = os.path.join(folder, checkpoint.META_FILE if sharded else checkpoint.FULL_FILE)
    meta = load_checked(path if os.path.isfile(path) else meta_path)
    refuse_code(meta, shown or path, untrusted)
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    spec = spec_of(cfg.model)
    with _one_process():  # (a sharded model.init_from: the base, read here)
        prepare_base(model, cfg, meta["model_info"], path)
    held = trained_shapes(model, spec)
    if sharded:
        state = {"model": {k: v for k, v in model.state_dict().items() if k in held}}
        with _one_process():
            read_sharded(folder, state)
        saved = state["model"]
    else:
        saved = meta["model"]
    problem = shape_mismatch(held, {k: tuple(v.shape) for k, v in saved.items()})
    if problem:
        raise UserError(f"checkpoint error: {path}: {problem}")
    model.load_state_dict(saved, strict=spec.holds_everything)
    if weights == "ema":
        with _one_process():
            _load_ema(model, folder)
    if spec.adapters and not adapters:
        merged: Any = model
        model = merged.merge_and_unload()
        meta = {**meta, "config": config.to_dict(dataclasses.replace(cfg, model=spec.base))}
    return model.float().eval(), meta


def untrusted_keys(fmt: str, trusted: bool) -> tuple[str, ...]:
    """The config keys whose code an export of `fmt` runs, unless the user trusts it: the model,
    the task (its example input) and, for the ONNX check's validation batch, the data."""
    if trusted:
        return ()
    return registry.BUILT_BY_READERS if fmt == "onnx" else ("model.name", "task.name")


def refuse_code(meta: dict, shown: str, keys: tuple[str, ...]) -> None:
    """One line, before anything is imported, when the checkpoint's config (not the user's own
    config of this command) names code that building `keys` runs."""
    if keys:
        named = registry.code_named(config.from_dict(meta["config"]), keys)
        registry.refuse_code(named, f"the checkpoint {shown}: its config")


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


def check_request(
    fmt: str, weights: str, overrides: list[str] | tuple[str, ...], shard_size: str | None = None
) -> None:
    """What the command is asked for, before any checkpoint is read (or fetched)."""
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
    if shard_size is not None:
        if fmt != "hf":
            raise UserError("export error: --max-shard-size goes with --format hf")
        from dtrain.commands.export import hf_folder

        hf_folder.shard_bytes(shard_size)


def check_out(out: str, fmt: str) -> None:
    """An export never replaces what it did not make: --out is new (a folder format may take an
    empty folder) and no link, dangling or not; so is each file it writes beside --out."""
    path = out.rstrip(os.sep) or out
    if os.path.islink(path):
        raise UserError(
            f"export error: --out {out} is {outputs.what_is_at(path)}; an export is a new file "
            f"or folder, never written through a link: name another --out"
        )
    folder = fmt in FOLDERS or (fmt == "safetensors" and not path.endswith(".safetensors"))
    found = outputs.what_is_at(path)
    if found and not (folder and found == "a folder" and not os.listdir(path)):
        made = "folder" if folder else "file"
        raise UserError(
            f"export error: --out {out} already exists ({found}); --format {fmt} writes a new "
            f"{made}: name one that is not there{' (or empty)' if folder else ''}"
        )
    for beside in named_after(path, fmt):
        found = outputs.what_is_at(beside)
        if found:
            raise UserError(
                f"export error: --out {out}: --format {fmt} writes {beside} beside it, and that "
                f"already exists ({found}); name another --out"
            )


def named_after(out: str, fmt: str) -> list[str]:
    """The files an export writes beside `out` under names made from it: safetensors' config
    (`model.safetensors`: `model.config.yaml`), ONNX's external data (`model.onnx.data`, for a
    model past 2 GB)."""
    if fmt == "safetensors" and out.endswith(".safetensors"):
        from dtrain.commands.export import safetensors_file

        return [safetensors_file.paths(out)[1]]
    return [out + ".data"] if fmt == "onnx" else []


def _streamed(
    path: str, fmt: str, weights: str, untrusted: tuple[str, ...], shown: str
) -> tuple[Any, dict] | None:
    """(What to write, the metadata) of a sharded checkpoint that --format hf exports file by
    file (hf_stream.py); None for every other export. `untrusted`: as `load_model`'s."""
    if fmt != "hf" or weights != "model":
        return None
    folder, kind = checkpoint.open_checkpoint(path)
    if kind != "sharded":
        return None
    meta = load_checked(os.path.join(folder, checkpoint.META_FILE))
    refuse_code(meta, shown, untrusted)
    from dtrain.commands.export import hf_folder, hf_stream

    hf_folder.check_model(meta)
    source = hf_stream.source(folder, meta, path)
    return None if source is None else (source, meta)


def _required(fmt: str) -> None:
    """The optional packages a format needs, before any checkpoint is read: a missing one is
    one line naming the extra (exit 2)."""
    from dtrain.core.imports import require

    needs = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}
    for module in needs.get(fmt, ()):
        require(module, "export", f"dtrain export --format {fmt} ({module})")
    if fmt == "hf":
        require("transformers", "transformers", "dtrain export --format hf")
    if fmt == "peft":
        require("peft", "peft", "dtrain export --format peft")


def export(
    path: str,
    out: str,
    fmt: str = "state_dict",
    weights: str = "model",
    overrides: list[str] | tuple[str, ...] = (),
    shown: str | None = None,
    where: tuple[str, str] | None = None,
    shard_size: str | None = None,
    trusted: bool = False,
) -> float:
    """Write the export, load it back, and return the largest difference found by the check.
    `overrides` (data.* keys) steer where the ONNX check reads its validation batch. `shown`:
    the checkpoint's name in messages (its URL); `where`: (this folder, the URL it stands for);
    `shard_size`: --format hf's largest safetensors file (default hf_folder.SHARD_SIZE);
    `trusted`: run the code that the checkpoint's config names (--trust-remote-code)."""
    check_request(fmt, weights, overrides, shard_size)
    if not os.path.exists(path):
        raise UserError(f"export error: --checkpoint {path}: no such checkpoint folder or file")
    if os.path.isdir(os.path.join(path, names.CHECKPOINTS)):
        raise UserError(
            f"export error: --checkpoint {path} is a run directory; give it as --run-dir {path} "
            f"(its newest checkpoint) or name one of its checkpoints"
        )
    check_out(out, fmt)
    out = out.rstrip(os.sep) or out
    shown = shown or path
    untrusted = untrusted_keys(fmt, trusted)
    streamed = _streamed(path, fmt, weights, untrusted, shown)  # hf file by file: no model held
    model, meta = (
        (None, streamed[1])
        if streamed
        else load_model(path, weights, fmt == "peft", untrusted, shown)
    )
    what = f"{shown} ({weights} weights)" if weights == "ema" else shown
    # Written beside --out under a hidden name, checked, then renamed into place: a failure (a
    # full disk, a failed check) leaves nothing at --out.
    folder = os.path.dirname(out)
    here, there = where or (folder, folder)
    with outputs.staged(folder, "export") as stage:
        staging = os.path.join(stage, os.path.basename(out))
        try:
            if streamed:
                from dtrain.commands.export import hf_folder, hf_stream

                size = hf_folder.shard_bytes(shard_size or hf_folder.SHARD_SIZE)
                found, line = hf_stream.export(streamed[0], meta, what, staging, size)
            else:
                assert model is not None
                found, line = _write(
                    fmt, model, meta, what, staging, list(overrides), weights, shard_size
                )
        except UserError as e:
            raise type(e)(_final_paths(_final_paths(str(e), stage, folder), here, there)) from None
    print(_final_paths(_final_paths(line, stage, folder), here, there))
    return found


def _write(
    fmt: str,
    model: nn.Module,
    meta: dict,
    what: str,
    out: str,
    overrides: list[str],
    weights: str,
    shard_size: str | None,
) -> tuple[float, str]:
    if fmt == "onnx":
        from dtrain.commands.export import onnx_file as export_onnx

        return export_onnx.export(model, meta, what, out, overrides, weights)
    if fmt == "safetensors":
        from dtrain.commands.export import safetensors_file as export_safetensors

        return export_safetensors.export(model, meta, what, out, weights)
    if fmt == "hf":
        from dtrain.commands.export import hf_folder

        hf_folder.check_model(meta)
        size = hf_folder.shard_bytes(shard_size or hf_folder.SHARD_SIZE)
        return hf_folder.export(model, meta, what, out, example_input(meta), size)
    if fmt == "peft":
        from dtrain.commands.export import peft_folder

        peft_folder.check_model(meta)
        return peft_folder.export(model, meta, what, out, example_input(meta))
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

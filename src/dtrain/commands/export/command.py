"""`dtrain export`: a checkpoint's model as a file that loads without dtrain, checked on a batch.

A checkpoint is named by its path (`--checkpoint`) or by its run directory (`--run`: the newest
complete checkpoint there); full and sharded checkpoints alike are read in this one process (no
process group), every file checked against the marker's digests. `--weights ema` exports the
checkpoint's moving average of the weights instead of the trained ones.

The format is looked up once by its name in formats.FORMATS (`state_dict`, `torchscript`,
`exported`, `onnx`, `safetensors`, `hf`, `peft`), and everything else is asked of it: whether
--out is a file or a folder and what it writes beside it, what it needs installed, which code it
runs, and its steps. After writing, the export is loaded back the way a user would and its
outputs (or weights) are compared with the checkpoint's model; an export that fails the check is
removed and the command exits 1. An export never replaces anything: --out, and every file
written beside it, must be new (`ExportFormat.check_out`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from dtrain import checkpoint
from dtrain.commands.export.checkpoint_model import load_model as load_model
from dtrain.commands.export.formats import FORMATS, ExportFormat, Job
from dtrain.commands.export.quantized import Request as Request
from dtrain.config import registry
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url, join
from dtrain.files import names, outputs, remote_copies

WEIGHTS = ("model", "ema")
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
    quantize: Request | None = None,
) -> float:
    """The command: the checkpoint at `path` (or the newest of the run `run`) exported to `out`;
    code that the checkpoint's config names runs only when `trusted` (--trust-remote-code).
    Either may be in an object store: a checkpoint there is fetched to a temporary folder (each
    file checked by its digest as it is read), an export is made and checked here, then uploaded
    (the weights file last: an interrupted upload leaves no new weights beside an old config).
    `quantize`: the export quantized and measured (quantized.py), its figures kept in the run's
    evals/ (in the store, for a run there) once the export is in place."""
    form = check_request(fmt, weights, overrides, quantize=quantize)
    if is_url(out):
        parent, name = out.rstrip("/").rsplit("/", 1)
        for rel in [name, *form.beside(name)]:
            remote_copies.check_new(join(parent, rel), {}, "export", "an export never replaces")
    with tempfile.TemporaryDirectory(prefix="dtrain-export-") as copies:
        source = path if path is not None else newest_checkpoint(str(run), copies)
        local = source
        if is_url(source):
            remote_copies.marker_of(source, {}, "export")  # a missing or damaged one: its line
            folder = remote_copies.checkpoint_folder(source)
            local = remote_copies.fetch_checkpoint(folder, os.path.join(copies, "checkpoint"), {})
        figures = None
        if quantize is not None:
            from dtrain.commands.export import quantized

            figures = quantized.evals_folder_of(source, out, run)
        if not is_url(out):
            return export(
                local,
                out,
                fmt,
                weights,
                overrides,
                source,
                shard_size=shard_size,
                trusted=trusted,
                quantize=quantize,
                figures=figures,
            )
        parent, name = out.rstrip("/").rsplit("/", 1)
        made = os.path.join(copies, "out")
        os.makedirs(made)
        return export(
            local,
            os.path.join(made, name),
            fmt,
            weights,
            overrides,
            shown=source,
            where=(made, parent),
            shard_size=shard_size,
            trusted=trusted,
            quantize=quantize,
            figures=figures,
            publish=lambda: upload(made, parent),
        )


def upload(made: str, parent: str) -> None:
    """The export made in the folder `made` uploaded below the store's `parent`, the weights
    files last."""
    objects = remote_copies.ObjectStore(parent, {})
    files = sorted(names_below(made), key=lambda n: n.endswith(WEIGHT_FILES))
    with objects.failing_as("write to"):
        for rel in files:
            objects.put(os.path.join(made, rel), rel)


def names_below(folder: str) -> list[str]:
    """Every file below `folder`, by its name relative to it."""
    return [
        os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
        for d, _, files in os.walk(folder)
        for f in files
    ]


def check_request(
    fmt: str,
    weights: str,
    overrides: list[str] | tuple[str, ...],
    shard_size: str | None = None,
    quantize: Request | None = None,
) -> ExportFormat:
    """What the command is asked for, before any checkpoint is read (or fetched): the format."""
    form = FORMATS.get(fmt)
    if form is None:
        raise UserError(f"export error: unknown format '{fmt}'; one of {', '.join(FORMATS)}")
    if weights not in WEIGHTS:
        raise UserError(f"export error: unknown --weights '{weights}'; model or ema")
    if overrides and not form.reads_data and quantize is None:
        raise UserError(
            "export error: data.* overrides steer the validation batch of --format onnx's "
            "check only; drop them"
        )
    form.require()
    if quantize is not None:
        from dtrain.commands.export import quantized

        quantized.check_request(form, quantize)
    if shard_size is not None:
        form.shard_bytes(shard_size)
    return form


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
    quantize: Request | None = None,
    figures: str | None = None,
    publish: Callable[[], None] | None = None,
) -> float:
    """Write the export, load it back, and return the largest difference found by the check.
    `overrides` (data.* keys) steer where the ONNX check reads its validation batch. `shown`:
    the checkpoint's name in messages (its URL); `where`: (this folder, the URL it stands for);
    `shard_size`: --format hf's largest safetensors file (default hf_files.SHARD_SIZE);
    `trusted`: run the code that the checkpoint's config names (--trust-remote-code);
    `quantize`: the export quantized, measured on the run's data (quantized.py): returns the
    drop; `figures`: the folder or store URL whose evals/ gets its figures (default:
    quantized.evals_folder_of); `publish`: run once the export is in place, before the figures
    are kept and the line printed (the upload to the store of an export made here)."""
    form = check_request(fmt, weights, overrides, shard_size, quantize)
    if not os.path.exists(path):
        raise UserError(f"export error: --checkpoint {path}: no such checkpoint folder or file")
    if os.path.isdir(os.path.join(path, names.CHECKPOINTS)):
        raise UserError(
            f"export error: --checkpoint {path} is a run directory; give it as --run-dir {path} "
            f"(its newest checkpoint) or name one of its checkpoints"
        )
    form.check_out(out)
    out = out.rstrip(os.sep) or out
    shown = shown or path
    # Quantizing reads the run's data, which runs the data's code.
    runs_code = registry.BUILT_BY_READERS if quantize is not None else form.runs_code
    untrusted = () if trusted else runs_code
    model, meta = form.load(path, weights, untrusted, shown)
    if quantize is not None:
        from dtrain.commands.export import quantized

        quantized.check_layers(form.module_of(model), meta, quantize.scheme, form)
    what = f"{shown} ({weights} weights)" if weights == "ema" else shown
    job = Job(model, meta, what, weights, list(overrides), shard_size)
    # Written beside --out under a hidden name, checked, then renamed into place: a failure (a
    # full disk, a failed check) leaves nothing at --out.
    folder = os.path.dirname(out)
    here, there = where or (folder, folder)
    with outputs.staged(folder, "export") as stage:
        staging = os.path.join(stage, os.path.basename(out))
        try:
            if quantize is None:
                found, line = form.read_back(job, staging, form.write(job, staging))
            else:
                measured = quantized.export(form, job, staging, quantize)
                found, line = measured.result["drop"], f"{measured.line} -> {staging}"
        except UserError as e:
            raise type(e)(_final_paths(_final_paths(str(e), stage, folder), here, there)) from None
    if publish is not None:
        publish()
    if quantize is not None:
        kept = quantized.keep(measured, figures or quantized.evals_folder_of(path, out))
        line += f"; figures in {kept}"
    print(_final_paths(_final_paths(line, stage, folder), here, there))
    return found


def _final_paths(text: str, stage: str, folder: str) -> str:
    """A message about the staged files, naming them where they go."""
    return text.replace(os.path.join(stage, ""), os.path.join(folder, "") if folder else "")

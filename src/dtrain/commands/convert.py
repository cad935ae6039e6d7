"""`dtrain convert`: a checkpoint in the other format, sharded (DCP) to one file and back.

The new checkpoint is what a save in that format would have written: a full one is one
`checkpoint.pt` holding the metadata and the model and optimizer state (parameter names as
keys, as a full save writes them), a sharded one is `meta.pt` plus `dcp/`, written by DCP in one
process (one shard file holding every tensor whole: DCP reshards it on load, so it resumes at
any world size). Everything else is kept as saved: the step, the random states of every rank,
the world size, the config, the other parts of the run's state. A resume of the converted
checkpoint at the world size of the save continues exactly as a resume of the original would.

Safety is that of a save: the source is checked against its marker's digests while it is read;
the new checkpoint is written into a temporary folder beside `--out`, fsynced, given a sealed
marker with every file's size and digest, read back through the same verified path a resume
takes and compared with the source, and only then renamed into place. Nothing existing is ever
replaced. No process group is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import warnings
from typing import Any

import torch

from dtrain.checkpoint import digest
from dtrain.checkpoint import state as ckpt_state
from dtrain.checkpoint.load import open_checkpoint
from dtrain.checkpoint.state import DCP_DIR, FULL_FILE, META_FILE
from dtrain.core.errors import CheckpointError, UserError
from dtrain.core.urls import is_url
from dtrain.files import outputs, remote_copies
from dtrain.files.digests import ALGORITHM, MARKER, read_marker, seal
from dtrain.files.store import (
    CHECKPOINTS,
    TMP_PREFIX,
    error_of_save,
    file_sizes,
    fsync_dir,
    write_atomic,
)
from dtrain.process import compat

FORMATS = ("full", "sharded")
# What a sharded save writes through DCP (the rest of a checkpoint goes into meta.pt): the state
# that is sharded under FSDP, "ema" (dtrain.loop.ema.KEY) only with train.ema. A full save puts
# them, in this order, after the metadata in checkpoint.pt.
PAYLOAD = ("model", "optimizer", "ema")
# What every checkpoint a run can resume from holds: without these, a file is no checkpoint.
REQUIRED = ("train_state", "world_size", "rng", "config", "model", "optimizer")
# Marker fields that describe the files: written anew for the new files.
_FILE_FIELDS = ("files", "digest", "digests", "marker_digest")


class ConvertCheckFailed(CheckpointError):
    """The converted checkpoint, read back, differs from its source: exit 1, nothing published."""


def convert(path: str, to: str, out: str, shown: str | None = None) -> str:
    """Convert the checkpoint at `path` (a checkpoint folder or its checkpoint.pt) into format
    `to` as the new checkpoint folder `out`; returns the line that reports it. `shown`: the
    source's name in messages and in the new marker (its URL, for a fetched copy)."""
    _check_format(to)
    _check_source_path(path)
    _check_out(out, path)
    with warnings.catch_warnings():
        # DCP's note that it assumes one process when no process group exists: that is meant.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        folder, fmt, data = read_checkpoint(path)
        _check_contents(path, data)
        if fmt == to:
            other = FORMATS[1 - FORMATS.index(to)]
            raise UserError(
                f"convert error: {path} is already a {to} checkpoint; nothing to convert "
                f"(--to {other} converts it to the other format)"
            )
        data["format"] = to
        marker = _new_marker(folder, shown or os.path.abspath(path), to, data)
        final = _write(out, to, data, marker)
    step = data["train_state"].get("step", "?")
    return (
        f"converted {shown or path} ({fmt}, step {step}, saved by {data['world_size']} "
        f"rank(s)) -> {final} ({to}); read back and equal to the source ({_count(data)} tensors)"
    )


def main(args: argparse.Namespace) -> int:
    """The command. The source, `--out`, or both may be in an object store: a source there is
    fetched to a temporary folder (each file checked by its digest as it is read); a new
    checkpoint there is made and checked here, then uploaded with its marker last (a folder
    that lost its connection half-way has none, and is never read as a checkpoint)."""
    source, out = args.checkpoint, args.out
    if not (is_url(source) or is_url(out)):
        print(convert(source, args.to, out), flush=True)
        return 0
    _check_format(args.to)
    with tempfile.TemporaryDirectory(prefix="dtrain-convert-") as copies:
        target = None
        if is_url(out):
            target = remote_copies.check_new(out, {}, "convert", "convert never overwrites")
        local = source
        if is_url(source):
            remote_copies.marker_of(source, {}, "convert")  # a missing or damaged one: its line
            folder = remote_copies.checkpoint_folder(source)
            local = remote_copies.fetch_checkpoint(folder, os.path.join(copies, "source"), {})
        made = os.path.join(copies, "out", "new") if target is not None else out
        line = convert(local, args.to, made, shown=source)
        if target is not None:
            remote_copies.upload_folder(made, target, "convert")
            line = line.replace(f"-> {made} (", f"-> {target.url} (")
    print(line, flush=True)
    return 0


def _check_format(to: str) -> None:
    if to not in FORMATS:
        raise UserError(
            f"convert error: --to {to}: unknown format; use --to full (one checkpoint.pt) "
            f"or --to sharded (meta.pt + dcp/)"
        )


# ---------------------------------------------------------------------------------------------
# Reading


def read_checkpoint(path: str) -> tuple[str, str, dict[str, Any]]:
    """The folder, format and whole content of the checkpoint at `path`, read through the
    verified path a resume takes (marker, sizes, every file's digest): for a sharded one, the
    metadata of meta.pt with the DCP state beside it, as a full checkpoint holds them."""
    folder, fmt = open_checkpoint(path)
    if fmt == "full":
        file = path if os.path.isfile(path) else os.path.join(folder, FULL_FILE)
        return folder, fmt, ckpt_state.load_checked(file, mmap=True)
    if fmt != "sharded":
        raise UserError(f"convert error: {folder}: unknown checkpoint format '{fmt}' in its marker")
    meta = ckpt_state.load_checked(os.path.join(folder, META_FILE))
    return folder, fmt, {**meta, **_read_dcp(folder)}


def _read_dcp(folder: str) -> dict[str, Any]:
    """Every value of the DCP checkpoint in `folder`, whole, in the nested layout it was saved
    from: empty tensors of the saved sizes and dtypes are made from DCP's metadata (read
    through dtrain's allow-list), then filled by dtrain's verified reader."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = ckpt_state.safe_reader(folder, digest.expected_digests(folder)).read_metadata()
    paths = metadata.planner_data or {}
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        # Values that are not tensors (the optimizer's hyperparameters) are read as saved; the
        # placeholder only marks where they go.
        value = (
            torch.empty(item.size, dtype=item.properties.dtype)
            if isinstance(item, TensorStorageMetadata)
            else item
        )
        if key in paths:
            compat.dcp_set_element(state, paths[key], value)
        else:
            state[key] = value
    ckpt_state.read_sharded(folder, state)
    return state


# ---------------------------------------------------------------------------------------------
# Checking the input


def _check_source_path(path: str) -> None:
    if not os.path.exists(path):
        raise UserError(f"convert error: --checkpoint {path} not found")
    if os.path.isdir(path) and read_marker(path) is None:
        if os.path.isdir(os.path.join(path, CHECKPOINTS)):
            raise UserError(
                f"convert error: --checkpoint {path} is a run directory; name one of its "
                f"checkpoints (a folder in {os.path.join(path, CHECKPOINTS)})"
            )
        if not os.path.exists(os.path.join(path, MARKER)):
            raise UserError(
                f"convert error: --checkpoint {path} is not a checkpoint (no {MARKER} marker: "
                f"an interrupted save, or another folder); name a checkpoint folder"
            )
        raise UserError(
            f"convert error: --checkpoint {path}: its {MARKER} marker is damaged (changed "
            f"since it was written); run dtrain verify --checkpoint {path}"
        )


def _check_out(out: str, source: str) -> None:
    """--out must be a new path: a conversion never replaces anything."""
    if os.path.lexists(out):
        what = "a checkpoint" if read_marker(out) is not None else outputs.what_is_at(out)
        raise UserError(
            f"convert error: --out {out} already exists ({what}); convert never overwrites: "
            f"name a new folder"
        )
    source_folder = source if os.path.isdir(source) else os.path.dirname(source) or "."
    real_out, real_source = os.path.realpath(out), os.path.realpath(source_folder)
    if read_marker(source_folder) is not None and real_out.startswith(real_source + os.sep):
        raise UserError(
            f"convert error: --out {out} is inside the source checkpoint {source_folder}; "
            f"name a folder outside it"
        )
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UserError(f"convert error: --out {out}: {parent} is not a folder")


def _check_contents(path: str, data: dict[str, Any]) -> None:
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise UserError(
            f"convert error: {path} is not a dtrain checkpoint (it has no {missing[0]!r}); "
            f"name a checkpoint a dtrain run saved"
        )


# ---------------------------------------------------------------------------------------------
# Writing


def _new_marker(folder: str, path: str, to: str, data: dict[str, Any]) -> dict[str, Any]:
    """The source's marker (its step, save number, metric, world size) for the new files; a
    bare checkpoint.pt without one gets what a save would have written from its content."""
    source = read_marker(folder) or {
        "step": data["train_state"].get("step", 0),
        "epoch": data["train_state"].get("epoch", 0),
        "world_size": data["world_size"],
    }
    marker = {k: v for k, v in source.items() if k not in _FILE_FIELDS}
    marker["format"] = to
    marker["converted_from"] = path
    return marker


def _write(out: str, to: str, data: dict[str, Any], marker: dict[str, Any]) -> str:
    """Write into a temporary folder beside `out`, check it by reading it back, and rename it
    into place; on any failure the temporary folder is removed and nothing else is changed."""
    final = os.path.abspath(out)
    parent, name = os.path.split(final)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{os.getpid()}")
    needed = ckpt_state.tensor_bytes(data)
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:  # a read-only place, a full disk
            raise outputs.output_error("convert", parent, e) from None
        try:
            digests = _write_files(tmp, to, data)
            files = file_sizes(tmp)
            sealed = seal(dict(marker, files=files, digest=ALGORITHM, digests=digests))
            write_atomic(os.path.join(tmp, MARKER), json.dumps(sealed, indent=1).encode())
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
            # A save's one line (disk full with the space needed, or what the OS said), told
            # as what it means here.
            line = str(error_of_save(e, name, parent, needed))
            line = line.removeprefix("checkpoint error: ").replace(
                "the previous checkpoint is kept", f"{out} was not made"
            )
            raise CheckpointError(f"convert error: {line}") from None
        _check_written(tmp, data)
        if os.path.lexists(final):  # made while this conversion ran
            raise UserError(
                f"convert error: --out {out} appeared while converting; convert never "
                f"overwrites: name a new folder"
            )
        os.replace(tmp, final)
        fsync_dir(parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_files(tmp: str, to: str, data: dict[str, Any]) -> dict[str, str]:
    """The checkpoint's files, fsynced, and their digests (computed as they are written)."""
    meta = {k: v for k, v in data.items() if k not in PAYLOAD}
    payload = {k: data[k] for k in PAYLOAD if k in data}
    if to == "full":
        # The layout of a full save: the metadata, then the model, optimizer (and EMA) state.
        return {FULL_FILE: ckpt_state.torch_save({**meta, **payload}, os.path.join(tmp, FULL_FILE))}
    writer = ckpt_state.write_sharded(tmp, payload)
    _, digests = digest.own_files(os.path.join(tmp, DCP_DIR), 0, writer)
    digests[META_FILE] = ckpt_state.torch_save(meta, os.path.join(tmp, META_FILE))
    return digests


def _check_written(tmp: str, data: dict[str, Any]) -> None:
    """Read the new checkpoint back as a resume would (marker, sizes, digests) and compare
    every value with the source, bit for bit."""
    _, _, written = read_checkpoint(tmp)
    difference = _first_difference(data, written, "")
    if difference is not None:
        raise ConvertCheckFailed(
            f"convert error: the converted checkpoint differs from its source at "
            f"{difference}; nothing was written to --out"
        )


def _first_difference(a: Any, b: Any, where: str) -> str | None:
    """Where `a` and `b` first differ (None when equal): tensors bit for bit, with their dtype
    and shape; containers key by key."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
        return None if same else where or "the top level"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            keys = sorted(map(str, a.keys() ^ b.keys()))
            return f"{where or 'the top level'} (key {keys[0]!r} only on one side)"
        for key in a:
            found = _first_difference(a[key], b[key], f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{where}.{i}")
            if found is not None:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return None  # a NaN metric is the same NaN
    return None if a == b else where


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: NaNs and signed zeros compare as stored."""
    flat = t.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8) if flat.numel() else flat


def _count(data: Any) -> int:
    return len(compat.tensor_leaves(data))

"""What the commands that read a run in an object store, or write an output there, share (eval,
export, convert): the run's checkpoints listed, a file of it copied here to be read, and an output
made here, checked, and only then uploaded. No torch.

Reading never changes the store (its checkpoints are listed, never `prepare`d, which removes
folders); writing never replaces an object that is there: an output's name must be new (a
conditional write when it is one object), a checkpoint folder's marker goes up last, as a save's.
"""

from __future__ import annotations

import os
from typing import Any

from dtrain.core.errors import UserError
from dtrain.files.digests import MARKER, parse_marker
from dtrain.files.objstore import ObjectStore, PreconditionFailed, join
from dtrain.files.remote_store import RemoteStore, fetch_checkpoint
from dtrain.files.store_protocol import Entry

__all__ = [
    "ObjectStore",
    "checkpoint_folder",
    "checkpoints",
    "check_new",
    "fetch_checkpoint",
    "fetch_file",
    "join",
    "listing",
    "marker_of",
    "upload_file",
    "upload_folder",
]


def listing(run_url: str, options: dict[str, Any], into: str) -> RemoteStore:
    """The checkpoints of the run at `run_url`, to list and choose from (`into`: a local folder
    the listing may use, never the run's)."""
    return RemoteStore(into, ObjectStore(run_url, options))


def checkpoints(store: RemoteStore, command: str, run_url: str) -> list[Entry]:
    """The run's complete checkpoints, newest first; one line when the store cannot be read or
    `run_url` is no run."""
    with store.objects.failing_as("read"):
        saved = store.complete()
        there = bool(saved) or store.objects.exists()
    if not there:
        raise UserError(f"{command} error: {run_url}: no run there (nothing below it)")
    return saved


def marker_of(url: str, options: dict[str, Any], command: str) -> dict[str, Any]:
    """The marker of the checkpoint at `url` (its folder or its checkpoint.pt), checked."""
    folder = checkpoint_folder(url)
    objects = ObjectStore(folder, options)
    with objects.failing_as("read"):
        data = objects.cat(MARKER)
        anything = data is not None or objects.exists()
    if data is None:
        if anything:
            raise UserError(
                f"{command} error: {folder} is not a checkpoint (no {MARKER} marker: an "
                f"interrupted save, or another folder); name a checkpoint folder"
            )
        raise UserError(f"{command} error: --checkpoint {url} not found")
    marker = parse_marker(data)
    if marker is None:
        raise UserError(
            f"{command} error: {folder}/{MARKER} is damaged (changed since it was written); "
            f"run dtrain verify {folder}"
        )
    return marker


def checkpoint_folder(url: str) -> str:
    """The checkpoint folder a URL names (the folder itself, or the folder of its .pt file)."""
    folder = url.rstrip("/")
    return folder.rsplit("/", 1)[0] if folder.endswith(".pt") else folder


def fetch_file(url: str, rel: str, local: str, options: dict[str, Any], command: str) -> None:
    """The run's file `rel` (config.yaml) into `local`; one line when it is not there."""
    objects = ObjectStore(url, options)
    with objects.failing_as("read"):
        try:
            objects.get(rel, local)
        except FileNotFoundError:
            raise UserError(
                f"{command} error: {url} has no {rel}; name the prefix of a dtrain run "
                f"(run.out_dir/run.name)"
            ) from None


def check_new(url: str, options: dict[str, Any], command: str, what: str) -> ObjectStore:
    """The store at `url`, which must hold nothing yet (`what`: an output never replaces)."""
    objects = ObjectStore(url, options)
    with objects.failing_as("reach"):
        taken = objects.exists()
    if taken:
        raise UserError(
            f"{command} error: --out {url} already exists in the store; {what}: name a new one"
        )
    return objects


def upload_file(local: str, url: str, options: dict[str, Any], command: str) -> None:
    """The finished file `local` as the object `url`, written only if there is none there."""
    parent, name = url.rstrip("/").rsplit("/", 1)
    objects = ObjectStore(parent, options)
    with objects.failing_as("write to"):
        try:
            objects.put(local, name, create=True)
        except PreconditionFailed:
            raise UserError(
                f"{command} error: {url} appeared in the store while it was written; nothing "
                f"was replaced: name a new one"
            ) from None


def upload_folder(local: str, objects: ObjectStore, command: str) -> None:
    """Every file below `local` into `objects`, its marker (when it has one) last: a folder
    that lost its connection half-way has no marker and is never read as a checkpoint."""
    names = []
    for folder, _, files in os.walk(local):
        names += [os.path.relpath(os.path.join(folder, f), local) for f in files]
    names.sort(key=lambda n: n == MARKER)
    try:
        for name in names:
            objects.put(os.path.join(local, name), name.replace(os.sep, "/"))
    except Exception as e:  # noqa: BLE001 - the store's failure as one line
        error = objects.error(e, "write to")
        raise UserError(f"{error} ({command}: the upload did not finish)") from None

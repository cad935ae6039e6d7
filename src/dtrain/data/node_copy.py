"""A node's copies of files in an object store (token shards, a saved Hugging Face dataset):
each fetched once per node (the first process that needs it fetches it under a lock; the others
wait for it) into a folder of the node's temporary directory, and used only while it is the
version the store lists: its size and its ETag, which changes whenever the object is written
again, are recorded beside the copy (under `.dtrain/`). A file rewritten in the store is fetched
again; one that changes while it is fetched is one line, and so is one whose content is not the
digest its folder's description gives (token files: meta.json's, written by dtrain tokenize).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile

from dtrain.core.errors import UserError
from dtrain.files.digests import file_digest
from dtrain.files.keys import local_path
from dtrain.files.objstore import ObjectStore

RECORDS = ".dtrain"  # below a copy's folder: each file's lock and recorded version


def folder_for(url: str) -> str:
    """The node-local folder for copies of the files below `url` (the same on every launch)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"dtrain-data-{os.getuid()}", digest)


def ensure(
    objects: ObjectStore, name: str, size: int, version: str, folder: str, digest: str = ""
) -> str:
    """The local copy of `name` (below `objects`) in `folder`, fetched unless the one there is
    of `version` with `size` bytes; with `digest` (what meta.json says the file holds), a
    fetched copy must have it. A name that would land outside `folder` (or its records outside
    theirs) is refused before anything is written."""
    local = local_path(folder, name, objects.url)
    record = local_path(os.path.join(folder, RECORDS), name, objects.url)
    if not _current(local, record, size, version):
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node; the others wait for it
            if not _current(local, record, size, version):
                _fetch(objects, name, local, size, version, digest)
                _write(record + ".version", f"{size} {version}")
    return local


def _current(local: str, record: str, size: int, version: str) -> bool:
    try:
        with open(record + ".version", encoding="utf-8") as f:
            recorded = f.read()
        return recorded == f"{size} {version}" and os.path.getsize(local) == size
    except OSError:
        return False


def _fetch(
    objects: ObjectStore, name: str, local: str, size: int, version: str, digest: str
) -> None:
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    tmp = f"{local}.tmp.{os.getpid()}"
    try:
        objects.get(name, tmp)
        now = objects.version(name) if version else ""
        got = os.path.getsize(tmp)
        if got != size or now != version:
            raise UserError(
                f"data error: {objects.url_of(name)} changed while it was read ({got} bytes "
                f"fetched, {size} listed); run again once the data is no longer being written"
            )
        if digest and file_digest(tmp) != digest:
            raise UserError(
                f"data error: {objects.url_of(name)} is not the file its meta.json describes "
                f"(its content digest differs: damaged, or replaced without a new meta.json); "
                f"upload the folder dtrain tokenize wrote again"
            )
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def remove_others(folder: str, kept: set[str]) -> None:
    """Remove the files of `folder` (but its records) that are not named in `kept`: a copy of a
    folder whose files the store no longer has."""
    for where, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not (where == folder and d == RECORDS)]
        for file in files:
            rel = os.path.relpath(os.path.join(where, file), folder).replace(os.sep, "/")
            if rel not in kept:
                os.remove(os.path.join(where, file))

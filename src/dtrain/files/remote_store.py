"""The checkpoints of a run directory in an object store: the local store's promises kept
without a rename.

    <run url>/checkpoints/<name>/...        the files of one save, each uploaded by the rank that
                                            wrote it (from its node's staging folder)
    <run url>/checkpoints/<name>/COMPLETE   the marker, written last, by rank 0, once every file
                                            it lists is in the store with its size: a folder
                                            without one is never resumed and is removed when the
                                            run starts again
    <run url>/checkpoints/latest            the newest complete checkpoint's name, for people
    <run url>/superseded/<time>/            an abandoned history, moved aside (copies, deletes)

Order, rotation and the best checkpoint follow the markers' save numbers, as on a disk.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.files.digests import ALGORITHM, MARKER, parse_marker, seal, verify_files
from dtrain.files.keys import local_path
from dtrain.files.objstore import TIMEOUT_S, ObjectStore
from dtrain.files.store import CHECKPOINTS, LATEST, RECORD_FILES, SUPERSEDED, Store
from dtrain.files.store_protocol import Entry
from dtrain.files.streaming_upload import StreamingUpload


class RemoteStore(Store):
    """Checkpoints in `objects` (the run's prefix), a `CheckpointStore`; `run_dir` is this
    node's staging folder, where each rank writes its files of a save before it uploads them.
    `before_marker` is called before each marker is written: a run's records up to the
    checkpoint go up first, so that a resume from it never finds them short (a gap before its
    step)."""

    def __init__(
        self, run_dir: str, objects: ObjectStore, before_marker: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__(run_dir, objects.options, objects.timeout_s)
        self.objects = objects
        self.checkpoints = objects.child(CHECKPOINTS)
        self.location = self.checkpoints.url
        self.retries_saves = True  # a connection lost or the store overloaded: it passes
        self.before_marker = before_marker
        self._streamed: set[tuple[str, str]] = set()  # (save, file) uploaded as it was written
        self._lock = threading.Lock()  # DCP writes a rank's files in threads

    def complete(self) -> list[Entry]:
        entries = []
        for name in self.checkpoints.folders():
            marker = parse_marker(self.checkpoints.cat(f"{name}/{MARKER}"))
            if marker is not None:
                entries.append(Entry(name, self.checkpoints.url_of(name), marker))
        return sorted(entries, key=lambda e: (e.seq, e.step), reverse=True)

    def find(self, path: str) -> Entry | None:
        wanted = path.rstrip("/")
        return next((e for e in self.complete() if e.path == wanted), None)

    def prepare(self) -> None:
        """The node's staging folder; in the store, a folder without its marker is a save that
        was interrupted (the marker is written last): removed. One with a marker that cannot
        be trusted is moved aside, never deleted."""
        super().prepare()
        damaged = []
        for name in self.checkpoints.folders():
            data = self.checkpoints.cat(f"{name}/{MARKER}")
            if data is None:
                log.warning(f"removing incomplete checkpoint {self.checkpoints.url_of(name)}")
                self.checkpoints.rm(name, recursive=True)
            elif parse_marker(data) is None:
                damaged.append(Entry(name, self.checkpoints.url_of(name), {}))
        if damaged:
            self.supersede(damaged, f"no {MARKER} marker that can be trusted (damaged)")

    def streaming(self, name: str, rel: str) -> StreamingUpload:
        """The file `rel` of the save `name` goes up while it is written (its staging copy is
        written too, for its size and digest): `upload` then has nothing left to send of it."""
        with self._lock:
            self._streamed.add((name, rel))
        return StreamingUpload(self.checkpoints, f"{name}/{rel}")

    def upload(self, name: str, tmp: str, files: list[str]) -> None:
        """This rank's files of the save `name`, from its staging folder into the store (those
        not streamed while they were written); each local copy goes once it is up."""
        for rel in files:
            local = os.path.join(tmp, rel)
            with self._lock:
                streamed = (name, rel) in self._streamed
                self._streamed.discard((name, rel))
            if not streamed:
                self.checkpoints.put(local, f"{name}/{rel}")
            os.remove(local)

    def discard(self, name: str) -> None:
        """The files of a failed save, unless its marker got written (then it is complete)."""
        if self.checkpoints.cat(f"{name}/{MARKER}") is None:
            self.checkpoints.rm(name, recursive=True)

    def publish(
        self,
        name: str,
        tmp: str,
        marker: dict[str, Any],
        files: dict[str, int],
        digests: dict[str, str],
    ) -> str:
        """Once every file the save lists is in the store with its size: the marker (with the
        next save number and every file's digest), then `latest`."""
        existing = self.checkpoints.cat(f"{name}/{MARKER}")
        if existing is not None:  # a complete one of this name is kept, moved aside
            entry = Entry(name, self.checkpoints.url_of(name), parse_marker(existing) or {})
            self.supersede([entry], "a checkpoint of the same name")
        present = self.checkpoints.files(name)
        missing = [f for f, size in files.items() if present.get(f) != size]
        if missing:
            raise OSError(f"{missing[0]} did not arrive in the store with its size")
        if any(not digests.get(n) for n in files):
            raise OSError("a file of the save has no digest")
        newest = self.complete()
        marker = dict(
            marker,
            seq=(newest[0].seq if newest else 0) + 1,
            files=files,
            digest=ALGORITHM,
            digests={n: digests[n] for n in sorted(files)},
        )
        self.before_marker()
        self.checkpoints.pipe(f"{name}/{MARKER}", json.dumps(seal(marker), indent=1).encode())
        self.checkpoints.pipe(LATEST, (name + "\n").encode())
        shutil.rmtree(tmp, ignore_errors=True)
        return self.checkpoints.url_of(name)

    def delete(self, entry: Entry) -> None:
        # The marker first: a folder half deleted is never taken for a checkpoint.
        self.checkpoints.rm(f"{entry.name}/{MARKER}")
        self.checkpoints.rm(entry.name, recursive=True)

    def supersede(self, entries: list[Entry], reason: str, records: bool = False) -> str | None:
        """As on a disk: the entries (and with `records` the run's metrics and TensorBoard
        events) moved into `superseded/<time>/` in the store; this node's staging copies of
        the records go with them. Returns that folder's staging copy (for what the run sets
        aside after this), uploaded with the records."""
        present = set(self.checkpoints.folders())
        moving = [e for e in entries if e.name in present]
        record_names = self.objects.files() if records else {}
        extra = [
            f for f in RECORD_FILES if any(n == f or n.startswith(f + "/") for n in record_names)
        ]
        if not moving and not extra:
            return None
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = f"{SUPERSEDED}/{stamp}"
        suffix = 1
        while self.objects.exists(target):
            suffix += 1
            target = f"{SUPERSEDED}/{stamp}-{suffix}"
        for entry in moving:
            self.objects.move_tree(
                f"{CHECKPOINTS}/{entry.name}", f"{target}/{CHECKPOINTS}/{entry.name}"
            )
        for name in extra:
            if name in record_names:  # a file
                self.objects.copy(name, f"{target}/{name}", record_names[name])
                self.objects.rm(name)
            else:
                self.objects.move_tree(name, f"{target}/{name}")
            local = os.path.join(self.run_dir, name)
            if os.path.isdir(local):
                shutil.rmtree(local, ignore_errors=True)
            elif os.path.exists(local):
                os.remove(local)
        remaining = self.complete()
        if remaining:
            self.checkpoints.pipe(LATEST, (remaining[0].name + "\n").encode())
        else:
            self.checkpoints.rm(LATEST)
        what = ", ".join([e.name for e in moving] + list(extra))
        log.warning(f"{reason}: moved {what} aside to {self.objects.url_of(target)}")
        # What the run sets aside later (records dropped by a rewind) goes to the same folder
        # here, and is uploaded with the records.
        local = os.path.join(self.run_dir, target)
        os.makedirs(local, exist_ok=True)
        return local


def fetch_checkpoint(
    url: str,
    into: str,
    options: dict[str, Any],
    reads: Callable[[dict[str, Any]], bool] = lambda marker: True,
    timeout_s: float = TIMEOUT_S,
) -> str:
    """The checkpoint at `url` (its folder, or its checkpoint.pt) as a local folder below
    `into`: its marker and, when `reads(marker)` (this process reads the files of a checkpoint
    of that format), every file the marker lists, each checked for its size here and for its
    content digest as it is read (an ETag is not a digest of what dtrain wrote). A copy already
    there with the same marker and sizes is used as it is: the processes of a node that share
    `into` fetch it once between them (the first, under a lock; the others wait and use its
    copy)."""
    folder = url.rstrip("/")
    if folder.endswith(".pt"):
        folder = folder.rsplit("/", 1)[0]
    objects = ObjectStore(folder, options, timeout_s)
    parent, name = folder.rsplit("/", 1)
    local = local_path(into, name, parent)  # a folder the store lists: a stranger's name
    os.makedirs(into, exist_ok=True)
    with objects.failing_as("read"), open(os.path.join(into, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_once(objects, folder, url, local, reads)


def _fetch_once(
    objects: ObjectStore,
    folder: str,
    url: str,
    local: str,
    reads: Callable[[dict[str, Any]], bool],
) -> str:
    data = objects.cat(MARKER)
    if data is None:
        if objects.files():
            raise UserError(f"checkpoint error: {folder} has no {MARKER} marker (incomplete save)")
        raise UserError(f"checkpoint error: {url} not found")
    marker = parse_marker(data)
    if marker is None:
        raise UserError(
            f"checkpoint error: {folder}/{MARKER} is damaged or not a dtrain marker; name "
            f"another checkpoint"
        )
    # Every name the marker lists is checked on every process, before anything is written.
    paths = {rel: local_path(local, rel, folder) for rel in marker.get("files", {})}
    if _same_copy(local, data, marker):
        return local
    shutil.rmtree(local, ignore_errors=True)
    files = marker.get("files", {}) if reads(marker) else {}
    for rel in files:
        objects.get(rel, paths[rel])
    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, MARKER), "wb") as f:
        f.write(data)
    if files:
        log.info(f"fetched {folder} ({len(files)} files, {sum(files.values()):,} bytes)")
    return local


def _same_copy(local: str, data: bytes, marker: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(local, MARKER), "rb") as f:
            if f.read() != data:
                return False
    except OSError:
        return False
    return verify_files(local, marker) is None  # sizes; contents are checked as they are read

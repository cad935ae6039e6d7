"""A run in an object store keeps its records in this node's staging folder and uploads them:
every `run.upload_every_s` seconds, before every checkpoint's marker (a resume from it never finds
its records short) and at exit. A killed run loses at most the records since the last upload
(never a checkpoint: those are uploaded by the save itself).

Rank 0 mirrors the run's records (config.yaml, metrics.jsonl, trackers.json, log.txt, tb/,
profile/, evals/); every other rank its own log file. At the start, each fetches what it mirrors
from the store (the staging folder may be new, on another node, or stale), so that a resumed run
continues its records where the store has them.
"""

from __future__ import annotations

import os
import shutil
import threading

from dtrain.core.errors import first_line
from dtrain.core.logs import log
from dtrain.files import names
from dtrain.files.keys import local_path
from dtrain.files.objstore import ObjectStore

# Checkpoints are uploaded by their save, never by the mirror; superseded/ is moved aside in the
# store itself: only what the run sets aside there later (records a rewind dropped) is uploaded,
# and nothing of it is fetched at the start.
_NOT_MIRRORED = (names.CHECKPOINTS,)
_NOT_FETCHED = (names.CHECKPOINTS, names.SUPERSEDED)


class RecordMirror:
    def __init__(self, run_dir: str, objects: ObjectStore, every_s: float, rank: int) -> None:
        self.run_dir, self.objects, self.every_s, self.rank = run_dir, objects, every_s, rank
        self._uploaded: dict[str, tuple[int, int]] = {}  # name -> (size, mtime) when uploaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def _mine(self, name: str) -> bool:
        """Whether this rank mirrors the run directory's file `name` (relative)."""
        top = name.split("/", 1)[0]
        if names.is_log_file(top):
            return top == names.log_file(self.rank)
        if self.rank != 0 or top in _NOT_MIRRORED or top == names.LOCK:
            return False
        base = os.path.basename(name)
        return not base.startswith(".") and not base.endswith(".tmp")

    def clear(self) -> None:
        """Empty the staging folder (but its lock): the store holds the run; what a staging
        folder kept from an earlier attempt may be of a history the store has set aside."""
        for name in os.listdir(self.run_dir):
            if name == names.LOCK:
                continue
            path = os.path.join(self.run_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)

    def pull(self) -> None:
        """The records the store holds, into the staging folder (replacing what is there); a
        key that would land outside it is refused before anything is fetched."""
        wanted = {
            name: (local_path(self.run_dir, name, self.objects.url), size)
            for name, size in self.objects.files().items()
            if self._mine(name) and name.split("/", 1)[0] not in _NOT_FETCHED
        }
        for name, (local, size) in wanted.items():
            self.objects.get(name, local)
            self._uploaded[name] = (size, os.stat(local).st_mtime_ns)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._every, name="dtrain-records", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        """Upload what changed since the last upload. A failure is one warning (the records are
        still here; the next upload takes them)."""
        with self._lock:
            try:
                for name, seen in self._changed().items():
                    self.objects.put(os.path.join(self.run_dir, name), name)
                    self._uploaded[name] = seen
                self._warned = False
            except Exception as e:  # noqa: BLE001 - records never stop training
                if not self._warned:
                    log.warning(
                        f"run records: cannot upload to {self.objects.url} ({first_line(e)}); "
                        f"retried every {self.every_s:g} s"
                    )
                self._warned = True

    def stop(self, upload: bool = True) -> None:
        """The last upload, at exit (unless not `upload`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if upload:
            self.sync()

    def _every(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync()

    def _changed(self) -> dict[str, tuple[int, int]]:
        changed = {}
        for folder, dirs, files in os.walk(self.run_dir):
            rel_folder = os.path.relpath(folder, self.run_dir)
            if rel_folder == ".":
                dirs[:] = [d for d in dirs if d not in _NOT_MIRRORED]
            for file in files:
                name = file if rel_folder == "." else f"{rel_folder}/{file}"
                if not self._mine(name):
                    continue
                try:
                    info = os.stat(os.path.join(folder, file))
                except FileNotFoundError:
                    continue
                seen = (info.st_size, info.st_mtime_ns)
                if self._uploaded.get(name) != seen:
                    changed[name] = seen
        return changed

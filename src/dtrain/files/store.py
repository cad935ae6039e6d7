"""The run directory's store: who owns the directory, atomic files, markers, the order of saves,
rotation, and moving an abandoned history aside.

Layout of `<run dir>/`:

    .lock                                   held by rank 0 of the run that owns the directory
    checkpoints/
        step_000120-epoch_01-val_acc_0.9412/   one checkpoint (the name is for people)
            COMPLETE                        save number, step, format, every file's size and
                                            content digest (xxh3-128): written
                                            last into the temporary folder, whose rename into
                                            place makes the checkpoint complete
        latest                              the name of the newest complete checkpoint
        .tmp-step_.../                      a save in progress (never loaded; removed at start-up)
    superseded/<time>/                      checkpoints (and records) of a history that was left:
                                            a fresh start, a rewind, a damaged checkpoint

Order is the order of saves: every marker carries a save number (`seq`), one more than the
largest in the folder. Rotation, `latest` and resuming follow it, never the step in a name, so
a rewind or a fresh start can never be mistaken for the newest state of the run.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import shutil
import socket
from collections.abc import Mapping
from typing import Any

from dtrain.core.errors import CheckpointError, UserError, first_line
from dtrain.core.logs import log
from dtrain.core.monitor import best_order
from dtrain.files import names
from dtrain.files.digests import ALGORITHM, MARKER, file_digest, read_marker, seal
from dtrain.files.objstore import TIMEOUT_S
from dtrain.files.store_protocol import Entry, Upload

LATEST = "latest"
LOCK_FILE = names.LOCK
CHECKPOINTS = names.CHECKPOINTS
SUPERSEDED = names.SUPERSEDED
TMP_PREFIX = ".tmp-"
FETCHED_PREFIX = ".fetched-"  # a checkpoint of an object store, copied here to be read
# What a run leaves beside its checkpoints that belongs to the same history.
RECORD_FILES = (names.METRICS, names.TENSORBOARD)


# ---------------------------------------------------------------------------------------------
# Small file-system helpers


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write `path` so that a reader sees the old content or the new one, never a mix."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


def checkpoint_name(step: int, epoch: int, monitor: str, value: float | None) -> str:
    name = f"step_{step:06d}-epoch_{epoch:02d}"
    return name if value is None else f"{name}-{monitor}_{value:.4f}"


# ---------------------------------------------------------------------------------------------
# One run directory, one owner


def check_run_dir_entries(run_dir: str, only: tuple[str, ...] | None = None) -> None:
    """What a run writes directly in its directory is a file or a folder of its own: never a
    symbolic link (a write would go through it, outside the run), never a folder where a file
    goes or the other way round. One UserError naming the first that is not, before anything is
    written; `only` checks those names alone (dtrain eval writes evals/ only)."""
    try:
        present = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    for name in present:
        if only is not None and name not in only:
            continue
        is_file = name in names.RUN_FILES or names.is_log_file(name)
        is_folder = name in names.RUN_FOLDERS
        if not (is_file or is_folder):
            continue
        path = os.path.join(run_dir, name)
        if os.path.islink(path):
            raise UserError(
                f"run error: {path} is a symbolic link; dtrain writes inside its run directory "
                f"and never through a link: remove the link (or give the run another run.name)"
            )
        if is_file and os.path.isdir(path):
            raise UserError(
                f"run error: {path} is a directory where dtrain writes a file; move it away "
                f"(or give the run another run.name)"
            )
        if is_folder and not os.path.isdir(path):
            raise UserError(
                f"run error: {path} is a file where dtrain keeps its {name}/ folder; move it "
                f"away (or give the run another run.name)"
            )


class RunDirLock:
    """An exclusive lock on `<run dir>/.lock`, held by rank 0 for the whole run.

    A POSIX record lock (`fcntl.lockf`): the kernel releases it when the process dies, however
    it dies, so a killed run never leaves a stale lock; and unlike `flock` it is not inherited by
    forked data-loader workers, which could otherwise keep it for seconds after their parent was
    killed. The file names the holder, for the message a second launch gets.
    """

    def __init__(self, run_dir: str, shown: str | None = None) -> None:
        self.run_dir = run_dir
        self.shown = shown or run_dir  # the run it keeps, for messages: a store's run by its URL
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self, job_id: str | None) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # e.g. ENOLCK: no locks on this FS
                os.close(fd)
                log.warning(
                    f"cannot lock {self.path} ({e.strerror}); two runs in this directory "
                    f"would not be kept apart"
                )
                return
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(
                f"run error: the run directory {self.shown} is in use by another run "
                f"({holder}); wait for it to end, or give this run another run.name"
            ) from None
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        this_run = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": job_id,
            "started": started,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_run).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        holder = {}
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("job"):
        parts.append(f"SLURM job {holder['job']}")
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Checkpoints in the order they were saved


class Store:
    """The checkpoints of one run directory on this disk (a `CheckpointStore`). Only rank 0
    changes it. `options` and `timeout_s`: the object store's (run.storage_options,
    run.store_timeout_s), for a checkpoint named by its URL (ckpt.resume)."""

    def __init__(
        self,
        run_dir: str,
        options: Mapping[str, Any] | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.run_dir = run_dir
        self.dir = os.path.join(run_dir, CHECKPOINTS)  # where saves are written first
        self.location = self.dir  # where the checkpoints are, for messages
        self.options = dict(options or {})
        self.timeout_s = timeout_s
        self.retries_saves = False  # a disk fails for reasons that stay (full, read-only)

    def streaming(self, name: str, rel: str) -> Upload | None:
        """None: a file of a save on this disk is written where it stays."""
        return None

    def upload(self, name: str, tmp: str, files: list[str]) -> None:
        """Each rank's own files of a save, where the store is not this disk (a no-op here)."""

    def discard(self, name: str) -> None:
        """What a failed save left where the store is not this disk (a no-op here)."""

    def complete(self) -> list[Entry]:
        """The complete checkpoints, newest (last saved) first."""
        if not os.path.isdir(self.dir):
            return []
        entries = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            marker = read_marker(path)
            if marker is not None:
                entries.append(Entry(name, path, marker))
        # Markers of the first version had no save number: among those the step decides.
        return sorted(entries, key=lambda e: (e.seq, e.step), reverse=True)

    def find(self, path: str) -> Entry | None:
        """The entry of this store that `path` names, or None for a checkpoint elsewhere."""
        real = os.path.realpath(path)
        return next((e for e in self.complete() if os.path.realpath(e.path) == real), None)

    def prepare(self) -> None:
        """Create the folder; remove what interrupted saves left (their temporary folders only).
        A checkpoint folder without a marker that can be trusted (one damaged after it was
        written, or copied in without it) is moved aside, never deleted: it may be all there is."""
        os.makedirs(self.dir, exist_ok=True)
        unmarked = []
        for name in sorted(os.listdir(self.dir)):
            path = os.path.join(self.dir, name)
            if not os.path.isdir(path):
                continue
            if name.startswith(TMP_PREFIX):
                log.warning(f"removing incomplete checkpoint {path}")
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(FETCHED_PREFIX):  # a copy a killed resume left
                shutil.rmtree(path, ignore_errors=True)
            elif read_marker(path) is None:
                unmarked.append(Entry(name, path, {}))
        if unmarked:
            self.supersede(unmarked, f"no {MARKER} marker that can be trusted (damaged or missing)")

    def begin(self, name: str) -> str:
        """A fresh temporary folder for the save of `name`."""
        tmp = os.path.join(self.dir, TMP_PREFIX + name)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        return tmp

    def publish(
        self,
        name: str,
        tmp: str,
        marker: dict[str, Any],
        files: dict[str, int],
        digests: dict[str, str],
    ) -> str:
        """After every file is on disk (fsynced by its writer): the marker (with the next save
        number, and the digest of every file: computed by its writer, or here for one that has
        none) goes into the temporary folder, and renaming the folder into place is the one
        step that makes the checkpoint complete; then `latest`. Three fsyncs beyond the data's:
        the marker, the temporary folder, the checkpoints folder. `latest` is for people and
        tools (resuming follows the markers), so it is replaced atomically but not fsynced.
        Returns the checkpoint's folder."""
        final = os.path.join(self.dir, name)
        if os.path.exists(final):  # only an incomplete one can be there; a complete one is kept
            existing = read_marker(final)
            self.supersede([Entry(name, final, existing or {})], "a checkpoint of the same name")
        newest = self.complete()
        digests = {n: digests.get(n) or file_digest(os.path.join(tmp, n)) for n in sorted(files)}
        marker = dict(
            marker,
            seq=(newest[0].seq if newest else 0) + 1,
            files=files,
            digest=ALGORITHM,
            digests=digests,
        )
        write_atomic(
            os.path.join(tmp, MARKER), json.dumps(seal(marker), indent=1).encode()
        )  # + fsync(tmp)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        latest = os.path.join(self.dir, LATEST)
        with open(latest + ".tmp", "w", encoding="utf-8") as f:
            f.write(name + "\n")
        os.replace(latest + ".tmp", latest)
        return final

    def rotate(self, keep_last: int, keep_best: int, monitor: str, mode: str) -> None:
        """Keep the `keep_last` last saved and the `keep_best` best complete checkpoints."""
        entries = self.complete()
        keep = {e.name for e in entries[:keep_last]}
        metrics = [(e.metric(monitor), e) for e in entries]
        scored = [(v, e) for v, e in metrics if v is not None and math.isfinite(v)]
        scored.sort(key=lambda item: best_order(item[0], item[1].step, mode))
        keep.update(e.name for _, e in scored[:keep_best])
        for entry in entries:
            if entry.name not in keep:
                self.delete(entry)

    def delete(self, entry: Entry) -> None:
        shutil.rmtree(entry.path, ignore_errors=True)

    def best(self, monitor: str, mode: str) -> Entry | None:
        metrics = [(e.metric(monitor), e) for e in self.complete()]
        scored = [(v, e) for v, e in metrics if v is not None and math.isfinite(v)]
        if not scored:
            return None
        return min(scored, key=lambda item: best_order(item[0], item[1].step, mode))[1]

    def supersede(self, entries: list[Entry], reason: str, records: bool = False) -> str | None:
        """Move `entries` (and with `records`, the run's metrics and TensorBoard events) out of
        the way into `superseded/<time>/`, so that they never mix with the history that goes on.
        Nothing is deleted. Returns the folder they went to (None when there was nothing)."""
        moving = [e for e in entries if os.path.exists(e.path)]
        extra = [
            f for f in RECORD_FILES if records and os.path.exists(os.path.join(self.run_dir, f))
        ]
        if not moving and not extra:
            return None
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        target = os.path.join(self.run_dir, SUPERSEDED, stamp)
        suffix = 1
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(self.run_dir, SUPERSEDED, f"{stamp}-{suffix}")
        os.makedirs(os.path.join(target, CHECKPOINTS))
        for entry in moving:
            os.replace(entry.path, os.path.join(target, CHECKPOINTS, entry.name))
        for name in extra:
            os.replace(os.path.join(self.run_dir, name), os.path.join(target, name))
        remaining = self.complete()
        latest = os.path.join(self.dir, LATEST)
        if remaining:
            write_atomic(latest, (remaining[0].name + "\n").encode())
        elif os.path.exists(latest):
            os.remove(latest)
        what = ", ".join([e.name for e in moving] + list(extra))
        log.warning(f"{reason}: moved {what} aside to {target}")
        return target


def error_of_save(
    error: BaseException, name: str, folder: str, needed: int, where: str | None = None
) -> CheckpointError:
    """A failed write as one line: disk full (with the space it needed), or what the OS (or the
    object store at `where`) said."""
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else needed
    causes = [error, *(getattr(error, "failures", {}) or {}).values()]
    causes = [c[0] if isinstance(c, tuple) else c for c in causes]
    # torch.save reports a failed write as a RuntimeError, not as the OSError beneath it.
    if any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes) or free < needed:
        return CheckpointError(
            f"checkpoint error: disk full while saving {name}: it needs about "
            f"{needed / 2**20:.2f} MiB, {free / 2**20:.2f} MiB free in {folder}; "
            f"the previous checkpoint is kept"
        )
    os_error = next((c for c in causes if isinstance(c, OSError)), None)
    reason = str(os_error) if os_error is not None else first_line(error)
    return CheckpointError(
        f"checkpoint error: cannot write {name} in {where or folder}: {reason}; the "
        f"previous checkpoint is kept"
    )

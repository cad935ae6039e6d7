"""`<run.out_dir>/runs.csv`, the table of runs: its columns, how it is read, and how a row is
changed (under an exclusive lock, the whole table renamed into place: readers never see half a
table). What each column says is the run record's (run/records.py)."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import os
import random
import time
from collections.abc import Callable, Iterator

from dtrain.core.logs import log
from dtrain.files import names
from dtrain.files.objstore import ObjectStore, PreconditionFailed

COLUMNS = (
    "name",
    "status",
    "started",
    "wall_time_s",
    "attempts",
    "step",
    "world_size",
    "monitor",
    "best_metric",
    "best_checkpoint",
    "git_commit",
    "config_hash",
    "mode",
    "model",
    "data",
    "optimizer",
    "lr",
    "effective_batch",
    "epochs",
    "max_steps",
    "precision",
    "seed",
    "error",
    "world_size_changes",
    "slurm_job",
)


def read(path: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Rows by name, in file order, and columns this version does not know (kept as they are).
    A line that cannot be read (not UTF-8, a NUL byte: a damaged file) is left out with a
    warning, and the next write of the table drops it: the record is a convenience, and never
    stops a run or `dtrain runs`."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}, []
    return parse(raw, path)


def parse(raw: bytes, path: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """`read`'s rows and extra columns from the table's bytes (read from a disk or a store)."""
    lines, damaged = [], 0
    for line in raw.splitlines(keepends=True):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            damaged += 1
            continue
        if "\0" in text:
            damaged += 1
            continue
        lines.append(text)
    if damaged:
        log.warning(
            f"run records: {path}: left out {damaged} line(s) that cannot be read (damaged); "
            f"the other rows are kept"
        )
    # (a csv.Error here, a table that is not CSV at all, is the caller's: a writer leaves the
    # table as it is)
    reader = csv.DictReader(io.StringIO("".join(lines), newline=""))
    rows = {row["name"]: row for row in reader if row.get("name")}
    extra = [c for c in reader.fieldnames or () if c not in COLUMNS]
    return rows, extra


@contextlib.contextmanager
def locked(path: str) -> Iterator[dict[str, dict[str, str]]]:
    """The rows by run name, under an exclusive lock; written back (temp file + rename) on exit."""
    with open(path + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:  # some cluster file systems (Lustre without -o flock) refuse locks
            log.warning(f"run records: cannot lock {path}.lock ({e.strerror}); writing without it")
        rows, extra_columns = read(path)
        yield rows
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(render(rows, extra_columns))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):  # a failed write leaves the old table as it was
                os.remove(tmp)


def render(rows: dict[str, dict[str, str]], extra_columns: list[str]) -> bytes:
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=[*COLUMNS, *extra_columns], restval="")
    writer.writeheader()
    writer.writerows(rows.values())
    return out.getvalue().encode("utf-8")


class Table:
    """runs.csv of an out_dir on a disk (`path`) or in an object store (`objects`, the out_dir's
    prefix). A change in the store rewrites the table only if it is still the version that was
    read (If-Match; If-None-Match for a new one), and reads it again when another run changed
    it meanwhile: two runs of one out_dir never lose each other's rows."""

    def __init__(self, path: str, objects: ObjectStore | None = None) -> None:
        self.path, self.objects = path, objects

    def read(self) -> dict[str, dict[str, str]]:
        if self.objects is None:
            return read(self.path)[0]
        return parse(self.objects.cat(names.RUNS_CSV) or b"", self.path)[0]

    def change(self, edit: Callable[[dict[str, dict[str, str]]], None]) -> None:
        if self.objects is None:
            with locked(self.path) as rows:
                edit(rows)
            return
        try:
            for _ in range(20):
                raw, etag = self.objects.read_with_etag(names.RUNS_CSV)
                rows, extra = parse(raw or b"", self.path)
                edit(rows)
                try:
                    self.objects.replace(names.RUNS_CSV, render(rows, extra), etag)
                    return
                except PreconditionFailed:
                    time.sleep(0.05 + random.random() * 0.2)
        except (OSError, csv.Error):
            raise
        except Exception as e:  # the store's own errors (a connection lost) read as a disk's
            raise OSError(str(e)) from e
        raise OSError(f"{self.path} changed 20 times while this run wrote its row")

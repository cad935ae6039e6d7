"""`<run.out_dir>/runs.csv`, the table of runs: its columns, how it is read, and how a row is
changed (under an exclusive lock, the whole table renamed into place: readers never see half a
table). What each column says is the run record's (run/records.py)."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import os
from collections.abc import Iterator

from dtrain.core.logs import log

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
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra_columns], restval="")
                writer.writeheader()
                writer.writerows(rows.values())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):  # a failed write leaves the old table as it was
                os.remove(tmp)

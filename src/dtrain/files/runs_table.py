"""`<run.out_dir>/runs.csv`, the table of runs: its columns, how it is read, and how a row is
changed (under an exclusive lock, the whole table renamed into place: readers never see half a
table). What each column says is the run record's (run/records.py)."""

from __future__ import annotations

import contextlib
import csv
import fcntl
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
    """Rows by name, in file order, and columns this version does not know (kept as they are)."""
    if not os.path.exists(path):
        return {}, []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
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

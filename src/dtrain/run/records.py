"""Run records: `<run.out_dir>/runs.csv`, one row per run directory, so that every past run is
found in one table (`dtrain runs`).

Rank 0 of a run writes its row at the start (status running), after every checkpoint and at the
end (finished, preempted, stopped_early or failed). Runs sharing an out_dir may write at the same
moment: each write holds an exclusive lock on `runs.csv.lock`, reads the table, replaces its own
row and renames a complete new file into place, so that readers never see a half-written table.

A resumed run (same name, with a checkpoint to resume from) keeps its row's start time and adds up
the wall time of its attempts. A run killed outright (SIGKILL, a lost node) cannot write: its row
says running until it is resumed.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import os
import subprocess
import time
from typing import Any

import yaml

from dtrain.config import CkptConfig, Config, to_dict
from dtrain.core.columns import aligned
from dtrain.core.errors import UserError
from dtrain.files import names, runs_table
from dtrain.files.objstore import ObjectStore, StoreUnanswered, is_url, join
from dtrain.files.resume_policy import training_part
from dtrain.files.store_protocol import CheckpointStore
from dtrain.observe import clock, log
from dtrain.process import slurm
from dtrain.process.layout import Layout

# What keeps a run's row from being written: a full disk, a store that does not answer, a table
# that is not one. The record is a convenience: training goes on, with a warning.
UNRECORDED = (OSError, csv.Error, StoreUnanswered)

FILE = names.RUNS_CSV
# What `dtrain runs` shows, and under which heading.
SHOWN = (
    ("name", "run"),
    ("status", "status"),
    ("started", "started"),
    ("wall_time_s", "wall"),
    ("step", "step"),
    ("world_size", "world"),
    ("best", "best"),
    ("best_checkpoint", "best checkpoint"),
    ("model", "model"),
    ("optimizer", "optim"),
    ("lr", "lr"),
    ("effective_batch", "batch"),
    ("git_commit", "commit"),
    ("config_hash", "config"),
)
# What the table leaves out first where it would be wider than a terminal.
DROPPED = ("config", "commit", "batch", "lr", "optim", "model", "world", "started")


def config_hash(cfg: Config) -> str:
    """Equal for runs that train the same thing: the resolved config without the keys that do
    not change what is trained (files.resume_policy: name, place, logging, checkpoints, ...)."""
    data = training_part(to_dict(cfg))
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()[:12]


def git_commit(cwd: str) -> str:
    """HEAD of the git work tree the run was started from, with '-dirty' when tracked files differ
    from it; '' outside a work tree or without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return ""
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def best_checkpoint(store: CheckpointStore, monitor: str, mode: str) -> str:
    """The complete checkpoint with the best `monitor` value, as an absolute path or a URL (the
    table may be read from another directory); '' when none has one."""
    best = store.best(monitor, mode)
    if best is None:
        return ""
    return best.path if is_url(best.path) else os.path.abspath(best.path)


def describe(cfg: Config, layout: Layout) -> dict[str, str]:
    """What a run's row says of what it trains (the assembly's part: the record itself never
    reads the config)."""
    return {
        "monitor": cfg.ckpt.monitor,
        "config_hash": config_hash(cfg),
        "mode": cfg.parallel.mode,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "optimizer": cfg.optim.name,
        "lr": str(cfg.optim.lr),
        "effective_batch": str(layout.effective_batch),
        "epochs": str(cfg.train.epochs),
        "max_steps": str(cfg.train.max_steps or ""),
        "precision": cfg.train.precision,
        "seed": str(cfg.run.seed),
    }


class RunRecord:
    """This run's row in `out_dir`'s table. Every method is a no-op except on rank 0 once
    `start` has run. `described` is the row's account of the config (`describe`); `ckpt` says
    whether the run resumes and what its best checkpoint is judged by."""

    def __init__(
        self,
        out_dir: str,
        name: str,
        described: dict[str, str],
        ckpt: CkptConfig,
        world_size: int,
        is_main: bool,
        objects: ObjectStore | None = None,
    ) -> None:
        """`objects`: the out_dir's prefix in an object store, where it is one."""
        self.name, self.described, self.ckpt = name, described, ckpt
        self.world_size, self.is_main = world_size, is_main
        self.path = join(out_dir, FILE) if objects else os.path.join(out_dir, FILE)
        self.table = runs_table.Table(self.path, objects)
        self.store: CheckpointStore | None = None
        self.started = False
        self.ended = False
        self.attempt_start = time.monotonic()
        self.earlier_wall_s = 0.0

    def start(self, store: CheckpointStore, resuming: bool) -> None:
        """Write the row as running; a run that resumed a checkpoint continues its earlier
        row. Called once every check of the launch has passed: a refused launch leaves the row
        as it was."""
        if not self.is_main:
            return
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        name = self.name
        row = {
            "name": name,
            "status": "running",
            "started": now,
            "wall_time_s": "0",
            "attempts": "1",
            "step": "0",
            "world_size": str(self.world_size),
            "best_metric": "",
            "best_checkpoint": "",
            "git_commit": git_commit(os.getcwd()),
            **self.described,
            "error": "",
            # `<array job>_<task>` for a task of a job array (a sweep's trial), as squeue shows it
            "slurm_job": slurm.job_label(os.environ.get("SLURM_JOB_ID")) or "",
        }

        def edit(rows: dict[str, dict[str, str]]) -> None:
            earlier = rows.get(name)
            new = dict(row)
            if resuming and earlier is not None:
                self.earlier_wall_s = _float(earlier.get("wall_time_s"))
                new.update(
                    started=earlier.get("started") or now,
                    attempts=str(int(_float(earlier.get("attempts"))) + 1),
                    step=earlier.get("step") or "0",
                    best_metric=earlier.get("best_metric", ""),
                    best_checkpoint=earlier.get("best_checkpoint", ""),
                    world_size_changes=earlier.get("world_size_changes", ""),
                )
            rows[name] = new

        try:
            self.table.change(edit)
        except UNRECORDED as e:  # the record is a convenience: training goes on
            log.warning(f"run records: cannot write {self.path} ({e}); this run is not recorded")
            return
        self.store = store
        self.started = True

    def update(self, state: Any, status: str = "running") -> None:
        """After a checkpoint (running) and at the end (finished, preempted or stopped_early)."""
        if not self.started or self.ended:
            return
        ckpt = self.ckpt
        fields = {"status": status, "step": str(state.step)}
        try:
            if self.store is not None:
                fields["best_checkpoint"] = best_checkpoint(
                    self.store, ckpt.monitor, ckpt.monitor_mode
                )
        except Exception as e:  # noqa: BLE001 - a store out of reach: the row says it next time
            log.warning(f"run records: cannot list the checkpoints for {self.path} ({e})")
        if state.best_metric is not None:
            fields["best_metric"] = f"{state.best_metric:.6g}"
        self._write(fields)
        self.ended = status != "running"

    def world_size_changed(self, before: int, after: int, step: int) -> None:
        """A resume at another world size (an elastic run losing or gaining a node): one entry
        `A->B@step` per change in the row's world_size_changes, oldest first."""
        if not self.started or self.ended:
            return

        def edit(rows: dict[str, dict[str, str]]) -> None:
            row = rows.setdefault(self.name, {"name": self.name})
            earlier = [e for e in (row.get("world_size_changes") or "").split(";") if e]
            row["world_size_changes"] = ";".join([*earlier, f"{before}->{after}@{step}"])

        try:
            self.table.change(edit)
        except UNRECORDED as e:
            log.warning(f"run records: cannot update {self.path} ({e})")

    def fail(self, error: BaseException) -> None:
        """The run ended with an exception: status failed, with the error's first line."""
        if not self.started or self.ended:
            return
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self.ended = True
        self._write({"status": "failed", "error": f"{type(error).__name__}: {message}"[:200]})

    def _write(self, fields: dict[str, str]) -> None:
        wall = self.earlier_wall_s + time.monotonic() - self.attempt_start

        def edit(rows: dict[str, dict[str, str]]) -> None:
            row = rows.setdefault(self.name, {"name": self.name})
            row.update(fields, wall_time_s=f"{wall:.1f}", world_size=str(self.world_size))

        try:
            self.table.change(edit)
        except UNRECORDED as e:  # a full disk must not end the run (or hide its error)
            log.warning(f"run records: cannot update {self.path} ({e})")


def mark_failed(out_dir: str, name: str, error: str) -> None:
    """The row of a run that ended badly without saying so (it failed before its record started,
    or was killed outright) says failed, with `error` unless it named its own."""
    with runs_table.locked(os.path.join(out_dir, FILE)) as rows:
        row = rows.setdefault(name, {"name": name, "status": "failed"})
        if row.get("status") != "failed" or not row.get("error"):
            row.update(status="failed", error=row.get("error") or error)


def read(out_dir: str) -> dict[str, dict[str, str]]:
    """The rows of `out_dir/runs.csv` (on a disk or in an object store) by run name, in file
    order; none without the file. A file that is not a table of runs at all is one line (exit
    2), as is a store that cannot be read."""
    objects = ObjectStore(out_dir) if is_url(out_dir) else None
    path = join(out_dir, FILE) if objects else os.path.join(out_dir, FILE)
    try:
        return runs_table.Table(path, objects).read()
    except csv.Error as e:
        raise UserError(
            f"runs error: {path} is not a table of runs ({e}); move it away to start a new one"
        ) from None
    except OSError as e:
        if objects is None:
            raise
        raise objects.error(e, "read") from None


def _float(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def table(out_dir: str) -> str:
    """`dtrain runs`: the records of `out_dir` as an aligned text table, oldest first."""
    if not is_url(out_dir) and not os.path.isdir(out_dir):
        raise UserError(
            f"runs error: '{out_dir}' is not a directory; pass the run.out_dir of "
            f"your runs with --out-dir"
        )
    rows = read(out_dir)
    if not rows:
        where = join(out_dir, FILE) if is_url(out_dir) else os.path.join(out_dir, FILE)
        return f"no runs recorded in {where}"
    lines = []
    for row in rows.values():
        shown = dict(row)
        shown["started"] = (row.get("started") or "")[:16].replace("T", " ")
        shown["wall_time_s"] = clock(_float(row.get("wall_time_s")), always_hours=True)
        shown["best"] = (
            f"{row.get('monitor')} {row['best_metric']}" if row.get("best_metric") else ""
        )
        best = row.get("best_checkpoint") or ""
        if best.startswith(out_dir.rstrip("/") + "/"):  # relative to out_dir: a narrow table
            best = best[len(out_dir.rstrip("/")) + 1 :]
        elif best and not is_url(best):
            best = os.path.relpath(best, out_dir)
        # one of the run's own checkpoints: its name (the row names the run)
        shown["best_checkpoint"] = best.removeprefix(f"{row.get('name')}/{names.CHECKPOINTS}/")
        shown["git_commit"] = (row.get("git_commit") or "")[:10] + (
            "-dirty" if (row.get("git_commit") or "").endswith("-dirty") else ""
        )
        lines.append([shown.get(key) or "-" for key, _ in SHOWN])
    header = [title for _, title in SHOWN]
    text = aligned(header, lines, [header.index(title) for title in DROPPED], f"{FILE} has them")
    failed = [row for row in rows.values() if row.get("status") == "failed" and row.get("error")]
    text += [f"{row['name']}: {row['error']}" for row in failed]
    return "\n".join(text)

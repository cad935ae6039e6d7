"""A sweep folder's own files as `dtrain sweep` writes them and its trials read them:
`sweep.yaml` (the trials, their names, overrides and run directories) and the trials' run
records (`runs.csv`)."""

from __future__ import annotations

import os
from typing import Any

import yaml

from dtrain import config
from dtrain.commands.sweep import space as sweep_space
from dtrain.core.errors import UserError
from dtrain.files import names, runs_table
from dtrain.files.outputs import output_error
from dtrain.files.sweeps import NotASweep, read_sweep

FILE = names.SWEEP
DONE = ("finished", "stopped_early")  # statuses a re-run does not launch again


def load_sweep(folder: str) -> dict[str, Any] | None:
    """The folder's sweep.yaml as a mapping; None when the folder has none. A file that is not
    a sweep.yaml of this format is a UserError naming it."""
    try:
        return read_sweep(folder)
    except NotASweep as e:
        raise foreign_file(e.path, e.why) from None


def foreign_file(path: str, why: str) -> UserError:
    return UserError(
        f"sweep error: {path} {why}; this folder holds something other than a dtrain sweep: "
        f"give the sweep another --name (or run.out_dir)"
    )


def statuses(folder: str) -> dict[str, dict[str, str]]:
    """The run records of the folder's runs (runs.csv) by run name; {} before any."""
    return runs_table.read(os.path.join(folder, names.RUNS_CSV))[0]


def trial_overrides(data: dict[str, Any], folder: str, trial: dict[str, Any]) -> list[str]:
    """The overrides a trial runs with: the fixed ones, its own, and its run directory (in this
    folder, wherever the folder has moved since)."""
    own = [sweep_space.override(k, v) for k, v in trial["overrides"].items()]
    # A fixed run.out_dir placed the sweep folder; the trial's own is that folder.
    fixed = [w for w in data["fixed"] if config.parse_override(w)[0] != "run.out_dir"]
    return [*fixed, *own, f"run.out_dir={folder}", f"run.name={trial['name']}"]


def trial_for_task(
    path: str, index: int | None, environ: dict[str, str] | os._Environ[str]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`dtrain train --sweep PATH [--trial I]`: the sweep, the trial (--trial, else the SLURM
    array task's id) and its overrides."""
    folder = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    data = load_sweep(folder)
    if data is None:
        raise UserError(f"sweep error: no {FILE} in {folder}; make the sweep with dtrain sweep")
    if index is None:
        task = environ.get("SLURM_ARRAY_TASK_ID")
        if task is None or not task.isdigit():
            raise UserError(
                "sweep error: which trial? pass --trial I, or run as a task of the SLURM array "
                "that dtrain sweep --slurm submits (SLURM_ARRAY_TASK_ID)"
            )
        index = int(task)
    trial = next((t for t in data["trials"] if t.get("index") == index), None)
    if trial is None:
        raise UserError(
            f"sweep error: sweep {data.get('name')} has no trial {index} (it has "
            f"{len(data['trials'])}: 0-{len(data['trials']) - 1})"
        )
    return data, trial, trial_overrides(data, folder, trial)


def write(folder: str, data: dict) -> None:
    """sweep.yaml, atomically: a reader (an array task starting) sees the old file or the new.
    A folder that cannot be written (read-only, full) is one line, the old file kept."""
    path = os.path.join(folder, FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f, sort_keys=False, width=100)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise output_error("sweep", folder, e) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

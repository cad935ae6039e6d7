"""`dtrain runs DIR`: the runs of a sweep folder, or of any run.out_dir, side by side.

One row per run: its name, the swept keys' values, its status (with the exit reason of a failed
run), step and epoch, the best value of its `ckpt.monitor` and the step it was reached at, and
its wall time; best run first. What it reads, all of it written by the runs themselves:

- `DIR/sweep.yaml` (a sweep folder): the trials, their names and swept values. A trial that has
  no row in runs.csv yet is `pending`.
- `DIR/runs.csv` (run/records.py): status, error, wall time, the step of the last checkpoint.
- `DIR/<run>/config.yaml`: `ckpt.monitor` and `ckpt.monitor_mode`; without a sweep.yaml, the
  training keys whose values differ between the runs stand in for the swept keys.
- `DIR/<run>/metrics.jsonl`: the last record's step and epoch (later than the last checkpoint
  while a run goes on), and the best `ckpt.monitor` value with its step.

"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import yaml

from dtrain.core.columns import aligned
from dtrain.core.errors import UserError
from dtrain.core.monitor import best_first, improves
from dtrain.files import metrics as metrics_file
from dtrain.files import names
from dtrain.files.keys import local_path
from dtrain.files.objstore import ObjectStore, is_url, join
from dtrain.files.sweeps import SWEEP_FILE, NotASweep, overrides_of, read_sweep, swept_keys

# Rows without a best value come after those with one, in this order (then folder order).
_UNRANKED = ("running", "preempted", "finished", "stopped_early", "failed", "pending")
# The row's fields besides the swept keys, in the order csv and json give them.
FIELDS = (
    "name",
    "status",
    "step",
    "epoch",
    "monitor",
    "monitor_mode",
    "best",
    "best_step",
    "wall_time_s",
    "error",
    "best_checkpoint",
    "run_dir",
)


def collect(folder: str, shown: str | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """The swept keys and one row per run of `folder` (a sweep folder or a run.out_dir), best
    first. A folder that is neither is a UserError naming it as `shown` (default: `folder`)."""
    from dtrain.run import records

    shown = shown or folder
    if not os.path.isdir(folder):
        raise UserError(
            f"runs error: '{shown}' is not a directory; pass a sweep folder or the "
            f"run.out_dir of your runs"
        )
    try:
        sweep = read_sweep(folder)
    except NotASweep as e:
        raise UserError(f"runs error: {e}; move it away or pass another folder") from None
    if sweep is None and not os.path.isfile(os.path.join(folder, records.FILE)):
        hint = (
            f" ('{shown}' is one run's directory: pass its parent)"
            if os.path.isfile(os.path.join(folder, names.CONFIG))
            else ""
        )
        raise UserError(
            f"runs error: '{shown}' holds neither {SWEEP_FILE} nor {records.FILE}; pass a "
            f"sweep folder or the run.out_dir of your runs{hint}"
        )
    recorded = records.read(folder)
    # A sweep's trials first, in its order, then any other run recorded in the folder.
    runs: dict[str, tuple[str, dict[str, Any] | None]] = {}
    for trial in sweep["trials"] if sweep else []:
        runs[trial["name"]] = (_trial_dir(folder, trial), overrides_of(trial))
    for name in recorded:
        runs.setdefault(name, (os.path.join(folder, name), None))
    configs = {name: _config(run_dir) for name, (run_dir, _) in runs.items()}
    keys = swept_keys(sweep) if sweep else _differing_keys(list(configs.values()))
    rows = []
    for name, (run_dir, overrides) in runs.items():
        row = _row(name, run_dir, recorded.get(name), configs[name])
        for key in keys:
            if overrides is not None and key in overrides:
                row[key] = overrides[key]
            else:
                row[key] = _lookup(configs[name], key)
        rows.append(row)
    return keys, sorted(rows, key=_rank(rows))


def _trial_dir(folder: str, trial: dict[str, Any]) -> str:
    # The folder may have been moved or copied since the sweep wrote its absolute paths.
    here = os.path.join(folder, trial["name"])
    written = trial.get("run_dir")
    if os.path.isdir(here) or not isinstance(written, str) or not os.path.isdir(written):
        return os.path.abspath(here)
    return written


def _config(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, names.CONFIG), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    """data['optim']['lr'] for 'optim.lr' (also inside model.args), None when absent."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The training keys (resume_policy.training_part) whose values are not the same in every
    run: the columns that tell runs apart when no sweep.yaml names them."""
    from dtrain.files.resume_policy import training_part

    flat = [training_part(c) for c in configs if c]
    keys: dict[str, None] = {}
    for config in flat:
        keys.update(dict.fromkeys(config))
    return [
        k
        for k in keys
        if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in flat}) > 1
    ]


def _row(
    name: str, run_dir: str, record: dict[str, str] | None, config: dict[str, Any]
) -> dict[str, Any]:
    ckpt = config.get("ckpt")
    ckpt = ckpt if isinstance(ckpt, dict) else {}
    monitor = ckpt.get("monitor") or (record or {}).get("monitor") or None
    mode = "min" if ckpt.get("monitor_mode") == "min" else "max"
    seen = _scan(os.path.join(run_dir, names.METRICS), monitor, mode)
    best, best_step = seen.best, seen.best_step
    if best is None and record and record.get("best_metric"):
        best = _number(record["best_metric"])  # the run's own figure; its step is unknown
    step = seen.step if seen.step is not None else _integer((record or {}).get("step"))
    return {
        "name": name,
        "status": (record or {}).get("status") or "pending",
        "step": step if step is not None else 0,
        "epoch": seen.epoch,
        "monitor": monitor,
        "monitor_mode": mode if monitor else None,
        "best": best,
        "best_step": best_step,
        "wall_time_s": _number((record or {}).get("wall_time_s")),
        "error": (record or {}).get("error") or None,
        "best_checkpoint": (record or {}).get("best_checkpoint") or None,
        "run_dir": os.path.abspath(run_dir),
    }


@dataclass
class _Seen:
    step: int | None = None
    epoch: int | None = None
    best: float | None = None
    best_step: int | None = None


def _scan(path: str, monitor: str | None, mode: str) -> _Seen:
    """The last record's step and epoch, and the best `monitor` value with its (first) step.
    A line torn by a kill, or damaged, is skipped."""
    seen = _Seen()
    try:
        records, _ = metrics_file.read(path)
    except OSError:
        return seen
    for _, record in records:
        step = record["step"]
        if seen.step is None or step >= seen.step:
            seen.step, seen.epoch = step, _integer(record.get("epoch"))
        value = record.get(monitor) if monitor else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            continue
        if improves(value, seen.best, mode):
            seen.best, seen.best_step = float(value), step
    return seen


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def _integer(value: Any) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (ValueError, TypeError):
        return None


def _rank(rows: list[dict[str, Any]]) -> Any:
    """Best value first in each run's own ckpt.monitor_mode; rows without one after, by status
    (running before failed before pending), each group in folder order."""
    order = {id(row): i for i, row in enumerate(rows)}

    def key(row: dict[str, Any]) -> tuple[int, float, int]:
        if row["best"] is None:
            status = row["status"]
            rank = _UNRANKED.index(status) if status in _UNRANKED else 0
            return (1 + rank, 0.0, order[id(row)])
        return (0, best_first(row["monitor_mode"]) * row["best"], order[id(row)])

    return key


# -- the three forms -----------------------------------------------------------------------------


def render(keys: list[str], rows: list[dict[str, Any]], fmt: str, folder: str) -> str:
    """The rows as an aligned table, csv (a header, one line per run) or a json list."""
    if fmt == "json":
        return json.dumps(
            [{**{f: row[f] for f in FIELDS}, **{k: row[k] for k in keys}} for row in rows],
            indent=2,
            default=str,
        )
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["name", *keys, *FIELDS[1:]])
        for row in rows:
            cells = [row["name"], *(row[k] for k in keys), *(row[f] for f in FIELDS[1:])]
            writer.writerow(["" if c is None else _cell(c, short=False) for c in cells])
        return out.getvalue().rstrip("\n")
    return _table(keys, rows, folder)


def _cell(value: Any, short: bool = True) -> str:
    """A value as the table (`short`: 6 significant digits) and csv show it: text as it is,
    anything else as JSON (0.01, true, [0.9, 0.95])."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and short:
        return f"{value:.6g}"
    return json.dumps(value, default=str)


def _table(keys: list[str], rows: list[dict[str, Any]], folder: str) -> str:
    from dtrain.observe.progress import clock

    if not rows:
        return f"no runs in {folder}"
    monitors = {row["monitor"] for row in rows if row["monitor"]}
    single = monitors.pop() if len(monitors) == 1 else None
    header = ["run", *keys, "status", "step", "epoch", f"best {single or ''}".rstrip(), "at step"]
    header.append("wall")
    lines = []
    for row in rows:
        best = "-" if row["best"] is None else _cell(row["best"])
        if single is None and row["best"] is not None:
            best = f"{row['monitor']} {best}"
        cells = [row["name"], *(_cell(row[k]) if row[k] is not None else "-" for k in keys)]
        cells += [row["status"], str(row["step"]), _or_dash(row["epoch"]), best]
        cells.append(_or_dash(row["best_step"]))
        wall = row["wall_time_s"]
        cells.append("-" if wall is None else clock(wall, always_hours=True))
        lines.append(cells)
    # Past the width of a terminal, the keys that differ go first (the last first), then wall.
    droppable = [*range(len(keys), 0, -1), len(header) - 1]
    text = aligned(header, lines, droppable, "--format csv has them")
    text += [f"{row['name']}: {row['error']}" for row in rows if row["error"]]
    return "\n".join(text)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def main(folder: str, fmt: str) -> int:
    """`dtrain runs DIR [--format table|csv|json]`; DIR on this disk or in an object store."""
    if not is_url(folder):
        keys, rows = collect(folder)
    else:
        with tempfile.TemporaryDirectory(prefix="dtrain-runs-") as copies:
            keys, rows = collect(_records_of(folder, copies), shown=folder)
        for row in rows:
            row["run_dir"] = join(folder, row["name"])
    print(render(keys, rows, fmt, folder))
    return 0


def _records_of(url: str, into: str) -> str:
    """What `collect` reads of a folder in an object store (its sweep.yaml, runs.csv or, for
    its hint, config.yaml; each run's config.yaml and metrics.jsonl), copied into `into`."""
    folder_files = (SWEEP_FILE, names.RUNS_CSV, names.CONFIG)
    run_files = (names.CONFIG, names.METRICS)
    objects = ObjectStore(url)
    with objects.failing_as("read"):
        for name in objects.files():
            if name in folder_files or name.partition("/")[2] in run_files:
                objects.get(name, local_path(into, name, objects.url))
    return into

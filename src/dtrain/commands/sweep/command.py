"""`dtrain sweep`: many runs of one config, one per trial of a grid or a random search.

The sweep folder `<run.out_dir>/<name>/` holds `sweep.yaml` (what was asked and every trial:
its index, name, overrides and run directory), written atomically before anything is launched,
and the trials' run directories with their records (`runs.csv`). A trial is an ordinary run with
`run.out_dir=<folder>` and `run.name=<trial>`, so it resumes like any run. Running the command
again launches the trials whose record does not say finished; a changed grid is refused unless
`--extend`, which appends the new trials and keeps the others' indices. Every check (options,
keys, values, every trial's full config, the folder) happens before anything is written.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shlex
import shutil
import subprocess
from typing import Any

from dtrain import config
from dtrain.commands.sweep import launch as sweep_launch
from dtrain.commands.sweep import space as sweep_space
from dtrain.commands.sweep.folder import (
    DONE,
    FILE,
    foreign_file,
    load_sweep,
    statuses,
    trial_overrides,
    write,
)
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files.sweeps import VERSION
from dtrain.observe import trackers

# ---------------------------------------------------------------------------------------------
# The command


def default_name(config_path: str | None) -> str:
    """`configs/default.yaml` -> `default_sweep`: the same command twice is the same sweep."""
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else ""
    return f"{stem or 'default'}_sweep"


def _file_digest(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _check_options(args: argparse.Namespace) -> None:
    for value, option in ((args.nproc, "--nproc"), (args.max_parallel, "--max-parallel")):
        if value is not None and value < 1:
            raise UserError(f"sweep error: {option} {value}: expected a positive number")
    if args.random is not None and args.random < 1:
        raise UserError(
            f"sweep error: --random {args.random}: expected a positive number of trials"
        )
    if not args.slurm:
        given = [
            o
            for o, v in (
                ("--max-parallel", args.max_parallel),
                ("--script", args.script),
                ("--sbatch-args", args.sbatch_args),
            )
            if v is not None
        ]
        if given:
            raise UserError(f"sweep error: {given[0]} is an option of --slurm; add --slurm")
        return
    if shutil.which("sbatch") is None:
        raise UserError(
            "sweep error: --slurm needs sbatch, and it is not on PATH; run this on a SLURM "
            "login node, or leave out --slurm to run the trials here one after another"
        )
    script = args.script or os.path.join("slurm", "train.sbatch")
    if not os.path.isfile(script):
        raise UserError(f"sweep error: --script {script}: no such file")
    with open(script, encoding="utf-8", errors="replace") as f:
        needs_launcher = "launch/train.py" in f.read()
    if needs_launcher and not os.path.isfile(os.path.join("launch", "train.py")):
        raise UserError(
            f"sweep error: {script} runs launch/train.py from the submit directory, and there "
            f"is none here: run dtrain sweep --slurm from the repository root"
        )
    try:
        shlex.split(args.sbatch_args or "")
    except ValueError as e:
        raise UserError(f"sweep error: --sbatch-args: {e}") from None


def _describe(args: argparse.Namespace, words: sweep_space.Words, name: str, folder: str) -> dict:
    """The sweep.yaml this command asks for, its trials made afresh."""
    sweep_space.check_count(words.space, args.random)
    mode = "random" if args.random is not None else "grid"
    if mode == "grid":
        trials = sweep_space.grid(words.space)
    else:
        trials = sweep_space.sample(words.space, args.random, args.seed)
    swept = list(words.space)
    names = sweep_space.trial_names(trials, swept)
    config_path = os.path.abspath(args.config) if args.config else None
    return {
        "version": VERSION,
        "name": name,
        "config": config_path,
        "config_sha256": _file_digest(config_path),
        "nproc": args.nproc,
        "mode": mode,
        "seed": args.seed,
        "random": args.random,
        "fixed": list(words.fixed),
        "space": words.space,
        "swept": swept,
        "trials": [
            {"index": i, "name": n, "overrides": t, "run_dir": os.path.join(folder, n)}
            for i, (n, t) in enumerate(zip(names, trials, strict=True))
        ],
        "jobs": [],
    }


def _existing(folder: str) -> dict | None:
    """The sweep already in the folder; None for no folder or an empty one."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise foreign_file(folder, "is a file")
    data = load_sweep(folder) if os.path.isdir(folder) else None
    if data is None and os.path.isdir(folder) and os.listdir(folder):
        raise foreign_file(folder, f"has files but no {FILE}")
    return data


def _changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """What differs from the sweep in the folder: (what every trial shares: config, fixed
    overrides, grid or random; what makes the trials: the space, --random N, --seed)."""
    shared = []
    if old.get("config") != new["config"]:
        shared.append(f"config {old.get('config')} -> {new['config']}")
    elif old.get("config_sha256") != new["config_sha256"]:
        shared.append(f"config {new['config']}: the file changed since the sweep was made")
    # run.out_dir only placed the folder, which is this one however it was written.
    a, b = _fixed_values(old.get("fixed") or []), _fixed_values(new["fixed"])
    a.pop("run.out_dir", None)
    b.pop("run.out_dir", None)
    for key in dict.fromkeys([*a, *b]):
        if a.get(key, _UNSET) != b.get(key, _UNSET):
            shared.append(
                f"fixed {key}: {_value(a.get(key, _UNSET))} -> {_value(b.get(key, _UNSET))}"
            )
    if old.get("mode") != new["mode"]:
        shared.append(f"{old.get('mode')} -> {new['mode']}")
    trials = []
    for key in dict.fromkeys([*old["space"], *new["space"]]):
        x, y = old["space"].get(key), new["space"].get(key)
        if x != y:
            trials.append(f"{key}: {_shown(x)} -> {_shown(y)}")
    if new["mode"] == "random":
        for key, option in (("random", "--random"), ("seed", "--seed")):
            if old.get(key) != new[key]:
                trials.append(f"{option} {old.get(key)} -> {new[key]}")
    return shared, trials


_UNSET = object()


def _fixed_values(words: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for word in words:
        key, value = config.parse_override(word)
        values[key] = value
    return values


def _value(value: Any) -> str:
    return "unset" if value is _UNSET else sweep_space.value_text(value)


def _shown(spec: dict | None) -> str:
    if spec is None:
        return "not swept"
    ((kind, args),) = spec.items()
    inner = ", ".join(sweep_space.value_text(a) for a in args)
    return f"[{inner}]" if kind == "values" else f"{kind}({inner})"


def _merge(old: dict, new: dict, extend: bool, folder: str) -> tuple[dict, int]:
    """The sweep after this command, and how many trials it adds. What every trial shares (the
    config, the fixed overrides, grid or random) never changes; the trials change with --extend
    only."""
    shared, changed = _changes(old, new)
    if shared:
        raise UserError(
            f"sweep error: sweep {new['name']} was made otherwise ({'; '.join(shared)}); the "
            f"config and fixed overrides are every trial's: start a new sweep with another --name"
        )
    if changed and not extend:
        raise UserError(
            f"sweep error: sweep {new['name']} was made with other trials ({'; '.join(changed)}); "
            f"add --extend to add the new ones to it, or give another --name"
        )
    merged = dict(old, nproc=new["nproc"] if new["nproc"] is not None else old.get("nproc"))
    if not changed:
        return merged, 0
    trials = [dict(t) for t in old["trials"]]
    known = [t["overrides"] for t in trials]
    added = [t["overrides"] for t in new["trials"] if t["overrides"] not in known]
    swept = list(dict.fromkeys([*old["swept"], *new["swept"]]))
    names = sweep_space.trial_names(added, swept, taken=[t["name"] for t in trials])
    start = max((t["index"] for t in trials), default=-1) + 1
    for i, (name, overrides) in enumerate(zip(names, added, strict=True)):
        trials.append(
            {
                "index": start + i,
                "name": name,
                "overrides": overrides,
                "run_dir": os.path.join(folder, name),
            }
        )
    merged.update(
        space=new["space"], swept=swept, random=new["random"], seed=new["seed"], trials=trials
    )
    return merged, len(added)


def _check_trials(data: dict, folder: str) -> None:
    """Every trial's full config, as its run will load it: a wrong type or value, or a tracker
    whose library is not installed, is found now, with the key named, and not when that trial
    starts (every trial would fail alike)."""
    for trial in data["trials"]:
        trackers.check_installed(
            config.load(data["config"], trial_overrides(data, folder, trial)).log
        )


def _busy_jobs(data: dict) -> None:
    """An array job of this sweep still queued or running would run its trials a second time."""
    ids = [str(job["id"]) for job in data.get("jobs") or []]
    if not ids or shutil.which("squeue") is None:
        return
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-o", "%i", "-j", ",".join(ids)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return
    queued = proc.stdout.split() if proc.returncode == 0 else []
    if queued:
        job = queued[0].split("_")[0]
        raise UserError(
            f"sweep error: array job {job} of sweep {data['name']} is still queued or running "
            f"({len(queued)} task(s)); wait for it to end (squeue -j {job}) or scancel {job}, "
            f"then run this again"
        )


def main(args: argparse.Namespace) -> int:
    _check_options(args)
    words = sweep_space.parse_words(args.words, args.random is not None)
    base = config.load(args.config, words.fixed)
    if is_url(base.run.out_dir):  # never a local folder named after the URL
        raise UserError(
            f"sweep error: run.out_dir {base.run.out_dir} is in an object store, where a sweep "
            f"folder cannot be kept: give the sweep a local run.out_dir (shared, for --slurm)"
        )
    name = args.name or default_name(args.config)
    if not name or name in (".", "..") or "/" in name:
        raise UserError(f"sweep error: --name {name!r} is not a plain directory name")
    folder = os.path.abspath(os.path.join(base.run.out_dir, name))
    new = _describe(args, words, name, folder)
    old = _existing(folder)
    data, added = (
        (new, len(new["trials"])) if old is None else _merge(old, new, args.extend, folder)
    )
    _check_trials(data, folder)
    if not args.slurm and data.get("nproc") is None:
        data["nproc"] = sweep_launch.default_nproc()
    records = statuses(folder)
    todo = [t for t in data["trials"] if records.get(t["name"], {}).get("status") not in DONE]
    if args.dry_run:
        print(sweep_launch.plan(data, folder, todo, args.slurm))
        return 0
    if todo:
        _busy_jobs(data)
    write(folder, data)
    print(sweep_launch.opening(data, folder, todo, added, old is None), flush=True)
    if not todo:
        return 0
    if args.slurm:
        job = sweep_launch.submit(data, folder, todo, args)
        data["jobs"] = [
            *(data.get("jobs") or []),
            {
                "id": job,
                "trials": [t["index"] for t in todo],
                "submitted": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            },
        ]
        write(folder, data)
        print(f"submitted array job {job}")
        print(sweep_launch.after_submit(data, folder, todo, job, args.max_parallel))
        return 0
    return sweep_launch.run_local(data, folder, todo)

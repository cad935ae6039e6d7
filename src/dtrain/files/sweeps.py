"""A sweep folder's `sweep.yaml` as the runs read it: the trials, their names and swept values.

A trial finds its swept keys in the sweep.yaml of its run.out_dir (`trial_of`), to write them to
TensorBoard's HParams tab; `dtrain runs` reads the same file to lay the runs side by side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import yaml

from dtrain.config.plain_yaml import load as load_yaml
from dtrain.files import names

SWEEP_FILE = names.SWEEP
VERSION = 1  # of sweep.yaml: what `dtrain sweep` writes


@dataclass(frozen=True)
class TrialSweep:
    """A trial's place in its sweep: the swept keys in the sweep's order, this trial's values,
    and every trial's values of each key (the range the sweep covers)."""

    keys: list[str]
    values: dict[str, Any]
    domains: dict[str, list[Any]]


class NotASweep(Exception):
    """A sweep.yaml that cannot be read or is not one this dtrain wrote: each command says so
    in its own words."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def read_sweep(folder: str) -> dict[str, Any] | None:
    """`folder/sweep.yaml` (see the sweep command), None when there is none; NotASweep for a
    file that cannot be read or is not a sweep's of this format."""
    path = os.path.join(folder, SWEEP_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise NotASweep(path, f"cannot be read ({reason})") from None
    trials = data.get("trials") if isinstance(data, dict) else None
    if not isinstance(trials, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in trials
    ):
        raise NotASweep(
            path, "is not a sweep description (it needs a 'trials' list, each with a 'name')"
        )
    assert isinstance(data, dict)
    if data.get("version") != VERSION:
        raise NotASweep(path, f"has version {data.get('version')!r}, this dtrain reads {VERSION}")
    return data


def swept_keys(sweep: dict[str, Any]) -> list[str]:
    """The sweep's `swept` list, or else every key the trials' overrides name, in first use."""
    declared = sweep.get("swept")
    if isinstance(declared, list) and all(isinstance(k, str) for k in declared):
        return list(declared)
    keys: dict[str, None] = {}
    for trial in sweep["trials"]:
        keys.update(dict.fromkeys(overrides_of(trial)))
    return list(keys)


def trial_of(run_dir: str) -> TrialSweep | None:
    """The sweep trial whose run directory `run_dir` is (a trial runs with run.out_dir set to
    the sweep folder and run.name to its name), or None: not a sweep's run, or a sweep.yaml that
    cannot be read (a run must not fail for it)."""
    run_dir = os.path.abspath(run_dir)
    try:
        sweep = read_sweep(os.path.dirname(run_dir))
    except NotASweep:
        return None
    if sweep is None:
        return None
    name = os.path.basename(run_dir)
    trial = next((t for t in sweep["trials"] if t["name"] == name), None)
    if trial is None:
        return None
    keys = swept_keys(sweep)
    domains = {
        k: [overrides_of(t)[k] for t in sweep["trials"] if k in overrides_of(t)] for k in keys
    }
    values = overrides_of(trial)
    return TrialSweep(keys, {k: values[k] for k in keys if k in values}, domains)


def overrides_of(trial: dict[str, Any]) -> dict[str, Any]:
    overrides = trial.get("overrides")
    return overrides if isinstance(overrides, dict) else {}


# -- the rows ------------------------------------------------------------------------------------

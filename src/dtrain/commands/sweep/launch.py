"""Launching a sweep's trials: here, one after another (a single process, or torchrun with
--nproc ranks), or as one SLURM job array whose tasks each find their trial in sweep.yaml.

Locally a trial that fails is recorded (its runs.csv row says failed, with the error) and the next
one starts; a stop signal (Ctrl-C, SIGTERM) is passed on to the running trial, which saves a
checkpoint, and no further trial starts.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import IO

from dtrain.commands.sweep import folder as sweep
from dtrain.core.errors import UserError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def default_nproc() -> int:
    """One rank per visible GPU, else one."""
    import torch

    return max(1, torch.cuda.device_count())


def launcher(nproc: int) -> list[str]:
    """`dtrain train` as one process, or under torchrun on this machine (--standalone: its own
    rendezvous on a free port, so two sweeps side by side do not meet)."""
    if nproc == 1:
        return [sys.executable, "-m", "dtrain", "train"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "dtrain",
        "train",
    ]


def command(data: dict, folder: str, trial: dict) -> list[str]:
    config_args = ["--config", data["config"]] if data.get("config") else []
    overrides = sweep.trial_overrides(data, folder, trial)
    return [*launcher(int(data["nproc"])), *config_args, *overrides]


def array_spec(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (sbatch --array's syntax)."""
    parts: list[str] = []
    ordered = sorted(indices)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def plan(data: dict, folder: str, todo: list[dict], slurm: bool) -> str:
    """--dry-run: the trials and what would launch them; nothing is written."""
    lines = [
        f"sweep {data['name']} in {folder}: {len(data['trials'])} trial(s), {len(todo)} to launch"
    ]
    for trial in data["trials"]:
        mark = "launch" if trial in todo else "done  "
        if slurm:
            lines.append(f"  {mark} {trial['index']:>3} {trial['name']}")
        else:
            lines.append(f"  {mark} {trial['index']:>3} {shlex.join(command(data, folder, trial))}")
    return "\n".join(lines)


def opening(data: dict, folder: str, todo: list[dict], added: int, fresh: bool) -> str:
    total = len(data["trials"])
    if fresh:
        what = f"{total} trial(s)"
    elif added:
        what = f"{added} trial(s) added, {total} in all"
    else:
        what = f"{total} trial(s)"
    done = total - len(todo)
    if not todo:
        return (
            f"sweep {data['name']}: {what}, all {total} finished earlier; nothing to launch "
            f"({folder})"
        )
    earlier = f", {done} finished earlier" if done else ""
    return f"sweep {data['name']}: {what}{earlier}; launching {len(todo)} ({folder})"


# ---------------------------------------------------------------------------------------------
# SLURM


def submit(data: dict, folder: str, todo: list[dict], args: argparse.Namespace) -> str:
    """One `sbatch --array` for the trials to launch; the array job's id. The job's output goes
    to the sweep folder (slurm-<array job>_<task>.out) unless --sbatch-args names another."""
    spec = array_spec(t["index"] for t in todo)
    if args.max_parallel:
        spec += f"%{args.max_parallel}"
    script = args.script or os.path.join("slurm", "train.sbatch")
    cmd = [
        "sbatch",
        "--parsable",
        f"--array={spec}",
        f"--job-name={data['name']}",
        f"--output={os.path.join(folder, 'slurm-%A_%a.out')}",
        *shlex.split(args.sbatch_args or ""),  # after ours: sbatch takes the last value given
        script,
        "--sweep",
        os.path.join(folder, sweep.FILE),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(
            f"sweep error: sbatch did not answer ({e}); no trial was submitted"
        ) from None
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(
            f"sweep error: sbatch refused the array ({reason[-1] if reason else proc.returncode}); "
            f"no trial was submitted"
        )
    return proc.stdout.strip().split(";")[0]


def after_submit(
    data: dict, folder: str, todo: list[dict], job: str, max_parallel: int | None
) -> str:
    at_once = f", at most {max_parallel} at a time" if max_parallel else ""
    return (
        f"sweep {data['name']}: trials {array_spec(t['index'] for t in todo)} as tasks "
        f"{job}_<trial>{at_once}; logs {folder}/slurm-{job}_<trial>.out; follow them with "
        f"dtrain runs {folder}"
    )


# ---------------------------------------------------------------------------------------------
# Here, one trial after another


class _Relay:
    """Passes stop signals to the running trial (started in a session of its own, so that a
    terminal's Ctrl-C reaches it once, through here) and remembers that no trial is to follow."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.signum: int | None = None
        self.previous = {s: signal.getsignal(s) for s in FORWARDED}

    def __enter__(self) -> _Relay:
        for s in FORWARDED:
            signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def _tee(stream: IO[bytes], tail: collections.deque[str]) -> None:
    """The trial's stderr to ours as it comes, keeping its last lines for the record."""
    for line in iter(stream.readline, b""):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        text = line.decode(errors="replace").strip()
        if text:
            tail.append(text)


def _error_line(tail: collections.deque[str], returncode: int) -> str:
    """What the record says of a failed trial: how it ended, then dtrain's own one-line message
    if it printed one, else the last line of its output (a traceback's exception). A trial
    killed by a signal said nothing about it: its last line would mislead."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    lines = list(tail)
    ours = [line for line in lines if line.startswith("dtrain: ")]
    text = ours[-1].removeprefix("dtrain: ") if ours else (lines[-1] if lines else "")
    return f"exit {returncode}: {text}"[:200] if text else f"exit {returncode}"


def _run_trial(cmd: list[str], relay: _Relay) -> tuple[int, str]:
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True)
    relay.proc = proc
    assert proc.stderr is not None
    reader = threading.Thread(target=_tee, args=(proc.stderr, tail), daemon=True)
    reader.start()
    returncode = proc.wait()
    reader.join(timeout=30)
    relay.proc = None
    return returncode, _error_line(tail, returncode)


def _record_failure(folder: str, name: str, error: str) -> None:
    """A trial that ended badly without saying so in its row (it failed before its record
    started, or was killed outright): its row says failed, with the error."""
    from dtrain.run import records  # torch comes with it: only once a trial has failed

    records.mark_failed(folder, name, error)


def _in_use(run_dir: str) -> str | None:
    """Why a trial's run directory is taken (another process runs that trial now: a second
    sweep command, a task of an array), or None. Launching it anyway would end at once with
    exit 2, and this sweep would mark a running trial failed."""
    if not os.path.isdir(run_dir):
        return None
    from dtrain.files.store import RunDirLock

    lock = RunDirLock(run_dir)
    try:
        lock.acquire(None)
    except UserError as e:
        return str(e)
    lock.release()
    return None


def run_local(data: dict, folder: str, todo: list[dict]) -> int:
    """Each trial in turn; 0 when every trial of the sweep has finished, else 1."""
    name, total = data["name"], len(data["trials"])
    stopped_by: int | None = None
    with _Relay() as relay:
        for k, trial in enumerate(todo, 1):
            busy = _in_use(os.path.join(folder, trial["name"]))
            if busy is not None:
                print(f"sweep {name}: trial {trial['index']} {trial['name']} skipped: {busy}")
                continue
            cmd = command(data, folder, trial)
            print(
                f"sweep {name}: trial {trial['index']} ({k}/{len(todo)}) {trial['name']}: "
                f"{shlex.join(cmd)}",
                flush=True,
            )
            started = time.monotonic()
            returncode, error = _run_trial(cmd, relay)
            row = sweep.statuses(folder).get(trial["name"], {})
            if returncode != 0:
                _record_failure(folder, trial["name"], error)
                outcome = f"failed: {row.get('error') or error}"
            else:
                outcome = row.get("status") or "finished"
            print(
                f"sweep {name}: trial {trial['index']} {trial['name']} {outcome} "
                f"({time.monotonic() - started:.1f} s)",
                flush=True,
            )
            if relay.signum is not None:
                stopped_by = relay.signum
                break
    print(summary(data, folder, stopped_by, total), flush=True)
    rows = sweep.statuses(folder)
    finished = all(rows.get(t["name"], {}).get("status") in sweep.DONE for t in data["trials"])
    return 0 if finished and stopped_by is None else 1


def summary(data: dict, folder: str, stopped_by: int | None, total: int) -> str:
    """One line: how many trials ended how, the failed ones by name."""
    rows = sweep.statuses(folder)
    counts: dict[str, int] = collections.Counter(
        rows.get(t["name"], {}).get("status") or "not run" for t in data["trials"]
    )
    parts = [f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    failed = [
        t["name"] for t in data["trials"] if rows.get(t["name"], {}).get("status") == "failed"
    ]
    text = f"sweep {data['name']}: {total} trials: {', '.join(parts)}"
    if failed:
        text += f"; failed: {' '.join(failed)}"
    if stopped_by is not None:
        text += (
            f"; stopped by {signal.Signals(stopped_by).name}: run the same command again to "
            f"continue"
        )
    return f"{text} ({os.path.join(folder, 'runs.csv')})"

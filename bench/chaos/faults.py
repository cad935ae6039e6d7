"""The faults a chaos run injects, each drawn with its moment from the episode's seed.

A fault is due once the run has logged its `step` in the current launch; it lands `delay_s`
later, which puts it anywhere in the next step (forward, backward, the all-reduce), in a save
(`kill_writer` waits for one to be under way), in an evaluation (the epoch's end) or in the
resume of a relaunch (`kill_in_resume`). Each kind names the line that must say what happened
(`said`), the longest it may take to end in it and to train the next step (`bound_s`), and
whether the launch ends (`ends`: the harness then relaunches, as a requeue or a person would)."""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from jobs import SAVE_EVERY, STALL_S, STEPS, Attempt, send

# A relaunch starts in 10 to 45 s here (imports, process group, resume), the machine loaded.
START_S = 60.0


@dataclass(frozen=True)
class Kind:
    said: str  # a regular expression the launch's output matches after the fault
    bound_s: float  # injection -> the next step trained
    ends: bool  # whether the launch ends (else torchrun restarts its workers, or nothing stops)
    damages: bool = False  # the newest checkpoint is damaged once the launch has ended


KINDS = {
    # kill -9 of one worker: torchrun names it and restarts the workers (--max-restarts)
    "kill_rank": Kind(r"failed \(exitcode: -9\) local_rank: \d", STALL_S + START_S, False),
    # kill -9 of every process (a node's power): nothing can say it; the rerun's resume line
    "kill_all": Kind(r"resumed from \S+|fresh start", START_S, True),
    # kill -9 of rank 0 while it writes a checkpoint (a `.tmp-` save in progress)
    "kill_writer": Kind(r"failed \(exitcode: -9\) local_rank: 0", STALL_S + START_S, False),
    # kill -9 of every process, then again during the relaunch's start-up or resume
    "kill_in_resume": Kind(r"resumed from \S+|fresh start", 2 * START_S, True),
    # preemption: a signal to torchrun (it forwards it), a save at the next step, exit 0
    "sigterm": Kind(r"stop requested \(SIGTERM\) at step \d+", START_S, True),
    "sigusr1": Kind(r"stop requested \(SIGUSR1\) at step \d+", START_S, True),
    # the same signal to every process of the job (as scancel sends it), twice
    "sigterm_twice": Kind(r"stop requested \(SIGTERM\) at step \d+", START_S, True),
    # one worker stopped past the stall timeout: the other names it, torchrun restarts both
    "stop_long": Kind(r"rank\(s\) \d did not arrive", 2 * STALL_S + START_S, False),
    # one worker stopped for a while below it: the run goes on, nothing restarts
    "stop_short": Kind(r"", STALL_S, False),
    # the disk full at a save: one line with the space needed, the previous checkpoint kept
    "disk_full": Kind(r"disk full while saving step_\d+", SAVE_EVERY * 5 + START_S, False),
    # every process killed, and the newest checkpoint truncated / a byte of it flipped
    "torn_newest": Kind(r"checkpoint step_\S+ is unusable", START_S, True, damages=True),
    "flip_byte": Kind(r"checkpoint step_\S+ is unusable", START_S, True, damages=True),
    # NaN gradients on one rank: every rank stops at the check, torchrun restarts them
    "nan_grad": Kind(r"non-finite loss or gradients at step \d+", START_S, False),
}


@dataclass
class Fault:
    kind: str
    step: int
    rank: int
    delay_s: float
    pause_s: float  # a brief stop's length, the second signal's lag, when the resume is killed
    injected_at: float | None = None
    phase: str = ""
    detail: str = ""
    recovered_s: float | None = None  # injection -> the next step logged
    steps_before: int = 0  # how many step records there were at the injection
    after: dict = field(default_factory=dict)  # what the harness still has to undo or do

    def describe(self) -> str:
        return f"{self.kind}@{self.step}+{self.delay_s:.2f}s/r{self.rank}"


def draw(rng: random.Random, kinds: list[str], count: int) -> list[Fault]:
    """`count` faults of the given kinds at distinct steps, in the order they come."""
    steps = rng.sample(range(2, STEPS - 1), count)
    faults = []
    for step in sorted(steps):
        kind = rng.choice(kinds)
        if KINDS[kind].damages:  # there is a checkpoint to damage
            step = max(step, SAVE_EVERY + 1)
        faults.append(Fault(kind, step, rng.randrange(2), rng.uniform(0.0, 0.15),
                            rng.uniform(0.5, STALL_S / 3)))
    return faults


def phase(run_dir: Path, step: int) -> str:
    saving = any(p.name.startswith(".tmp-") for p in _entries(run_dir / "checkpoints"))
    if saving:
        return "save"
    if step % (STEPS // 2) == 0:
        return "evaluation"
    return "step"


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def inject(fault: Fault, attempt: Attempt, run_dir: Path, requests: Path,
           disk: Path | None) -> None:
    """Do what `fault` is, now (its later half, if any, is `follow_up`'s)."""
    workers = attempt.workers()
    pid = workers.get(fault.rank) or next(iter(workers.values()), None)
    kind = fault.kind
    if kind in ("kill_rank", "kill_writer") and pid:
        send(workers.get(0, pid) if kind == "kill_writer" else pid, signal.SIGKILL)
    elif kind in ("kill_all", "kill_in_resume", "torn_newest", "flip_byte"):
        attempt.signal_all(signal.SIGKILL)
    elif kind in ("sigterm", "sigusr1"):
        send(attempt.proc.pid, signal.SIGTERM if kind == "sigterm" else signal.SIGUSR1)
    elif kind == "sigterm_twice":
        attempt.signal_all(signal.SIGTERM)
        fault.after["again_at"] = time.monotonic() + fault.pause_s / 10
    elif kind in ("stop_long", "stop_short") and pid:
        send(pid, signal.SIGSTOP)
        fault.after["stopped"] = pid
        fault.after["until"] = time.monotonic() + (fault.pause_s if kind == "stop_short" else
                                                   3 * STALL_S)
    elif kind == "nan_grad":
        (requests / f"nan.rank{fault.rank}").write_text("")
    elif kind == "disk_full" and disk is not None:
        _fill(disk / "filler")
        fault.after.update(filler=disk / "filler", workers=set(workers.values()),
                           until=time.monotonic() + 60)
    fault.detail = f"pid {pid}" if pid else ""


def follow_up(fault: Fault, attempt: Attempt) -> None:
    """The fault's second half, when its moment has come: the second signal, the stopped
    worker continued, the disk freed once a worker it made fail has gone."""
    after, now = fault.after, time.monotonic()
    if "again_at" in after and now >= after["again_at"]:
        attempt.signal_all(signal.SIGTERM)
        del after["again_at"]
    if "stopped" in after:
        named = fault.kind == "stop_long" and "did not arrive" in attempt.text()
        if now >= after["until"] or named or not attempt.running():
            send(after.pop("stopped"), signal.SIGCONT)
            del after["until"]
    if "filler" in after:  # freed as an operator would once the run said so, or it ended
        now_running = set(attempt.workers().values())
        gone = bool(now_running) and not after["workers"] <= now_running
        said = "disk full while saving" in attempt.text()[after["out_at"]:]
        if gone or not attempt.running() or said or now > after["until"]:
            after.pop("filler").unlink(missing_ok=True)
            del after["workers"], after["until"]


def damage_newest(run_dir: Path, kind: str, rng: random.Random) -> str:
    """Truncate a file of the newest complete checkpoint, or flip one byte of its data; returns
    the checkpoint's name ('' where there is none yet)."""
    saved = sorted(p for p in _entries(run_dir / "checkpoints")
                   if p.is_dir() and p.name.startswith("step_") and (p / "COMPLETE").exists())
    if not saved:
        return ""
    newest = max(saved, key=lambda p: int(p.name[5:11]))
    files = sorted(p for p in newest.rglob("*") if p.is_file() and p.name != "COMPLETE"
                   and p.stat().st_size > 0)
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    if kind == "torn_newest":
        target.write_bytes(data[: rng.randrange(len(data))])
    else:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
    return newest.name


def _fill(path: Path) -> None:
    """Take what is left of the disk `path` is on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)

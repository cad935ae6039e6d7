"""One episode: a job trained from scratch to its end through the faults drawn for it, each
injected at its moment, every launch that ends relaunched as the user's launcher would; then
every invariant checked (checks.py)."""

from __future__ import annotations

import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import checks
import faults as chaos
from jobs import STEPS, Attempt, Job, environment, records_logged

HANG_S = 150.0  # no new step for this long, with no fault that may take longer: a hang
POLL_S = 0.02


@dataclass
class Outcome:
    job: str
    faults: list[chaos.Fault]
    launches: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run(job: Job, faults: list[chaos.Fault], sandbox: Path, rng: random.Random,
        reference: dict | None, disk: Path | None) -> Outcome:
    """Train `job` in `sandbox/run` through `faults`; `reference` is the fault-free run's
    final weights (None: this is that run, and only its other invariants are checked)."""
    run_dir = sandbox / "run"
    for folder in ("requests", "tmp"):
        (sandbox / folder).mkdir(parents=True, exist_ok=True)
    env = environment(sandbox / "requests", sandbox / "tmp")
    outcome, started = Outcome(job.name, faults), time.monotonic()
    pending, damaged, attempts = list(faults), [], []
    kill_in_start: float | None = None  # the next launch is killed this long after it starts
    while outcome.launches < len(faults) + 4:
        outcome.launches += 1
        attempt = Attempt(job, run_dir, len(faults) + 1, env,
                          sandbox / f"launch_{outcome.launches}.txt")
        attempts.append(attempt)
        hung = _drive(attempt, run_dir, pending, faults, sandbox, disk, kill_in_start, outcome)
        kill_in_start = None
        if hung:
            break
        for fault in faults:  # what a fault that ended this launch still has to do
            if fault.injected_at and fault.after.pop("launch_end", False):
                if chaos.KINDS[fault.kind].damages:
                    name = chaos.damage_newest(run_dir, fault.kind, rng)
                    fault.detail += f", damaged {name}" if name else ", nothing saved to damage"
                    damaged += [name] if name else []
                if fault.kind == "kill_in_resume":
                    kill_in_start = fault.pause_s  # (0.5 to STALL_S / 3 s into the start)
        if attempt.proc.returncode == 0 and _complete(run_dir, attempt.text()):
            for fault in faults:  # one that came as the run ended: nothing was left to train
                if fault.injected_at and fault.recovered_s is None:
                    fault.recovered_s = time.monotonic() - fault.injected_at
            break
    else:
        outcome.violations.append(f"unfinished: the run did not end after {outcome.launches} "
                                  f"launches")
    outcome.seconds = time.monotonic() - started
    live = _wait_for_exits(attempts)
    outputs = [a.text() for a in attempts]
    outcome.violations += _said(faults, attempts)
    outcome.violations += checks.endings(outputs)
    if run_dir.is_dir() and (run_dir / "checkpoints").is_dir():
        if reference is not None:
            outcome.violations += checks.weights(run_dir, reference)
        outcome.violations += checks.samples(run_dir)
        outcome.violations += checks.records(run_dir)
        outcome.violations += checks.checkpoints(run_dir, damaged, "\n".join(outputs))
    outcome.violations += checks.leftovers(sandbox, run_dir, live)
    return outcome


def _drive(attempt: Attempt, run_dir: Path, pending: list[chaos.Fault], faults: list[chaos.Fault],
           sandbox: Path, disk: Path | None, kill_in_start: float | None, outcome: Outcome) -> bool:
    """Follow one launch to its end, injecting the faults that come due; True if it hung."""
    seen = records_logged(run_dir)
    progress_at = time.monotonic()
    inject_at: float | None = None
    while attempt.running():
        time.sleep(POLL_S)
        attempt.note()
        now, logged = time.monotonic(), records_logged(run_dir)
        if _new_since(logged, seen):
            progress_at = now
            for fault in faults:
                if fault.injected_at and fault.recovered_s is None and \
                        _new_since(logged, fault.after["records"]) and \
                        _back(fault, attempt, outcome.launches):
                    fault.recovered_s = now - fault.injected_at
        seen = logged
        for fault in faults:
            chaos.follow_up(fault, attempt)
        if kill_in_start is not None and now - attempt.started >= kill_in_start:
            if not _new_since(logged, _latest_records(faults)):  # still starting or resuming
                attempt.signal_all(signal.SIGKILL)
            kill_in_start = None
        step = logged[-1][0] if logged else 0
        due = _due(pending, faults, attempt, step)
        if due is not None and inject_at is None:
            inject_at = now + due.delay_s
        where = chaos.phase(run_dir, step) if due is not None else ""
        if due is not None and inject_at is not None and now >= inject_at and \
                (due.kind != "kill_writer" or where == "save" or
                 step >= due.step + 2 * chaos.SAVE_EVERY):
            due.phase = where
            due.after.update(records=logged, launch=outcome.launches, out_at=len(attempt.text()))
            due.injected_at = now
            chaos.inject(due, attempt, run_dir, sandbox / "requests", disk)
            due.detail = f"at step {step}" + (f", {due.detail}" if due.detail else "")
            if chaos.KINDS[due.kind].ends:
                due.after["launch_end"] = True
            pending.remove(due)
            inject_at = None
        if now - progress_at > HANG_S + _allowance(faults):
            waited = now - progress_at
            outcome.violations.append(f"hang: no step for {waited:.0f} s "
                                      f"(last fault: {_last(faults)})")
            attempt.signal_all(signal.SIGKILL)
            attempt.wait(30)
            return True
    return False


def _complete(run_dir: Path, output: str) -> bool:
    """Whether the launch that printed `output` left the run trained to its end."""
    steps = [s for s, _ in records_logged(run_dir)]
    return steps[-1:] == [STEPS] and (f"finished at step {STEPS}" in output or
                                      "is already at or past the asked length" in output)


def _back(fault: chaos.Fault, attempt: Attempt, launch: int) -> bool:
    """Whether the run is back from `fault`: the workers that train now started after it (a
    resume line after it, in its launch or a later one), or, for a brief stop, it is over."""
    if fault.kind == "stop_short":
        return "stopped" not in fault.after
    since = attempt.text()[fault.after["out_at"]:] if launch == fault.after["launch"] else \
        attempt.text()
    return re.search(r"resumed from |fresh start", since) is not None


def _latest_records(faults: list[chaos.Fault]) -> list:
    """The records at the latest injection (what a resume has not yet passed)."""
    injected = [f for f in faults if f.injected_at]
    return max(injected, key=lambda f: f.injected_at).after["records"] if injected else []


def _new_since(logged: list, before: list) -> bool:
    """Whether a record was written after `before` was read (a resume rewrites from its
    checkpoint's step on, so a record is new where it differs from what was there)."""
    return any(i >= len(before) or line != before[i] for i, line in enumerate(logged))


def _due(pending: list[chaos.Fault], faults: list[chaos.Fault], attempt: Attempt,
         step: int) -> chaos.Fault | None:
    """The next fault, once the run has logged its step in a launch whose workers are all up
    and the previous fault is over (the run trained a step after it, nothing left to undo)."""
    if not pending or step < pending[0].step or len(attempt.workers()) < 2:
        return None
    marks = {"records", "launch", "out_at"}  # (what every injected fault keeps)
    if any(f.injected_at and (f.recovered_s is None or f.after.keys() - marks) for f in faults):
        return None
    return pending[0]


def _allowance(faults: list[chaos.Fault]) -> float:
    return max((chaos.KINDS[f.kind].bound_s for f in faults if f.injected_at), default=0.0)


def _last(faults: list[chaos.Fault]) -> str:
    injected = [f for f in faults if f.injected_at]
    return injected[-1].describe() if injected else "none"


def _said(faults: list[chaos.Fault], attempts: list[Attempt]) -> list[str]:
    """Each fault ended in its named line, and trained its next step within its bound."""
    problems = []
    for fault in faults:
        if not fault.injected_at:
            continue
        kind = chaos.KINDS[fault.kind]
        first = fault.after["launch"] - 1  # (what that launch printed before the fault left out)
        after = "\n".join([attempts[first].text()[fault.after["out_at"]:],
                           *(a.text() for a in attempts[first + 1:])])
        if kind.said and not re.search(kind.said, after):
            problems.append(f"said: {fault.describe()} ended without /{kind.said}/")
        if fault.kind == "stop_short" and "did not arrive" in after:
            problems.append(f"said: {fault.describe()}, below the stall timeout, ended the run")
        if fault.recovered_s is None:
            problems.append(f"recovered: no step was trained after {fault.describe()}")
        elif fault.recovered_s > kind.bound_s + (fault.pause_s if "stop" in fault.kind else 0):
            problems.append(f"bound: {fault.describe()} took {fault.recovered_s:.1f} s to the "
                            f"next step (bound {kind.bound_s:.0f} s)")
    return problems


def _wait_for_exits(attempts: list[Attempt], grace_s: float = 15.0) -> list[int]:
    """The processes of the launches still alive `grace_s` after the last ended."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        live = [pid for a in attempts for pid in a.alive()]
        if not live:
            return []
        time.sleep(0.2)
    return live

"""What a run does because it is a SLURM job: before the preemption checkpoint, tell whether the
job's time limit leaves room for it; after it, requeue the job so that it resumes from there.

Only rank 0 calls these (they run `scontrol`). The requeued job keeps its job id, so an unnamed
run finds its run directory (`job_<id>`) and resumes from the checkpoint. A task of a job array
(a sweep's trial) is named `<array job>_<task>` in what it runs and logs: that task alone is
requeued, and it comes back with the same task id, so it finds its own trial again.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time

from dtrain.core import signals
from dtrain.core.logs import log
from dtrain.process.env import Env

SCONTROL_TIMEOUT_S = 30


def job_label(
    job_id: str | None, environ: os._Environ[str] | dict[str, str] = os.environ
) -> str | None:
    """`<array job>_<task>` for a task of a job array (its SLURM_JOB_ID is a number of its own
    that users never see: squeue, sacct and the log file names show the array form), else the
    job id as it is."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if job_id and array and task:
        return f"{array}_{task}"
    return job_id


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a mapping (JobState, EndTime, ...); empty when it cannot be read."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id],
            text=True,
            capture_output=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if proc.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(\w+)=(\S*)", proc.stdout):
        fields.setdefault(key, value)
    return fields


def seconds_left(fields: dict[str, str], now: float | None = None) -> float | None:
    """Seconds until the time limit of a running job; None without a limit, or once the job is
    ending (then EndTime is when it ended: a cancel or the limit, which SLURM does not tell apart
    while the job is COMPLETING)."""
    if fields.get("JobState") != "RUNNING":
        return None
    try:
        end = time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # 'Unknown': the job has no time limit
        return None
    return end - (time.time() if now is None else now)


def check_grace(job_id: str, last_save_s: float | None) -> None:
    """Before the preemption save: log whether it can finish before the job's time limit."""
    job_id = job_label(job_id) or job_id
    report = grace_report(job_id, seconds_left(job_fields(job_id)), last_save_s)
    if report is not None:
        level, message = report
        log.log(level, message)


def grace_report(
    job_id: str, left: float | None, last_save_s: float | None
) -> tuple[int, str] | None:
    """The log level and message for `left` seconds to the time limit and a save that last
    took `last_save_s` (None: no save yet in this attempt); None for a job without a limit."""
    if left is None:
        return None
    if last_save_s is None:
        return logging.INFO, (
            f"SLURM job {job_id}: {left:.0f} s left before its time limit; no "
            f"checkpoint was saved earlier in this attempt, so how long the "
            f"save takes is not known yet"
        )
    if last_save_s >= left:
        return logging.WARNING, (
            f"SLURM job {job_id}: {left:.0f} s left before its time limit, but the last "
            f"checkpoint save took {last_save_s:.1f} s: this save will probably not finish "
            f"before SLURM stops the job (it waits only KillWait seconds after the limit); send "
            f"the warning earlier, e.g. #SBATCH --signal=B:USR1@{_suggested_grace(last_save_s)}"
        )
    return logging.INFO, (
        f"SLURM job {job_id}: {left:.0f} s left before its time limit; the "
        f"last checkpoint save took {last_save_s:.1f} s"
    )


def _suggested_grace(save_s: float) -> int:
    # SLURM sends the --signal warning up to 60 s late; leave twice the last save's time, and
    # 30 s for the step in progress when the signal comes.
    return int(60 + 2 * save_s + 30)


def after_preemption(requeue_job: bool, env: Env, saved: bool = True) -> None:
    """Rank 0, once the preemption checkpoint is complete: report the timing, then requeue a
    job that is still running (the time-limit warning, a preemption's grace time). A job that
    is already ending was cancelled or ran out of time: requeueing it would undo a scancel.
    An array task requeues itself alone (`scontrol requeue <array job>_<task>`).
    `requeue_job` is slurm.requeue; `saved` is false for a replica group that keeps no
    checkpoint (it heals from a live peer when it starts again)."""
    job_id = job_label(env.slurm_job_id)
    name = signals.received()
    fields = job_fields(job_id) if job_id else {}
    state = fields.get("JobState")
    if name is not None:
        what = "preemption checkpoint saved" if saved else "stopped at a step boundary"
        took = f"{what} {signals.seconds_since():.1f} s after {name}"
        left = seconds_left(fields)
        log.info(took if left is None else f"{took}, {left:.0f} s before the job's time limit")
    if job_id is None:
        return
    if not requeue_job:
        log.info(
            f"slurm.requeue is false: SLURM job {job_id} is not requeued; submit it again "
            f"to resume from the checkpoint"
        )
        return
    if state is not None and state != "RUNNING":
        log.info(
            f"SLURM job {job_id} is already ending (state {state}: cancelled, or past its "
            f"time limit): not requeued; submit it again to resume from the checkpoint"
        )
        return
    requeue(job_id, "resumes from this checkpoint" if saved else "heals from a live peer")


def requeue(job_id: str, then: str = "resumes from this checkpoint") -> None:
    """`scontrol requeue`: SLURM stops what is left of the job and starts it again later."""
    log.info(f"requeueing SLURM job {job_id}; it {then} when it starts again")
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job_id],
            text=True,
            capture_output=True,
            timeout=SCONTROL_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning(f"could not requeue SLURM job {job_id} ({e}); submit it again to resume")
        return
    if proc.returncode != 0:
        reason = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
        log.warning(f"could not requeue SLURM job {job_id} ({reason}); submit it again to resume")

"""A submitted SLURM job as the tests watch it: on the one-node cluster (conf None) or on the
two-node one (conf: its slurm.conf)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import Result, child_env

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def slurm_env(conf: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    """The environment of a user of the cluster (SLURM_CONF points at `conf` when given), without
    the variables of a job the suite itself may run in."""
    env = {k: v for k, v in child_env(extra).items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["PYTHON"] = (extra or {}).get("PYTHON", sys.executable)  # a test may give its own
    if conf:
        env["SLURM_CONF"] = conf
    return env


def train_steps(run_dir: Path) -> list[int]:
    """The steps of the run's training records so far."""
    return [r["step"] for r in Result(0, "", "", run_dir).records() if "loss" in r]


class Job:
    def __init__(self, job_id: str, output: Path, conf: Optional[str] = None) -> None:
        self.id, self.output_path, self.conf = job_id, output, conf

    def fields(self) -> dict[str, str]:
        """`scontrol show job` as a mapping (JobState, NodeList, ...); empty when not readable."""
        proc = subprocess.run(["scontrol", "-o", "show", "job", self.id], env=slurm_env(self.conf),
                              capture_output=True, text=True, timeout=60)
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def cancel(self, signal: Optional[str] = None) -> None:
        """scancel the job, or with `signal` send it to the batch shell (as SLURM does before the
        time limit with `--signal=B:USR1@...`)."""
        args = [f"--signal={signal}", "--batch"] if signal else []
        subprocess.run(["scancel", *args, self.id], env=slurm_env(self.conf), capture_output=True,
                       check=bool(signal))

    def wait_end(self, timeout: float = 240) -> dict[str, str]:
        """The job's fields once it is over (requeued jobs included, until their last run ends)."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            fields = self.fields()
            state = fields.get("JobState", "?")
            if not seen or seen[-1] != state:
                seen.append(state)
            if state in FINAL_STATES:
                return fields
            time.sleep(0.5)
        self.cancel()
        pytest.fail(f"job {self.id} not over after {timeout} s (states {seen}):\n"
                    f"{self.output()[-4000:]}")

    def wait_for_step(self, run_dir: Path, step: int, timeout: float = 180) -> None:
        """Until the run has a training record at `step` or later."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(s >= step for s in train_steps(run_dir)):
                return
            if self.fields().get("JobState") in FINAL_STATES:
                pytest.fail(f"job {self.id} ended before step {step}:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        self.cancel()
        pytest.fail(f"job {self.id} did not reach step {step} in {timeout} s:\n{self.output()[-4000:]}")

"""Replica groups launched by SLURM (slurm/replicas.sbatch) on the one-node local cluster: the
batch script starts the lighthouse and one job step per group; a group whose training process is
killed is started again by the script, heals from the live group and the job still completes,
with both groups' weights equal and every sample of every epoch trained exactly once. Skipped
without a cluster (`tests/slurm/cluster.sh start`) or without torchft."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import TINY
from slurm_jobs import Job, slurm_env
from test_replicas import assert_every_sample_once, digests  # (skips without torchft)
from test_slurm import CONFIG, needs_cluster, sbatch

SCRIPT = "slurm/replicas.sbatch"
# A lost group is noticed within 2 s (the lighthouse's default is 5 s).
FAST_LIGHTHOUSE = {"LIGHTHOUSE_ARGS": "--heartbeat-timeout-s=2"}
# A paced model (0.2 s a forward) on 4096 samples: 128 steps of the two groups, 256 of one alone
# (about a minute), long enough for the killed group's step to start again (30-40 s on a loaded
# machine) before the other has finished the run.
PACED = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.2}",
         "data.synthetic.train_size=4096"]


def submit_groups(tmp_path: Path, run_dir: Path, overrides: list[str]) -> Job:
    """Two groups of one task each, sample logs on."""
    return sbatch(tmp_path, ["--ntasks=2", SCRIPT, CONFIG, *TINY, f"run.out_dir={run_dir.parent}",
                             f"run.name={run_dir.name}", "parallel.replicas.sample_log=true",
                             "parallel.replicas.timeout_s=10", *overrides], env=FAST_LIGHTHOUSE)


def group_logs(job: Job) -> list[Path]:
    """Each group's output file, beside the job's log."""
    return [job.output_path.with_name(f"slurm-{job.id}.group{g}.out") for g in (0, 1)]


def assert_completed(job: Job) -> tuple[str, list[str]]:
    """The job ended COMPLETED 0:0; its log and each group's."""
    fields = job.wait_end(timeout=300)
    logs = group_logs(job)
    texts = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        job.output()[-3000:] + "\n".join(t[-2000:] for t in texts)
    return job.output(), texts


def training_pids(job: Job, step_name: str) -> list[int]:
    """The task processes of the job's running step `step_name` (srun --job-name), from
    `scontrol listpids` (its rows with a task id; slurmstepd's own have none)."""
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job.id, "-o", "%i %j"], env=slurm_env(),
                           capture_output=True, text=True, timeout=30).stdout.split("\n")
    ids = [line.split()[0] for line in steps if line.split()[1:] == [step_name]]
    if not ids:
        return []
    rows = subprocess.run(["scontrol", "listpids", ids[0]], env=slurm_env(), capture_output=True,
                          text=True, timeout=30).stdout.split("\n")[1:]
    return [int(row.split()[0]) for row in rows if len(row.split()) == 5 and row.split()[3] != "-"]


@pytest.mark.slurm
@needs_cluster
def test_two_groups_as_job_steps_agree_and_train_every_sample_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "replicas"
    # Both groups from the first step (a group alone would take step 1 by itself).
    job = submit_groups(tmp_path, run_dir, ["parallel.replicas.min_groups=2"])
    output, logs = assert_completed(job)
    assert re.search(rf"job {job.id} \(restart 0\) on \S+: 2 replica group\(s\) x 1 rank\(s\)",
                     output)
    assert "dtrain: lighthouse listening on http://" in output
    assert "starting it again" not in output
    assert "dtrain: every replica group finished" in output
    for log in logs:
        assert "slurm: 1 node(s) x 1 rank(s) = world size 1" in log
    found = digests(*group_logs(job))
    assert found[0] == found[1] and found[0][0] == 16, found
    assert_every_sample_once(run_dir, epochs=1, size=512, batch=16)
    assert (run_dir / "checkpoints" / "latest").exists()


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_a_killed_group_is_started_again_by_the_script_and_heals(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "killed"
    job = submit_groups(tmp_path, run_dir, PACED)
    together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"
    deadline = time.monotonic() + 180
    # group 1 has joined (healed from group 0, if it came second) and took part in 3 steps
    while not (together.exists() and together.read_text().count('"groups": 2') >= 3):
        assert time.monotonic() < deadline, job.output()[-3000:]
        time.sleep(0.2)
    pids = training_pids(job, "group1")
    assert pids, "group 1's training process was not found"
    # Killed in the middle of a step's forward, not between a commit and its sample-log line
    # (a step committed by both groups but logged by one would fail the audit).
    lines = together.read_text().count("\n")
    while together.read_text().count("\n") == lines:
        time.sleep(0.01)
    time.sleep(0.1)
    for pid in pids:
        subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(pid)], check=True)
    killed = time.monotonic()

    output, (first, second) = assert_completed(job)
    print(f"job completed {time.monotonic() - killed:.1f} s after the kill")
    assert re.search(r"replica group 1 ended with exit code \d+; starting it again \(restart 1 "
                     r"of 3\): it heals from a live peer", output), output[-3000:]
    assert "replica group 0 ended" not in output and "dtrain: every replica group finished" in output
    # Group 0 started once and went on alone; group 1 twice, healed after its second start.
    assert first.count("dtrain | slurm") == 1 and second.count("dtrain | slurm") == 2
    # (the step under way not committed, or the next quorum without group 1)
    assert "not committed" in first or "replica groups: 2 -> 1 present" in first
    assert "healed from a live peer" in second.split("dtrain | slurm")[2]
    found = digests(*group_logs(job))
    assert found[0] == found[1] and found[0][0] >= 128, found
    groups = assert_every_sample_once(run_dir, epochs=1, size=4096, batch=16)
    assert groups[1] >= 1 and groups[2] >= 1  # steps alone and steps together

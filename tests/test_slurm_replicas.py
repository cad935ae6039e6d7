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

from conftest import REPO, TINY
from slurm_jobs import Job, slurm_env
# (this module skips without torchft, as test_replicas does; `lighthouse` is a fixture)
from test_replicas import assert_every_sample_once, digests, lighthouse  # noqa: F401
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


def assert_the_tiny_run_agreed(run_dir: Path, logs: list[Path]) -> None:
    """Both groups of the tiny job ended at its step 16 with equal digests, every sample trained
    once, and group 0 wrote the checkpoints."""
    found = digests(*logs)
    assert found[0] == found[1] and found[0][0] == 16, found
    assert_every_sample_once(run_dir, epochs=1, size=512, batch=16)
    assert (run_dir / "checkpoints" / "latest").exists()


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
    assert_the_tiny_run_agreed(run_dir, group_logs(job))


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


def fake_array_task(env: dict) -> subprocess.CompletedProcess:
    """The script as an array task would start, with `env` as SLURM sets it and no cluster:
    what it checks before it starts anything."""
    base = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "0",
            "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0",
            "SLURM_ARRAY_TASK_MAX": "1", "SLURM_NTASKS": "1"}
    return subprocess.run(["bash", SCRIPT, CONFIG], cwd=REPO, env={**slurm_env(), **base, **env},
                          capture_output=True, text=True, timeout=60)


def test_an_array_task_without_a_lighthouse_or_with_a_gap_is_one_line_and_exit_2() -> None:
    cases = [
        ({}, "dtrain: slurm error: a job array of replica groups needs a lighthouse that outlives "
             "its tasks: start `dtrain lighthouse` where every node reaches it and submit with "
             "LIGHTHOUSE=host:port"),
        ({"SLURM_ARRAY_TASK_MAX": "2", "LIGHTHOUSE": "http://127.0.0.1:1"},
         "dtrain: slurm error: the array's task indices must be contiguous (--array=0-1): task i "
         "is replica group i - the first index"),
    ]
    for env, line in cases:
        proc = fake_array_task(env)
        assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line, ""), proc


def submit_array(tmp_path: Path, run_dir: Path, indices: tuple[int, int], lighthouse: str,
                 overrides: list[str]) -> tuple[str, list[Job]]:
    """An array of two tasks of one task each (`indices`), sample logs on, the lighthouse
    given; the array's id and its tasks, each with its log."""
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--array={indices[0]}-{indices[1]}", "--ntasks=1",
         f"--output={tmp_path}/a-%A_%a.out", "--gpus-per-node=0", "--cpus-per-task=1",
         "--time=10", SCRIPT, CONFIG, *TINY, f"run.out_dir={run_dir.parent}",
         f"run.name={run_dir.name}", "parallel.replicas.sample_log=true",
         "parallel.replicas.timeout_s=10", *overrides],
        cwd=REPO, env=slurm_env(extra={"LIGHTHOUSE": lighthouse}), capture_output=True,
        text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    array = proc.stdout.strip().split(";")[0]
    return array, [Job(f"{array}_{t}", tmp_path / f"a-{array}_{t}.out") for t in indices]


@pytest.mark.slurm
@needs_cluster
def test_a_job_array_runs_one_group_per_task_with_a_lighthouse_of_its_own(
        tmp_path: Path, lighthouse: str) -> None:
    run_dir = tmp_path / "runs" / "array"
    array, tasks = submit_array(tmp_path, run_dir, (5, 6), lighthouse,
                                ["parallel.replicas.min_groups=2"])
    for task in tasks:
        fields = task.wait_end(timeout=300)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), task.output()
    logs = [tmp_path / f"a-{array}_{t}.group{g}.out" for g, t in enumerate((5, 6))]
    for g, (task, log) in enumerate(zip(tasks, logs)):
        output = task.output()
        assert f"dtrain: job {task.id} (restart 0) on " in output
        assert "2 replica group(s) x 1 rank(s)" in output
        assert f"dtrain: this array task is replica group {g}; lighthouse {lighthouse}" in output
        assert "lighthouse listening" not in output  # the one given, none of its own
        assert not (tmp_path / f"a-{array}_{5 + g}.lighthouse.out").exists()
        assert f"replica group {g} started (start 1)" in output
        assert "dtrain: every replica group finished (of this array task)" in output
        assert "slurm: 1 node(s) x 1 rank(s) = world size 1" in log.read_text()
    assert_the_tiny_run_agreed(run_dir, logs)


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_a_preempted_array_task_requeues_itself_alone_and_heals(
        tmp_path: Path, lighthouse: str) -> None:
    run_dir = tmp_path / "runs" / "preempted"
    array, (first, second) = submit_array(tmp_path, run_dir, (0, 1), lighthouse, PACED)
    together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"
    deadline = time.monotonic() + 180
    while not (together.exists() and together.read_text().count('"groups": 2') >= 3):
        assert time.monotonic() < deadline, second.output()[-3000:]
        time.sleep(0.2)
    second.cancel(signal="USR1")  # the time-limit warning, to task 1's batch shell alone

    for task, restarts in ((first, "0"), (second, "1")):
        fields = task.wait_end(timeout=300)
        assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == \
            ("COMPLETED", "0:0", restarts), task.output()[-3000:]
    assert "got SIG" not in first.output() and "(restart 1)" not in first.output()
    output = second.output()
    assert f"job {second.id} got SIGUSR1: asking every replica group to checkpoint" in output
    assert f"job {second.id} (restart 1) on " in output
    assert "dtrain: replica group 1 stopped at a step boundary (SIGUSR1)" in output
    assert output.count("dtrain: replica group 1 finished") == 1  # after the restart
    log = (tmp_path / f"a-{array}_1.group1.out").read_text()
    assert re.search(r"stop requested \(SIGUSR1\) at step \d+", log), log[-3000:]
    assert re.search(r"stopped at a step boundary [\d.]+ s after SIGUSR1", log), log[-3000:]
    assert (f"requeueing SLURM job {second.id}; it heals from a live peer when it starts again"
            in log)
    assert "healed from a live peer" in log.split("dtrain | slurm")[2]
    logs = [tmp_path / f"a-{array}_{g}.group{g}.out" for g in (0, 1)]
    found = digests(*logs)
    assert found[0] == found[1] and found[0][0] >= 128, found
    groups = assert_every_sample_once(run_dir, epochs=1, size=4096, batch=16)
    assert groups[1] >= 1 and groups[2] >= 1  # group 0 alone while task 1 was requeued

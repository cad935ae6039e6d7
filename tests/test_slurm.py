"""SLURM for real: slurm/train.sbatch and slurm/train_torchrun.sbatch submitted to a one-node
cluster on this machine (`tests/slurm/cluster.sh start`), compared step by step with a plain
torchrun run of the same job; preemption that checkpoints, requeues and resumes; and the
multi-node torchrun path without SLURM. The tests marked `slurm` are skipped without a cluster.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

import forkserver
from conftest import REPO, TINY, TRAIN, Result, child_env, launch, torchrun_cmd
from dtrain.process import slurm
from dtrain.process.env import port_for_job
from slurm_jobs import Job, slurm_env, train_steps

CONFIG = "configs/default.yaml"
STEPS = 48  # 3 epochs of 16 steps: 512 samples, 16 per rank, 2 ranks
JOB = ["model.name=user_code:slow_cnn", "train.epochs=3"]
FAST = "model.args={width: 8, sleep_s: 0}"
# Slow enough that a signal sent after step 5 lands well before step 48, on a busy machine too.
PACED = "model.args={width: 8, sleep_s: 0.15}"


def cluster_problem() -> Optional[str]:
    """Why the SLURM tests cannot run here, or None."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "no SLURM here (sbatch not found); `tests/slurm/cluster.sh start` sets up a local cluster"
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if proc.returncode != 0:
        return f"the SLURM cluster does not answer: {proc.stderr.strip()}"
    if not any(s.startswith(("idle", "mixed", "alloc")) for s in proc.stdout.split()):
        return f"no SLURM node is up (node states: {proc.stdout.split()})"
    return None


_PROBLEM = cluster_problem()
needs_cluster = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def sbatch(tmp_path: Path, args: list[str], env: Optional[dict] = None) -> Job:
    """sbatch on CPUs, as a user of a CPU partition would: the scripts' #SBATCH GPU request and
    sizes are overridden on the command line. The job's output goes to tmp_path."""
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out",
                           "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", *args],
                          cwd=REPO, env=slurm_env(extra=env), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    return Job(job_id, tmp_path / f"slurm-{job_id}.out")


def submit(script: str, tmp_path: Path, sbatch_args: list[str], train_args: list[str],
           env: Optional[dict] = None) -> Job:
    """A batch script with the TINY job and `train_args`."""
    return sbatch(tmp_path, [*sbatch_args, script, CONFIG, *TINY, *train_args], env)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / latest / "checkpoint.pt", weights_only=True)["model"]


def assert_same_run(run_dir: Path, reference: Result) -> None:
    """Every step's loss and the final weights equal the reference run's."""
    losses = Result(0, "", "", run_dir).losses()
    expected = reference.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) == sorted(expected)
    for step in expected:
        assert abs(losses[step] - expected[step]) <= 1e-6, (step, losses[step], expected[step])
    weights, ref_weights = final_weights(run_dir), final_weights(reference.run_dir)
    assert weights.keys() == ref_weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """The same job, uninterrupted, under a plain 2-rank torchrun."""
    run_dir = tmp_path_factory.mktemp("reference") / "runs" / "reference"
    result = launch(run_dir, [*JOB, FAST], nproc=2, config=CONFIG)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# ---------------------------------------------------------------------------------------------
# Without a cluster: the time-limit arithmetic and the multi-node torchrun path

def test_seconds_left_reads_scontrol_end_time() -> None:
    end = time.mktime(time.strptime("2030-01-02T03:04:05", "%Y-%m-%dT%H:%M:%S"))
    running = {"JobState": "RUNNING", "EndTime": "2030-01-02T03:04:05"}
    assert slurm.seconds_left(running, now=end - 90) == 90
    assert slurm.seconds_left({**running, "EndTime": "Unknown"}) is None  # no time limit
    # cancelled or timed out, SLURM shows COMPLETING with EndTime = when it ended
    assert slurm.seconds_left({**running, "JobState": "COMPLETING"}, now=end - 90) is None
    assert slurm.seconds_left({}) is None


def test_grace_report_says_when_the_save_cannot_fit() -> None:
    assert slurm.grace_report("7", None, 3.0) is None
    level, message = slurm.grace_report("7", 20.0, 45.0)
    assert level == logging.WARNING
    assert "20 s left" in message and "took 45.0 s" in message and "--signal=B:USR1@" in message
    level, message = slurm.grace_report("7", 200.0, 4.5)
    assert level == logging.INFO and "200 s left" in message and "took 4.5 s" in message
    level, message = slurm.grace_report("7", 200.0, None)
    assert level == logging.INFO and "not known yet" in message


@pytest.mark.slow
def test_two_torchrun_agents_with_nnodes_2_match_one_torchrun(reference: Result, tmp_path: Path) -> None:
    """The multi-node path on one host: two agents, one rank each, one c10d rendezvous."""
    run_dir = tmp_path / "runs" / "two_nodes"
    args = [f"--config={CONFIG}", *TINY, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}",
            *JOB, FAST]
    agent = [*torchrun_cmd(1, nnodes=2), "--rdzv-id=two-nodes", TRAIN, *args]
    procs = [forkserver.popen(agent, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    log = (run_dir / "log.txt").read_text()
    assert "torchrun: 2 node(s) x 1 rank(s) = world size 2" in log
    assert_same_run(run_dir, reference)


# ---------------------------------------------------------------------------------------------
# On the local cluster

@pytest.mark.slurm
@needs_cluster
def test_detection_inside_srun_and_refusal_in_the_batch_script(tmp_path: Path) -> None:
    probe = "from dtrain.process.env import detect; e = detect(); print(e.launcher, e.rank, e.world_size, e.master_addr)"
    proc = subprocess.run(["srun", "--ntasks=2", "--gpus-per-node=0", "--cpus-per-task=1",
                           sys.executable, "-c", probe], cwd=REPO, env=slurm_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first_host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    lines = sorted(proc.stdout.split("\n")[:-1])
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["slurm 0 2", "slurm 1 2"]
    assert {line.rsplit(" ", 1)[1] for line in lines} == {first_host}

    # The launcher started straight from a 2-task batch script, not through srun: exit 2.
    job = sbatch(tmp_path, ["--ntasks=2", f"--wrap={sys.executable} {TRAIN} --config {CONFIG}"])
    fields = job.wait_end()
    assert fields["ExitCode"] == "2:0", job.output()
    assert f"dtrain: slurm error: job {job.id} has 2 tasks but this process was not started by " \
           f"srun" in job.output()
    assert "Traceback" not in job.output()


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_sbatch_two_tasks_matches_torchrun(reference: Result, tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    job = submit("slurm/train.sbatch", tmp_path, ["--ntasks-per-node=2"],
                 [*JOB, FAST, f"run.out_dir={out_dir}", "run.name=sbatch"])
    fields = job.wait_end()
    output = job.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert "slurm: 1 node(s) x 2 rank(s) = world size 2 | device cpu | backend gloo" in output
    assert_same_run(out_dir / "sbatch", reference)


def preempt_and_finish(job, run_dir: Path) -> str:
    """Send the time-limit warning to the batch shell mid-run; the job must checkpoint, requeue
    itself once and complete. Returns the job's output."""
    job.wait_for_step(run_dir, 5)
    job.cancel(signal="USR1")
    fields = job.wait_end()
    output = job.output()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        output[-4000:]
    return output


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_preempted_job_checkpoints_requeues_itself_and_resumes_exactly(
        reference: Result, tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    # run.name unset: the run directory is job_<id>, the same after the requeue
    job = submit("slurm/train.sbatch", tmp_path, ["--ntasks-per-node=2"],
                 [*JOB, PACED, "log.tensorboard=true", "run.name=null", f"run.out_dir={out_dir}"])
    run_dir = out_dir / f"job_{job.id}"
    output = preempt_and_finish(job, run_dir)

    stopped = re.search(r"stop requested \(SIGUSR1\) at step (\d+)", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 5 <= step < STEPS
    assert f"job {job.id} got SIGUSR1: asking every rank to checkpoint and stop" in output
    assert re.search(r"preemption checkpoint saved [\d.]+ s after SIGUSR1, \d+ s before the job's "
                     r"time limit", output)
    assert f"requeueing SLURM job {job.id}" in output
    assert f"job {job.id} (restart 1)" in output
    assert f"resumed from {run_dir}/checkpoints/step_{step:06d}-epoch_" in output

    # metrics.jsonl: every step once, in order, across both attempts; the numbers are the
    # uninterrupted run's, before and after the resume
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, reference)

    # TensorBoard continues: steps strictly increase, none repeated from the first attempt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, STEPS + 1))
    losses = Result(0, "", "", run_dir).losses()
    assert all(abs(s.value - losses[s.step]) <= 1e-5 for s in scalars)


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_cancelled_job_saves_a_checkpoint_and_is_not_requeued(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    job = submit("slurm/train.sbatch", tmp_path, ["--ntasks-per-node=2"],
                 [*JOB, PACED, f"run.out_dir={out_dir}", "run.name=cancelled"])
    run_dir = out_dir / "cancelled"
    job.wait_for_step(run_dir, 3)
    subprocess.run(["scancel", job.id], check=True)  # the user's scancel: SIGTERM to every process
    fields = job.wait_end()
    output = job.output()
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), output[-4000:]
    stopped = re.search(r"stop requested \((SIGTERM|SIGUSR1)\) at step (\d+)", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(2))
    assert f"SLURM job {job.id} is already ending (state COMPLETING: cancelled, or past its " \
           f"time limit): not requeued" in output
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith(f"step_{step:06d}-")
    assert (run_dir / "checkpoints" / latest / "COMPLETE").exists()


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_torchrun_sbatch_two_agents_preempted_and_resumed(reference: Result, tmp_path: Path) -> None:
    """slurm/train_torchrun.sbatch with two agents on this one node (two "nodes" of one rank)."""
    out_dir = tmp_path / "runs"
    job = submit("slurm/train_torchrun.sbatch", tmp_path, ["--nodes=1", "--ntasks-per-node=2"],
                 [*JOB, PACED, "run.name=null", f"run.out_dir={out_dir}"],
                 env={"NPROC_PER_NODE": "1"})
    run_dir = out_dir / f"job_{job.id}"
    output = preempt_and_finish(job, run_dir)
    assert re.search(rf"job {job.id} \(restart 0\) on \S+: 2 torchrun agent\(s\) x 1 rank\(s\), "
                     rf"rendezvous \S+:{port_for_job(job.id)}", output)
    assert "torchrun: 2 node(s) x 1 rank(s) = world size 2" in output
    stopped = re.search(r"stop requested \(SIGUSR1\) at step (\d+)", output)
    assert stopped and 5 <= int(stopped.group(1)) < STEPS, output[-4000:]
    assert f"requeueing SLURM job {job.id}" in output
    assert f"resumed from {run_dir}/checkpoints/step_{int(stopped.group(1)):06d}-" in output
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, reference)

"""Two nodes for real: "hosts" made of Linux network namespaces, each with its own address and
host name on a private bridge (tests/cluster/hosts.sh), and a two-node SLURM cluster on them
(tests/cluster/slurm2.sh). Ranks on different hosts reach each other only through the bridge,
rendezvous on the first host's address (never 127.0.0.1), and must train exactly what a one-host
2-rank torchrun run trains:

- two torchrun agents, one per host, DDP and FSDP: losses and final weights of the one-host run;
- the second host's agent and workers SIGKILLed mid-run, both agents started again: the run
  resumes from its last checkpoint, bit-identical to an uninterrupted run;
- `sbatch --nodes=2` of both batch scripts: ranks on both hosts, rendezvous on the first host of
  the node list at the job's port; preempted (SIGUSR1 to the batch shell), they checkpoint,
  requeue themselves once and finish with the reference's losses;
- a run directory that the second host does not share: refused before training; the same two
  hosts on node-local disks with the run in an S3 server: the one-host run's losses, under
  torchrun and under `sbatch` preempted and requeued onto fresh local disks.

The hosts and the cluster are started once per session (and stopped at its end if this session
started them; `.ci/run` starts them beforehand). Where they cannot be made (not root, no network
namespaces, no SLURM), the tests are skipped with the scripts' one-line reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from conftest import (REPO, TINY, TRAIN, Result, child_env, descendants, free_port, kill_tree,
                      launch)
from slurm_jobs import FINAL_STATES, Job, slurm_env, train_steps

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

HOSTS_SH = REPO / "tests" / "cluster" / "hosts.sh"
SLURM2_SH = REPO / "tests" / "cluster" / "slurm2.sh"
SLURM_CONF = "/etc/slurm-dtrain2/slurm.conf"

CONFIG = "configs/default.yaml"
STEPS = 32  # 2 epochs of 16 steps: 512 samples, 16 per rank, 2 ranks
# The tiny job of test_slurm.py; the model prints where each rank runs (multinode_code.py).
JOB = ["model.name=multinode_code:located_cnn", "train.epochs=2", "ckpt.every_steps=8"]
FAST = "model.args={width: 8, sleep_s: 0}"
# Slow enough that a kill or a signal after step 5-8 lands well before step 32.
PACED = "model.args={width: 8, sleep_s: 0.15}"
TOLERANCE = {"ddp": 1e-6, "fsdp": 1e-5}
LOCATED = re.compile(r"multinode_code: rank (\d+) of (\d+) on host (\S+) \((\S+)\), "
                     r"MASTER_ADDR=(\S+) MASTER_PORT=(\S+) dtrain=(\S+)")


# ---------------------------------------------------------------------------------------------
# Hosts and cluster, once per session

def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout)


def _reason(proc: subprocess.CompletedProcess) -> str:
    """The script's own one-line reason: its last line on stderr (else stdout)."""
    lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit code {proc.returncode}"


@pytest.fixture(scope="session")
def hosts() -> dict[str, str]:
    """{host name: address} of the test hosts (at least dtn1 and dtn2), made if need be."""
    was_up = _script(str(HOSTS_SH), "status").returncode == 0
    proc = _script(str(HOSTS_SH), "up")
    if proc.returncode != 0:
        pytest.skip(f"no test hosts: {_reason(proc)}")
    status = _script(str(HOSTS_SH), "status")
    found = dict(re.findall(r"^(dtn\d+) (\S+) up$", status.stdout, re.M))
    assert {"dtn1", "dtn2"} <= found.keys(), status.stdout + status.stderr
    yield found
    if not was_up:
        down = _script(str(HOSTS_SH), "down")
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="session")
def cluster2(hosts: dict[str, str]) -> str:
    """The two-node SLURM cluster on dtn1 and dtn2, started if need be; its SLURM_CONF."""
    was_up = _script(str(SLURM2_SH), "status").returncode == 0
    proc = _script(str(SLURM2_SH), "start")
    if proc.returncode != 0:
        pytest.skip(f"no two-node SLURM cluster: {_reason(proc)}")
    yield SLURM_CONF
    if not was_up:
        stop = _script(str(SLURM2_SH), "stop")
        assert stop.returncode == 0, stop.stderr


# ---------------------------------------------------------------------------------------------
# Reading runs

def losses(run_dir: Path) -> dict[int, float]:
    return Result(0, "", "", run_dir).losses()


def latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def saved_step(run_dir: Path) -> int:
    """Step of the newest complete checkpoint, 0 before the first."""
    if not (run_dir / "checkpoints" / "latest").exists():
        return 0
    return json.loads((latest(run_dir) / "COMPLETE").read_text())["step"]


def final_weights(run_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model of the newest checkpoint: a full one, or DCP shards consolidated by torch."""
    folder = latest(run_dir)
    if (folder / "checkpoint.pt").exists():
        return torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / f"consolidated-{run_dir.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder / "dcp"), str(out))
    return torch.load(out, map_location="cpu", weights_only=True)["model"]


def assert_same_run(run_dir: Path, reference: Result, tolerance: float, tmp_path: Path) -> None:
    """Every step's loss and the final weights equal the reference run's, within `tolerance`."""
    got, expected = losses(run_dir), reference.losses()
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(expected)
    for step in expected:
        assert abs(got[step] - expected[step]) <= tolerance, (step, got[step], expected[step])
    weights = final_weights(run_dir, tmp_path)
    ref_weights = final_weights(reference.run_dir, tmp_path)
    assert weights and weights.keys() == ref_weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=tolerance, rtol=0)


def located(output: str) -> dict[int, dict[str, str]]:
    """What each rank printed about where it ran (the last time, for a restarted run)."""
    ranks = {}
    for rank, world, host, address, addr, port, package in LOCATED.findall(output):
        # every process of these tests runs this repository's dtrain (conftest's PYTHONPATH)
        assert package == str(REPO / "src" / "dtrain"), f"rank {rank} imported dtrain from {package}"
        ranks[int(rank)] = {"world": world, "host": host, "address": address,
                            "master_addr": addr, "master_port": port}
    return ranks


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def port_for_job(job_id: str) -> int:
    """dtrain.process.env.port_for_job of the code under test (this repository's src/, as the jobs see it)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from dtrain.process.env import port_for_job; "
                           "print(port_for_job(sys.argv[1]))", job_id], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


# ---------------------------------------------------------------------------------------------
# Reference runs (one host, 2 ranks on 127.0.0.1) and two-host torchrun runs

@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Result]:
    """The job under a plain one-host 2-rank torchrun, per parallel mode (made when first asked)."""
    runs: dict[str, Result] = {}

    def get(mode: str) -> Result:
        if mode not in runs:
            run_dir = tmp_path_factory.mktemp(f"reference-{mode}") / "runs" / "reference"
            result = launch(run_dir, [*JOB, FAST, f"parallel.mode={mode}"], nproc=2, config=CONFIG)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[mode] = result
        return runs[mode]

    return get


@dataclass
class Agents:
    """One torchrun agent per host, started with the same command line."""
    procs: dict[str, subprocess.Popen]
    logs: dict[str, Path]

    def wait(self, timeout: float = 300) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for host, proc in self.procs.items():
            try:
                codes[host] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"torchrun agents not done after {timeout} s:\n{self.tails()}")
        return codes

    def output(self, host: str) -> str:
        return self.logs[host].read_text(errors="replace") if self.logs[host].exists() else ""

    def tails(self, chars: int = 3000) -> str:
        return "\n".join(f"--- agent on {h}:\n{self.output(h)[-chars:]}" for h in self.procs)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def start_agents(hosts: dict[str, str], run_dir: Path, overrides: list[str], port: int,
                 logs_dir: Path, rdzv_id: str = "multinode",
                 wrap: Optional[dict[str, list[str]]] = None,
                 env: Optional[dict[str, str]] = None) -> Agents:
    """`torchrun --nnodes=2 --nproc_per_node=1` on dtn1 and dtn2, c10d rendezvous on dtn1's
    address. `wrap[host]` is put before the agent's command on that host (inside the host)."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    args = [f"--config={CONFIG}", *TINY, f"run.out_dir={run_dir.parent}",
            f"run.name={run_dir.name}", *overrides]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts['dtn1']}:{port}",
             f"--rdzv-id={rdzv_id}", "--max-restarts=0", TRAIN, *args]
    procs, logs = {}, {}
    for host in ("dtn1", "dtn2"):
        n = len(list(logs_dir.glob(f"agent-{host}*.log")))
        logs[host] = logs_dir / f"agent-{host}.{n}.log"
        with open(logs[host], "w") as log:
            # LOGLEVEL=INFO: torchrun logs its rendezvous (endpoint, master_addr, group_rank).
            procs[host] = subprocess.Popen(
                [str(HOSTS_SH), "exec", host, *(wrap or {}).get(host, []), *agent], cwd=REPO,
                env=child_env({"LOGLEVEL": "INFO", **(env or {})}), stdout=log,
                stderr=subprocess.STDOUT)
    return Agents(procs, logs)


def assert_placed_on_both_hosts(agents: Agents, hosts: dict[str, str], port: int) -> None:
    """Rank r ran on dtn(r+1), both agents met at dtn1's address, the store was on dtn1."""
    for host in ("dtn1", "dtn2"):
        output = agents.output(host)
        assert re.search(rf"rdzv_endpoint\s*:\s*{re.escape(hosts['dtn1'])}:{port}\b", output), \
            agents.tails()
        assert re.search(r"master_addr=dtn1\b", output), agents.tails()
        assert re.search(rf"group_rank={int(host[3:]) - 1}\b", output), agents.tails()
        ranks = located(output)
        assert len(ranks) == 1, agents.tails()  # one rank per agent
        (rank, where), = ranks.items()
        assert rank == int(host[3:]) - 1 and where["world"] == "2", where
        assert (where["host"], where["address"]) == (host, hosts[host]), where
        assert where["master_addr"] == "dtn1", where


@pytest.fixture(scope="module")
def two_host_runs(hosts: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """The job under two agents on dtn1 and dtn2 (FAST), per parallel mode: (run_dir, agents,
    port). The DDP one is also the uninterrupted run the killed run must reproduce."""
    runs: dict[str, tuple[Path, Agents, int]] = {}

    def get(mode: str) -> tuple[Path, Agents, int]:
        if mode not in runs:
            base = tmp_path_factory.mktemp(f"two-hosts-{mode}")
            run_dir, port = base / "runs" / "two_hosts", free_port()
            agents = start_agents(hosts, run_dir, [*JOB, FAST, f"parallel.mode={mode}"], port,
                                  base / "agents")
            assert agents.wait() == {"dtn1": 0, "dtn2": 0}, agents.tails()
            runs[mode] = (run_dir, agents, port)
        return runs[mode]

    return get


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_hosts_torchrun_matches_one_host(two_host_runs, reference, hosts, mode: str,
                                             tmp_path: Path) -> None:
    run_dir, agents, port = two_host_runs(mode)
    log = (run_dir / "log.txt").read_text()
    assert "torchrun: 2 node(s) x 1 rank(s) = world size 2" in log
    assert f"mode {mode}" in log
    # FSDP: every rank wrote its shards into the shared run directory (DCP)
    assert (latest(run_dir) / "dcp").is_dir() == (mode == "fsdp")
    assert_placed_on_both_hosts(agents, hosts, port)
    assert_same_run(run_dir, reference(mode), TOLERANCE[mode], tmp_path)


def test_second_host_killed_then_both_restarted_resumes_exactly(two_host_runs, hosts,
                                                                 tmp_path: Path) -> None:
    """SIGKILL the agent of dtn2 and its worker (a lost node) once a checkpoint exists; the
    agent of dtn1 must end by itself; the same two commands again continue bit-exactly."""
    straight_dir, _, _ = two_host_runs("ddp")
    run_dir, port = tmp_path / "runs" / "killed", free_port()
    overrides = [*JOB, "model.args={width: 8, sleep_s: 0.1}", "parallel.mode=ddp"]
    agents = start_agents(hosts, run_dir, overrides, port, tmp_path / "agents")
    try:
        deadline = time.monotonic() + 180
        while saved_step(run_dir) < 8:
            assert all(p.poll() is None for p in agents.procs.values()), \
                f"the run ended before it could be killed:\n{agents.tails()}"
            assert time.monotonic() < deadline, f"no checkpoint after 180 s:\n{agents.tails()}"
            time.sleep(0.05)
        second = agents.procs["dtn2"]
        workers = descendants(second.pid)
        assert workers, "the agent on dtn2 has no worker"
        kill_tree(second.pid, signal.SIGKILL)
        second.wait(timeout=30)
        killed_at = saved_step(run_dir)
        assert 8 <= killed_at < STEPS
        # The survivor notices: its rank's next collective fails, and its agent exits non-zero.
        started = time.monotonic()
        first_code = agents.procs["dtn1"].wait(timeout=180)
        survivor_s = time.monotonic() - started
        assert first_code == 1, agents.tails()
        assert survivor_s < 60, f"the agent on dtn1 took {survivor_s:.0f} s to end"
        assert re.search(r"distributed error at step \d+ on rank 0: rank\(s\) 1 did not arrive",
                         agents.output("dtn1")), agents.tails()
        assert not [pid for pid in workers if alive(pid)], "dtn2's worker survived"
    finally:
        agents.kill()

    again = start_agents(hosts, run_dir, overrides, port, tmp_path / "agents")
    assert again.wait() == {"dtn1": 0, "dtn2": 0}, again.tails()
    log = (run_dir / "log.txt").read_text()
    assert f"resumed from {run_dir}/checkpoints/step_{killed_at:06d}-" in log, log[-3000:]
    assert_placed_on_both_hosts(again, hosts, port)
    # bitwise: the same floats at every step, the same final weights
    assert losses(run_dir) == losses(straight_dir)
    weights, straight = final_weights(run_dir, tmp_path), final_weights(straight_dir, tmp_path)
    assert weights and weights.keys() == straight.keys()
    for name in straight:
        assert torch.equal(weights[name], straight[name]), name
    print(f"killed at checkpoint step {killed_at}; the agent on dtn1 ended {survivor_s:.1f} s after "
          f"dtn2 was killed, with exit code {first_code}")


@pytest.fixture(scope="module")
def bridge_s3(hosts: dict[str, str]):
    """An S3 server on the bridge's address of the root namespace: reachable from both hosts."""
    import s3server

    server = s3server.start(host=hosts["dtn1"].rsplit(".", 1)[0] + ".1")
    yield server
    s3server.stop(server)


def test_two_hosts_on_node_local_disks_train_through_an_object_store(hosts, reference, bridge_s3,
                                                                    tmp_path: Path) -> None:
    """No shared disk: each host has its own staging folder (dtn2's agent sees another
    directory there, a bind mount in a mount namespace of its own) and the run is in an S3
    server on the bridge's address. FSDP with sharded checkpoints: each rank uploads its own
    shard from its own disk, rank 0 the marker; the losses are the one-host run's."""
    server = bridge_s3
    bucket = server.bucket()
    stage, dtn2_disk = tmp_path / "stage", tmp_path / "dtn2-disk"
    stage.mkdir()
    dtn2_disk.mkdir()
    own_disk = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(dtn2_disk),
                str(stage)]
    run_dir, port = tmp_path / "unused" / "r", free_port()
    overrides = [*JOB, FAST, "parallel.mode=fsdp", "ckpt.format=sharded",
                 f"run.out_dir=s3://{bucket}/exp", f"run.staging_dir={stage}"]
    agents = start_agents(hosts, run_dir, overrides, port, tmp_path / "agents",
                          wrap={"dtn2": own_disk}, env=server.env)
    try:
        assert agents.wait() == {"dtn1": 0, "dtn2": 0}, agents.tails()
    finally:
        agents.kill()
    fs = server.fs()
    text = fs.cat(f"{bucket}/exp/r/metrics.jsonl").decode()
    got = {r["step"]: r["loss"] for r in map(json.loads, text.splitlines()) if "loss" in r}
    want = reference("fsdp").losses()
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= TOLERANCE["fsdp"] for k in want), (got, want)
    latest_name = fs.cat(f"{bucket}/exp/r/checkpoints/latest").decode().strip()
    folder = f"{bucket}/exp/r/checkpoints/{latest_name}"
    shards = {p.rsplit("/", 1)[1] for p in fs.find(folder)}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "COMPLETE"} <= shards
    assert fs.exists(f"{bucket}/exp/r/log.rank1.txt")
    # Each host wrote on its own disk: dtn2's staging folder holds rank 1's log only.
    theirs = {p.name for p in dtn2_disk.rglob("*") if p.is_file()}
    assert "log.rank1.txt" in theirs and "metrics.jsonl" not in theirs, theirs
    ours = {p.name for p in stage.rglob("*") if p.is_file()}
    assert "metrics.jsonl" in ours and "log.rank1.txt" not in ours, ours
    assert not run_dir.parent.exists()


def test_run_directory_not_shared_by_the_second_host_is_refused(hosts, tmp_path: Path) -> None:
    """dtn2 sees another directory at the run directory's parent (a bind mount in a mount
    namespace of its agent's own): every worker exits 2 before training, with one line naming
    the run directory."""
    out_dir, elsewhere = tmp_path / "runs", tmp_path / "dtn2-sees-this"
    out_dir.mkdir()
    elsewhere.mkdir()
    run_dir, port = out_dir / "unshared", free_port()
    # dtn2's agent, in a mount namespace of its own: `elsewhere` bind-mounted over `out_dir`
    over_parent = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                   'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(elsewhere),
                   str(out_dir)]
    agents = start_agents(hosts, run_dir, [*JOB, FAST], port, tmp_path / "agents",
                          wrap={"dtn2": over_parent})
    try:
        codes = agents.wait(timeout=300)
    finally:
        agents.kill()
    outputs = {h: agents.output(h) for h in agents.procs}
    assert codes == {"dtn1": 1, "dtn2": 1}, agents.tails()
    lines = [line for o in outputs.values() for line in o.splitlines()
             if "is not shared by all ranks" in line]
    assert lines and all(str(run_dir) in line for line in lines), agents.tails()
    # The worker exit codes torchrun reports are 2 (bad input). The agent that ends second may
    # find the rendezvous store already gone and report no summary at all: that is torchrun's.
    summaries = [re.findall(r"exitcode\s*:\s*(-?\d+)", output) for output in outputs.values()]
    assert any(summaries) and all(set(codes) <= {"2"} for codes in summaries), agents.tails()
    for output in outputs.values():
        assert "/dtrain/" not in output, agents.tails()  # no traceback through dtrain's code
    assert not train_steps(run_dir) and not train_steps(elsewhere / "unshared")


# ---------------------------------------------------------------------------------------------
# The two-node SLURM cluster

def scontrol(conf: str, *args: str) -> str:
    proc = subprocess.run(["scontrol", *args], env=slurm_env(conf), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def submit(cluster2: str, tmp_path: Path):
    """sbatch of a script on both nodes, one task (one rank or one torchrun agent) per node, on
    CPUs; the job's output goes to tmp_path. Jobs still running at the end are cancelled."""
    jobs: list[Job] = []

    def sbatch(script: str, train_args: list[str], env: Optional[dict] = None) -> Job:
        proc = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", "--nodes=2",
             "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
             script, CONFIG, *TINY, *train_args],
            cwd=REPO, env=slurm_env(cluster2, {"NPROC_PER_NODE": "1", "LOGLEVEL": "INFO",
                                               **(env or {})}),
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        job = Job(job_id, tmp_path / f"slurm-{job_id}.out", cluster2)
        jobs.append(job)
        return job

    yield sbatch
    for job in jobs:
        if job.fields().get("JobState") not in FINAL_STATES:
            job.cancel()


def assert_ran_across_both_nodes(job: Job, fields: dict[str, str], script: str, restart: int) -> None:
    """From the job's output: the ranks ran on the two hosts, rank 0 on the first host of the
    node list, every rank met at that host, on the job's port (train.sbatch: the process
    group's; train_torchrun.sbatch: the c10d rendezvous')."""
    output = job.output()
    nodes = scontrol(job.conf, "show", "hostnames", fields["NodeList"]).split()
    assert sorted(nodes) == ["dtn1", "dtn2"], fields["NodeList"]
    first, port = nodes[0], port_for_job(job.id)
    attempt = output.split(f"dtrain: job {job.id} (restart {restart}) on {fields['NodeList']}:")
    assert len(attempt) == 2, output[-4000:]
    attempt_output = attempt[1].split(f"dtrain: job {job.id} (restart {restart + 1})")[0]
    ranks = located(attempt_output)
    assert sorted(ranks) == [0, 1], attempt_output[-4000:]
    assert {r["host"] for r in ranks.values()} == {"dtn1", "dtn2"}, ranks
    assert ranks[0]["host"] == first, ranks
    assert all(r["master_addr"] == first for r in ranks.values()), ranks
    if script == "slurm/train.sbatch":
        assert attempt_output.lstrip().startswith("2 tasks"), attempt_output[:300]
        assert "slurm: 2 node(s) x 1 rank(s) = world size 2" in attempt_output
        assert all(r["master_port"] == str(port) for r in ranks.values()), (port, ranks)
    else:
        assert attempt_output.lstrip().startswith(
            f"2 torchrun agent(s) x 1 rank(s), rendezvous {first}:{port},"), attempt_output[:300]
        assert "torchrun: 2 node(s) x 1 rank(s) = world size 2" in attempt_output
        endpoints = re.findall(r"rdzv_endpoint\s*:\s*(\S+)", attempt_output)
        assert endpoints == [f"{first}:{port}"] * 2, endpoints
        assert len(re.findall(rf"master_addr={first}\b", attempt_output)) == 2, attempt_output[-4000:]


SCRIPTS = ["slurm/train_torchrun.sbatch", "slurm/train.sbatch"]


@pytest.mark.slurm
@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_two_nodes_matches_one_host(submit, reference, script: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    job = submit(script, [*JOB, FAST, f"run.out_dir={out_dir}", "run.name=two_nodes"])
    fields = job.wait_end()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), job.output()[-4000:]
    assert_ran_across_both_nodes(job, fields, script, restart=0)
    assert_same_run(out_dir / "two_nodes", reference("ddp"), TOLERANCE["ddp"], tmp_path)


@pytest.fixture
def slow_requeue(tmp_path: Path) -> dict:
    """The job's PATH starts with an `scontrol` that answers `requeue` after 3 s, as a busy
    slurmctld may: the node whose ranks are done first must not take rank 0 down before its
    requeue is made."""
    folder = tmp_path / "busy-slurmctld"
    folder.mkdir()
    real = subprocess.run(["sh", "-c", "command -v scontrol"], capture_output=True, text=True).stdout.strip()
    wrapper = folder / "scontrol"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = requeue ] && sleep 3\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def checkpointed_requeued_and_resumed(job: Job, run_dir: str) -> tuple[dict[str, str], str]:
    """SIGUSR1 to the job's batch shell: it checkpoints, requeues itself once, resumes from the
    checkpoint of its stop in `run_dir` and completes. The job's fields and output."""
    job.cancel(signal="USR1")
    fields = job.wait_end()
    output = job.output()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        output[-6000:]
    stopped = re.search(r"stop requested \(SIGUSR1\) at step (\d+)", output)
    assert stopped, output[-4000:]
    step = int(stopped.group(1))
    assert 5 <= step < STEPS
    assert f"job {job.id} got SIGUSR1: asking every rank to checkpoint and stop" in output
    assert f"requeueing SLURM job {job.id}" in output
    assert f"resumed from {run_dir}/checkpoints/step_{step:06d}-" in output, output[-4000:]
    return fields, output


@pytest.mark.slurm
@pytest.mark.parametrize("script", SCRIPTS)
def test_sbatch_two_nodes_preempted_requeues_and_resumes_exactly(submit, reference, slow_requeue,
                                                                  script: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    # run.name unset: the run directory is job_<id>, the same after the requeue
    job = submit(script, [*JOB, PACED, "run.name=null", f"run.out_dir={out_dir}"], slow_requeue)
    run_dir = out_dir / f"job_{job.id}"
    job.wait_for_step(run_dir, 5)
    fields, output = checkpointed_requeued_and_resumed(job, str(run_dir))
    assert_ran_across_both_nodes(job, fields, script, restart=0)
    assert_ran_across_both_nodes(job, fields, script, restart=1)
    # every step once, in order, across both attempts; the numbers are the reference's
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, reference("ddp"), TOLERANCE["ddp"], tmp_path)


@pytest.mark.slurm
def test_sbatch_two_nodes_on_local_disks_preempted_requeues_through_an_object_store(
        submit, reference, slow_requeue, bridge_s3, tmp_path: Path) -> None:
    """The run in the S3 server, every node on a local disk of its own ($TMPDIR, where the
    staging folder is by default), and the requeued job on fresh local disks: SIGUSR1, a
    checkpoint uploaded, a requeue, a resume from the store alone; the reference's losses."""
    server, disks = bridge_s3, tmp_path / "disks"
    bucket = server.bucket()
    # What a cluster's prolog does: TMPDIR on each node's own disk, a new one for each attempt
    # (a requeued job may land on other nodes, with nothing of its first attempt on them).
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'TMPDIR="{disks}/${{SLURMD_NODENAME:-batch}}.restart${{SLURM_RESTART_COUNT:-0}}"\n'
        'mkdir -p "$TMPDIR" && export TMPDIR\n'
        f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = f"s3://{bucket}/exp"
    job = submit("slurm/train_torchrun.sbatch", [*JOB, PACED, "run.name=null", f"run.out_dir={out}"],
                 {**slow_requeue, **server.env, "PYTHON": str(python)})
    deadline = time.monotonic() + 180
    while not [int(s) for s in re.findall(r" step (\d+) \| epoch", job.output()) if int(s) >= 5]:
        assert job.fields().get("JobState") not in FINAL_STATES, job.output()[-4000:]
        assert time.monotonic() < deadline, f"no step 5 after 180 s:\n{job.output()[-4000:]}"
        time.sleep(0.2)
    fields, output = checkpointed_requeued_and_resumed(job, f"{out}/job_{job.id}")
    assert_ran_across_both_nodes(job, fields, "slurm/train_torchrun.sbatch", restart=0)
    assert_ran_across_both_nodes(job, fields, "slurm/train_torchrun.sbatch", restart=1)
    # The run, read back from the store: every step once, the reference's numbers.
    run_dir = tmp_path / "from-the-store" / f"job_{job.id}"
    server.fs().get(f"{bucket}/exp/job_{job.id}", str(run_dir), recursive=True)
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, reference("ddp"), TOLERANCE["ddp"], tmp_path)
    # Each node of each attempt wrote on its own disk: rank 0's records on the first node's,
    # rank 1's log on the other's; no attempt found a file of the one before on its disks.
    staged = {d.name: {p.name for p in d.rglob("*") if p.is_file()} for d in disks.iterdir()
              if not d.name.startswith("batch")}
    assert sorted(staged) == [f"{n}.restart{r}" for n in ("dtn1", "dtn2") for r in (0, 1)], staged
    for restart in (0, 1):
        assert "metrics.jsonl" in staged[f"dtn1.restart{restart}"], staged
        assert "log.rank1.txt" in staged[f"dtn2.restart{restart}"], staged
        assert "metrics.jsonl" not in staged[f"dtn2.restart{restart}"], staged

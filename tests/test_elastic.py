"""Elastic membership on two test hosts (tests/cluster/hosts.sh): one torchrun agent per host,
`--nnodes=1:2 --max-restarts=3`, c10d rendezvous on dtn1's address.

dtn2's agent and worker are SIGKILLed (a node lost) -> dtn1's worker notices its dead peer at the
next collective and exits -> dtn1's agent re-rendezvouses alone -> dtrain resumes from the last
checkpoint at world size 1 -> dtn2's agent is started again -> dtn1's agent stops its worker with
SIGTERM to re-form the group -> dtrain checkpoints at the next step boundary and exits -> both
resume at world size 2 from that checkpoint and finish. With the short rendezvous waits the
run is in an S3 server instead of the shared disk, each host staging on a disk of its own: the
same leave and rejoin, read back from the store.

A user dataset writes what each process served, in order; with the checkpoints each attempt
resumed from, the test keeps what the final history kept (an attempt's samples up to the position
the next attempt resumed from) and checks that each epoch's samples were consumed exactly once,
with the default data.drop_last=true (512 samples: no tail at either world size; when the
preemption falls after an odd number of one-rank steps, the two ranks finish the epoch with a
short step of 8 samples each, tests/test_world_change.py has that case every time).
"""

from __future__ import annotations

import json
import posixpath
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, TRAIN, child_env, free_port, kill_tree, unwrapped
from test_multinode import (CONFIG, HOSTS_SH, bridge_s3,  # noqa: F401 - the module's fixtures
                            hosts)

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

# batch 16 a rank: 16 steps an epoch on two hosts, 32 on one. Four epochs: the survivor must not
# finish alone before the rejoining agent (a new process, slow on a loaded machine) is in.
SAMPLES, EPOCHS = 512, 4
JOB = ["data.name=user_code:attempt_served_synthetic", "model.name=user_code:slow_cnn",
       "model.args={width: 8, sleep_s: 0.25}", f"train.epochs={EPOCHS}", "ckpt.every_steps=4",
       "ckpt.every_epochs=0", "ckpt.keep_last=100", "log.tensorboard=true"]


# torchrun shares its rendezvous TCPStore with the workers by default, and then an agent that has
# rendezvoused before never writes the round's MASTER_ADDR again (torch 2.14's
# DynamicRendezvousHandler.next_rendezvous reuses its first _bootstrap_store_info): a node that
# joins later waits for that key until both agents time out. The documented opt-out makes every
# round publish it (docs/elastic.md).
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Agent:
    """`torchrun --nnodes=1:2` on one test host, its output in a log file."""

    def __init__(self, host: str, hosts: dict[str, str], port: int, out_dir: str,  # noqa: F811
                 served: Path, logs: Path, rdzv: list[str], wrap: list[str],
                 env: dict[str, str], extra: list[str]) -> None:
        self.log = logs / f"agent-{host}.{len(list(logs.glob(f'agent-{host}.*')))}.log"
        args = [f"--config={CONFIG}", *TINY, f"run.out_dir={out_dir}", "run.name=elastic", *JOB,
                *extra]
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                   "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={hosts['dtn1']}:{port}", "--rdzv-id=elastic", *rdzv, TRAIN,
                   *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(HOSTS_SH), "exec", host, *wrap, *command], cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env({"LOGLEVEL": "INFO", "SERVED_DIR": str(served), **NO_SHARED_STORE,
                               **env}))

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class RunFiles:
    """The run's files, read while it runs: in its directory on the shared disk, or (`fs`) in
    the S3 server, where the records are uploaded every second."""

    def __init__(self, run_dir: Path, fs=None, key: str = "") -> None:  # noqa: ANN001 - s3fs's
        self.run_dir, self.fs, self.key = run_dir, fs, key
        self.poll_s = 0.05 if fs is None else 0.3  # (each look at the store is a request)

    def text(self, name: str) -> str:
        """The file `name` of the run ("../runs.csv": the table beside it); "" while missing."""
        if self.fs is None:
            path = self.run_dir / name
            return path.read_text() if path.exists() else ""
        try:
            return self.fs.cat(posixpath.normpath(f"{self.key}/{name}")).decode()
        except FileNotFoundError:
            return ""

    def local(self, name: str, into: Path) -> Path:
        """A local path of the run's file or folder `name` (from the store: a copy in `into`)."""
        if self.fs is None:
            return self.run_dir / name
        self.fs.get(f"{self.key}/{name}", str(into / name), recursive=True)
        return into / name


def records(run: RunFiles) -> list[dict]:
    return [json.loads(line) for line in run.text("metrics.jsonl").splitlines()
            if line.endswith("}")]


def saved_step(run: RunFiles) -> int:
    latest = run.text("checkpoints/latest").strip()
    if not latest:
        return 0
    return json.loads(run.text(f"checkpoints/{latest}/COMPLETE"))["step"]


def wait_until(what: str, ready, agents: list[Agent], timeout: float = 240,
               every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {a.log.name}:\n{a.output()[-3000:]}" for a in agents)
            pytest.fail(f"no {what} after {timeout} s\n{tails}")
        time.sleep(every)


def position(run: RunFiles, checkpoint: str, into: Path) -> int:
    """Global sample position a checkpoint holds: epoch x SAMPLES + samples of its epoch."""
    data = torch.load(run.local(f"checkpoints/{checkpoint}/checkpoint.pt", into),
                      map_location="cpu", weights_only=False, mmap=True)
    state = data["train_state"]
    return state["epoch"] * SAMPLES + state["samples_in_epoch"]


def attempts(served: Path) -> list[dict[int, list[int]]]:
    """Each attempt's samples by rank, in the order served. A process's file is named
    <start ns>.<host>.ws<W>.rank<R>.txt: attempts are the W files of one world size that follow
    each other in start order, one per rank."""
    files = sorted(served.glob("*.txt"), key=lambda f: int(f.name.split(".")[0]))
    found: list[dict[int, list[int]]] = []
    while files:
        world = int(re.search(r"\.ws(\d+)\.", files[0].name).group(1))
        group, files = files[:world], files[world:]
        ranks = {int(re.search(r"\.rank(\d+)\.", f.name).group(1)): f for f in group}
        assert sorted(ranks) == list(range(world)), [f.name for f in group]
        found.append({r: [int(x) for x in f.read_text().split()] for r, f in ranks.items()})
    return found


def kept_samples(served: Path, starts: list[int], end: int) -> dict[int, list[int]]:
    """The samples of each epoch that the final history consumed: of attempt a, started at
    global position starts[a], what its ranks served up to starts[a + 1] (the rest was served
    again after a resume). Rank r of W serves every W-th position of what is left, from the r-th."""
    by_epoch: dict[int, list[int]] = {}
    found = attempts(served)
    assert len(found) == len(starts), (len(found), starts)
    for a, ranks in enumerate(found):
        world = len(ranks)
        begin, stop = starts[a], (starts[a + 1] if a + 1 < len(starts) else end)
        taken = {r: 0 for r in ranks}
        pos = begin
        while pos < stop:  # epoch by epoch: each epoch's rest is dealt out afresh
            epoch, in_epoch = divmod(pos, SAMPLES)
            segment_end = min(stop, (epoch + 1) * SAMPLES)
            for r in ranks:
                count = len(range(pos + r, segment_end, world))
                by_epoch.setdefault(epoch, []).extend(ranks[r][taken[r]:taken[r] + count])
                taken[r] += count
            pos = segment_end
        assert all(len(ranks[r]) >= taken[r] for r in ranks), "an attempt served too little"
    return by_epoch


# torchrun's rendezvous waits after a loss: a node is dead once keep_alive_interval x
# keep_alive_max_attempt (5 s x 3) pass without its heartbeat, and a round with fewer than the most
# nodes closes last_call_timeout (30 s) after it has the fewest. The bound on kill -> next step
# (plus dtrain's start-up) for each setting.
WAITS = {"default": ([], 60.0),
         "short-object-store": (["--rdzv-conf=last_call_timeout=5,keep_alive_interval=2"], 25.0)}


@pytest.mark.parametrize("waits", sorted(WAITS))
def test_node_lost_then_rejoined_continues_elastically(hosts, bridge_s3, tmp_path: Path,  # noqa: F811
                                                       waits: str) -> None:
    rdzv, bound = WAITS[waits]
    run_dir, served, logs = tmp_path / "runs" / "elastic", tmp_path / "served", tmp_path / "agents"
    served.mkdir()
    logs.mkdir()
    port = free_port()
    run, out_dir, wrap, env, extra = RunFiles(run_dir), str(run_dir.parent), [], {}, []
    if waits.endswith("object-store"):
        # The run in the store; dtn2's agent stages on a disk of its own (a bind mount over the
        # staging folder, in a mount namespace of its own), records uploaded every second.
        bucket, stage, dtn2_disk = bridge_s3.bucket(), tmp_path / "stage", tmp_path / "dtn2-disk"
        stage.mkdir()
        dtn2_disk.mkdir()
        run = RunFiles(run_dir, bridge_s3.fs(), f"{bucket}/exp/elastic")
        out_dir, env = f"s3://{bucket}/exp", bridge_s3.env
        wrap = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(dtn2_disk), str(stage)]
        extra = [f"run.staging_dir={stage}", "run.upload_every_s=1"]

    def agent(host: str) -> Agent:
        return Agent(host, hosts, port, out_dir, served, logs, rdzv,
                     wrap if host == "dtn2" else [], env, extra)

    first, second = agent("dtn1"), agent("dtn2")
    everyone = [first, second]
    try:
        # Two hosts train; a checkpoint at step 4 or later, then dtn2 is lost.
        wait_until("checkpoint", lambda: saved_step(run) >= 4, everyone, every=run.poll_s)
        assert any(r.get("world_size") == 2 for r in records(run))
        kill_tree(second.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        second.proc.wait(timeout=30)
        lost_at = saved_step(run)
        # The survivor resumes alone: its first record says world size 1.
        wait_until("step at world size 1",
                   lambda: any(r.get("world_size") == 1 for r in records(run)), everyone,
                   every=run.poll_s)
        to_next_step = time.monotonic() - killed
        log = run.text("log.txt")
        assert "world size changed from 2 to 1" in log, log[-3000:]
        startups = re.findall(r"start-up: .*\((\d+\.\d+) s since the process started\)",
                              unwrapped(log))
        startup = float(startups[-1])
        one = next(r for r in records(run) if r.get("world_size") == 1)
        assert one["world_size_from"] == 2 and one["step"] == lost_at + 1, one
        # ... trains a few steps at world size 1, then dtn2 comes back.
        wait_until("steps at world size 1",
                   lambda: max(r["step"] for r in records(run)) >= lost_at + 4, everyone,
                   every=run.poll_s)
        second = agent("dtn2")
        everyone.append(second)
        rejoined = time.monotonic()
        wait_until("SIGTERM to dtn1's worker",
                   lambda: "stop requested (SIGTERM)" in run.text("log.txt"),
                   everyone, every=run.poll_s)
        to_sigterm = time.monotonic() - rejoined
        wait_until("step at world size 2 again",
                   lambda: [r.get("world_size") for r in records(run)
                            if "world_size" in r][-1:] == [2] and
                   "world size changed from 1 to 2" in run.text("log.txt"),
                   everyone, every=run.poll_s)
        to_two = time.monotonic() - rejoined
        codes = {"dtn1": first.proc.wait(timeout=300), "dtn2": second.proc.wait(timeout=300)}
    finally:
        for a in everyone:
            a.kill()
    tails = "\n".join(f"--- {a.log.name}:\n{a.output()[-4000:]}" for a in everyone)
    assert codes == {"dtn1": 0, "dtn2": 0}, tails
    log = run.text("log.txt")

    # dtn1's agent re-formed the group twice: once for the loss, once for the return
    stopped = re.search(r"stop requested \(SIGTERM\) at step (\d+)", log)
    assert stopped, tails
    stop_step = int(stopped.group(1))
    assert lost_at + 4 <= stop_step, (lost_at, stop_step)
    resumes = re.findall(r"resumed from \S+/checkpoints/(\S+) \(step (\d+),", log)
    assert [int(step) for _, step in resumes] == [lost_at, stop_step], resumes
    assert "world size changed from 2 to 1" in log and "world size changed from 1 to 2" in log

    # one history: every step once, world sizes 2, 1, 2 in the records
    recs = [r for r in records(run) if "loss" in r]
    steps = [r["step"] for r in recs]
    at_one = (SAMPLES * EPOCHS - 0) // 16  # upper bound check below uses positions instead
    assert steps == list(range(1, steps[-1] + 1)), steps
    assert [(r["world_size"], r.get("world_size_from")) for r in recs if "world_size" in r] == \
        [(2, None), (1, 2), (2, 1)]
    assert steps[-1] < at_one  # part of the run at world size 2: fewer steps than all on one

    # the run record keeps one entry per change
    table = run.text("../runs.csv")
    assert f"2->1@{lost_at};1->2@{stop_step}" in table, table

    # every sample of every epoch consumed exactly once across the changes
    starts = [0] + [position(run, name, tmp_path / "copies") for name, _ in resumes]
    kept = kept_samples(served, starts, SAMPLES * EPOCHS)
    assert sorted(kept) == list(range(EPOCHS))
    for epoch, samples in kept.items():
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {epoch}"

    # TensorBoard has the world size of each attempt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sizes = []
    for events in sorted(run.local("tb", tmp_path / "copies").rglob("events.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if tag.endswith("world_size"):
                sizes += [(e.step, e.value) for e in acc.Scalars(tag)]
    assert sorted(sizes) == [(1, 2.0), (lost_at + 1, 1.0), (stop_step + 1, 2.0)], sizes
    if run.fs is not None:  # nothing on a shared disk; dtn2 staged on its own
        assert not run_dir.parent.exists()
        assert any(p.is_file() for p in dtn2_disk.rglob("*")), "dtn2 staged nothing"

    budget = bound + startup
    print(f"elastic ({waits} rendezvous waits): dtn2 killed after checkpoint step {lost_at}; "
          f"first step at world size 1 {to_next_step:.1f} s later (dtrain start-up "
          f"{startup:.1f} s of it); dtn2's agent started again: SIGTERM {to_sigterm:.1f} s "
          f"later, checkpoint at step {stop_step}, first step at world size 2 {to_two:.1f} s "
          f"after the agent started")
    assert to_next_step <= budget, (to_next_step, startup)

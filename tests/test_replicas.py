"""Replica groups (parallel.replicas) with torchft, real processes on gloo: a lighthouse started
by `dtrain lighthouse`, each group a launch of its own. A failure-free run equals plain DDP on
the same ranks bit for bit; a group killed with SIGKILL costs one replica, not the job: the other
group steps on without a restart, the killed one is restarted by torchrun, heals from the live
peer and ends with the same weights; the sample logs show every sample of every epoch trained
exactly once."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from conftest import (REPO, TINY, TRAIN, child_env, descendants, dtrain, final_weights,
                      forkserver, free_port, kill_tree, latest, launch, torchrun_cmd,
                      without_module)

from dtrain.data import ImageDataset, Transform, synthetic

sys.path.insert(0, str(REPO / "bench"))
import job  # noqa: E402 - the hand-written loop's model, data and optimizer

pytest.importorskip("torchft", reason="the 'replicas' extra (torchft) is part of the test set")

HEARTBEAT_S = 2.0
DIGEST = re.compile(r"replica group (\d+): left at step (\d+), weights digest ([0-9a-f]{64})")


@pytest.fixture
def lighthouse():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "lighthouse", f"--port={port}",
         f"--heartbeat-timeout-s={HEARTBEAT_S}"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert "lighthouse listening on" in line, line
    yield f"http://127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def group_args(run_dir: Path, address: str, group: int, extra: list[str],
               groups: int = 2) -> list[str]:
    return [*TINY, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}",
            f"parallel.replicas.groups={groups}", f"parallel.replicas.group={group}",
            f"parallel.replicas.lighthouse={address}", "parallel.replicas.sample_log=true",
            "parallel.replicas.timeout_s=10", *extra]


STARTED: list = []  # every group a test started, killed at its end if still running
STOP_AFTER: list[int] = []  # pids to kill at the test's end


@pytest.fixture(autouse=True)
def _no_group_left_running():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            kill_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    while STOP_AFTER:  # (processes in sessions of their own: a lighthouse a launch started)
        try:
            os.kill(STOP_AFTER.pop(), signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_group(run_dir: Path, address: str, group: int, extra: list[str], log: Path,
                torchrun: list[str] | None = None, host: list[str] | None = None,
                groups: int = 2, env: dict | None = None):
    """One replica group of `groups`: a plain process, or under `torchrun`; `host` (a command
    that runs what follows on another test host) before it; `env`: entries added to its
    environment."""
    prefix = [*(host or []), *(torchrun if torchrun is not None else [sys.executable])]
    args = group_args(run_dir, address, group, extra, groups)
    with open(log, "w") as out:
        proc = forkserver.popen([*prefix, TRAIN, *args], cwd=REPO, env=child_env(env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    STARTED.append(proc)
    return proc


def steps_trained(run_dir: Path) -> dict[int, list[dict]]:
    """Every committed step's lines of the sample logs of every group (a killed process's and
    its restart's lines in one file; a line that a retraction follows left out), by step."""
    by_step: dict[int, list[dict]] = {}
    for path in sorted([*run_dir.glob("replica_samples.rank*.jsonl"),
                        *run_dir.glob("replicas/group_*/replica_samples.rank*.jsonl")]):
        kept: list[dict] = []
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("retracted"):  # the step just logged was not committed after all
                assert kept and kept[-1]["step"] == entry["step"], entry
                kept.pop()
            else:
                kept.append(entry)
        for entry in kept:
            by_step.setdefault(entry["step"], []).append(entry)
    return by_step


def assert_every_sample_once(run_dir: Path, epochs: int, size: int, batch: int,
                             ranks: int = 1, groups: int = 2) -> Counter:
    """Each step has a line per rank of each group present, the groups in distinct places; over
    the run, every sample of each epoch is trained exactly once (drop_last drops less than a
    step of the groups)."""
    by_step = steps_trained(run_dir)
    assert sorted(by_step) == list(range(1, max(by_step) + 1))
    per_epoch: dict[int, Counter] = {}
    groups_per_step: Counter = Counter()
    for step, lines in by_step.items():
        present = {line["groups"] for line in lines}
        assert len(present) == 1, f"step {step}: groups disagree on who took part: {lines}"
        places = sorted(line["place"] for line in lines)
        assert places == sorted(list(range(present.pop())) * ranks), step
        groups_per_step[len(lines) // ranks] += 1
        for line in lines:
            assert 0 < len(line["samples"]) <= batch  # (a short step after a change)
            for epoch, index in line["samples"]:
                per_epoch.setdefault(epoch, Counter())[index] += 1
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, counts in per_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample trained twice"
        # drop_last: a whole number of steps of the groups present; never more than a step lost
        assert size - groups * batch < len(counts) <= size, (epoch, len(counts))
    return groups_per_step


def replayed(by_step: dict[int, list[dict]], train_size: int) -> dict[str, torch.Tensor]:
    """The run's final weights by a plain hand-written loop (bench/job.py's model, data and
    SGD), replaying the sample logs: at each committed step, each group's batch of the logged
    keys, its gradient scaled by 1/groups, summed in the groups' order, one optimizer step. In
    one thread, as the runs have (child_env): a kernel's sums depend on how it splits them."""
    args = argparse.Namespace(seed=0, width=8, lr=0.05, momentum=0.9, weight_decay=5e-4)
    images, labels = synthetic.generate(train_size, "train")
    dataset = ImageDataset(images, labels, Transform("cifar", 32, True, 0))
    model = job.model(args)
    optimizer = job.optimizer(model, args)
    params = list(model.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in sorted(by_step):
            lines = sorted(by_step[step], key=lambda line: line["place"])  # (stable: by rank)
            total = None
            for line in lines:  # one line per rank of each group: the mean over all of them
                x, y = default_collate([dataset[tuple(key)] for key in line["samples"]])
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(job.normalize(x)), y).backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params]).mul_(1.0 / len(lines))
                total = flat if total is None else total + flat
            offset = 0
            for p in params:
                p.grad.copy_(total[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


def digests(*logs: Path) -> dict[int, tuple[int, str]]:
    found = {}
    for log in logs:
        for group, step, digest in DIGEST.findall(log.read_text()):
            found[int(group)] = (int(step), digest)
    return found


@pytest.mark.slow
def test_replica_groups_equal_plain_ddp_and_train_every_sample_once(tmp_path, lighthouse):
    # Both groups from the first step (a group alone would take step 1 by itself); 520 samples
    # do not divide into steps of 2 groups x 16: each epoch drops 8, as DDP's does.
    extra = ["train.epochs=2", "data.synthetic.train_size=520", "parallel.replicas.min_groups=2"]
    run_dir = tmp_path / "replicas"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    procs = [start_group(run_dir, lighthouse, g, extra, logs[g]) for g in (0, 1)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0], logs[0].read_text()[-3000:]
    ddp = launch(tmp_path / "ddp", ["train.epochs=2", "data.synthetic.train_size=520"], nproc=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]

    # The same weights as DDP over the same two ranks, bit for bit; both groups agree.
    ours, plain = final_weights(run_dir), final_weights(tmp_path / "ddp")
    assert all(torch.equal(ours[k], plain[k]) for k in plain)
    found = digests(*logs)
    assert found[0] == found[1] and found[0][0] == 32
    assert_every_sample_once(run_dir, epochs=2, size=520, batch=16)
    plain_replay = replayed(steps_trained(run_dir), 520)
    assert all(torch.equal(ours[k], plain_replay[k]) for k in plain_replay)
    # Group 0 writes the run; group 1 only its logs, no checkpoint.
    assert (run_dir / "checkpoints" / "latest").exists()
    assert not (run_dir / "replicas" / "group_1" / "checkpoints" / "latest").exists()
    assert "healed from a live peer" not in logs[0].read_text()
    # Every group gone: an ordinary resume, here as one process without replica groups.
    again = launch(run_dir, ["train.epochs=3", "data.synthetic.train_size=520"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.output and max(again.losses()) == 32 + 32


@pytest.mark.slow
def test_a_killed_group_costs_one_replica_and_heals_from_its_peer(tmp_path, lighthouse):
    # A paced model (0.1 s a forward): 4096 samples of 16 a group, 128 steps with both groups.
    extra = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.1}",
             "data.synthetic.train_size=4096", "train.epochs=1"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    group0 = start_group(run_dir, lighthouse, 0, extra, logs[0], torchrun_cmd(1))
    group1 = start_group(run_dir, lighthouse, 1, extra, logs[1],
                         torchrun_cmd(1, extra=["--max-restarts=1"]))
    metrics = run_dir / "metrics.jsonl"
    together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"

    def last_step() -> int:
        if not metrics.exists():
            return 0
        steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
                 if line.endswith("}")]
        return max(steps, default=0)

    def both_stepping() -> bool:  # group 1 took part in 10 steps, group 0 logged step 20
        return (together.exists() and together.read_text().count('"groups": 2') >= 10
                and last_step() >= 20)

    deadline = time.monotonic() + 180
    while not both_stepping():
        assert group0.poll() is None and group1.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    workers = descendants(group1.pid)  # torchrun's rank (the agent itself lives on)
    assert workers, "group 1's worker was not found"
    at_kill = last_step()
    killed = time.monotonic()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    while last_step() < at_kill + 2:  # the step under way, then one without group 1
        assert group0.poll() is None and time.monotonic() - killed < 60
        time.sleep(0.02)
    went_on_s = time.monotonic() - killed

    assert group0.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
    assert group1.wait(timeout=300) == 0, logs[1].read_text()[-3000:]
    first, second = logs[0].read_text(), logs[1].read_text()
    # Group 0 never restarted (one start); group 1 started twice and healed after the restart.
    assert first.count("dtrain | torchrun") == 1 and second.count("dtrain | torchrun") == 2
    # Group 0 saw the loss: the step under way was not committed, or (killed between steps)
    # the next quorum had one group; a restart quicker than the heartbeat timeout rejoins
    # before the lighthouse ever drops the group, and group 0 says it sends it its state.
    assert re.search(r"not committed|replica groups: 2 -> 1 present|replica group 0: sending its "
                     r"state at step \d+ to a group that heals from it", first), first[-3000:]
    if "replica groups: 2 -> 1 present" in first:  # the survivor names the group it lost
        assert re.search(r"2 -> 1 present at step \d+ \(lost: group 1\)", first), first[-3000:]
    assert "healed from a live peer" in second.split("dtrain | torchrun")[2]
    found = digests(*logs)
    assert found[0] == found[1], found
    groups = assert_every_sample_once(run_dir, epochs=1, size=4096, batch=16)
    assert groups[1] >= 1 and groups[2] >= 1  # steps alone and steps together
    # Bit for bit what a plain loop trains with the same membership changes, step by step.
    final, replay = final_weights(run_dir), replayed(steps_trained(run_dir), 4096)
    assert all(torch.equal(final[k], replay[k]) for k in replay)
    print(f"group 0 stepped on {went_on_s:.1f} s after the kill (heartbeat {HEARTBEAT_S:g} s)")


@pytest.mark.slow
def test_fsdp_groups_heal_a_late_group_shard_by_shard(tmp_path, lighthouse):
    """Two groups of two FSDP ranks; group 1 starts once group 0 has trained alone for a while
    and heals from it shard by shard (each rank from the donor's rank of the same number)."""
    # Paced so that group 0 alone would take 64 steps of 0.1 s or more: group 1's two ranks
    # start on a loaded machine well before that.
    extra = ["parallel.mode=fsdp", "model.name=observe_models:slow_cnn",
             "model.args={width: 8, delay_s: 0.1}", "data.synthetic.train_size=2048"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    group0 = start_group(run_dir, lighthouse, 0, extra, logs[0], torchrun_cmd(2))
    alone = run_dir / "replica_samples.rank0.jsonl"
    deadline = time.monotonic() + 240
    while not (alone.exists() and alone.read_text().count("\n") >= 3):
        assert group0.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    group1 = start_group(run_dir, lighthouse, 1, extra, logs[1], torchrun_cmd(2))
    assert group0.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
    assert group1.wait(timeout=300) == 0, logs[1].read_text()[-3000:]
    second = logs[1].read_text()
    assert "healed from a live peer" in second  # (rank 0 logs; each rank healed its shards)
    found = digests(*logs)  # rank 0's shards of each group
    assert found[0] == found[1], found
    groups = assert_every_sample_once(run_dir, epochs=1, size=2048, batch=16, ranks=2)
    assert groups[1] >= 3 and groups[2] >= 1
    # A plain loop over the logged batches: FSDP's sums over ranks come in another order, and
    # the rounding grows with the steps group 0 trains alone before group 1 starts, which the
    # machine's load sets (8.6e-4 at most seen, on a loaded machine; a wrong shard
    # or a step taken twice moves weights by 1e-2 or more).
    final, replay = final_weights(run_dir), replayed(steps_trained(run_dir), 2048)
    for name, value in replay.items():
        torch.testing.assert_close(final[name], value, atol=3e-3, rtol=0)


@pytest.mark.slow
def test_fsdp_groups_without_a_failure_equal_plain_hsdp_on_the_same_ranks(tmp_path, lighthouse):
    """Two groups of two FSDP ranks from the first step train what one torchrun of HSDP over
    the same four ranks (2 replicas x 2 shards) trains: the same samples on each rank, the
    same weights bit for bit."""
    extra = ["parallel.mode=fsdp", "data.synthetic.train_size=512"]
    run_dir = tmp_path / "replicas"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    procs = [start_group(run_dir, lighthouse, g, [*extra, "parallel.replicas.min_groups=2"],
                         logs[g], torchrun_cmd(2)) for g in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], \
        [log.read_text()[-3000:] for log in logs]
    hsdp = launch(tmp_path / "hsdp", [*extra, "parallel.fsdp.hybrid_replicas=2"], nproc=4)
    assert hsdp.returncode == 0, hsdp.stderr[-3000:]
    assert "world size 4" in hsdp.stderr
    assert_every_sample_once(run_dir, epochs=1, size=512, batch=16, ranks=2)
    ours, plain = final_weights(run_dir), final_weights(tmp_path / "hsdp")
    assert set(ours) == set(plain) and all(torch.equal(ours[k], plain[k]) for k in plain)


# Loaded by the donors of the test below (a sitecustomize on their PYTHONPATH): once the test
# arms it, the first heal any of them serves stops half-way, the pid that serves it written to
# the marker file, until the test kills that process.
STALL_FIRST_HEAL = """
import os
marker = os.environ.get("STALL_FIRST_HEAL")
if marker:
    import io, time
    os.environ.setdefault("RUST_LOG", "warn")  # (as dtrain sets it before importing torchft)
    from torchft.checkpointing import http_transport
    serve = http_transport._streaming_save
    def stalled(state, stream):
        try:  # armed by the test: the first heal served after that stops half-way
            os.rename(marker + ".armed", marker + ".taken")
        except FileNotFoundError:
            return serve(state, stream)
        whole = io.BytesIO()
        serve(state, whole)
        stream.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        stream.flush()
        with open(marker + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        time.sleep(600)
    http_transport._streaming_save = stalled
"""


@pytest.mark.slow
def test_a_heal_whose_donor_dies_mid_copy_heals_from_another_peer(tmp_path, lighthouse):
    """Three groups; group 2 joins late, and the peer it heals from is killed half-way through
    sending. Group 2 says so in one line and heals from the other live peer at the next quorum;
    the killed donor is restarted by torchrun and heals too; nothing is lost or trained twice."""
    extra = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.05}",
             "data.synthetic.train_size=2048", "train.epochs=6", "ckpt.every_steps=10"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"g{g}.log" for g in range(3)]
    marker = tmp_path / "stalled_donor"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STALL_FIRST_HEAL)
    stall = {"STALL_FIRST_HEAL": str(marker),
             "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO / "tests"),
                                            str(REPO / "src")])}
    donors = [start_group(run_dir, lighthouse, g, extra, logs[g],
                          torchrun_cmd(1, extra=["--max-restarts=1"]), groups=3, env=stall)
              for g in (0, 1)]
    together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"
    deadline = time.monotonic() + 180
    while not (together.exists() and together.read_text().count('"groups": 2') >= 10
               and (run_dir / "checkpoints" / "latest").exists()):
        assert all(d.poll() is None for d in donors) and time.monotonic() < deadline
        time.sleep(0.05)
    Path(f"{marker}.armed").touch()
    late = start_group(run_dir, lighthouse, 2, extra, logs[2], groups=3)
    while not marker.exists():
        assert late.poll() is None and time.monotonic() < deadline, logs[2].read_text()[-3000:]
        time.sleep(0.02)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # the donor, half-way through the heal

    assert [p.wait(timeout=300) for p in (*donors, late)] == [0, 0, 0], \
        [log.read_text()[-2000:] for log in logs]
    texts = [log.read_text() for log in logs]
    victim = next(g for g in (0, 1) if texts[g].count("dtrain | torchrun") == 2)
    assert texts[1 - victim].count("dtrain | torchrun") == 1
    # The late group: one line for the heal that failed, then a heal from the other peer.
    failed = [line for line in texts[2].splitlines() if "replica group 2: " in line
              and "healed" not in line and "left at step" not in line]
    assert len(failed) == 1 and "cannot take part in the step under way (the heal from http://" \
        in failed[0] and "broke off" in failed[0], texts[2][-3000:]
    assert texts[2].index(failed[0]) < texts[2].index("healed from a live peer")
    assert "Traceback" not in texts[2]
    # The killed donor came back from its checkpoint and healed from a live peer as well, or,
    # its checkpoint at the step the others were at (the step under way not committed), took
    # part as it was, a donor again.
    assert re.search(r"healed from a live peer|replica group \d: sending its state at step",
                     texts[victim].split("dtrain | torchrun")[2]), texts[victim][-3000:]
    found = digests(*logs)
    assert sorted(found) == [0, 1, 2] and len(set(found.values())) == 1, found
    # Group 2 started from group 0's checkpoint through links of its own (group 0 deletes its
    # older checkpoints meanwhile), and heals between launches of both kinds (a plain process;
    # one under torchrun, whose model DDP wraps).
    assert len(list((run_dir / "replicas" / "group_2" / "start").iterdir())) == 1
    started = re.search(r"resumed from \S*/replicas/group_2/start/step_\d+", texts[2])
    assert started, texts[2][:3000]
    groups = assert_every_sample_once(run_dir, epochs=6, size=2048, batch=16, groups=3)
    assert groups[2] >= 1 and groups[3] >= 1, groups


def test_a_group_with_another_model_cannot_heal_and_says_so_in_one_line(tmp_path, lighthouse):
    """A group launched with another model (a wider one) asks to heal from the live group: it
    stops in one line, exit 1, and the live group finishes the run with nothing lost."""
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    paced = ["model.name=observe_models:slow_cnn", "data.synthetic.train_size=1024"]
    first = start_group(run_dir, lighthouse, 0, [*paced, "model.args={width: 8, delay_s: 0.05}"],
                        logs[0])
    samples = run_dir / "replica_samples.rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (samples.exists() and samples.read_text().count("\n") >= 3):
        assert first.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    other = start_group(run_dir, lighthouse, 1, [*paced, "model.args={width: 16, delay_s: 0.05}"],
                        logs[1])
    assert (other.wait(timeout=120), first.wait(timeout=300)) == (1, 0), \
        [log.read_text()[-3000:] for log in logs]
    text = logs[1].read_text()
    [line] = [line for line in text.splitlines() if "does not fit" in line]
    assert re.search(r"replica group 1: the state a live peer sent at step \d+ does not fit this "
                     r"group \(RuntimeError: .*\); every group needs the same model and the same "
                     r"parallel layout; this group stops$", line), line
    assert "Traceback" not in text
    assert not (run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl").exists() or \
        "groups" not in (run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl").read_text()
    assert_every_sample_once(run_dir, epochs=1, size=1024, batch=16, groups=1)


@pytest.mark.slow
def test_a_launch_starts_the_lighthouse_and_it_outlives_the_launch(tmp_path):
    """parallel.replicas.start_lighthouse: group 0's torchrun, on the host the address names,
    starts the lighthouse; group 1 finds it there; group 0's worker killed, torchrun starts it
    again and it heals while the lighthouse, in a session of its own, serves on."""
    address = f"http://127.0.0.1:{free_port()}"
    extra = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.05}",
             "data.synthetic.train_size=1024", "parallel.replicas.start_lighthouse=true"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    first = start_group(run_dir, address, 0, extra, logs[0],
                        torchrun_cmd(1, extra=["--max-restarts=1"]))
    deadline = time.monotonic() + 120
    while "started a lighthouse" not in logs[0].read_text():
        assert first.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    started = re.search(r"started a lighthouse \(pid (\d+)\) on port \d+ of this host "
                        r"\(parallel.replicas.start_lighthouse; its log: (\S+)\): it stops once "
                        r"no group has been heard for 60 s", logs[0].read_text())
    assert started, logs[0].read_text()[-3000:]
    lighthouse = int(started.group(1))
    STOP_AFTER.append(lighthouse)
    assert Path(started.group(2)) == run_dir / "replicas" / "lighthouse.log"
    second = start_group(run_dir, address, 1, extra, logs[1])
    together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"
    while not (together.exists() and together.read_text().count('"groups": 2') >= 5):
        assert second.poll() is None and time.monotonic() < deadline, logs[1].read_text()[-3000:]
        time.sleep(0.05)
    # torchrun's worker: its child (the lighthouse is the worker's, in a session of its own)
    worker = [p for p in descendants(first.pid)
              if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(first.pid)]
    assert len(worker) == 1 and lighthouse not in worker, worker
    os.kill(worker[0], signal.SIGKILL)  # (torchrun's worker; the lighthouse lives on)

    assert (first.wait(timeout=300), second.wait(timeout=300)) == (0, 0), \
        [log.read_text()[-3000:] for log in logs]
    texts = [log.read_text() for log in logs]
    assert "started a lighthouse" not in texts[1]
    assert texts[0].count("started a lighthouse") == 1  # (the restarted worker found it)
    assert "healed from a live peer" in texts[0].split("dtrain | torchrun")[2]
    found = digests(*logs)
    assert found[0] == found[1], found
    assert_every_sample_once(run_dir, epochs=1, size=1024, batch=16)
    os.kill(lighthouse, 0)  # still there after both launches ended (it stops when idle)
    os.kill(lighthouse, signal.SIGTERM)
    assert "lighthouse listening on" in (run_dir / "replicas" / "lighthouse.log").read_text()


def test_groups_started_together_start_one_lighthouse_and_say_so_once(tmp_path):
    """parallel.replicas.start_lighthouse with both groups on this host, started at once: one
    of them starts the lighthouse and says so; the other finds it (not a second that exits on
    the taken port while its launch logs that it started it)."""
    address = f"http://127.0.0.1:{free_port()}"
    extra = ["parallel.replicas.start_lighthouse=true", "parallel.replicas.min_groups=2"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    procs = [start_group(run_dir, address, g, extra, logs[g]) for g in (0, 1)]
    codes = [proc.wait(timeout=300) for proc in procs]
    texts = [log.read_text() for log in logs]
    started = re.findall(r"started a lighthouse \(pid (\d+)\)", "".join(texts))
    STOP_AFTER.extend(int(pid) for pid in started)
    assert codes == [0, 0], [text[-3000:] for text in texts]
    assert len(started) == 1, texts
    os.kill(int(started[0]), 0)  # (the one it names is the one that serves)
    served = (run_dir / "replicas" / "lighthouse.log").read_text()
    assert served.count("lighthouse listening on") == 1, served
    found = digests(*logs)
    assert found[0] == found[1], found
    assert_every_sample_once(run_dir, epochs=1, size=512, batch=16)


def test_a_lighthouse_stops_once_no_group_is_heard(tmp_path):
    """`dtrain lighthouse --exit-when-idle-s`: up while a group trains against it, stopped
    once no group has sent a heartbeat for that long."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "lighthouse", f"--port={port}",
         "--heartbeat-timeout-s=1", "--exit-when-idle-s=3"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)  # (stopped at the test's end if it is still running)
    assert "lighthouse listening on" in proc.stdout.readline()
    # One group of two, alone: 32 steps of 0.2 s, longer than the 3 s it may be idle.
    run = launch(tmp_path / "run", ["parallel.replicas.groups=2", "parallel.replicas.group=0",
                                    f"parallel.replicas.lighthouse=http://127.0.0.1:{port}",
                                    "model.name=observe_models:slow_cnn",
                                    "model.args={width: 8, delay_s: 0.2}"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert max(run.losses()) == 32 and proc.poll() is None
    ended = time.monotonic()
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - ended < 10
    assert proc.stderr.read().strip().endswith("lighthouse stopped: no group for 3 s")


def test_bad_replica_settings_are_one_line_each(tmp_path):
    cases = [
        (["parallel.replicas.groups=2"], "this launch's group is not known"),
        (["parallel.replicas.groups=2", "parallel.replicas.group=2"],
         "replica group 2 is not one of the 2"),
        (["parallel.replicas.groups=2", "parallel.replicas.group=0"], "needs a lighthouse"),
    ]
    for overrides, message in cases:
        result = launch(tmp_path / "bad", overrides)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
        assert not (tmp_path / "bad" / "checkpoints").exists()


def test_without_the_extra_train_and_lighthouse_are_one_line(tmp_path):
    hidden = without_module(tmp_path / "no_torchft", "torchft")
    line = "missing dependency: {} needs the 'replicas' extra: pip install 'dtrain[replicas]'"
    result = launch(tmp_path / "run", ["parallel.replicas.groups=2", "parallel.replicas.group=0",
                                       "parallel.replicas.lighthouse=127.0.0.1:1"], env=hidden)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "dtrain: " + line.format("parallel.replicas")
    assert not (tmp_path / "run").exists()
    result = dtrain("lighthouse", env=hidden)
    assert result.returncode == 2 and line.format("dtrain lighthouse") in result.stderr


def test_no_lighthouse_at_the_start_is_one_line_and_writes_nothing(tmp_path):
    result = launch(tmp_path / "run", ["parallel.replicas.groups=2", "parallel.replicas.group=0",
                                       f"parallel.replicas.lighthouse=127.0.0.1:{free_port()}"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "lighthouse" in line]
    assert len(lines) == 1 and "no lighthouse answers at http://127.0.0.1:" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_lighthouse_lost_mid_run_ends_the_groups_in_one_line_with_the_checkpoint_kept(
        tmp_path):
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "lighthouse", f"--port={port}"], cwd=REPO,
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert "listening" in lighthouse.stdout.readline()
    extra = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.05}",
             "data.synthetic.train_size=4096", "ckpt.every_steps=5",
             "parallel.replicas.timeout_s=3"]
    run_dir = tmp_path / "run"
    logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
    groups = [start_group(run_dir, address, g, extra, logs[g]) for g in (0, 1)]
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and groups[0].poll() is None
        time.sleep(0.05)
    lighthouse.kill()
    lighthouse.wait()
    assert [g.wait(timeout=120) for g in groups] == [1, 1]
    for log in logs:
        text = log.read_text()
        assert "no quorum from the lighthouse at " + address in text, text[-2000:]
        assert "Traceback" not in text
    kept = json.loads((latest(run_dir) / "COMPLETE").read_text())
    assert kept["step"] >= 5


def test_lighthouse_on_a_taken_port_is_one_line(tmp_path):
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = dtrain("lighthouse", f"--port={port}", timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "cannot listen on port" in result.stderr

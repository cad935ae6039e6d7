"""Replica groups on two hosts (the network-namespace hosts of tests/cluster/hosts.sh): the
lighthouse and group 0 on dtn1, group 1 on dtn2, each group under its own torchrun; they reach
each other only over the hosts' bridge, at the addresses dtrain advertises (the interface that
routes to the lighthouse, not the host names). Group 1's worker is killed with SIGKILL mid-run:
torchrun on dtn2 restarts it, it heals from dtn1 across the bridge, both groups end with the same
weights, and every sample of the epoch was trained exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, child_env, descendants, free_port, torchrun_cmd
from test_multinode import HOSTS_SH, hosts  # noqa: F401 - the session's test hosts
from test_replicas import _no_group_left_running  # noqa: F401 - kills what a test left
from test_replicas import assert_every_sample_once, digests, start_group

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
pytest.importorskip("torchft", reason="the 'replicas' extra (torchft) is part of the test set")


def on(host: str) -> list[str]:
    return [str(HOSTS_SH), "exec", host]


def leaves(pid: int) -> list[int]:
    """The processes below `pid` that started none of their own: a torchrun agent's worker."""
    below = descendants(pid)
    return [p for p in below if not descendants(p)]


def test_groups_on_two_hosts_survive_a_killed_worker_and_heal_across_the_bridge(
        tmp_path, hosts):  # noqa: F811 - the fixture imported above
    port = free_port()
    address = f"http://{hosts['dtn1']}:{port}"
    lighthouse = subprocess.Popen(
        [*on("dtn1"), sys.executable, "-m", "dtrain", "lighthouse", f"--port={port}",
         "--heartbeat-timeout-s=2"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening" in lighthouse.stdout.readline()
        extra = ["model.name=observe_models:slow_cnn", "model.args={width: 8, delay_s: 0.1}",
                 "data.synthetic.train_size=8192", "train.epochs=1"]
        run_dir = tmp_path / "run"
        logs = [tmp_path / "g0.log", tmp_path / "g1.log"]
        group0 = start_group(run_dir, address, 0, extra, logs[0], torchrun_cmd(1), on("dtn1"))
        group1 = start_group(run_dir, address, 1, extra, logs[1],
                             torchrun_cmd(1, extra=["--max-restarts=1"]), on("dtn2"))
        together = run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"
        deadline = time.monotonic() + 240
        while not (together.exists() and together.read_text().count('"groups": 2') >= 10):
            assert group0.poll() is None and group1.poll() is None, logs[1].read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        workers = leaves(group1.pid)
        assert workers, "dtn2's worker was not found"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert group0.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
        assert group1.wait(timeout=300) == 0, logs[1].read_text()[-3000:]
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
    first, second = logs[0].read_text(), logs[1].read_text()
    assert first.count("dtrain | torchrun") == 1 and second.count("dtrain | torchrun") == 2
    assert "healed from a live peer" in second.split("dtrain | torchrun")[2]
    # dtn2 fetched its heal from group 0's server on dtn1, over the bridge.
    assert any(hosts["dtn2"] in line and "GET /checkpoint/" in line
               for line in first.splitlines()), first[-3000:]
    found = digests(*logs)
    assert found[0] == found[1], found
    assert_every_sample_once(run_dir, epochs=1, size=8192, batch=16)

"""How a failed collective is told from a rank's own bug: real gloo groups of two processes in
which the peer dies or stalls, and what torch raises then."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as torch_dist

from conftest import REPO, child_env, free_port
from dtrain.process import dist

# Rank 1 dies or stalls after the first all-reduce; rank 0 prints how dtrain sees the second.
SCRIPT = """
import datetime, os, sys, time
import torch, torch.distributed as torch_dist
from dtrain.process import dist
rank, fault, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                              world_size=2, timeout=datetime.timedelta(seconds=3))
tensor = torch.ones(2)
torch_dist.all_reduce(tensor)
if rank == 1:
    if fault == "stall":
        time.sleep(5)
    os._exit(0)
time.sleep(0.5)
try:
    torch_dist.all_reduce(tensor)
    print("no failure")
except Exception as e:
    print(type(e).__name__, dist.is_collective_failure(e), str(e).splitlines()[0][-80:])
os._exit(0)
"""


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_a_lost_or_stalled_peer_is_a_collective_failure(fault) -> None:
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(rank), fault, port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(), cwd=REPO) for rank in (1, 0)]
    out, err = ranks[1].communicate(timeout=60)
    ranks[0].communicate(timeout=60)
    assert "RuntimeError True" in out, out + err[-2000:]


@pytest.mark.parametrize("error,expected", [
    (torch_dist.DistBackendError("NCCL communicator was aborted"), True),
    (torch_dist.DistNetworkError("Connection reset by peer"), True),
    (torch_dist.DistStoreError("wait timeout after 30000ms, keys: /dtrain/x"), True),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset"),
     True),
    (RuntimeError("Application timeout caused pair closure"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 4x8)"), False),
    (RuntimeError("Tensors must be contiguous; the peer tensor of a ProcessGroup call"), False),
    (ValueError("Timed out waiting for the user's own queue"), False),
])
def test_only_failures_of_the_group_count(error, expected) -> None:
    assert dist.is_collective_failure(error) is expected

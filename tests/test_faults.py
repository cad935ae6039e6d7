"""Faults: a rank that dies, raises or stalls; NaNs; bad input. Each ends in a correct recovery or
a prompt, clear, non-zero exit, never in a hang or a lost checkpoint. Faults come from users'
code (tests/user_code.py), not from switches in the product."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import Result, child_env, descendants, final_weights, latest, launch, start

FAULTY = "model.name=user_code:faulty_cnn"


def faulty(fault: str, at_call: int, **extra) -> str:
    args = ", ".join(f"{k}: {v}" for k, v in {"width": 8, "fault": fault, "at_call": at_call, **extra}.items())
    return f"model.args={{{args}}}"


def timed(*args, **kwargs):
    started = time.monotonic()
    result = launch(*args, **kwargs)
    return result, time.monotonic() - started


# -- recovery ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_restart_after_a_killed_rank_resumes_and_matches(tmp_path) -> None:
    common = [FAULTY, "train.max_steps=16", "ckpt.every_steps=4"]
    straight = launch(tmp_path / "runs" / "straight", [*common, faulty("none", 0)], nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    result = launch(tmp_path / "runs" / "restarted",
                    [*common, faulty("kill", 10, first_attempt_only="true")], nproc=2,
                    torchrun_args=["--max-restarts=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (result.run_dir / "log.txt").read_text()
    assert "resumed from" in log and "step_000008" in log.split("resumed from")[1].splitlines()[0]
    assert result.losses() == straight.losses()
    a, b = final_weights(straight.run_dir), final_weights(result.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_promptly_with_its_traceback(tmp_path) -> None:
    result, elapsed = timed(tmp_path / "runs" / "r", [FAULTY, faulty("raise", 3), "dist.timeout_s=30"],
                            nproc=2)
    assert result.returncode != 0
    assert elapsed < 30 + 30 + 60  # timeout + torchrun's kill grace + start-up, generously
    assert "RuntimeError: injected failure in forward call 3" in result.stderr  # rank 1's traceback
    assert "Root Cause" in result.stderr
    assert "dtrain: distributed error at step 3 on rank 0: rank(s) 1 did not arrive" in result.stderr


@pytest.mark.slow
def test_a_stalled_rank_is_a_timeout_naming_it_not_a_hang(tmp_path) -> None:
    result, elapsed = timed(tmp_path / "runs" / "r", [FAULTY, faulty("stall", 3), "dist.timeout_s=10"],
                            nproc=2)
    assert result.returncode != 0
    assert elapsed < 10 + 30 + 60
    assert ("dtrain: distributed error at step 3 on rank 0: rank(s) 1 did not arrive "
            "(collective timeout dist.timeout_s=10 s)") in result.stderr
    # Where the stalled rank was: its last step and phase, and its stack in its own log.
    assert re.search(rf"rank 1 \(host {re.escape(socket.gethostname())}\) did not arrive: last step 2 "
                     r"completed, now in forward/backward \(for \d+ s\); its Python stack is in the run "
                     r"directory.s log.rank1.txt", result.stderr), result.stderr[-3000:]
    stack = (result.run_dir / "log.rank1.txt").read_text()
    assert "asked for its Python stack by a rank waiting for it: last step 2 completed" in stack
    assert re.search(r'File ".*user_code.py", line \d+ in forward', stack), stack[-3000:]


@pytest.mark.slow
def test_workers_end_with_a_killed_torchrun_agent(tmp_path) -> None:
    from conftest import wait_for_step
    run_dir = tmp_path / "runs" / "r"
    proc = start(run_dir, ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.05}",
                           "train.epochs=5"], nproc=2)
    wait_for_step(run_dir / "metrics.jsonl", 2, proc, timeout=120)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGKILL)  # the agent only
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers outlived their torchrun agent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- NaN / Inf -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_nan_policy_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", [FAULTY, faulty("nan", 5), "ckpt.every_steps=2"], nproc=2)
    assert result.returncode != 0
    assert "dtrain: non-finite loss or gradients at step 5; stopping (train.nan_policy=stop)" \
        in result.stderr
    good = latest(result.run_dir)
    assert good.name.startswith("step_000004")
    weights = final_weights(result.run_dir)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_policy_skip_leaves_params_and_optimizer_unchanged(tmp_path) -> None:
    # One process: what a skipped step leaves is the same on any rank (that every rank skips when
    # one rank's gradients are not finite is test_integrity.py's inf-gradient test, on 2 ranks;
    # that every rank stops, test_nan_policy_stop_names_the_step_and_keeps_the_last_good_checkpoint).
    result = launch(tmp_path / "runs" / "r", [FAULTY, faulty("nan", 5, on_rank=0), "train.nan_policy=skip",
                                              "ckpt.every_steps=1", "train.max_steps=7",
                                              "ckpt.keep_last=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (result.run_dir / "log.txt").read_text()
    assert "step 5: non-finite loss or gradients, optimizer step skipped (1 in a row, 1 in all)" in log
    assert [r.get("skipped_steps") for r in result.records() if r.get("step") == 7 and "loss" in r] == [1]
    folder = result.run_dir / "checkpoints"
    by_step = {int(p.name[5:11]): torch.load(p / "checkpoint.pt", weights_only=True)
               for p in folder.iterdir() if p.is_dir()}
    for key in by_step[4]["model"]:
        assert torch.equal(by_step[4]["model"][key], by_step[5]["model"][key])
    for key, state in by_step[4]["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], by_step[5]["optimizer"]["state"][key]["momentum_buffer"])
    assert any(not torch.equal(by_step[5]["model"][k], by_step[6]["model"][k]) for k in by_step[5]["model"])


def test_too_many_consecutive_skips_stop(tmp_path) -> None:
    # One process: the count of skips in a row follows the skips (that every rank skips when one
    # rank's gradients are not finite is test_integrity.py's inf-gradient test, on 2 ranks).
    result = launch(tmp_path / "runs" / "r", [FAULTY, faulty("nan_from", 5, on_rank=0),
                                              "train.nan_policy=skip", "train.max_consecutive_skips=2"])
    assert result.returncode != 0
    assert "3 non-finite steps in a row at step 7, more than train.max_consecutive_skips=2" in result.stderr


def test_detect_anomaly_points_at_the_operation(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", [FAULTY, faulty("nan", 2, on_rank=0), "train.detect_anomaly=true"])
    assert result.returncode == 1
    assert "returned nan values" in result.stderr


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", [
    (["data.synthetic.train_size=20"], "the training set has 20 samples, fewer than one step needs "
                                       "(2 ranks x batch 16)"),
    (["data.name=user_code:empty_data"], "the training set has 0 samples"),
    (["data.name=cifar10", "data.root=/nonexistent"], "CIFAR-10 not found under '/nonexistent'"),
])
def test_data_errors_end_every_rank_promptly_with_one_message(tmp_path, overrides, message) -> None:
    result, elapsed = timed(tmp_path / "runs" / "r", overrides, nproc=2)
    assert result.returncode != 0 and elapsed < 60
    assert result.stderr.count(f"dtrain: data error: {message}") == 1
    assert "exitcode  : 2" in result.stderr


def test_more_ranks_than_gpus_is_refused(monkeypatch) -> None:
    from dtrain.process.env import Env
    from dtrain.core.errors import UserError
    from dtrain.process.layout import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = Env(launcher="torchrun", rank=3, local_rank=3, world_size=4, local_world_size=4)
    with pytest.raises(UserError, match=r"4 ranks per node requested, found 2 visible GPU"):
        pick_device(env)
    assert pick_device(Env(launcher="torchrun", rank=1, local_rank=1, world_size=2,
                                local_world_size=2)) == torch.device("cuda", 1)


def test_unwritable_output_directory(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = launch(blocker / "runs" / "r", [])
    assert result.returncode == 2
    assert f"cannot write the run directory '{blocker}/runs/r'" in result.stderr
    assert "Traceback" not in result.stderr


# One short single-process run, read by three tests: its files' modes, its checkpoint resumed by
# another model, and its checkpoint's size (to size a disk that holds one and a half of them).
TWO_STEPS = ["ckpt.every_steps=2", "train.log_every=100", "train.max_steps=2"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Result:
    result = launch(tmp_path_factory.mktemp("two_steps") / "runs" / "cnn", TWO_STEPS)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_checkpoint_of_another_model_names_the_keys(two_steps, tmp_path) -> None:
    result = launch(tmp_path / "runs" / "resnet", ["model.name=resnet_small", f"ckpt.resume={latest(two_steps.run_dir)}"])
    assert result.returncode == 2
    assert ("checkpoint is from a different model: 54 key(s) missing (e.g. ['layers.0.0.bn1.bias', "
            "'layers.0.0.bn1.num_batches_tracked', 'layers.0.0.bn1.running_mean']), 12 unexpected "
            "(e.g. ['features.0.0.weight', 'features.0.1.bias', 'features.0.1.weight'])") in result.stderr


def _modes(run_dir) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mode & 0o777
            for p in [run_dir, *run_dir.rglob("*")] if p.name != ".lock"}


def test_a_run_follows_the_umask_unless_private(two_steps, tmp_path) -> None:
    """By default every file and folder of a run gets what the user's umask gives (a team reads
    a shared run); run.private makes them the owner's alone. The lock, naming its holder's
    process, is the owner's either way."""
    umask = os.umask(0)
    os.umask(umask)
    modes = _modes(two_steps.run_dir)
    assert {"config.yaml", "metrics.jsonl", "checkpoints"} <= set(modes)
    for name, mode in modes.items():
        is_dir = (two_steps.run_dir / name).is_dir() if name != "." else True
        assert mode == (0o777 if is_dir else 0o666) & ~umask, (name, oct(mode), oct(umask))
    private = launch(tmp_path / "runs" / "private", [*TWO_STEPS, "run.private=true"])
    assert private.returncode == 0, private.stderr[-2000:]
    for name, mode in _modes(private.run_dir).items():
        is_dir = (private.run_dir / name).is_dir() if name != "." else True
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))


def test_disk_full_while_saving_keeps_the_previous_checkpoint(two_steps, tmpfs) -> None:
    common = TWO_STEPS[:2]
    one_checkpoint = sum(f.stat().st_size for f in latest(two_steps.run_dir).iterdir())
    disk = tmpfs(f"size={(one_checkpoint * 3 // 2 + 48 * 1024) // 1024}k")
    result = launch(disk / "runs" / "r", [*common, "train.max_steps=6"])
    assert result.returncode == 1
    assert "dtrain: checkpoint error: disk full while saving step_000004" in result.stderr
    assert "MiB free" in result.stderr and "the previous checkpoint is kept" in result.stderr
    kept = latest(result.run_dir)
    assert kept.name.startswith("step_000002")
    assert not [p for p in (result.run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    json.loads((kept / "COMPLETE").read_text())
    torch.load(kept / "checkpoint.pt", weights_only=True)
    # The same command again, the disk still full: one line, the kept checkpoint as it was.
    again = launch(disk / "runs" / "r", [*common, "train.max_steps=6"])
    assert again.returncode in (1, 2) and "Traceback" not in again.stderr, again.stderr[-3000:]
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("dtrain: ") and "disk" in last and "full" in last, last
    assert latest(again.run_dir) == kept and (kept / "checkpoint.pt").stat().st_size > 0


FILLS_UNDER_THE_LOG = """
import os, sys
from dtrain.core import logs
logs.setup_logging(0, False)
logs.attach_log_files(sys.argv[1] + "/log.txt")  # (empty: its first line needs a new block)
filler = open(sys.argv[1] + "/filler", "wb")
try:
    while True:
        filler.write(b"0" * 4096); filler.flush()
except OSError:
    pass
for i in range(5):
    logs.log.info(f"while full {i}")
os.remove(sys.argv[1] + "/filler")
logs.log.info("after")
"""


def test_a_disk_that_fills_under_the_log_file_is_one_warning_not_a_traceback_a_line(tmpfs) -> None:
    # Found by the chaos run (bench/chaos): logging's own handler printed a traceback for every
    # line a full disk kept out of log.txt.
    disk = tmpfs("size=64k")
    proc = subprocess.run([sys.executable, "-c", FILLS_UNDER_THE_LOG, str(disk)], capture_output=True,
                          text=True, timeout=60, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("dtrain: warning")]
    assert warnings == [f"dtrain: warning: cannot write {disk}/log.txt (No space left on device); "
                        "the lines it misses are on the console"]
    assert [line.split(" ", 2)[2] for line in proc.stderr.splitlines() if "dtrain" not in line] == \
        [*(f"while full {i}" for i in range(5)), "after"]  # the console has every line
    assert "after" in (disk / "log.txt").read_text()

"""Speed where users feel it, checked for what can be checked on a CPU: between checks a training
step reads no tensor value on the host (on a GPU, every such read waits for the device), the
non-finite skip stays exact without reading, and start-up reports where its time goes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import launch, unwrapped

QUIET = ["model.name=user_code:counting_cnn", "model.args={width: 8}", "train.max_steps=14",
         "train.log_every=1000", "train.check_every_steps=1000", "train.eval_every_epochs=0",
         "ckpt.every_epochs=0", "log.progress=lines", "log.every_s=1000"]


def reads_per_step(folder: Path, rank: int = 0) -> list[int]:
    """Host reads between one training forward and the next: one step's backward, optimizer
    step and bookkeeping, and the next step's data."""
    lines = (folder / f"rank{rank}.txt").read_text().splitlines()
    counts = [int(line.split()[0]) for line in lines]
    return [b - a for a, b in zip(counts, counts[1:])]


@pytest.mark.parametrize("mode,nproc,extra", [
    ("none", 0, []),
    ("ddp", 2, []),
    ("fsdp", 2, ["optim.name=adamw", "optim.lr=0.001"]),
    ("ddp", 2, ["train.clip_grad_norm=1.0", "train.grad_accum=2", "data.batch_size=8"]),
])
def test_steady_state_steps_read_nothing_on_the_host(tmp_path, mode, nproc, extra) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    result = launch(tmp_path / "runs" / "r", [*QUIET, f"parallel.mode={mode}", *extra], nproc=nproc,
                    env={"READS_DIR": str(reads)})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(max(1, nproc)):
        per_step = reads_per_step(reads, rank)
        forwards_per_step = 2 if "train.grad_accum=2" in extra else 1
        steady = per_step[2 * forwards_per_step:12 * forwards_per_step]  # steps 3..12
        assert steady and all(n == 0 for n in steady), (rank, per_step)
        # The set-up's objects (modules, model, data) are out of the collector's sight while
        # the loop runs: its full collections do not walk them.
        lines = (reads / f"rank{rank}.txt").read_text().splitlines()
        frozen = [int(line.split()[1]) for line in lines]
        assert min(frozen) > 100_000, frozen[:3]
    assert [r["step"] for r in result.records() if "val_loss" in r] == [14]


def test_a_skipped_step_is_exact_without_reading_the_device(tmp_path) -> None:
    """Gradients made infinite at step 4 by a user's backward hook: the fused optimizer skips the
    step on the device (parameters and momentum unchanged), and the check that follows names it."""
    import torch
    result = launch(tmp_path / "runs" / "r", ["model.name=user_code:inf_grad_cnn",
                                              "model.args={width: 8, at_call: 4}",
                                              "train.nan_policy=skip", "ckpt.every_steps=1",
                                              "train.max_steps=6", "ckpt.keep_last=10",
                                              "train.log_every=100", "train.check_every_steps=100"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 4: non-finite loss or gradients, optimizer step skipped (1 in a row, 1 in all)" \
        in result.stderr
    folder = result.run_dir / "checkpoints"
    by_step = {int(p.name[5:11]): torch.load(p / "checkpoint.pt", weights_only=True)
               for p in folder.iterdir() if p.is_dir()}
    for key, value in by_step[3]["model"].items():
        assert torch.equal(value, by_step[4]["model"][key]), key
    for key, state in by_step[3]["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], by_step[4]["optimizer"]["state"][key]["momentum_buffer"])
    assert by_step[6]["train_state"]["skipped_steps"] == 1


def test_start_up_says_where_its_time_goes(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["train.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"start-up: imports ([\d.]+) s, process group ([\d.]+) s, data ([\d.]+) s, "
                     r"model and wrap ([\d.]+) s, task check ([\d.]+) s, run directory and resume "
                     r"([\d.]+) s, first step ([\d.]+) s \(([\d.]+) s since the process started\)",
                     unwrapped(result.stderr))
    assert line, result.stderr[-2000:]
    phases = [float(x) for x in line.groups()]
    assert abs(sum(phases[:-1]) - phases[-1]) < 0.05 and phases[-1] < 60


def test_console_lines_on_each_ranks_own_clock_never_call_for_a_check(tmp_path) -> None:
    """log.every_s lines follow each rank's clock, which differ: a check (a collective) called
    for by one would leave the other waiting in another collective."""
    result = launch(tmp_path / "runs" / "r", ["model.name=user_code:slow_cnn",
                                              "model.args={width: 8, sleep_s: 0.02}",
                                              "train.max_steps=60", "train.log_every=1000",
                                              "train.check_every_steps=7", "log.progress=lines",
                                              "log.every_s=0.13"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"step (\d+) \| epoch \d+ \| loss ", result.stderr)
    assert len(lines) >= 2  # lines came, by time alone

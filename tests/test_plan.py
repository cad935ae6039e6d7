"""`dtrain plan` says before a run what the run then measures: state bytes, steps, checkpoint
size."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import TINY, dtrain, launch

from dtrain import config
from dtrain.commands.plan import command as plan

# Odd widths (33, 99 rows of the attention projection) make FSDP's shards uneven: rank 0 holds
# one row more than rank 1, which the plan must count exactly.
ODD_TRANSFORMER = ["model.name=transformer", "model.args={dim: 33, depth: 2, heads: 3}",
                   "optim.name=adamw", "optim.lr=0.001"]


def _first_record(result) -> dict:
    records = result.records()
    assert records, result.stderr[-3000:]
    return records[0]


def _disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _assert_run_matches_plan(result, overrides: list[str], nproc: int) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    estimate = plan.estimate(config.load(None, [*TINY, *overrides]), nproc=nproc)
    mode = "fsdp" if "parallel.mode=fsdp" in overrides else "ddp"
    first = _first_record(result)
    assert estimate.memory_for(mode, "fp32").state == first["state_bytes"]
    assert estimate.state_bytes_unsharded == first["state_bytes_unsharded"]
    banner = (result.run_dir / "log.txt").read_text()
    assert f"| {estimate.steps_per_epoch} steps per epoch" in banner
    assert f"effective batch {estimate.effective_batch} = " in banner
    assert f"backend {estimate.backend}" in banner and f"world size {estimate.world_size}" in banner
    assert max(r["step"] for r in result.records()) == estimate.total_steps
    latest = (result.run_dir / "checkpoints" / "latest").read_text().strip()
    marker = json.loads((result.run_dir / "checkpoints" / latest / "COMPLETE").read_text())
    assert marker["format"] == estimate.checkpoint_format
    on_disk = _disk_bytes(result.run_dir / "checkpoints" / latest)
    assert abs(estimate.checkpoint_bytes - on_disk) <= max(0.05 * on_disk, 24 * 1024), \
        (estimate.checkpoint_bytes, on_disk)


@pytest.mark.slow
def test_plan_state_bytes_equal_a_ddp_run(run_dir: Path) -> None:
    overrides = ["train.max_steps=2"]
    result = launch(run_dir, overrides, nproc=2)
    _assert_run_matches_plan(result, overrides, nproc=2)


@pytest.mark.slow
def test_plan_state_bytes_equal_a_two_rank_fsdp_run(run_dir: Path) -> None:
    overrides = [*ODD_TRANSFORMER, "parallel.mode=fsdp", "train.max_steps=2"]
    result = launch(run_dir, overrides, nproc=2)
    _assert_run_matches_plan(result, overrides, nproc=2)
    first = _first_record(result)
    # the shards really are uneven, and FSDP holds about half of DDP's state
    assert first["state_bytes"] * 2 != first["state_bytes_unsharded"]
    assert 0.5 < first["state_bytes"] / first["state_bytes_unsharded"] < 0.51


def test_plan_accounts_for_optimizer_accumulation_and_overfit() -> None:
    def load(*overrides: str) -> plan.Plan:
        return plan.estimate(config.load(None, [*TINY, *overrides]), nproc=2)

    sgd = load().memory_for("ddp", "fp32")
    assert sgd.optimizer == sgd.params  # one momentum buffer per parameter
    no_momentum = load("optim.momentum=0").memory_for("ddp", "fp32")
    assert no_momentum.optimizer == 0
    adam = load("optim.name=adam").memory_for("ddp", "fp32")
    assert adam.optimizer > 2 * adam.params  # two moments plus a step counter per tensor
    assert adam.activations == sgd.activations > 0
    bf16 = load("train.precision=bf16")
    low, full = bf16.memory_for("fsdp", "bf16"), bf16.memory_for("fsdp", "fp32")
    assert 0 < low.activations < full.activations
    # 512 samples, 2 ranks x 16: 16 batches per rank; accumulation of 4 makes 4 steps
    assert load().steps_per_epoch == 16 and load("train.grad_accum=4").steps_per_epoch == 4
    assert load("train.grad_accum=4").effective_batch == 16 * 2 * 4
    overfit = load("train.overfit_batches=3", "train.epochs=5")
    assert (overfit.steps_per_epoch, overfit.total_steps) == (3, 15)
    checkpointed = load("model.activation_checkpointing=true").memory_for("ddp", "fp32")
    assert checkpointed.activations < sgd.activations


def test_plan_command_prints_the_plan_and_warns_when_memory_is_short() -> None:
    proc = dtrain("plan", "--config", "configs/default.yaml", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "effective 128 = 64 per rank x 2 rank(s) x 1 accumulation" in out
    assert "156 per epoch; 1248 in total over 8 epoch(s)" in out
    assert re.search(r"ddp fp32 .*<- this run", out)
    assert "all-reduce of fp32 gradients" in out and "resolved config:" in out
    assert "WARNING" not in out
    assert "| backend gloo | mode ddp |" in out
    # One process runs no DDP, whatever the config says: the plan says so, as the banner does.
    single = dtrain("plan", "--config", "configs/default.yaml", "--nproc", "1")
    assert "| backend none (single process) | mode none (one process) |" in single.stdout
    # A 10-billion-parameter model is built on the meta device: no memory, but a clear warning.
    huge = dtrain("plan", "model.name=transformer", "model.args={dim: 20480, depth: 2, heads: 16}",
                  "--nproc", "2")
    assert huge.returncode == 0, huge.stderr
    warning = r"WARNING: the estimate for this run, [\d.]+ GiB per rank, exceeds"
    assert re.search(warning, huge.stdout)
    # The layout errors of a real launch are the plan's errors too: one line, exit 2.
    bad = dtrain("plan", "parallel.mode=none", "--nproc", "2")
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("dtrain: config error: parallel.mode: 'none' with 2 ranks")

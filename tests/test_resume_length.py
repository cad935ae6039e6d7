"""Extending a run is not training something else: a resume that changed `train.max_steps` or
`train.epochs` is allowed without ckpt.resume_config_change=allow, says in one line what changes,
and continues to the new end; the learning-rate schedule does what `ckpt.on_length_change` says:

- respan (default): from the resumed step on, the lr is the one of a run configured with the new
  length from the start (a cosine that had decayed jumps back up);
- keep: the schedule keeps its length; the steps past its end train at its last lr.

A change of what is learned (here the optimizer) is still refused, with exit 2, even beside a
length change.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from conftest import Result, launch

# 128 samples, batch 16: 8 steps an epoch.
SMALL = ["data.synthetic.train_size=128", "ckpt.every_epochs=0"]
COSINE = [*SMALL, "sched.name=cosine", "sched.warmup_steps=0", "sched.min_lr=0.005",
          "train.epochs=4"]
BASE_LR = 0.05  # conftest.TINY's optim.lr


def cosine_lr(step: int, total: int) -> float:
    """The lr of optimizer step `step` (1-based, as in metrics.jsonl) of a cosine over `total`."""
    progress = min(1.0, (step - 1) / total)
    return 0.005 + (BASE_LR - 0.005) * 0.5 * (1 + math.cos(math.pi * progress))


def lrs(result: Result) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in result.records() if "loss" in r}


@pytest.fixture(scope="module")
def short_cosine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished cosine run of 8 steps, never modified: the tests extend copies of it."""
    run_dir = tmp_path_factory.mktemp("length") / "runs" / "short"
    short = launch(run_dir, [*COSINE, "train.max_steps=8"])
    assert short.returncode == 0, short.stderr[-3000:]
    assert sorted(lrs(short)) == list(range(1, 9))
    return run_dir


@pytest.fixture(scope="module")
def cosine_runs(tmp_path_factory: pytest.TempPathFactory, short_cosine: Path) -> dict[str, Result]:
    """A cosine run of 8 steps extended to 16 (respan and keep), and one of 16 from the start."""
    base = tmp_path_factory.mktemp("length") / "runs"
    runs = {}
    for name in ("respan", "keep"):  # both extend a copy of the same 8-step run
        shutil.copytree(short_cosine, base / name)
    runs["respan"] = launch(base / "respan", [*COSINE, "train.max_steps=16"])
    runs["keep"] = launch(base / "keep", [*COSINE, "train.max_steps=16",
                                          "ckpt.on_length_change=keep"])
    runs["straight"] = launch(base / "straight", [*COSINE, "train.max_steps=16"])
    for result in runs.values():
        assert result.returncode == 0, result.stderr[-3000:]
    return runs


def test_longer_max_steps_resumes_and_respans_the_schedule(cosine_runs) -> None:
    extended, straight = cosine_runs["respan"], cosine_runs["straight"]
    assert "trains something else" not in extended.stderr
    assert ("run length changed on resume (train.max_steps: 8 -> 16): training continues from "
            "step 8 to step 16; the learning-rate schedule is re-spanned from 8 to 16 steps") \
        in extended.stderr
    # the line names the jump: lr at step 8 of the old span (its end) and of the new one
    assert f"lr at step 8 {0.005:.4g} -> {cosine_lr(9, 16):.4g}" in extended.stderr
    got, expected = lrs(extended), lrs(straight)
    assert sorted(got) == list(range(1, 17))  # steps 1-8 kept, 9-16 trained once
    for step in range(1, 9):  # the first 8 steps followed the 8-step cosine ...
        assert got[step] == pytest.approx(cosine_lr(step, 8), rel=1e-6), step
    for step in range(9, 17):  # ... the rest is the 16-step run's, step for step
        assert got[step] == pytest.approx(expected[step], rel=1e-9), step
        assert got[step] == pytest.approx(cosine_lr(step, 16), rel=1e-6), step
    assert got[9] > 4 * got[8]  # the documented jump back up
    assert "resumed from" in extended.stderr


def test_longer_max_steps_with_keep_trains_on_at_the_last_lr(cosine_runs) -> None:
    extended = cosine_runs["keep"]
    assert ("the learning-rate schedule keeps its 8 steps (ckpt.on_length_change=keep)"
            in extended.stderr)
    got = lrs(extended)
    assert sorted(got) == list(range(1, 17))
    for step in range(1, 9):
        assert got[step] == pytest.approx(cosine_lr(step, 8), rel=1e-6), step
    for step in range(9, 17):  # past the schedule's end: its floor, sched.min_lr
        assert got[step] == pytest.approx(0.005, rel=1e-6), step
    # it trained: the loss moved over the added steps
    losses = extended.losses()
    assert losses[16] != losses[9]


def test_more_epochs_continue_exactly_as_a_run_that_long_from_the_start(tmp_path: Path) -> None:
    """With a constant lr the extended run is the longer run: the same losses, bit for bit."""
    runs = tmp_path / "runs"
    first = launch(runs / "extended", [*SMALL, "train.epochs=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    extended = launch(runs / "extended", [*SMALL, "train.epochs=2"])
    straight = launch(runs / "straight", [*SMALL, "train.epochs=2"])
    assert extended.returncode == 0 and straight.returncode == 0, extended.stderr[-3000:]
    assert ("run length changed on resume (train.epochs: 1 -> 2): training continues from step 8 "
            "to step 16") in extended.stderr
    assert f"resumed from {runs / 'extended'}/checkpoints/step_000008-" in extended.stderr
    assert extended.losses() == straight.losses()
    assert sorted(extended.losses()) == list(range(1, 17))


def test_changed_optimizer_is_still_refused_beside_a_length_change(short_cosine: Path,
                                                                  tmp_path: Path) -> None:
    # A copy of the finished 8-step cosine run (the other tests extend it) is asked for 16 steps
    # with another optimizer.
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(short_cosine, run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    refused = launch(run_dir, [*COSINE, "train.max_steps=16", "optim.name=adamw"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = next(ln for ln in refused.stderr.splitlines() if "trains something else" in ln)
    assert "optim.name: 'sgd' -> 'adamw'" in line and "train.max_steps" not in line, line
    assert "ckpt.resume_config_change=allow" in line
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing trained, nothing lost


@pytest.mark.parametrize("base,length,asked,step,epoch", [
    ("short", ["train.max_steps=4"], "train.epochs=4, train.max_steps=4", 8, 1),
    ("straight", ["train.epochs=1"], "train.epochs=1", 16, 2),
], ids=["fewer_steps", "fewer_epochs"])
def test_a_relaunch_past_its_length_trains_nothing_and_rewrites_nothing(
        short_cosine: Path, cosine_runs, tmp_path: Path, base: str, length: list[str], asked: str,
        step: int, epoch: int) -> None:
    """A finished run (8 steps; 16, two epochs) asked for a shorter one: nothing trains, and its
    config.yaml and its runs.csv row still say what its checkpoints trained."""
    source = short_cosine if base == "short" else cosine_runs["straight"].run_dir
    run_dir = tmp_path / "runs" / source.name
    shutil.copytree(source, run_dir)
    shutil.copy(source.parent / "runs.csv", run_dir.parent / "runs.csv")
    kept = {path: path.read_bytes() for path in
            (run_dir / "config.yaml", run_dir.parent / "runs.csv", run_dir / "metrics.jsonl")}
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    relaunch = launch(run_dir, [*COSINE, *length])
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert (f"{run_dir} is already at or past the asked length ({asked}): it trained to step "
            f"{step}, epoch {epoch}; nothing to train, and its config.yaml and record are "
            f"unchanged") in relaunch.stderr
    for path, content in kept.items():
        assert path.read_bytes() == content, path
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints

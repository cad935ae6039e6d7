"""Early stopping (`train.early_stop`): a run whose `ckpt.monitor` stops improving by more than
`min_delta` for `patience` scheduled evaluations ends with exit 0, one line, a final checkpoint
(the best one kept by rotation) and status stopped_early in runs.csv. The count is in every
checkpoint: a run extended from a shorter one stops where an uninterrupted one does, a stopped run
started again stops at once, a larger patience on resume trains on, and 2 ranks stop together.

The runs below make the stop step certain: with min_delta 10 no val_loss of the tiny CNN ever
improves on the first evaluation's, so with evaluations every 4 steps and patience 2 the run
stops at step 12 (evaluations at 4, 8 and 12), long before the end of its epoch (32 steps; 16 on
2 ranks).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Result, dtrain, launch

from dtrain import config
from dtrain.loop.early_stop import EarlyStop
from dtrain.core.errors import UserError
from dtrain.loop.state import TrainState

PLATEAU = [
    "train.eval_every_steps=4", "train.eval_every_epochs=0",
    "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
    "train.early_stop.patience=2", "train.early_stop.min_delta=10",
    # a checkpoint at every evaluation; rotation keeps the last one and the best one
    "ckpt.every_steps=4", "ckpt.every_epochs=0", "ckpt.keep_last=1", "ckpt.keep_best=1",
]
LINE = re.compile(r"stopped early at step \d+: .*")


def stop_lines(text: str) -> list[str]:
    return LINE.findall(text)


def row(result: Result) -> dict[str, str]:
    with open(result.run_dir.parent / "runs.csv", newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}[result.run_dir.name]


def val_losses(result: Result) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in result.records() if "val_loss" in r}


def train_steps(result: Result) -> list[int]:
    return [r["step"] for r in result.records() if "loss" in r]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


# -- the rule, in-process -------------------------------------------------------------------------

def rule(*overrides: str) -> tuple[EarlyStop, TrainState]:
    cfg = config.load(None, ["train.eval_every_steps=1", *overrides])
    state = TrainState()
    return EarlyStop(cfg.train.early_stop, cfg.ckpt, state), state


def feed(stop: EarlyStop, state: TrainState, values: list[float]) -> list[bool]:
    """Each value as the evaluation of the next step; whether the run is due to stop after it."""
    due = []
    for value in values:
        state.step += 1
        stop.count(value)
        due.append(stop.due)
    return due


def test_an_improvement_resets_the_count_and_patience_ends_the_run() -> None:
    stop, state = rule("train.early_stop.patience=2", "ckpt.monitor=val_acc")
    assert feed(stop, state, [0.5, 0.6, 0.6, 0.55, 0.7, 0.69, 0.7]) == [
        False, False, False, True, False, False, True]
    assert (state.early_stop_best, state.early_stop_best_step) == (0.7, 5)
    assert state.evals_since_best == 2
    assert stop.line() == ("stopped early at step 7: val_acc did not improve by 0 for 2 "
                           "evaluations; best 0.7 at step 5")


def test_min_delta_counts_in_the_monitors_direction() -> None:
    # min: an improvement is lower than the best by more than min_delta
    stop, state = rule("train.early_stop.patience=3", "train.early_stop.min_delta=0.1",
                       "ckpt.monitor=val_loss", "ckpt.monitor_mode=min")
    due = feed(stop, state, [2.0, 1.95, 1.89, 1.85, 1.80, 1.795])
    assert due == [False, False, False, False, False, True]
    assert (state.early_stop_best, state.early_stop_best_step) == (1.89, 3)  # 2.0 - 0.11
    stop, state = rule("train.early_stop.patience=1", "train.early_stop.min_delta=0.1",
                       "ckpt.monitor=val_acc")
    assert feed(stop, state, [0.5, 0.61, 0.7]) == [False, False, True]  # +0.11, then +0.09


def test_non_finite_values_never_improve() -> None:
    stop, state = rule("train.early_stop.patience=2", "ckpt.monitor=val_loss",
                       "ckpt.monitor_mode=min")
    assert feed(stop, state, [math.nan, math.inf]) == [False, True]
    assert stop.line().endswith("for 2 evaluations; no finite value so far")


def test_off_counts_but_never_stops_and_the_decision_follows_the_current_patience() -> None:
    stop, state = rule("ckpt.monitor=val_acc")  # patience null: off
    assert feed(stop, state, [0.5, 0.4, 0.4, 0.4]) == [False] * 4
    assert state.evals_since_best == 3
    # the same count under a patience set on resume: due at once, or not yet
    for patience, due in ((3, True), (4, False)):
        cfg = config.load(None, ["train.eval_every_steps=1",
                                 f"train.early_stop.patience={patience}"])
        assert EarlyStop(cfg.train.early_stop, cfg.ckpt, state).due is due


def test_a_checkpoint_without_the_count_loads_with_an_empty_one() -> None:
    older = {"epoch": 1, "step": 30, "samples_in_epoch": 0, "consecutive_skips": 0,
             "skipped_steps": 0, "best_metric": 0.5, "last_eval": {"step": 30, "val_acc": 0.5}}
    state = TrainState(evals_since_best=7)
    state.load_state_dict(older)
    assert (state.step, state.best_metric) == (30, 0.5)
    assert (state.early_stop_best, state.early_stop_best_step, state.evals_since_best) == (
        None, None, 0)


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["train.early_stop.patience=0"],
     "config error: train.early_stop.patience: must be >= 1, got 0"),
    (["train.early_stop.patience=2", "train.early_stop.min_delta=-0.1"],
     "config error: train.early_stop.min_delta: must be >= 0, got -0.1"),
    (["train.early_stop.patience=two"],
     "config error: train.early_stop.patience: expected an integer, got 'two'"),
    (["train.early_stop.patiense=2"],
     "config error: unknown key 'train.early_stop.patiense' (did you mean "
     "'train.early_stop.patience'?)"),
])
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError) as e:
        config.load(None, overrides)
    assert str(e.value) == message


def test_early_stop_without_evaluations_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    proc = dtrain("train", f"run.out_dir={out}", "run.name=r", "train.eval_every_epochs=0",
                  "train.early_stop.patience=2")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "train.early_stop.patience" in lines[0]
    assert "train.eval_every_epochs" in lines[0] and "train.eval_every_steps" in lines[0]
    assert not out.exists()  # nothing launched, nothing written
    # evaluations by steps alone are enough; without early stopping nothing is asked
    config.load(None, ["train.eval_every_epochs=0", "train.eval_every_steps=5",
                       "train.early_stop.patience=2"])
    config.load(None, ["train.eval_every_epochs=0"])


# -- real runs ------------------------------------------------------------------------------------

@dataclass
class Run:
    """A launch and what its directory held right after it (later launches reuse directories)."""

    result: Result
    row: dict[str, str]
    evals: dict[int, float]  # val_loss by step
    steps: list[int]  # the steps of training records
    checkpoints: list[str]

    @property
    def stderr(self) -> str:
        return self.result.stderr

    @property
    def returncode(self) -> int:
        return self.result.returncode


def run(run_dir: Path, overrides: list[str], nproc: int = 0) -> Run:
    result = launch(run_dir, overrides, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return Run(result, row(result), val_losses(result), train_steps(result), checkpoints(run_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The plateau run straight through; the same command again (a stopped run started anew);
    then again with patience 3. A run stopped at max_steps=6, after one evaluation, then extended
    to the full length. And the plateau on 2 ranks."""
    base = tmp_path_factory.mktemp("early_stop") / "runs"
    return {
        "straight": run(base / "straight", PLATEAU),
        "again": run(base / "straight", PLATEAU),
        "patient": run(base / "straight", [*PLATEAU, "train.early_stop.patience=3"]),
        "short": run(base / "extended", [*PLATEAU, "train.max_steps=6"]),
        "extended": run(base / "extended", PLATEAU),
        "two_ranks": run(base / "two_ranks", PLATEAU, nproc=2),
        # 16 steps an epoch, evaluated every 8 steps and at every epoch's end
        "both": run(base / "both", [*PLATEAU, "train.eval_every_steps=8", "ckpt.every_steps=8",
                                    "train.eval_every_epochs=1", "data.synthetic.train_size=256",
                                    "train.epochs=2"]),
    }


@pytest.mark.slow
def test_a_plateau_stops_the_run_with_one_line_exit_0_and_the_best_checkpoint(runs) -> None:
    straight = runs["straight"]
    evals = straight.evals
    assert sorted(evals) == [4, 8, 12]  # no evaluation after the stop (nor one at the end)
    assert stop_lines(straight.stderr) == [
        f"stopped early at step 12: val_loss did not improve by 10 for 2 evaluations; "
        f"best {evals[4]:.6g} at step 4"]
    assert straight.steps == list(range(1, 13))  # trained to step 12, not beyond
    assert "stopped_early at step 12" in straight.stderr
    assert straight.row["status"] == "stopped_early"
    assert straight.row["step"] == "12"
    # the final checkpoint is the stop's; rotation (keep_last 1, keep_best 1) kept the best
    best_step = min(evals, key=evals.__getitem__)
    kept = straight.checkpoints
    assert kept[-1].startswith("step_000012-")
    assert any(name.startswith(f"step_{best_step:06d}-") for name in kept)
    assert len(kept) == (1 if best_step == 12 else 2)
    assert f"step_{best_step:06d}-" in straight.row["best_checkpoint"]


@pytest.mark.slow
def test_a_stopped_run_started_again_stops_at_once_with_the_same_line(runs) -> None:
    again, straight = runs["again"], runs["straight"]
    assert "resumed from" in again.stderr
    assert stop_lines(again.stderr) == stop_lines(straight.stderr)
    assert again.steps == straight.steps and again.evals == straight.evals  # nothing more
    assert again.checkpoints == straight.checkpoints
    assert again.row["status"] == "stopped_early"
    assert again.row["attempts"] == "2"


@pytest.mark.slow
def test_a_larger_patience_on_resume_trains_on_to_the_next_stop(runs) -> None:
    patient, straight = runs["patient"], runs["straight"]
    assert "trains something else" not in patient.stderr  # the stop rule may change freely
    assert sorted(patient.evals) == [4, 8, 12, 16]
    assert patient.steps == list(range(1, 17))
    assert stop_lines(patient.stderr) == [
        f"stopped early at step 16: val_loss did not improve by 10 for 3 evaluations; "
        f"best {straight.evals[4]:.6g} at step 4"]
    assert patient.row["status"] == "stopped_early" and patient.row["step"] == "16"


@pytest.mark.slow
def test_a_run_extended_after_one_evaluation_stops_where_the_straight_one_did(runs) -> None:
    short, extended, straight = runs["short"], runs["extended"], runs["straight"]
    # max_steps ends it at step 6 with an evaluation outside the schedule: not counted, and
    # the run finished its length
    assert sorted(short.evals) == [4, 6]
    assert stop_lines(short.stderr) == []
    assert short.row["status"] == "finished"
    assert "resumed from" in extended.stderr
    assert stop_lines(extended.stderr) == stop_lines(straight.stderr)  # step 12, same best
    # bit-exact: the evaluations after the resume are the straight run's
    assert {s: extended.evals[s] for s in (4, 8, 12)} == straight.evals
    assert extended.steps == straight.steps
    assert extended.row["status"] == "stopped_early" and extended.row["step"] == "12"


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step(runs) -> None:
    two = runs["two_ranks"]
    run_dir = two.result.run_dir
    rank0 = stop_lines((run_dir / "log.txt").read_text())
    rank1 = stop_lines((run_dir / "log.rank1.txt").read_text())
    assert len(rank0) == 1 and rank0 == rank1, (rank0, rank1)
    assert rank0[0] == (f"stopped early at step 12: val_loss did not improve by 10 for 2 "
                        f"evaluations; best {two.evals[4]:.6g} at step 4")
    assert two.steps == list(range(1, 13))
    assert two.row["status"] == "stopped_early" and two.row["world_size"] == "2"


@pytest.mark.slow
def test_a_step_evaluated_twice_counts_once(runs) -> None:
    """Step 16 ends epoch 0: eval_every_steps and eval_every_epochs both evaluate it; counted
    twice, the run would stop there instead of at step 24."""
    both = runs["both"]
    assert sorted(both.evals) == [8, 16, 24]
    assert stop_lines(both.stderr) == [
        f"stopped early at step 24: val_loss did not improve by 10 for 2 evaluations; "
        f"best {both.evals[8]:.6g} at step 8"]
    assert both.row["status"] == "stopped_early" and both.row["step"] == "24"

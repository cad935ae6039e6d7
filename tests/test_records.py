"""Run records: runs.csv in run.out_dir, one row per run with its status, and `dtrain runs`."""

from __future__ import annotations

import csv
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import forkserver
from conftest import REPO, TINY, TRAIN, child_env, dtrain, launch, wait_for_step

from dtrain import cli, config
from dtrain.run import records
from dtrain.files import store
from dtrain.loop.state import TrainState


def read_rows(out_dir: Path) -> dict[str, dict[str, str]]:
    with open(out_dir / "runs.csv", newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def git_head() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


@pytest.mark.slow
def test_finished_failed_and_preempted_runs_are_recorded(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    common = ["train.max_steps=6", "train.eval_every_steps=3"]
    first = launch(out / "first", common)
    second = launch(out / "second", [*common, "optim.lr=0.02"])
    broken = launch(out / "broken", [*common, "model.name=observe_models:failing_cnn",
                                     "model.num_classes=10", "model.args={fail_at: 3}"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    assert broken.returncode == 1
    assert "deliberate failure in training call 3" in broken.stderr

    stopped_dir = out / "stopped"
    args = [*TINY, "model.name=observe_models:slow_cnn", "model.num_classes=10",
            "model.args={width: 8, delay_s: 0.1}", f"run.out_dir={out}", "run.name=stopped"]
    proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(stopped_dir / "metrics.jsonl", 3, proc, timeout=120)
        proc.send_signal(signal.SIGTERM)  # what SLURM sends before a time limit or preemption
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()

    rows = read_rows(out)
    assert list(rows) == ["first", "second", "broken", "stopped"]
    assert {name: row["status"] for name, row in rows.items()} == {
        "first": "finished", "second": "finished", "broken": "failed", "stopped": "preempted"}
    assert rows["broken"]["error"] == ("RuntimeError: observe_models: deliberate failure in "
                                       "training call 3")
    assert rows["broken"]["step"] == "0" and rows["broken"]["best_checkpoint"] == ""
    for name, result in (("first", first), ("second", second)):
        row = rows[name]
        assert row["step"] == "6" and row["world_size"] == "1" and row["attempts"] == "1"
        best = max(e["val_acc"] for e in result.evals())
        assert float(row["best_metric"]) == pytest.approx(best, abs=1e-6)
        assert Path(row["best_checkpoint"]).is_dir()
        assert f"val_acc_{best:.4f}" in row["best_checkpoint"]
        assert 0 < float(row["wall_time_s"]) < 300
    assert (rows["first"]["lr"], rows["second"]["lr"]) == ("0.05", "0.02")
    assert rows["first"]["config_hash"] != rows["second"]["config_hash"]
    if git_head():
        assert rows["first"]["git_commit"].startswith(git_head())
    stopped_step = int(rows["stopped"]["step"])
    assert 3 <= stopped_step < 32
    latest = (stopped_dir / "checkpoints" / "latest").read_text()
    assert latest.startswith(f"step_{stopped_step:06d}")  # the record matches the saved state

    listing = dtrain("runs", f"--out-dir={out}")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "status", "started"]
    assert [line.split()[:2] for line in lines[1:5]] == [
        ["first", "finished"], ["second", "finished"], ["broken", "failed"], ["stopped", "preempted"]]
    assert "broken: RuntimeError: observe_models: deliberate failure" in listing.stdout


def test_dtrain_runs_on_a_missing_directory_is_one_clear_line(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nowhere"
    assert cli.main(["runs", f"--out-dir={missing}"]) == 2
    assert capfd.readouterr().err.splitlines() == [
        f"dtrain: runs error: '{missing}' is not a directory; pass the run.out_dir of your runs "
        f"with --out-dir"]
    assert cli.main(["runs", f"--out-dir={tmp_path}"]) == 0
    assert capfd.readouterr().out.strip() == f"no runs recorded in {tmp_path / 'runs.csv'}"


def test_config_hash_ignores_name_and_place_only() -> None:
    base = config.load(None, ["run.name=a", "run.out_dir=x"])
    same = config.load(None, ["run.name=b", "run.out_dir=y"])
    other = config.load(None, ["run.name=a", "run.out_dir=x", "optim.lr=0.2"])
    assert records.config_hash(base) == records.config_hash(same)
    assert records.config_hash(base) != records.config_hash(other)


def _hammer(out_dir: str, name: str, count: int) -> None:
    cfg = config.load(None, [f"run.name={name}", f"run.out_dir={out_dir}"])
    described = {"model": cfg.model.name, "lr": str(cfg.optim.lr)}
    record = records.RunRecord(out_dir, name, described, cfg.ckpt, world_size=1, is_main=True)
    record.start(store.Store(os.path.join(out_dir, name)), resuming=False)
    for step in range(1, count + 1):
        record.update(TrainState(step=step))
    record.update(TrainState(step=count), "finished")


def test_concurrent_runs_keep_every_row(tmp_path: Path) -> None:
    """Runs sharing an out_dir write at the same time: the lock and the rename keep all rows."""
    names = [f"run{i}" for i in range(4)]
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_hammer, args=(str(tmp_path), name, 25)) for name in names]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    rows = read_rows(tmp_path)
    assert sorted(rows) == names
    assert all(row["status"] == "finished" and row["step"] == "25" for row in rows.values())
    assert not list(tmp_path.glob("runs.csv.tmp*"))


def test_a_damaged_runs_csv_keeps_its_readable_rows_for_runs_and_for_new_records(
        tmp_path: Path, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that are not UTF-8 or a NUL in runs.csv: `dtrain runs` and a run's record skip
    that line with a warning and keep every other row."""
    for name in ("first", "second"):
        _hammer(str(tmp_path), name, 2)
    table = tmp_path / "runs.csv"
    lines = table.read_bytes().splitlines(keepends=True)
    table.write_bytes(lines[0] + lines[1] + b"\xff\xfebroken,\xc3(\n" + b"nul\x00row\n" + lines[2])
    assert cli.main(["runs", f"--out-dir={tmp_path}"]) == 0
    captured = capfd.readouterr()
    listed = [line for line in captured.out.splitlines()[1:]
              if not line.startswith(("not shown", "  "))]  # the note on columns left out
    assert [line.split()[:2] for line in listed] == [["first", "finished"], ["second", "finished"]]
    assert "runs.csv: left out 2 line(s) that cannot be read (damaged)" in caplog.text
    _hammer(str(tmp_path), "third", 1)  # a new run's record rewrites the table without them
    rows = read_rows(tmp_path)
    assert list(rows) == ["first", "second", "third"]
    assert all(row["status"] == "finished" for row in rows.values())
    table.write_text("name,status\n\"unclosed,running\n" + "x" * 200_000 + "\n")
    assert cli.main(["runs", f"--out-dir={tmp_path}"]) == 2
    assert "is not a table of runs" in capfd.readouterr().err

"""Paths as the commands take them: a run.out_dir in an object store is walked by `dtrain verify`
and listed by `dtrain runs` exactly as a local one, "nothing to verify" is never a success, a
second launch onto a live run in a store names that run and its holder, and a word that names a
path (a sweep's trial `lr=0.3`) is a path, never an override. Against a real S3 server (moto's);
one run trained into the store serves every case."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import dtrain, launch

from dtrain.core.urls import staging_dir
from dtrain.files.store import RunDirLock

RUN = ["train.max_steps=4", "ckpt.every_steps=2", "ckpt.keep_last=5"]


@dataclass(frozen=True)
class Trained:
    bucket: str
    out: str  # the run.out_dir: s3://bucket/exp
    run: str  # its one run: s3://bucket/exp/r
    stage: Path  # run.staging_dir


@pytest.fixture(scope="module")
def trained(s3, tmp_path_factory) -> Trained:
    """A run trained into the store: two checkpoints (steps 2 and 4) of s3://bucket/exp/r."""
    fs, bucket = s3.fs(), s3.bucket()
    stage = tmp_path_factory.mktemp("stage")
    out = f"s3://{bucket}/exp"
    first = launch(stage / "x" / "r", [*RUN, f"run.out_dir={out}", f"run.staging_dir={stage}"],
                   env=s3.env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(fs.ls(f"{bucket}/exp/r/checkpoints")) == 3  # two checkpoints and `latest`
    return Trained(bucket, out, f"{out}/r", stage)


def _copy(fs, bucket: str, source: str, target: str) -> None:
    for key in fs.find(f"{bucket}/{source}"):
        fs.copy(key, f"{bucket}/{target}" + key.removeprefix(f"{bucket}/{source}"))


def _one_line(result) -> str:
    """The one line a refusal prints (exit 2, no traceback)."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------
# dtrain verify


@pytest.mark.parametrize("words", [
    ["{out}"], ["{out}/"], ["--run-dir", "{out}"], ["--run-dir", "{out}/"], ["{run}"],
    ["{run}/checkpoints/"],
], ids=["out_dir", "out_dir/", "--run-dir out_dir", "--run-dir out_dir/", "run", "checkpoints/"])
def test_verify_walks_a_store_as_a_disk(s3, trained: Trained, words: list[str]) -> None:
    """Every checkpoint of every run below the path, one line each: 2 intact, exit 0."""
    args = [w.format(out=trained.out, run=trained.run) for w in words]
    result = dtrain("verify", *args, env=s3.env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [
        ["intact", f"{trained.run}/checkpoints/step_000002-epoch_00:"],
        ["intact", f"{trained.run}/checkpoints/step_000004-epoch_00:"],
    ]
    assert lines[2:] == ["2 checkpoints: 2 intact, 0 damaged, 0 unverified"]


def test_verify_finds_a_damaged_checkpoint_below_a_store_out_dir(s3, trained: Trained) -> None:
    fs, bucket = s3.fs(), trained.bucket
    _copy(fs, bucket, "exp", "damaged")
    key = f"{bucket}/damaged/r/checkpoints/step_000004-epoch_00/checkpoint.pt"
    data = bytearray(fs.cat(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(key, bytes(data))
    result = dtrain("verify", f"s3://{bucket}/damaged/", env=s3.env)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith(f"damaged     s3://{key.removesuffix('/checkpoint.pt')}: "
                               f"checkpoint.pt: digest "), lines
    assert lines[-1] == "2 checkpoints: 1 intact, 1 damaged, 0 unverified"


def _store_without_runs(fs, trained: Trained, tmp_path: Path) -> tuple[str, str]:
    fs.pipe(f"{trained.bucket}/records-only/runs.csv", b"name,status\n")
    path = f"s3://{trained.bucket}/records-only"
    return path, f"{path} is neither a checkpoint (no COMPLETE marker), a run directory"


def _store_run_without_checkpoints(fs, trained: Trained, tmp_path: Path) -> tuple[str, str]:
    fs.pipe(f"{trained.bucket}/none/r/checkpoints/latest", b"step_000002-epoch_00\n")
    fs.pipe(f"{trained.bucket}/none/r/config.yaml", b"{}\n")
    path = f"s3://{trained.bucket}/none/"
    return path, f"no checkpoints in {path}: nothing to verify"


def _local_run_without_checkpoints(fs, trained: Trained, tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "runs" / "r" / "checkpoints").mkdir(parents=True)
    return str(tmp_path / "runs"), f"no checkpoints in {tmp_path / 'runs'}: nothing to verify"


def _local_interrupted_saves_only(fs, trained: Trained, tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000002-epoch_00").mkdir(parents=True)
    return str(tmp_path / "runs" / "r"), f"no complete checkpoint in {tmp_path / 'runs' / 'r'} ("


@pytest.mark.parametrize("case", [_store_without_runs, _store_run_without_checkpoints,
                                  _local_run_without_checkpoints, _local_interrupted_saves_only])
def test_nothing_to_verify_is_one_line_and_exit_2(s3, trained: Trained, tmp_path: Path,
                                                   case) -> None:
    path, said = case(s3.fs(), trained, tmp_path)
    line = _one_line(dtrain("verify", path, env=s3.env))
    assert line.startswith(f"dtrain: verify error: {said}"), line


# ---------------------------------------------------------------------------------------------
# dtrain runs


@pytest.mark.parametrize("words", [["{out}"], ["{out}/"], ["{out}", "--format", "csv"]])
def test_runs_lists_a_store_out_dir_given_positionally(s3, trained: Trained, words) -> None:
    result = dtrain("runs", *[w.format(out=trained.out) for w in words], env=s3.env)
    assert result.returncode == 0, result.stderr
    if "csv" in words:
        row = result.stdout.splitlines()[1].split(",")
        assert row[:4] == ["r", "finished", "4", "0"] and row[-1] == trained.run, row
    else:
        [row] = [line.split() for line in result.stdout.splitlines() if line.startswith("r ")]
        assert row[:4] == ["r", "finished", "4", "0"], row


def test_runs_of_one_store_run_names_its_parent(s3, trained: Trained) -> None:
    line = _one_line(dtrain("runs", trained.run, env=s3.env))
    assert line.startswith(f"dtrain: runs error: '{trained.run}' holds neither sweep.yaml nor "
                           f"runs.csv"), line
    assert line.endswith(f"('{trained.run}' is one run's directory: pass its parent)"), line


# ---------------------------------------------------------------------------------------------
# A second launch


def test_a_second_launch_names_the_store_run_and_its_holder(s3, trained: Trained) -> None:
    """A live run of this host holds the run's lease in the store and its staging folder's lock
    (here this test process holds both, as a run does): a second launch says which run is in
    use, by its URL, and who holds it; never the staging folder. Nothing in the store changes."""
    fs = s3.fs()
    before = fs.find(f"{trained.bucket}/exp", detail=True)
    staging = staging_dir(trained.run, str(trained.stage))
    lock = RunDirLock(staging)
    lock.acquire(None)
    lease = {"host": socket.gethostname(), "pid": os.getpid(), "job": None, "started": "now",
             "ttl_s": 600, "renewed": time.time()}
    fs.pipe(f"{trained.bucket}/exp/r/.lock", json.dumps(lease).encode())
    try:
        second = launch(trained.stage / "x" / "r",
                        [*RUN, f"run.out_dir={trained.out}", f"run.staging_dir={trained.stage}"],
                        env=s3.env)
    finally:
        fs.rm(f"{trained.bucket}/exp/r/.lock")
        lock.release()
    assert second.returncode == 2, second.stderr[-3000:]
    assert (f"dtrain: run error: the run directory {trained.run} is in use by another run "
            f"(host {socket.gethostname()}, pid {os.getpid()}, since now, renewed ") in second.stderr
    assert staging not in second.stderr
    assert fs.find(f"{trained.bucket}/exp", detail=True) == before


# ---------------------------------------------------------------------------------------------
# Paths that look like overrides


@pytest.fixture(scope="module")
def trial(s3, trained: Trained, tmp_path_factory) -> Path:
    """The store's run copied to a local sweep folder as its trial `lr=0.3`."""
    folder = tmp_path_factory.mktemp("lr_sweep") / "lr=0.3"
    s3.fs().get(trained.run.removeprefix("s3://"), str(folder), recursive=True)
    assert (folder / "config.yaml").is_file()
    return folder


@pytest.mark.parametrize("words", [["{trial}"], ["{trial}", "data.batch_size=50"],
                                   ["--run-dir", "{trial}", "data.batch_size=50"]])
def test_eval_takes_a_trial_named_like_an_override(trial: Path, words: list[str]) -> None:
    result = dtrain("eval", *[w.format(trial=trial) for w in words])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val_acc" in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["train"], ["plan"], ["sweep", "--dry-run"],
                                     ["export", "--run-dir", "{trial}", "--out", "{out}"]])
def test_a_path_among_overrides_is_one_line(trial: Path, tmp_path: Path, command) -> None:
    """Commands that take no path among their overrides refuse one by name: nothing written."""
    words = [w.format(trial=trial, out=tmp_path / "model.pt") for w in command]
    line = _one_line(dtrain(*words, str(trial)))
    assert line.startswith(f"dtrain: usage error: '{trial}' is no section.key=value override"), line
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_into_a_store_is_one_line(s3, trained: Trained) -> None:
    """A sweep folder is kept on a disk: a run.out_dir in a store is refused, never a local
    folder named after the URL."""
    from conftest import REPO

    result = dtrain("sweep", "--dry-run", f"run.out_dir={trained.out}", "optim.lr=[0.1,0.2]",
                    env=s3.env)
    line = _one_line(result)
    assert line.startswith(f"dtrain: sweep error: run.out_dir {trained.out} is in an object "
                           f"store"), line
    assert not (Path(REPO) / "s3:").exists()

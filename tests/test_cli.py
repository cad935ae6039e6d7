"""The command line as a user meets it: every --help exits 0, every usage error exits 2 with the
usage and no traceback, options and overrides mix in any order, and export finds a run's newest
checkpoint by its run directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from conftest import REPO, TINY, TRAIN, child_env, dtrain, fill_disk, latest

COMMANDS = ["train", "plan", "doctor", "export", "verify", "runs", "tokenize", "sweep", "convert", "eval"]


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)], ids=["dtrain", *COMMANDS])
def test_every_help_exits_0_without_a_traceback(command) -> None:
    result = dtrain(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and result.stderr == ""
    assert result.stdout.startswith(f"usage: {' '.join(['dtrain', *command])} ")
    if not command:  # the top level lists every command
        assert all(f"    {c} " in result.stdout for c in COMMANDS)


def test_launch_script_help_is_the_train_command_s() -> None:
    result = subprocess.run([sys.executable, TRAIN, "--help"], cwd=REPO, env=child_env(),
                            text=True, capture_output=True, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert result.stdout.startswith("usage: dtrain train ") and "--config" in result.stdout


USAGE_ERRORS = [
    ([], "the following arguments are required: COMMAND"),
    (["trian"], "argument COMMAND: invalid choice: 'trian'"),
    (["--config", "c.yaml", "train"], "argument COMMAND: invalid choice: 'c.yaml'"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--config"], "argument --config: expected one argument"),
    (["plan", "--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    (["doctor", "now"], "unrecognized arguments: now"),
    (["export", "--out", "m.pt"], "one of the arguments --run-dir/--run --checkpoint is required"),
    (["export", "--run", "r", "--checkpoint", "c", "--out", "m.pt"],
     "argument --checkpoint: not allowed with argument --run"),
    (["export", "--run", "r"], "the following arguments are required: --out"),
    (["export", "--run", "r", "--out", "m.pt", "--format", "tflite"],
     "argument --format: invalid choice: 'tflite'"),
    (["runs", "--out-dir"], "argument --out-dir: expected one argument"),
    (["verify", "--run", "r", "--checkpoint", "c"],
     "argument --checkpoint: not allowed with argument --run"),
]


@pytest.mark.parametrize("args,message", USAGE_ERRORS,
                         ids=[" ".join(args) or "nothing" for args, _ in USAGE_ERRORS])
def test_every_usage_error_is_2_with_the_usage(args, message, capsys) -> None:
    from dtrain import cli
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dtrain") and message in err.splitlines()[-1]


@pytest.mark.parametrize("args,message", [USAGE_ERRORS[0], USAGE_ERRORS[7]], ids=["top", "export"])
def test_a_usage_error_leaves_the_process_with_2_and_no_traceback(args, message) -> None:
    result = dtrain(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: dtrain") and message in result.stderr


def test_plan_takes_overrides_before_and_after_config() -> None:
    """configs/default.yaml says batch 64 and 8 epochs: both overrides win, wherever they stand."""
    result = dtrain("plan", "data.batch_size=8", "--config", "configs/default.yaml",
                    "train.epochs=3", "--nproc", "1")
    assert result.returncode == 0, result.stderr
    assert "8 per rank" in result.stdout and "over 3 epoch(s)" in result.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of launch/train.py with overrides before --config (its name) and after it (the
    learning rate, 0.1 in configs/default.yaml, with no warm-up), checkpointing at steps 2 and 4."""
    out_dir = tmp_path_factory.mktemp("cli") / "runs"
    args = ["run.name=mixed", f"run.out_dir={out_dir}", "--config", "configs/default.yaml",
            *TINY, "optim.lr=0.02", "sched.warmup_steps=0", "train.max_steps=4",
            "ckpt.every_steps=2"]
    result = forkserver.run([sys.executable, TRAIN, *args], cwd=REPO, env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out_dir / "mixed"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`dtrain export --run` of the trained run: the export test checks it, and the full-disk
    test starts from a copy of it as a file that a failed export must leave."""
    out = tmp_path_factory.mktemp("exported") / "model.pt"
    return dtrain("export", "--out", str(out), "--run", str(trained)), out


def test_an_export_that_cannot_be_written_leaves_what_was_there_and_says_why(
        trained, exported, tmp_path, tmpfs) -> None:
    """A full disk, a read-only place, a directory at --out: one line, exit 2, and the files
    that were there as they were (written beside --out under a hidden name, then renamed)."""
    disk = tmpfs("size=512k", "small")
    out = disk / "model.pt"
    first, first_out = exported
    assert first.returncode == 0, first.stderr
    shutil.copyfile(first_out, disk / "earlier.pt")
    good = (disk / "earlier.pt").read_bytes()
    fill_disk(disk)
    full = dtrain("export", "--out", str(out), "--run", str(trained))
    assert full.returncode == 2, full.stderr
    assert full.stderr.strip().splitlines() == [
        f"dtrain: export error: cannot write into {disk} (the disk is full); nothing there "
        f"was changed: free space or choose another --out"]
    assert (disk / "earlier.pt").read_bytes() == good
    assert sorted(p.name for p in disk.iterdir()) == ["earlier.pt", "filler"]
    read_only = tmpfs("ro,size=64k", "read_only")
    refused = dtrain("export", "--out", str(read_only / "model.pt"), "--run", str(trained))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"dtrain: export error: cannot write into {read_only} (Read-only file system); "
        f"nothing there was changed: free space or choose another --out"]
    folder = tmp_path / "a_folder"
    folder.mkdir()
    onto = dtrain("export", "--out", str(folder), "--run", str(trained))
    assert onto.returncode == 2 and onto.stderr.strip().splitlines() == [
        f"dtrain: export error: --out {folder} already exists (a folder); --format state_dict "
        f"writes a new file: name one that is not there"]


def test_launch_takes_overrides_before_and_after_config(trained) -> None:
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    rates = [r["lr"] for r in records if "loss" in r]
    assert len(rates) == 4 and set(rates) == {0.02}
    assert "name: mixed" in (trained / "config.yaml").read_text()


def test_export_by_run_directory_takes_its_newest_checkpoint(trained, exported) -> None:
    result, out = exported
    assert result.returncode == 0, result.stderr
    newest = latest(trained)
    assert result.stdout.startswith(f"exported {newest} -> {out} (state_dict)")
    saved = torch.load(newest / "checkpoint.pt", weights_only=True)["model"]
    exported = torch.load(out, weights_only=True)
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)


@pytest.mark.parametrize("make,message", [
    (lambda run: run, "not a run directory"),
    (lambda run: (run / "checkpoints").mkdir(parents=True) or run, "no complete checkpoint in"),
], ids=["missing", "empty"])
def test_export_of_a_run_without_checkpoints_is_one_line_and_exit_2(tmp_path, make, message) -> None:
    run = make(tmp_path / "run")
    result = dtrain("export", "--run", str(run), "--out", str(tmp_path / "m.pt"))
    assert result.returncode == 2
    assert result.stderr.startswith(f"dtrain: export error: --run-dir {run}: {message}")
    assert len(result.stderr.strip().splitlines()) == 1

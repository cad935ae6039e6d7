"""Configs, commands and files as users (and typos) give them: a key written twice, a number that
is not finite, a sweep that cannot be meant, a folder that cannot be written, a reader that goes
away, a checkpoint crafted to run code, a second Ctrl-C. Each is one line with its exit code,
no traceback, and nothing written; each runs the real command."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import typing

import pytest
import torch
from conftest import REPO, TINY, TRAIN, child_env, dtrain, forkserver, latest, launch, saved_step

# ---------------------------------------------------------------------------------------------
# Configs: (config file text or None, overrides, words the one line holds)

CONFIGS = {
    "a section twice": ("optim:\n  lr: 0.1\noptim:\n  name: adamw\n", [],
                        "duplicate key 'optim' at line 3 (first at line 1)"),
    "a key twice": ("optim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n", [],
                    "duplicate key 'optim.lr' at line 4 (first at line 2)"),
    "a key twice in a list's mapping": (
        "data:\n  name: tokens\n  tokens:\n    mix:\n      - {root: a, weight: 1, weight: 2}\n",
        [], "duplicate key 'data.tokens.mix[0].weight' at line 5 (first at line 5)"),
    "a key twice in an override": (None, ["model.args={width: 8, width: 16}"],
                                   "override 'model.args={width: 8, width: 16}': duplicate key "
                                   "'model.args.width'"),
    "lr inf": (None, ["optim.lr=.inf"], "optim.lr: must be a finite number, got inf"),
    "lr nan": (None, ["optim.lr=.nan"], "optim.lr: must be a finite number, got nan"),
    "a timeout inf in a file": ("dist:\n  init_timeout_s: .inf\n", [],
                                "dist.init_timeout_s: must be a finite number, got inf"),
    "lora alpha inf": (None, ["model.lora.alpha=.inf"], "model.lora.alpha: must be a finite"),
    "optional float inf": (None, ["train.clip_grad_norm=.inf"],
                           "train.clip_grad_norm: must be a finite number, got inf"),
    "init timeout inf": (None, ["dist.init_timeout_s=.inf"],
                         "dist.init_timeout_s: must be a finite number, got inf"),
    "timeout 1e999": (None, ["dist.timeout_s=1e999"],
                      "dist.timeout_s: must be a finite number, got '1e999'"),
    "upload interval inf": (None, ["run.upload_every_s=.inf"],
                            "run.upload_every_s: must be a finite number, got inf"),
    "a duration past a year": (None, ["dist.timeout_s=1e10"],
                               "dist.timeout_s: must be > 0 and at most 31536000 s (a year), "
                               "got 10000000000.0"),
}


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The command's only line on stderr (no traceback, nothing else)."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_with_a_key_twice_or_a_number_that_is_not_finite_is_one_line(tmp_path,
                                                                              case) -> None:
    text, overrides, words = CONFIGS[case]
    args = [*TINY, *overrides, f"run.out_dir={tmp_path / 'runs'}"]
    if text is not None:
        (tmp_path / "config.yaml").write_text(text)
        args = ["--config", str(tmp_path / "config.yaml"), *args]
    proc = dtrain("train", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_line(proc)
    assert line.startswith("dtrain: config error: ") and words in line, line
    assert not (tmp_path / "runs").exists()


def _schema_fields(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name.rstrip("_")
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _schema_fields(hints[f.name], key + ".")
        else:
            yield key, f


def test_every_duration_key_is_bounded() -> None:
    """Every `*_s` key takes seconds: finite, positive and at most a year (a timeout of 1e300 s
    overflows Python's and torch's clocks), by the one check all of them use."""
    from dtrain.config import Config
    from dtrain.config.fields import DURATION

    durations = {k: f for k, f in _schema_fields(Config) if k.endswith("_s")}
    assert {"dist.timeout_s", "dist.init_timeout_s", "run.upload_every_s"} <= set(durations)
    for key, field in durations.items():
        assert field.metadata["check"] is DURATION, key


# ---------------------------------------------------------------------------------------------
# Sweeps


def test_a_sweep_that_cannot_be_meant_is_refused_at_once(tmp_path) -> None:
    out = f"run.out_dir={tmp_path / 'runs'}"
    started = time.monotonic()
    many = dtrain("sweep", "--random", "1000000000", "--dry-run", "optim.lr=loguniform(1e-4,1e-1)",
                  out)
    assert time.monotonic() - started < 60  # it printed nothing for minutes, its memory growing
    assert many.returncode == 2
    assert one_line(many) == ("dtrain: sweep error: --random 1000000000: at most 10000 trials in "
                              "one sweep; ask for fewer (--extend adds more to a sweep later)")
    values = ",".join(str(i) for i in range(1, 102))
    grid = dtrain("sweep", "--dry-run", f"train.epochs=[{values}]", f"data.batch_size=[{values}]",
                  out)
    assert grid.returncode == 2
    assert "the grid has 10201 trials (101 x 101), at most 10000 in one sweep" in one_line(grid)
    infinite = dtrain("sweep", "--dry-run", "dist.timeout_s=[60,.inf]", out)
    assert infinite.returncode == 2
    assert "dist.timeout_s: must be a finite number, got inf" in one_line(infinite)
    unbounded = dtrain("sweep", "--random", "3", "--dry-run", "train.epochs=uniform(1,.inf)", out)
    assert unbounded.returncode == 2
    assert one_line(unbounded) == ("dtrain: sweep error: train.epochs=uniform(1,.inf): "
                                   "uniform(a,b) needs finite bounds")
    assert not (tmp_path / "runs").exists()


def test_a_sweep_into_a_read_only_folder_is_one_line(tmp_path, tmpfs) -> None:
    disk = tmpfs("ro,size=64k")
    proc = dtrain("sweep", "optim.lr=[0.1,0.2]", f"run.out_dir={disk}")
    assert proc.returncode == 2
    assert one_line(proc) == (
        f"dtrain: sweep error: cannot write into {disk / 'default_sweep'} (Read-only file "
        f"system); nothing there was changed: free space or make it writable, or choose another "
        f"run.out_dir")


def test_a_sweep_file_with_a_key_twice_is_one_line(tmp_path) -> None:
    folder = tmp_path / "runs" / "s"
    folder.mkdir(parents=True)
    (folder / "sweep.yaml").write_text(
        "version: 1\nname: s\ntrials:\n- {index: 0, name: a, overrides: {optim.lr: 0.1}}\n"
        "name: t\n")
    proc = dtrain("train", "--sweep", str(folder), "--trial", "0")
    assert proc.returncode == 2
    line = one_line(proc)
    assert line.startswith(f"dtrain: sweep error: {folder / 'sweep.yaml'} cannot be read ("
                           f"duplicate key 'name' at line 5 (first at line 2))"), line


# ---------------------------------------------------------------------------------------------
# Output to a reader that has gone


@pytest.mark.parametrize("command", [["plan"], ["sweep", "--dry-run", "optim.lr=[0.1,0.2]"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path, command) -> None:
    """`dtrain plan | head`: the pipe closes before dtrain writes; it ends as a Unix tool does
    (SIGPIPE's status), saying nothing."""
    proc = forkserver.popen([sys.executable, "-m", "dtrain", *command,
                             f"run.out_dir={tmp_path / 'runs'}"], cwd=REPO, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is written
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, stderr
    assert stderr == ""


# ---------------------------------------------------------------------------------------------
# A checkpoint crafted to run code, in an object store


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_crafted_checkpoint_is_refused_naming_where_it_is_and_never_advising_unsafe_loading(
        s3, tmp_path) -> None:
    from dtrain.files.digests import file_digest, seal

    run = launch(tmp_path / "runs" / "r", ["train.max_steps=1", "train.eval_every_epochs=0"])
    assert run.returncode == 0, run.stderr[-3000:]
    folder = latest(run.run_dir)
    pwned = tmp_path / "pwned"
    torch.save({"model": {}, "extra": _RunsCode(str(pwned))}, folder / "checkpoint.pt")
    marker = json.loads((folder / "COMPLETE").read_text())
    # Whoever can write the files can write the marker's digests too.
    marker["files"]["checkpoint.pt"] = (folder / "checkpoint.pt").stat().st_size
    marker["digests"]["checkpoint.pt"] = file_digest(str(folder / "checkpoint.pt"))
    (folder / "COMPLETE").write_text(json.dumps(seal(marker)))
    bucket = s3.bucket()
    s3.fs().put(str(run.run_dir), f"{bucket}/runs/r", recursive=True)
    url = f"s3://{bucket}/runs/r"
    for where, named, env in ((url, f"{url}/checkpoints/{folder.name}/checkpoint.pt", s3.env),
                              (str(run.run_dir), str(folder / "checkpoint.pt"), None)):
        proc = dtrain("eval", "--run-dir", where, env=env)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        [line] = [line for line in proc.stderr.splitlines() if line.startswith("dtrain:")]
        assert line == (f"dtrain: checkpoint error: {named} holds objects that only arbitrary "
                        f"unpickling can load (it names posix.system); refused: dtrain loads "
                        f"weights only, never code"), line
        assert "weights_only=False" not in line and "likely succeed" not in line
    assert not pwned.exists()


# ---------------------------------------------------------------------------------------------
# A second Ctrl-C while the stop's checkpoint is saved


def test_a_second_ctrl_c_during_the_stops_save_is_one_line_naming_what_is_kept(tmp_path) -> None:
    """The run is held before step 4 (user_code's SlowCNN) until the checkpoint of step 2 is
    complete; then the saves pause, the first SIGINT asks for a stop, and the second comes while
    the stop's save waits: exit 130, one line naming the step-2 checkpoint, which is intact."""
    run_dir = tmp_path / "runs" / "r"
    hold, pause = tmp_path / "hold", tmp_path / "pause"
    hold.touch()
    env = child_env({"PAUSE_TRAIN_FILE": str(hold), "PAUSE_TRAIN_AFTER": "3",
                     "PAUSE_SAVE_FILE": str(pause)})
    args = [*TINY, "model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0}",
            "ckpt.every_steps=2", f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
    proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while saved_step(run_dir) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of step 2"
            time.sleep(0.05)
        pause.touch()  # the next save waits in the model's state_dict()
        proc.send_signal(signal.SIGINT)
        hold.unlink()  # the stop comes after step 3 or 4, and the stop's save waits
        log = run_dir / "log.txt"
        while "stop requested (SIGINT)" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "no stop requested"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        stderr = proc.stderr.read()
    finally:
        pause.unlink(missing_ok=True)
        proc.kill()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    kept = latest(run_dir)
    assert stderr.strip().splitlines()[-1] == (
        f"dtrain: stopped at once by a second Ctrl-C; the last complete checkpoint is kept: "
        f"{kept} (step 2); the same command resumes from it")
    assert json.loads((kept / "COMPLETE").read_text())["step"] == 2

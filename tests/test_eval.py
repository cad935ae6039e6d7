"""`dtrain eval`: a checkpoint's metrics by the run's own evaluation, at any world size and from
any checkpoint format, on the run's validation data or on other data, without touching the run
directory (but for evals/) while the training holds it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forkserver
from conftest import REPO, child_env, kill_tree, latest, launch, saved_step, start, torchrun_cmd

from dtrain import cli
from dtrain.files.store import Store

# 101 validation samples: over 2 ranks one is padded, and must not be counted twice.
SMALL = ["data.synthetic.train_size=256", "data.synthetic.val_size=101"]
# The four ways a 2-rank run checkpoints; two of them keep EMA weights too (train.ema).
RUNS = {
    "ddp-full": ["parallel.mode=ddp", "train.ema.decay=0.9"],
    "ddp-sharded": ["parallel.mode=ddp", "ckpt.format=sharded"],
    "fsdp-full": ["parallel.mode=fsdp", "ckpt.format=full"],
    "fsdp-sharded": ["parallel.mode=fsdp", "train.ema.decay=0.9"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-rank run of a RUNS entry, trained once for the module, when a test first needs it."""
    root = tmp_path_factory.mktemp("eval_runs")
    made = {}

    def get(name: str):
        if name not in made:
            result = launch(root / name, [*SMALL, *RUNS[name]], nproc=2)
            assert result.returncode == 0, result.stderr[-3000:]
            made[name] = result
        return made[name]

    return get


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A one-process run that evaluates and checkpoints every 4 steps (4 checkpoints kept, the
    best by val_loss: values that differ, where this short run's val_acc hardly moves)."""
    result = launch(tmp_path_factory.mktemp("eval_single") / "run",
                    [*SMALL, "train.eval_every_steps=4", "ckpt.every_steps=4", "ckpt.keep_last=10",
                     "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def evals_of(run_dir: Path) -> set[Path]:
    folder = run_dir / "evals"
    return set(folder.iterdir()) if folder.exists() else set()


def evaluate(run_dir: Path, *args: str, nproc: int = 0) -> tuple[subprocess.CompletedProcess, dict]:
    """`dtrain eval` as a single process (`--run DIR`) or under torchrun (`--run-dir DIR`:
    torchrun's own parser takes `--run` for its `--run-path`); the new evals/ file's content."""
    before = evals_of(run_dir)
    if nproc:
        command = [*torchrun_cmd(nproc), "-m", "dtrain", "eval", "--run-dir", str(run_dir), *args]
    else:
        command = [sys.executable, "-m", "dtrain", "eval", "--run", str(run_dir), *args]
    proc = forkserver.run(command, cwd=REPO, env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = evals_of(run_dir) - before
    assert len(new) == 1, new
    return proc, json.loads(new.pop().read_text())


def final_evaluation(run) -> dict:
    """The val_* metrics of the run's last evaluation, from metrics.jsonl."""
    last = [r for r in run.records() if "val_loss" in r][-1]
    return {k: v for k, v in last.items() if k.startswith("val_")}


def metrics_of(result: dict) -> dict:
    return {k: v for k, v in result.items() if k.startswith("val_")}


def model_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("_ema")}


def ema_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.endswith("_ema")}


def same_path(a, b) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


# -- the run's own data, at its world size and at another --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_at_the_runs_world_size_eval_gives_its_final_evaluation_exactly(runs, name) -> None:
    run = runs(name)
    checkpoint = latest(run.run_dir)
    fmt = "full" if name.endswith("full") else "sharded"
    assert json.loads((checkpoint / "COMPLETE").read_text())["format"] == fmt
    proc, result = evaluate(run.run_dir, nproc=2)
    assert metrics_of(result) == model_metrics(final_evaluation(run))
    assert set(metrics_of(result)) == {"val_loss", "val_acc"}
    assert same_path(result["checkpoint"], checkpoint)
    assert result["world_size"] == 2 and result["weights"] == "model"
    assert result["data"] == {"name": "synthetic", "val_size": 101, "val_samples": 101}
    # One line on stdout: the checkpoint, the metrics and where they were written.
    [line] = proc.stdout.strip().splitlines()
    assert line.startswith(checkpoint.name) and "val_loss" in line and "val_acc" in line
    assert str(run.run_dir / "evals") in line


@pytest.mark.slow
def test_a_two_rank_sharded_checkpoint_evaluates_in_one_process_to_the_same_metrics(runs) -> None:
    """Exactly the same, not only to float tolerance: every rank sums its samples' float32
    metrics in float64, which holds such sums exactly in any order (101 samples, values within
    a few powers of two), and on the CPU a sample's output does not depend on the others in its
    batch; so regrouping the samples into other batches and ranks changes no bit. (Kernels that
    pick another algorithm by batch size, as some GPU ones do, would differ by rounding.)"""
    run = runs("fsdp-sharded")
    _, result = evaluate(run.run_dir)
    assert metrics_of(result) == model_metrics(final_evaluation(run))
    assert result["world_size"] == 1
    # The checkpoint was DCP shards of 2 ranks, resharded for one process.
    marker = json.loads((latest(run.run_dir) / "COMPLETE").read_text())
    assert marker["world_size"] == 2 and marker["format"] == "sharded"


# -- other data ---------------------------------------------------------------------------------

def png_folder(root: Path, per_class_val: int, classes: int = 10, per_class_train: int = 2) -> Path:
    """root/{train,val}/<class>/<n>.png of the synthetic shapes (lossless), `classes` classes."""
    from test_images import image_folder
    image_folder(root, train=per_class_train, val=per_class_val, ext=".png")
    for split in ("train", "val"):
        for extra in sorted((root / split).iterdir())[classes:]:
            shutil.rmtree(extra)
    return root


def reference_metrics(checkpoint: Path, data_root: Path) -> dict:
    """val_loss and val_acc of the checkpoint's weights on the folder's validation images,
    computed here directly: one batch, plain cross-entropy and argmax."""
    import torch
    import torch.nn.functional as F

    from dtrain import config, data, models

    cfg = config.load(None, ["model.name=simple_cnn", "model.args={width: 8}",
                             "data.name=imagefolder", f"data.root={data_root}"])
    datasets = data.build(cfg.data, cfg.run.seed)
    model = models.build(cfg.model, datasets.info, cfg.run.seed)
    saved = torch.load(checkpoint / "checkpoint.pt", weights_only=True, map_location="cpu")
    model.load_state_dict(saved["model"])
    batch = data.collate([datasets.val[i] for i in range(len(datasets.val))])
    images, labels = data.to_device(batch, torch.device("cpu"), datasets.on_device)
    with torch.no_grad():
        logits = model.eval()(images)
    loss = F.cross_entropy(logits, labels, reduction="none").double().mean().item()
    acc = (logits.argmax(1) == labels).double().mean().item()
    return {"val_loss": loss, "val_acc": acc, "samples": len(labels)}


def test_eval_on_other_data_given_by_overrides(single, tmp_path) -> None:
    root = png_folder(tmp_path / "pngs", per_class_val=3)
    older = sorted((single.run_dir / "checkpoints").glob("step_000004-*"))[0]
    expected = reference_metrics(older, root)
    # A dataset of validation images alone: eval builds the validation split only.
    shutil.rmtree(root / "train")
    _, result = evaluate(single.run_dir, "--checkpoint", str(older), "data.name=imagefolder",
                         f"data.root={root}")
    assert expected["samples"] == 30
    assert result["data"] == {"name": "imagefolder", "root": str(root), "val_samples": 30}
    assert result["overrides"] == ["data.name=imagefolder", f"data.root={root}"]
    assert same_path(result["checkpoint"], older) and result["step"] == 4
    assert result["val_acc"] == expected["val_acc"]
    assert result["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-6)
    # Not the run's own validation set: its evaluation at step 4 had 101 other samples.
    own = [r for r in single.records() if r.get("step") == 4 and "val_loss" in r][0]
    assert result["val_loss"] != own["val_loss"]


def test_a_config_files_keys_go_over_the_runs_config(single, tmp_path) -> None:
    extra = tmp_path / "holdout.yaml"
    extra.write_text("data:\n  synthetic:\n    val_size: 37\n")
    _, result = evaluate(single.run_dir, "--config", str(extra), "data.eval_batch_size=5")
    assert result["data"] == {"name": "synthetic", "val_size": 37, "val_samples": 37}
    assert result["config"] == str(extra) and result["overrides"] == ["data.eval_batch_size=5"]
    assert result["val_loss"] != final_evaluation(single)["val_loss"]


def test_best_and_latest_pick_what_the_checkpoint_store_says(single) -> None:
    saved = [json.loads(m.read_text()) | {"path": m.parent}
             for m in (single.run_dir / "checkpoints").glob("*/COMPLETE")]
    assert len(saved) == 4 and all(s["metric"] == "val_loss" for s in saved)
    best = min(saved, key=lambda s: s["value"])
    assert best["step"] != 16  # not the latest: the test tells them apart
    _, result = evaluate(single.run_dir, "--checkpoint", "best")
    assert same_path(result["checkpoint"], best["path"]) and result["step"] == best["step"]
    assert result["val_loss"] == best["value"]
    _, result = evaluate(single.run_dir)  # latest
    assert same_path(result["checkpoint"], latest(single.run_dir)) and result["step"] == 16
    assert metrics_of(result) == final_evaluation(single)


# -- read-only, beside the training that holds the run directory -------------------------------

def snapshot(root: Path, skip: Path) -> dict[str, tuple]:
    """Every folder's listing and every file's size, modification time and content under `root`,
    but what lies under `skip`."""
    found: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        if Path(folder) == skip or skip in Path(folder).parents:
            continue
        found[folder] = tuple(sorted(d for d in dirs if Path(folder, d) != skip) + sorted(files))
        for name in files:
            path = os.path.join(folder, name)
            info = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            found[path] = (info.st_size, info.st_mtime_ns, digest)
    return found


def lock_is_held(run_dir: Path) -> bool:
    fd = os.open(run_dir / ".lock", os.O_RDONLY)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.slow
def test_eval_reads_only_while_the_training_holds_the_run_directory(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "busy"
    proc = start(run_dir, [*SMALL, "train.epochs=100", "ckpt.every_steps=4",
                           "train.eval_every_steps=4"], nproc=0)
    try:
        deadline = time.monotonic() + 120
        while saved_step(run_dir) < 4:
            assert proc.poll() is None, "the training ended early"
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.1)
        # The training stays alive, holding the lock, but writes nothing while it is stopped:
        # whatever changes in the run directory meanwhile is the evaluation's doing.
        kill_tree(proc.pid, signal.SIGSTOP)
        assert lock_is_held(run_dir)
        # What a training's start-up would clean up (an interrupted save's folder, a folder
        # without a marker): an evaluation leaves them be.
        (run_dir / "checkpoints" / ".tmp-step_000099-epoch_00").mkdir()
        shutil.copytree(latest(run_dir), run_dir / "checkpoints" / "unmarked")
        (run_dir / "checkpoints" / "unmarked" / "COMPLETE").unlink()
        # The run directory and its out_dir (runs.csv), all but evals/.
        before = snapshot(run_dir.parent, run_dir / "evals")
        assert str(run_dir / "metrics.jsonl") in before and str(run_dir / "config.yaml") in before
        _, result = evaluate(run_dir)
        assert snapshot(run_dir.parent, run_dir / "evals") == before
        assert lock_is_held(run_dir)
        assert [p.parent for p in evals_of(run_dir)] == [run_dir / "evals"]
        # The newest complete checkpoint, as the store orders them: the training may have been
        # stopped between a save's rename into place and its `latest` update.
        assert result["step"] == Store(str(run_dir)).complete()[0].step
    finally:
        kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- bad input ----------------------------------------------------------------------------------

def eval_in_process(capsys, run_dir: Path, *args: str) -> tuple[int, str]:
    """`dtrain eval --run DIR ARGS` through the CLI's own entry, in this process."""
    before = evals_of(run_dir)
    code = cli.main(["eval", "--run", str(run_dir), *args])
    _, err = capsys.readouterr()
    assert evals_of(run_dir) == before  # nothing written
    return code, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dtrain: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_checkpoint_that_does_not_exist_or_is_not_one_is_refused(single, tmp_path,
                                                                   capsys) -> None:
    run_dir = single.run_dir
    code, err = eval_in_process(capsys, run_dir, "--checkpoint", str(tmp_path / "nope"))
    assert code == 2
    assert error_line(err) == (f"dtrain: eval error: --checkpoint {tmp_path / 'nope'} not "
                               f"found; name a checkpoint folder (or its checkpoint.pt), latest "
                               f"or best")
    for not_one in (run_dir, run_dir / "config.yaml"):
        code, err = eval_in_process(capsys, run_dir, "--checkpoint", str(not_one))
        assert code == 2
        assert f"eval error: --checkpoint {not_one} is not a checkpoint" in error_line(err)
    # A checkpoint without its completion marker: resuming's own line.
    copy = tmp_path / "unfinished"
    shutil.copytree(latest(run_dir), copy)
    (copy / "COMPLETE").unlink()
    code, err = eval_in_process(capsys, run_dir, "--checkpoint", str(copy))
    assert code == 2
    assert error_line(err) == f"dtrain: checkpoint error: {copy} has no COMPLETE marker " \
                              f"(incomplete save)"
    # This run's checkpoints record val_loss: none has a value of val_acc to be best by.
    code, err = eval_in_process(capsys, run_dir, "--checkpoint", "best", "ckpt.monitor=val_acc",
                                "ckpt.monitor_mode=max")
    assert code == 2
    assert error_line(err) == (f"dtrain: eval error: --checkpoint best: no checkpoint in "
                               f"{run_dir / 'checkpoints'} records a value of ckpt.monitor "
                               f"val_acc; use --checkpoint latest or a PATH")
    code, err = eval_in_process(capsys, tmp_path)
    assert code == 2
    assert error_line(err) == (f"dtrain: eval error: --run-dir {tmp_path}: not a run directory (it "
                               f"has no config.yaml); name the folder a training run wrote")


def test_overrides_that_change_the_model_get_the_mismatch_line(single, tmp_path, capsys) -> None:
    run_dir = single.run_dir
    code, err = eval_in_process(capsys, run_dir, "model.args={width: 16}")
    assert code == 2
    assert error_line(err) == (
        f"dtrain: checkpoint error: {latest(run_dir)}: checkpoint is from a different model: "
        f"features.0.0.weight has shape [8, 3, 3, 3] there, [16, 3, 3, 3] here (13 such key(s))")
    # Data of 3 classes (enough training images for a step): the model built for it has
    # another head.
    root = png_folder(tmp_path / "three", per_class_val=1, classes=3, per_class_train=6)
    code, err = eval_in_process(capsys, run_dir, "data.name=imagefolder", f"data.root={root}")
    assert code == 2
    line = error_line(err)
    assert line.startswith(f"dtrain: checkpoint error: {latest(run_dir)}: checkpoint is from a "
                           f"different model: ")
    assert "has shape [10] there, [3] here" in line


def test_ema_weights_of_a_run_without_them_are_refused(single, capsys) -> None:
    code, err = eval_in_process(capsys, single.run_dir, "--weights", "ema")
    assert code == 2
    assert error_line(err) == (f"dtrain: eval error: {latest(single.run_dir)} was saved without "
                               f"EMA weights (train.ema.decay unset); use --weights model")


# -- EMA weights --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("name", "nproc"), [("fsdp-sharded", 2), ("fsdp-sharded", 0),
                                             ("ddp-full", 0)])
def test_ema_weights_evaluate_to_the_runs_own_ema_metrics(runs, name, nproc) -> None:
    """--weights ema: the run's last evaluation of its average, exactly, under the names
    metrics.jsonl gives it; in one process too (the same reasoning as for the model's)."""
    run = runs(name)
    expected = ema_metrics(final_evaluation(run))
    assert set(expected) == {"val_loss_ema", "val_acc_ema"}
    assert expected["val_loss_ema"] != final_evaluation(run)["val_loss"]  # not the weights'
    proc, result = evaluate(run.run_dir, "--weights", "ema", nproc=nproc)
    assert metrics_of(result) == expected
    assert result["weights"] == "ema" and result["world_size"] == max(nproc, 1)
    assert "val_loss_ema" in proc.stdout


def test_on_a_read_only_run_directory_the_metrics_are_shown_and_the_failure_is_one_line(
        single, tmpfs) -> None:
    disk = tmpfs("size=64m")
    run_dir = disk / "run"
    shutil.copytree(single.run_dir, run_dir)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    proc = forkserver.run([sys.executable, "-m", "dtrain", "eval", "--run-dir", str(run_dir)],
                          cwd=REPO, env=child_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    expected = final_evaluation(single)
    [line] = proc.stdout.strip().splitlines()
    assert line.endswith("-> not saved") and f"val_loss {expected['val_loss']:.6g}" in line
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dtrain: eval error: cannot write into {run_dir / 'evals'} (Read-only file system); "
        f"nothing there was changed: free space or make it writable")
    assert "Traceback" not in proc.stderr

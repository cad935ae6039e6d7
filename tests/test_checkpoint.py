"""Checkpoints: kill at any moment and resume exactly; never load a half-written or corrupt one."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import (Result, final_weights, kill_then_resume, kill_when, latest, launch,
                      saved_step, start)
from dtrain import cli

STEPS = 24
SLOW = ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.03}",
        "data.synthetic.train_size=1024", f"train.max_steps={STEPS}", "ckpt.every_steps=6",
        "ckpt.keep_last=10"]


def checkpoints(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []


def assert_identical(straight, resumed_dir: Path) -> None:
    resumed_losses = {r["step"]: r["loss"] for r in
                      (json.loads(l) for l in (resumed_dir / "metrics.jsonl").read_text().splitlines())
                      if "loss" in r}
    assert resumed_losses == straight.losses()  # bitwise: the same floats, every step
    a, b = final_weights(straight.run_dir), final_weights(resumed_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory) -> dict:
    """Uninterrupted 2-rank runs, one per mode, with no loader workers. The killed runs below
    must reproduce them exactly, also with 2 loader workers: the order and the augmentation of
    the data do not depend on the number of workers."""
    runs = {}
    for mode in ("ddp", "fsdp"):
        run_dir = tmp_path_factory.mktemp(mode) / "runs" / "straight"
        runs[mode] = launch(run_dir, [*SLOW, f"parallel.mode={mode}", "data.num_workers=0"], nproc=2)
        assert runs[mode].returncode == 0, runs[mode].stderr[-3000:]
    return runs


KILLED_IN_SAVE = [*SLOW, "parallel.mode=ddp", "data.num_workers=0"]


@pytest.fixture(scope="module")
def killed_during_a_save(tmp_path_factory) -> tuple[Path, int, Result]:
    """The 2-rank DDP run without loader workers (the config of straight_runs["ddp"]) SIGKILLed
    inside its save of step 12, once step 6 is saved, then the same command again: the run
    directory, the step of its newest complete checkpoint when killed, and the relaunch. It is
    the kill during a save below, and the [ddp-0] case of the mid-epoch kill (a kill inside a save
    is one mid-epoch moment; the other three cases kill wherever the run is after step 6)."""
    base = tmp_path_factory.mktemp("save_killed")
    run_dir = base / "runs" / "killed"
    flag = base / "pause"
    proc = start(run_dir, KILLED_IN_SAVE, nproc=2, env={"PAUSE_SAVE_FILE": str(flag)})
    # Once step 6 is saved, make the next save (step 12) hang inside, then kill it there.
    kill_when(proc, lambda: saved_step(run_dir) == 6 and (flag.touch() or True)
              and any(n.startswith(".tmp-step_000012") for n in os.listdir(run_dir / "checkpoints")))
    flag.unlink()
    killed_at = saved_step(run_dir)
    return run_dir, killed_at, launch(run_dir, KILLED_IN_SAVE, nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode,workers", [("ddp", 0), ("ddp", 2), ("fsdp", 0), ("fsdp", 2)])
def test_sigkill_mid_epoch_then_same_command_continues_bit_exactly(straight_runs, request,
                                                                   tmp_path, mode, workers) -> None:
    overrides = [*SLOW, f"parallel.mode={mode}", f"data.num_workers={workers}"]
    straight = straight_runs[mode]
    if overrides == KILLED_IN_SAVE:  # [ddp-0]: the run killed inside a save is this case's run
        run_dir, killed_at, resumed = request.getfixturevalue("killed_during_a_save")
    else:
        run_dir = tmp_path / "runs" / "killed"
        killed_at, resumed = kill_then_resume(run_dir, overrides, at_step=6)
    assert killed_at < STEPS
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_line = [l for l in (run_dir / "log.txt").read_text().splitlines() if "resumed from" in l][0]
    assert f"step_{killed_at:06d}" in resumed_line
    assert_identical(straight, run_dir)


@pytest.mark.slow
def test_kill_during_a_save_keeps_the_previous_checkpoint(straight_runs,
                                                          killed_during_a_save) -> None:
    straight = straight_runs["ddp"]
    run_dir, killed_at, resumed = killed_during_a_save
    assert killed_at == 6
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run_dir / "log.txt").read_text()
    assert "removing incomplete checkpoint" in log and ".tmp-step_000012" in log
    assert "resumed from" in log and "step_000006" in log
    assert not any(n.startswith(".tmp") for n in os.listdir(run_dir / "checkpoints"))
    assert_identical(straight, run_dir)


# -- single-process checks of what is on disk ---------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished single-process run with checkpoints at steps 4, 8 and 12 (epoch end 16)."""
    run_dir = tmp_path_factory.mktemp("finished") / "runs" / "run"
    result = launch(run_dir, ["train.max_steps=12", "ckpt.every_steps=4", "train.eval_every_steps=8",
                              "ckpt.keep_last=5"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage", ["truncated", "zero_bytes", "random_bytes", "no_marker"])
def test_damaged_newest_checkpoint_falls_back_to_previous(finished, tmp_path, damage) -> None:
    run_dir = copy_run(finished, tmp_path / "runs" / "run")
    newest = latest(run_dir)
    assert newest.name.startswith("step_000012")
    target = newest / "checkpoint.pt"
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:1000])
    elif damage == "zero_bytes":
        target.write_bytes(b"")
    elif damage == "random_bytes":
        target.write_bytes(os.urandom(target.stat().st_size))
    else:
        (newest / "COMPLETE").unlink()
    result = launch(run_dir, ["train.max_steps=16", "ckpt.every_steps=4", "train.eval_every_steps=8",
                              "ckpt.keep_last=5", "ckpt.resume_config_change=allow"])
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "log.txt").read_text()
    if damage == "no_marker":  # moved aside, never deleted: it may be all there is
        assert "no COMPLETE marker that can be trusted (damaged or missing): moved " \
               f"{newest.name} aside" in log
        [aside] = (run_dir / "superseded").iterdir()
        assert (aside / "checkpoints" / newest.name / "checkpoint.pt").exists()
    else:
        assert newest.name in log and "unusable" in log
    assert "resumed from" in log and "step_000008" in log.split("resumed from")[1].splitlines()[0]
    # it re-did steps 9..16 from step 8: the records after 8 are the new attempt's
    steps = [r["step"] for r in result.records() if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 16


def test_rotation_keeps_last_and_best(finished) -> None:
    names = checkpoints(finished)
    assert [n.split("-")[0] for n in names] == ["step_000004", "step_000008", "step_000012"]
    assert any("val_acc_" in n for n in names if n.startswith("step_000008"))  # evaluated at step 8


def test_rotation_deletes_beyond_keep_last_but_keeps_best(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "rot"
    result = launch(run_dir, ["train.max_steps=12", "ckpt.every_steps=2", "train.eval_every_steps=4",
                              "ckpt.keep_last=2", "ckpt.keep_best=1", "ckpt.monitor=val_loss",
                              "ckpt.monitor_mode=min"])
    assert result.returncode == 0, result.stderr[-3000:]
    evals = {r["step"]: r["val_loss"] for r in result.evals()}
    best_step = min((s for s in evals if s % 2 == 0), key=lambda s: evals[s])
    kept = {int(n.split("-")[0][5:]) for n in checkpoints(run_dir)}
    assert kept == {10, 12} | {best_step}


def test_explicit_missing_or_corrupt_checkpoint_is_exit_2(finished, tmp_path) -> None:
    result = launch(tmp_path / "runs" / "x", ["ckpt.resume=/nonexistent/step_1"])
    assert result.returncode == 2
    assert "ckpt.resume: /nonexistent/step_1 not found" in result.stderr
    assert "Traceback" not in result.stderr
    broken = copy_run(finished, tmp_path / "runs" / "broken")
    newest = latest(broken)
    (newest / "checkpoint.pt").write_bytes(b"garbage")
    result = launch(tmp_path / "runs" / "y", [f"ckpt.resume={newest}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "checkpoint.pt has 7 bytes" in result.stderr


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path) -> None:
    pwned = tmp_path / "pwned"
    folder = tmp_path / "evil" / "step_000001-epoch_00"
    folder.mkdir(parents=True)
    with open(folder / "checkpoint.pt", "wb") as f:
        pickle.dump({"model": _RunsCode(str(pwned))}, f)
    marker = {"step": 1, "epoch": 0, "format": "full", "world_size": 1,
              "files": {"checkpoint.pt": (folder / "checkpoint.pt").stat().st_size}}
    (folder / "COMPLETE").write_text(json.dumps(marker))
    result = launch(tmp_path / "runs" / "victim", [f"ckpt.resume={folder}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "checkpoint error" in result.stderr and "Traceback" not in result.stderr
    assert not pwned.exists()


def test_async_save_writes_the_same_checkpoint_as_a_synchronous_one(finished, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "async"
    result = launch(run_dir, ["train.max_steps=12", "ckpt.every_steps=4", "train.eval_every_steps=8",
                              "ckpt.keep_last=5", "ckpt.async=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert checkpoints(run_dir) == checkpoints(finished)
    for name in checkpoints(run_dir):
        a = torch.load(run_dir / "checkpoints" / name / "checkpoint.pt", weights_only=True)
        b = torch.load(finished / "checkpoints" / name / "checkpoint.pt", weights_only=True)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key])
        assert a["train_state"] == b["train_state"]


# -- world-size changes of sharded checkpoints ---------------------------------------------------

def served(folder: Path) -> list[int]:
    return [int(line) for f in sorted(folder.glob("rank*.txt")) for line in f.read_text().split()]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_another_world_size(tmp_path, before, after) -> None:
    first, second = tmp_path / "served1", tmp_path / "served2"
    first.mkdir(), second.mkdir()
    # 512 samples, batch 16: each sample of epoch 0 must be served exactly once over both attempts.
    common = ["data.name=user_code:served_synthetic", "parallel.mode=fsdp", "ckpt.format=sharded",
              "data.batch_size=16", "ckpt.every_epochs=0"]
    run_dir = tmp_path / "runs" / "resize"
    a = launch(run_dir, [*common, "train.max_steps=8"], nproc=before, env={"SERVED_DIR": str(first)})
    assert a.returncode == 0, a.stderr[-3000:]
    assert (latest(run_dir) / "dcp").is_dir()
    steps_left = (512 - 8 * 16 * before) // (16 * after)
    b = launch(run_dir, [*common, "ckpt.resume_config_change=allow"], nproc=after,
               env={"SERVED_DIR": str(second)})
    assert b.returncode == 0, b.stderr[-3000:]
    log = (run_dir / "log.txt").read_text()
    assert f"world size changed from {before} to {after}" in log
    assert sorted(served(first) + served(second)) == list(range(512))
    steps = [r["step"] for r in b.records() if "loss" in r]
    assert steps[-1] == 8 + steps_left


def test_export_round_trip(finished, tmp_path, capsys) -> None:
    from dtrain.models import SimpleCNN
    ckpt = latest(finished)
    for fmt in ("state_dict", "torchscript", "exported"):
        out = tmp_path / f"model.{fmt}"
        # `dtrain export` through the CLI's own entry, in this process (no torch start-up)
        code = cli.main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--format", fmt])
        stdout, stderr = capsys.readouterr()
        assert code == 0, stderr[-3000:]
        assert "outputs match the checkpoint" in stdout
    weights = torch.load(tmp_path / "model.state_dict", weights_only=True)
    saved = torch.load(ckpt / "checkpoint.pt", weights_only=True)["model"]
    assert weights.keys() == saved.keys()
    model = SimpleCNN(num_classes=10, in_channels=3, width=8)
    model.load_state_dict(weights)  # plain PyTorch, no dtrain needed
    scripted = torch.jit.load(str(tmp_path / "model.torchscript"))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(scripted(x), model.eval()(x))
    # torch.export's own loader reads the program, whose JSON records dtrain deflates.
    program = torch.export.load(str(tmp_path / "model.exported"))
    assert all(torch.equal(program.state_dict[k], v) for k, v in weights.items())
    assert_deflated_graph(tmp_path / "model.exported")


def assert_deflated_graph(path: Path) -> None:
    """A .pt2 archive dtrain wrote: its JSON records (the graph among them) deflated, its
    tensors stored as torch writes them; nothing of the writing left beside it."""
    assert not list(path.parent.glob(".*.part")), list(path.parent.iterdir())
    with zipfile.ZipFile(path) as archive:
        kinds = {entry.filename: entry.compress_type for entry in archive.infolist()}
    assert any(name.endswith("models/model.json") for name in kinds), sorted(kinds)
    assert all((kind == zipfile.ZIP_DEFLATED) == name.endswith(".json")
               for name, kind in kinds.items()), kinds


# -- a relaunch with another model: refused, the run as it was ----------------------------------

def files_of(out_dir: Path) -> dict[str, str]:
    """Every file of `out_dir` (its runs.csv, each run's checkpoints, records, config.yaml)
    by its digest; what each launch writes of itself (its log, the holder in the lock) left out."""
    import hashlib
    return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.rglob("*"))
            if p.is_file() and not p.name.startswith("log") and p.name != ".lock"}


USER_CNN = ["model.name=user_code:cnn_of_this_code", "model.args={}", "train.max_steps=4",
            "ckpt.every_steps=2", "train.eval_every_steps=4"]


@pytest.fixture(scope="module")
def finished_user_cnn(tmp_path_factory) -> Path:
    """A finished run of a user's model (`tests/user_code.py`) built without model.args."""
    run_dir = tmp_path_factory.mktemp("user_cnn") / "runs" / "run"
    result = launch(run_dir, USER_CNN)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


GPT = ["task.name=language_model", "model.name=gpt", "model.args={dim: 32, depth: 2, heads: 2}",
       "data.name=text", "data.text.corpus=python_docs", "data.text.seq_len=32",
       "data.batch_size=8", "optim.name=adamw", "optim.lr=0.003", "ckpt.monitor=val_loss",
       "ckpt.monitor_mode=min", "train.eval_every_epochs=0", "train.max_steps=2"]


@pytest.fixture(scope="module")
def finished_gpt(tmp_path_factory) -> Path:
    """A finished full training of the built-in gpt."""
    run_dir = tmp_path_factory.mktemp("gpt") / "runs" / "run"
    result = launch(run_dir, GPT)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


FINISHED = ["train.max_steps=12", "ckpt.every_steps=4", "train.eval_every_steps=8", "ckpt.keep_last=5"]


@pytest.mark.parametrize("base,overrides,env,expected", [
    # The built-in CNN made wider: its weights do not fit, and the line says which key did it.
    ("finished", [*FINISHED, "model.args={width: 32}"], None,
     ["checkpoint is from a different model: features.0.0.weight has shape [8, 3, 3, 3] there, "
      "[32, 3, 3, 3] here", "the config changed: model.args.width: 8 -> 32",
      "start anew with another run.name"]),
    # A model.args entry the first launch did not have: a key on one side only is a change.
    ("user", [*USER_CNN, "model.args={width: 8}"], None,
     ["trains something else (model.args.width: absent -> 8)", "ckpt.resume_config_change=allow"]),
    ("user", [*USER_CNN, "model.args={width: 16}"], None,
     ["checkpoint is from a different model", "the config changed: model.args.width: absent -> 16"]),
    # Allowing config changes does not make another model's weights fit.
    ("user", [*USER_CNN, "model.args={width: 16}", "ckpt.resume_config_change=allow"], None,
     ["checkpoint is from a different model", "the config changed: model.args.width: absent -> 16"]),
    # LoRA switched on: a checkpoint of the whole model is not one of adapters.
    ("gpt", [*GPT, "model.lora.r=8"], None,
     ["checkpoint is from a different model", "the config changed: model.lora.r: None -> 8"]),
    # The model's code changed between the launches, its config did not.
    ("user", USER_CNN, {"CNN_EXTRA_LAYER": "1"},
     ["checkpoint is from a different model: 2 key(s) missing (e.g. ['extra.bias', 'extra.weight'])",
      "(its code changed, not the config)", "start anew with another run.name"]),
], ids=["wider_builtin", "new_args_entry", "new_args_entry_misfit", "misfit_allowed", "lora_on",
                         "code_changed"])
def test_a_changed_model_is_refused_and_the_run_kept_as_it_was(request, tmp_path, base, overrides,
                                                                env, expected) -> None:
    source = request.getfixturevalue({"user": "finished_user_cnn", "gpt": "finished_gpt"}.get(base, base))
    run_dir = copy_run(source, tmp_path / "runs" / "run")
    (tmp_path / "runs" / "runs.csv").write_bytes((source.parent / "runs.csv").read_bytes())
    before = files_of(tmp_path / "runs")
    result = launch(run_dir, overrides, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"dtrain: checkpoint error: {latest(run_dir)}"), line
    for part in expected:
        assert part in line, line
    assert "unusable" not in result.stderr and "Traceback" not in result.stderr
    assert files_of(tmp_path / "runs") == before  # nothing moved, rewritten or added
    assert not (run_dir / "superseded").exists()


@pytest.mark.parametrize("saved,current,expected", [
    # An entry of a free-form section on one side only (data.hf.columns maps names).
    ({"data": {"hf": {"columns": {}}}}, {"data": {"hf": {"columns": {"text": "body"}}}},
     ["data.hf.columns.text: absent -> 'body'"]),
    # A section the saved config lacks (written before it existed) counts at its default ...
    ({"model": {"name": "gpt"}}, {"model": {"name": "gpt", "lora": {"r": 8, "alpha": 16.0}}},
     ["model.lora.r: None -> 8"]),
    # ... so that a section left at its default is no change.
    ({"model": {"name": "gpt"}}, {"model": {"name": "gpt", "lora": {"r": None}}}, []),
], ids=["free_form_entry", "section_switched_on", "section_at_default"])
def test_a_key_on_one_side_only_is_a_training_difference(saved, current, expected) -> None:
    from dtrain.files.resume_policy import training_differences
    assert training_differences(saved, current) == expected

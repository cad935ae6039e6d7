"""`dtrain convert`: sharded (DCP) checkpoints to one file and back, written as safely as a save,
and resuming training bitwise like the original."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dtrain, latest, launch

from dtrain import cli
from dtrain.checkpoint import state as ckpt_state
from dtrain.commands.convert import _first_difference, read_checkpoint


def step_folder(run_dir: Path, step: int) -> Path:
    return next((run_dir / "checkpoints").glob(f"step_{step:06d}-*"))


def convert(capsys, *args: str) -> tuple[int, str, str]:
    """`dtrain convert ARGS` through the CLI's own entry (in this process: no torch start-up)."""
    code = cli.main(["convert", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def marker(folder: Path) -> dict:
    return json.loads((folder / "COMPLETE").read_text())


def differences(a: dict, b: dict, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Where two checkpoints' contents differ, key by key (bitwise for tensors)."""
    found = {}
    for key in sorted(a.keys() | b.keys()):
        if key in skip:
            continue
        where = _first_difference(a.get(key), b.get(key), key)
        if where is not None:
            found[key] = where
    return found


# -- one small single-process checkpoint, for formats, safety and bad input ---------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "runs" / "single"
    result = launch(run_dir, ["train.max_steps=2", "ckpt.every_steps=2", "ckpt.every_epochs=0",
                              "ckpt.format=sharded", "parallel.mode=none",
                              "data.synthetic.train_size=64", "data.synthetic.val_size=16"])
    assert result.returncode == 0, result.stderr[-3000:]
    return latest(run_dir)


def test_round_trip_keeps_every_value_and_writes_what_a_save_writes(sharded, tmp_path,
                                                                    capsys) -> None:
    full, back = tmp_path / "full", tmp_path / "out" / "sharded"
    code, out, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out", full)
    assert code == 0, err
    assert "read back and equal to the source" in out
    assert sorted(os.listdir(full)) == ["COMPLETE", "checkpoint.pt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    code, out, err = convert(capsys, "--checkpoint", full, "--to", "sharded", "--out", back)
    assert code == 0, err
    assert sorted(os.listdir(back)) == ["COMPLETE", "dcp", "meta.pt"]

    source, one_file = read_checkpoint(str(sharded))[2], torch.load(full / "checkpoint.pt",
                                                                    weights_only=True)
    # A full save's layout: the metadata first, then the model and optimizer, by parameter name.
    assert list(one_file)[-2:] == ["model", "optimizer"]
    assert one_file["format"] == "full" and source["format"] == "sharded"
    assert differences(source, one_file, skip=("format",)) == {}
    assert set(one_file["optimizer"]["state"]) <= set(one_file["model"])
    again = read_checkpoint(str(back))[2]
    assert differences(source, again) == {}
    # The meta.pt and the DCP keys of a sharded save.
    assert torch.load(back / "meta.pt", weights_only=True).keys() == \
        torch.load(sharded / "meta.pt", weights_only=True).keys()
    saved_keys = ckpt_state.safe_reader(str(sharded)).read_metadata().state_dict_metadata.keys()
    new_keys = ckpt_state.safe_reader(str(back)).read_metadata().state_dict_metadata.keys()
    assert new_keys == saved_keys

    # The markers: the source's step, epoch and save number; files, digests and seal anew.
    src, made = marker(sharded), marker(full)
    assert {k: made[k] for k in ("step", "epoch", "seq", "world_size")} == \
        {k: src[k] for k in ("step", "epoch", "seq", "world_size")}
    assert made["format"] == "full" and made["files"].keys() == made["digests"].keys() == \
        {"checkpoint.pt"}
    checked = dtrain("verify", "--checkpoint", str(back))
    assert checked.returncode == 0 and checked.stdout.startswith("intact"), checked.stdout

    # Both load where a checkpoint is named: `dtrain export` gets the same model from each.
    from dtrain.commands.export.command import load_model
    weights = load_model(str(sharded))[0].state_dict()
    for folder in (full, back):
        other = load_model(str(folder))[0].state_dict()
        assert all(torch.equal(weights[k], other[k]) for k in weights)


def test_out_that_exists_is_refused_and_left_alone(sharded, tmp_path, capsys) -> None:
    ok = tmp_path / "converted"
    assert convert(capsys, "--checkpoint", sharded, "--to", "full", "--out", ok)[0] == 0
    before = (ok / "checkpoint.pt").read_bytes()
    empty, file = tmp_path / "empty", tmp_path / "file.pt"
    empty.mkdir()
    file.write_bytes(b"keep me")
    for out, what in [(ok, "a checkpoint"), (sharded, "a checkpoint"), (empty, "a folder"),
                      (file, "a file")]:
        code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out", out)
        assert code == 2
        assert err.count("\n") == 1 and f"--out {out} already exists ({what})" in err, err
    assert (ok / "checkpoint.pt").read_bytes() == before
    assert list(empty.iterdir()) == [] and file.read_bytes() == b"keep me"
    assert sorted(os.listdir(sharded)) == ["COMPLETE", "dcp", "meta.pt"]
    code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out",
                           sharded / "inside")
    assert code == 2 and "inside the source checkpoint" in err
    assert sorted(os.listdir(tmp_path)) == ["converted", "empty", "file.pt"]


def test_out_on_a_read_only_place_is_one_line(sharded, capsys, tmpfs) -> None:
    place = tmpfs("ro,size=64k", "read_only")
    code, out, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out",
                             place / "full")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"dtrain: convert error: cannot write into {place} (Read-only file system); nothing "
        f"there was changed: free space or choose another --out"]


def test_a_source_that_is_no_checkpoint_is_refused(sharded, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    half = tmp_path / "half"
    shutil.copytree(sharded, half)
    (half / "COMPLETE").unlink()
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    weights = tmp_path / "weights.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, weights)
    cases = [
        (tmp_path / "missing", "not found"),
        (half, "is not a checkpoint (no COMPLETE marker"),
        (sharded.parent.parent, "is a run directory; name one of its checkpoints"),
        (junk, "is corrupt or not a checkpoint"),
        (weights, "is not a dtrain checkpoint (it has no 'train_state')"),
    ]
    for source, says in cases:
        code, _, err = convert(capsys, "--checkpoint", source, "--to", "full", "--out", out)
        assert code == 2, (source, err)
        assert err.count("\n") == 1 and says in err, err
    code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "fp16", "--out", out)
    assert code == 2 and err.count("\n") == 1
    assert "--to fp16: unknown format; use --to full" in err
    code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "sharded", "--out", out)
    assert code == 2 and "already a sharded checkpoint" in err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["half", "junk.pt", "weights.pt"]


def test_a_damaged_source_is_refused_and_nothing_is_written(sharded, tmp_path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    shard = copy / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: the file still parses
    shard.write_bytes(bytes(data))
    code, _, err = convert(capsys, "--checkpoint", copy, "--to", "full", "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1
    assert "dcp/__0_0.distcp is damaged" in err, err
    assert sorted(os.listdir(tmp_path)) == ["copy"]


def test_a_conversion_that_reads_back_differently_publishes_nothing(sharded, tmp_path, capsys,
                                                                     monkeypatch) -> None:
    from dtrain.commands import convert as module
    real = module.read_checkpoint

    def altered(path: str):  # the read-back of the new files (the source is read first)
        folder, fmt, data = real(path)
        if os.path.basename(path).startswith(".tmp-"):
            data["model"] = {k: v + 1 for k, v in data["model"].items()}
        return folder, fmt, data

    monkeypatch.setattr(module, "read_checkpoint", altered)
    code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out",
                           tmp_path / "out")
    assert code == 1 and "differs from its source at model." in err, err
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(sharded, tmp_path, capsys,
                                                    monkeypatch) -> None:
    from dtrain.commands import convert as module

    def full_disk(obj, path: str) -> str:
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.ckpt_state, "torch_save", full_disk)
    code, _, err = convert(capsys, "--checkpoint", sharded, "--to", "full", "--out",
                           tmp_path / "out")
    assert code == 1 and err.count("\n") == 1
    assert "convert error: disk full while saving out" in err and "was not made" in err, err
    assert os.listdir(tmp_path) == []


def test_help_exits_zero(capsys) -> None:
    assert cli.main(["convert", "--help"]) == 0
    assert "--to FORMAT" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert "    convert " in capsys.readouterr().out  # the top level lists it


# -- a converted checkpoint resumes training bitwise like the original --------------------------

STEPS, AT = 8, 4
# With EMA weights: a part of the checkpoint that is sharded like the model, converted alike.
RUN = ["train.max_steps=8", "ckpt.every_steps=4", "ckpt.every_epochs=0", "ckpt.keep_last=5",
       "train.ema.decay=0.9"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, object]:
    """Uninterrupted 2-rank runs to step 8, saving at 4 and 8: FSDP sharded, FSDP full (the
    same training: its checkpoints are what a full save of it writes), DDP full."""
    base = tmp_path_factory.mktemp("straight")
    runs = {}
    for name, mode, fmt in [("fsdp_sharded", "fsdp", "sharded"), ("fsdp_full", "fsdp", "full"),
                            ("ddp_full", "ddp", "full")]:
        result = launch(base / "runs" / name,
                        [*RUN, f"parallel.mode={mode}", f"ckpt.format={fmt}"], nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = result
    return runs


def steps_after(result, step: int) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in result.records()
            if "loss" in r and r["step"] > step}


def resume_converted(tmp_path: Path, capsys, original, mode: str,
                     to: str) -> tuple[Path, object]:
    """Convert the original's step-4 checkpoint, then resume it in a new run directory with the
    same config but the converted format."""
    converted = tmp_path / "converted" / f"step4-{to}"
    code, _, err = convert(capsys, "--checkpoint", step_folder(original.run_dir, AT), "--to", to,
                           "--out", converted)
    assert code == 0, err[-3000:]
    resumed = launch(tmp_path / "runs" / "resumed",
                     [*RUN, f"parallel.mode={mode}", f"ckpt.format={to}",
                      f"ckpt.resume={converted}"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {converted} (step {AT}" in resumed.stderr
    return converted, resumed


def assert_continues_like(original, resumed) -> None:
    """The same losses, gradient norms and learning rates at every step after 4, bitwise, and
    the same final checkpoint: weights, optimizer state, random states, position."""
    assert steps_after(resumed, AT) == steps_after(original, AT)
    assert len(steps_after(resumed, AT)) == STEPS - AT
    a = read_checkpoint(str(latest(original.run_dir)))[2]
    b = read_checkpoint(str(latest(resumed.run_dir)))[2]
    assert a["train_state"]["step"] == STEPS and a["ema"].keys() == a["model"].keys() - {
        k for k in a["model"] if "running" in k or "num_batches" in k}
    assert differences(a, b, skip=("format", "config", "versions")) == {}


@pytest.mark.slow
def test_sharded_to_full_is_what_a_full_save_writes(straight, tmp_path, capsys) -> None:
    full = tmp_path / "full"
    source = step_folder(straight["fsdp_sharded"].run_dir, AT)
    assert convert(capsys, "--checkpoint", source, "--to", "full", "--out", full)[0] == 0
    made = torch.load(full / "checkpoint.pt", weights_only=True)
    saved = torch.load(step_folder(straight["fsdp_full"].run_dir, AT) / "checkpoint.pt",
                       weights_only=True)
    assert list(made) == list(saved)
    assert list(made)[-3:] == ["model", "optimizer", "ema"]
    assert list(made["optimizer"]["state"]) == list(saved["optimizer"]["state"])
    # Bitwise the same file content, but for the names of the two runs' folders and formats.
    assert differences(made, saved, skip=("config",)) == {}
    assert differences(made["config"], saved["config"]) == {"run": "run.name",
                                                            "ckpt": "ckpt.format"}


@pytest.mark.slow
def test_fsdp_sharded_converted_to_full_resumes_bitwise(straight, tmp_path, capsys) -> None:
    original = straight["fsdp_sharded"]
    _, resumed = resume_converted(tmp_path, capsys, original, "fsdp", "full")
    assert (latest(resumed.run_dir) / "checkpoint.pt").is_file()
    assert_continues_like(original, resumed)


@pytest.mark.slow
def test_ddp_full_converted_to_sharded_resumes_bitwise(straight, tmp_path, capsys) -> None:
    original = straight["ddp_full"]
    converted, resumed = resume_converted(tmp_path, capsys, original, "ddp", "sharded")
    assert sorted(os.listdir(converted / "dcp")) == [".metadata", "__0_0.distcp"]
    assert (latest(resumed.run_dir) / "dcp").is_dir()
    assert_continues_like(original, resumed)

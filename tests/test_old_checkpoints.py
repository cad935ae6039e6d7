"""Checkpoints written before the code was laid out in packages still resume and export.

tests/fixtures/before_layers holds two tiny run directories written by dtrain as it was before
the move (a full checkpoint of one process, a sharded one of a 2-rank FSDP run, both at step 4)
and the losses that code recorded when it resumed each to step 6. Today's code must resume them to
the same losses and export their weights unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TESTS, launch
from dtrain import cli

FIXTURES = Path(TESTS) / "fixtures" / "before_layers"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())["resumed_to_step_6_losses"]
safetensors_torch = pytest.importorskip("safetensors.torch")


def _copy(name: str, tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / name
    shutil.copytree(FIXTURES / name, run_dir)
    return run_dir


def _checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def _exported(checkpoint: Path, tmp_path: Path, capsys) -> dict:
    """`dtrain export --format safetensors` of `checkpoint`, read back (through the CLI's own
    entry, in this process: no torch start-up)."""
    out = tmp_path / "w"
    code = cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(out),
                     "--format", "safetensors"])
    assert code == 0, capsys.readouterr().err[-3000:]
    return safetensors_torch.load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("name, nproc", [("full", 0), ("sharded", 2)])
def test_an_old_checkpoint_resumes_to_the_losses_the_old_code_recorded(name, nproc, tmp_path):
    run_dir = _copy(name, tmp_path)
    result = launch(run_dir, ["train.max_steps=6"], nproc=nproc,
                    config=str(run_dir / "config.yaml"), tiny=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resum" in result.output.lower()
    steps = [r["step"] for r in result.records() if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # the old records kept, nothing repeated, nothing missing
    losses = result.losses()
    for step, loss in EXPECTED[name].items():
        assert losses[int(step)] == pytest.approx(loss, rel=1e-6, abs=1e-7), step


def test_an_old_full_checkpoint_exports_its_weights_unchanged(tmp_path, capsys):
    checkpoint = _checkpoint(FIXTURES / "full")
    exported = _exported(checkpoint, tmp_path, capsys)
    saved = torch.load(checkpoint / "checkpoint.pt", weights_only=True)["model"]
    assert sorted(exported) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(exported[key], value), key


def test_an_old_sharded_checkpoint_exports_the_weights_its_shards_hold(tmp_path, capsys):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = _checkpoint(FIXTURES / "sharded")
    exported = _exported(checkpoint, tmp_path, capsys)
    # torch's own conversion of the shards, independent of dtrain's reader
    dcp_to_torch_save(str(checkpoint / "dcp"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    assert sorted(exported) == sorted(whole)
    for key, value in whole.items():
        assert torch.equal(exported[key], value), key

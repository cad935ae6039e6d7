"""train.overfit_batches=K: the same K batches every epoch, augmentation off, loss towards 0."""

from __future__ import annotations

from pathlib import Path

from conftest import launch


def test_overfit_batches_drive_the_training_loss_to_zero(run_dir: Path) -> None:
    epochs = 100
    result = launch(run_dir, ["train.overfit_batches=2", f"train.epochs={epochs}",
                              "train.eval_every_epochs=0", "ckpt.every_epochs=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "overfit check: the same 2 batch(es) per rank every epoch" in result.stderr
    train = [r for r in result.records() if "loss" in r]
    # two steps per epoch: the epoch is the two fixed batches, not the 512-sample set
    assert [r["step"] for r in train] == list(range(1, 2 * epochs + 1))
    assert {r["epoch"] for r in train if r["step"] in (199, 200)} == {epochs - 1}
    assert train[0]["loss"] > 2.0  # ten classes: ln 10 at the start
    assert max(r["loss"] for r in train[-10:]) < 0.05

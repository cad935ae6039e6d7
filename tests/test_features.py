"""Per-block torch.compile and channels_last train the same model to the same numbers."""

from __future__ import annotations

import pytest

from conftest import launch

STEPS = ["train.max_steps=4"]


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    result = launch(tmp_path_factory.mktemp("eager") / "runs" / "eager", STEPS)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_same_losses(a, b, tol: float) -> None:
    la, lb = a.losses(), b.losses()
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert abs(la[step] - lb[step]) <= tol, (step, la[step], lb[step])


@pytest.mark.slow
def test_compiled_blocks_match_eager(eager, tmp_path) -> None:
    compiled = launch(tmp_path / "runs" / "compiled", [*STEPS, "model.compile=true"], timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert_same_losses(eager, compiled, 1e-4)


def test_channels_last_matches(eager, tmp_path) -> None:
    other = launch(tmp_path / "runs" / "cl", [*STEPS, "model.channels_last=true",
                                              "train.deterministic=true"])
    assert other.returncode == 0, other.stderr[-3000:]
    assert_same_losses(eager, other, 1e-4)

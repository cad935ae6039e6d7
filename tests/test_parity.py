"""dtrain's numbers equal a plain hand-written PyTorch loop on the same model, data and seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forkserver
from conftest import REPO, child_env, launch, torchrun_cmd

STEPS = 12
PLAIN = str(REPO / "bench" / "plain_loop.py")


def plain_loop(out: Path, nproc: int = 0) -> tuple[list[float], dict]:
    prefix = torchrun_cmd(nproc) if nproc else [sys.executable]
    proc = forkserver.run([*prefix, PLAIN, f"--steps={STEPS}", f"--out={out}"], cwd=REPO,
                          env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    return result["losses"], torch.load(out / "weights.pt", weights_only=True)


def final_weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ckpt = torch.load(run_dir / "checkpoints" / latest / "checkpoint.pt", weights_only=True)
    return ckpt["model"]


def assert_same(losses: dict[int, float], reference: list[float], weights: dict, ref_weights: dict) -> None:
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, ref in enumerate(reference, start=1):
        assert abs(losses[step] - ref) <= 1e-6, (step, losses[step], ref)
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_single_process_and_one_rank_torchrun_match_plain_loop(tmp_path: Path) -> None:
    reference, ref_weights = plain_loop(tmp_path / "plain")
    single = launch(tmp_path / "runs" / "single", [f"train.max_steps={STEPS}"])
    assert single.returncode == 0, single.stderr[-3000:]
    assert_same(single.losses(), reference, final_weights(single.run_dir), ref_weights)
    one_rank = launch(tmp_path / "runs" / "one", [f"train.max_steps={STEPS}"], nproc=1)
    assert one_rank.returncode == 0, one_rank.stderr[-3000:]
    assert_same(one_rank.losses(), reference, final_weights(one_rank.run_dir), ref_weights)


@pytest.mark.slow
def test_two_rank_ddp_matches_plain_ddp_loop(tmp_path: Path) -> None:
    reference, ref_weights = plain_loop(tmp_path / "plain", nproc=2)
    result = launch(tmp_path / "runs" / "ddp", [f"train.max_steps={STEPS}"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same(result.losses(), reference, final_weights(result.run_dir), ref_weights)
    # both ranks evaluated the same numbers: rank 1's log shows rank 0's final val line
    val = result.evals()[-1]
    rank1_log = (result.run_dir / "log.rank1.txt").read_text()
    assert "world size 2" in (result.run_dir / "log.txt").read_text()
    assert rank1_log.count("[rank 1]") > 0
    assert f"val_acc {val['val_acc']:.4g}" in rank1_log

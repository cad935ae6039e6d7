"""The chaos harness (bench/chaos) in short: one seeded run of six faults of six kinds over a
DDP and an FSDP job, every invariant checked after each episode. Its long runs are `make chaos`
(docs/benchmarks.md); this one keeps the harness and dtrain's recoveries working as both change."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, child_env

# Seed 108 draws: DDP through SIGUSR1, a killed rank and a brief stop; FSDP through a flipped
# byte and a truncated file in its newest checkpoint, and a kill during a relaunch's resume.
SEED = 108
KINDS = {"sigusr1", "kill_rank", "stop_short", "flip_byte", "torn_newest", "kill_in_resume"}


@pytest.mark.slow
def test_a_short_chaos_run_violates_nothing(tmp_path) -> None:
    harness = str(REPO / "bench" / "chaos" / "run.py")
    proc = subprocess.run([sys.executable, harness, "--faults", "6", "--seed", str(SEED),
                           "--out", str(tmp_path / "chaos")],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env())
    report = (tmp_path / "chaos" / "report.md").read_text() if proc.returncode in (0, 1) else ""
    violations = report.split("## Violations")[-1]
    assert proc.returncode == 0, (violations if report else proc.stdout + proc.stderr)[-4000:]
    episodes = [json.loads(line) for line in (tmp_path / "chaos" / "episodes.jsonl").open()]
    assert {e["job"] for e in episodes} == {"ddp", "fsdp"}
    faults = [f for e in episodes for f in e["faults"]]
    assert {f["kind"] for f in faults} == KINDS and all(f["injected"] for f in faults), faults
    assert all(f["recovered_s"] is not None for f in faults)
    assert all(e["violations"] == [] for e in episodes)
    assert "6 faults" in report and "0 violations" in report
    # Each damaged checkpoint was one the run had: the fault did what it says.
    assert all(f["detail"].split(", ")[-1].startswith("damaged step_") for f in faults
               if f["kind"] in ("flip_byte", "torn_newest")), faults

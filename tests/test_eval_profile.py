"""`dtrain eval --profile`: the evaluation under the torch profiler, its top operators, the
shares of its time spent waiting for data and in host-device copies, a verdict on whether int8
quantization can help, and a trace for TensorBoard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import dtrain, launch

HEADER = re.compile(r"^operator\s+self ms\s+% of wall\s+calls$")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny trained run (the default CNN), in one process."""
    result = launch(tmp_path_factory.mktemp("eval_profile") / "run", [])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.run_dir


@pytest.fixture(scope="module")
def profiled(run_dir):
    """`dtrain eval --profile` of it: what it printed, and the result file's profile."""
    proc = dtrain("eval", "--run", str(run_dir), "--profile", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(Path(proc.stdout.strip().splitlines()[-1].split(" -> ")[1]).read_text())
    return proc.stdout.splitlines(), result["profile"]


def test_the_table_lists_operators_within_the_wall_time(profiled) -> None:
    lines, profile = profiled
    wall_ms = float(re.search(r"([\d.]+) ms of wall time", lines[0]).group(1))
    start = next(i for i, line in enumerate(lines) if HEADER.match(line))
    rows = lines[start + 1 : next(i for i, line in enumerate(lines) if line.startswith("waiting"))]
    assert 1 <= len(rows) <= 10
    self_ms = [float(row.split()[-3]) for row in rows]
    assert self_ms == sorted(self_ms, reverse=True)
    assert 0 < sum(self_ms) <= wall_ms
    assert sum(op["self_ms"] for op in profile["top"]) <= profile["wall_s"] * 1e3
    assert any(row.startswith("aten::") for row in rows)
    assert all(len(line) <= 120 for line in [lines[0], *lines[start:start + len(rows) + 3]])


def test_the_shares_are_percentages_and_the_verdict_is_said(profiled) -> None:
    lines, profile = profiled
    for key in ("data_percent", "arithmetic_percent"):
        assert 0 <= profile[key] <= 100, key
    assert profile["copy_percent"] is None  # on the CPU
    shares = next(line for line in lines if line.startswith("waiting for data (the loader): "))
    assert 0 <= float(shares.split(": ")[1].split(" %")[0]) <= 100
    assert "host-device copies: none" in shares
    verdict = [line for line in lines if line.startswith("verdict: ")]
    assert len(verdict) == 1
    assert re.search(r"take (only )?\d+ % of the time: |data loading takes \d+ %", verdict[0])


def test_the_trace_is_written_for_tensorboard(profiled, run_dir) -> None:
    lines, profile = profiled
    trace = Path(profile["trace"])
    assert trace.parent.parent == run_dir / "profile"
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    assert any(str(trace.parent) in line for line in lines)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_an_unwritable_trace_place_is_one_line(run_dir, tmp_path) -> None:
    evals = set((run_dir / "evals").iterdir())
    (tmp_path / "file").write_text("")
    proc = dtrain("eval", "--run", str(run_dir), "--profile", "--profile-dir",
                  str(tmp_path / "file" / "traces"), timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"dtrain: eval error: --profile: cannot write the traces into {tmp_path}/file/traces "
        f"(Not a directory); nothing was evaluated: make it writable or name another folder "
        f"with --profile-dir"
    ]
    assert set((run_dir / "evals").iterdir()) == evals

"""`dtrain doctor` passes on this machine and fails, with exit 1 and a reason, where a check fails."""

from __future__ import annotations

import pytest

from conftest import dtrain


@pytest.mark.slow
def test_doctor_passes_here() -> None:
    proc = dtrain("doctor", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    verdicts = {line.split(":")[0].split(None, 1)[1]: line.split()[0] for line in lines[:-1]}
    assert verdicts["versions"] == "ok" and verdicts["matmul on cpu"] == "ok"
    assert verdicts["gloo all-reduce (2 processes on 127.0.0.1)"] == "ok"
    assert "FAIL" not in verdicts.values()
    assert "sum 3.0 on every rank" in proc.stdout
    assert "launcher: single: 1 node(s) x 1 rank(s)" in proc.stdout
    assert lines[-1].startswith("doctor: all") and "checks passed" in lines[-1]


@pytest.mark.slow
def test_doctor_fails_on_a_broken_network_setting_and_bad_launcher_variables() -> None:
    # A gloo interface that does not exist (a typical copy-paste from another cluster) and a
    # torchrun variable that is not a number: both are real failures a run would hit.
    proc = dtrain("doctor", timeout=240, env={"GLOO_SOCKET_IFNAME": "dtrain-none0", "RANK": "first",
                                              "WORLD_SIZE": "2"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    gloo = next(line for line in out.splitlines() if "gloo all-reduce" in line)
    assert gloo.startswith("FAIL") and "dtrain-none0" in gloo
    launcher = next(line for line in out.splitlines() if line.split()[1] == "launcher:")
    assert launcher.startswith("FAIL") and "RANK='first' is not an integer" in launcher
    assert "ok    matmul on cpu" in out
    assert out.splitlines()[-1].startswith("doctor: 2 of ")

"""The tests' forked launches (tests/forkserver.py) behave as fresh interpreters do: the same
output, exit codes and signals, for the same program, arguments, folder and environment."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

import forkserver
from conftest import REPO, child_env

# What a launch sees and how it ends: argv, folder, environment, import path, standard files, a
# thread still running at the end, an atexit handler, and the exit code it asks for.
PROGRAM = """\
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "isatty", sys.stdin.isatty())
print("env", os.environ.get("PROBE"), os.environ.get("PYTEST_XDIST_WORKER", "-") != "", flush=True)
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    atexit.register(lambda: print("atexit ran", flush=True))
    sys.exit(3)
if mode == "raise":
    raise ValueError("deliberate")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "wait":
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("forks") / "probe.py"
    path.write_text(PROGRAM)
    return path


def both(cmd: list[str], cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, ...]:
    forked = forkserver.run(cmd, cwd=cwd, env=env, timeout=60)
    fresh = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    return forked, fresh


@pytest.mark.parametrize("mode", ["thread", "raise", "interrupt", "plain"])
def test_a_forked_launch_ends_as_a_fresh_one(program: Path, tmp_path: Path, mode: str) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = child_env({"PROBE": "seen"})
    forked, fresh = both([sys.executable, str(program), mode, "--flag=1"], cwd, env)
    assert forked.returncode == fresh.returncode == {"thread": 3, "raise": 1, "interrupt": -2,
                                                     "plain": 0}[mode]
    assert forked.stdout == fresh.stdout
    assert f"cwd {cwd} path0 {program.parent} isatty False" in forked.stdout
    assert "env seen True" in forked.stdout
    if mode == "thread":  # the thread joined first, then the atexit handler
        assert forked.stdout.splitlines()[-2:] == ["thread done", "atexit ran"]
    # A traceback's lines name the same place (the fork's has the runner's frames above).
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]


def test_a_module_launch_gets_python_m_s_argv_and_path(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dtrain", "no-such-command"]
    forked, fresh = both(cmd, REPO, child_env())
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 2 and "invalid choice: 'no-such-command'" in forked.stderr


def test_a_forked_launch_is_a_process_that_signals_reach(program: Path, tmp_path: Path) -> None:
    proc = forkserver.popen([sys.executable, str(program), "wait"], cwd=tmp_path, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    assert isinstance(proc, forkserver.Forked)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    assert lines[-1] == "ready\n" and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.stdout.close()


def test_what_this_process_s_libraries_set_does_not_stop_a_fork(program: Path,
                                                                tmp_path: Path) -> None:
    """Importing inductor here sets TORCHINDUCTOR_CACHE_DIR in this process's environment; the
    launches after it still fork (and see it)."""
    import os

    import torch._inductor.config  # noqa: F401 - imported for what it does to os.environ

    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    proc = forkserver.popen([sys.executable, str(program), "plain"], cwd=tmp_path,
                            env=child_env(), stdout=subprocess.DEVNULL)
    assert isinstance(proc, forkserver.Forked)
    assert proc.wait(timeout=60) == 0


def test_settings_read_at_start_get_a_fresh_interpreter(program: Path, tmp_path: Path) -> None:
    proc = forkserver.popen([sys.executable, str(program), "plain"], cwd=tmp_path,
                            env=child_env({"OMP_NUM_THREADS": "2"}), stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=60) == 0
    other = forkserver.popen([sys.executable, "-c", "pass"], cwd=tmp_path, env=child_env())
    assert isinstance(other, subprocess.Popen)  # not a script or a module: run as it is
    assert other.wait(timeout=60) == 0

"""Running a whole job (launcher and every rank) inside a memory cgroup of its own: the limit it
may use, whether the kernel killed any of its processes for memory, and its peak usage.

cgroup v1 (`memory.limit_in_bytes`, `memory.oom_control`, `memory.max_usage_in_bytes`) and v2
(`memory.max`, `memory.events`, `memory.peak`) are both handled. Needs root and a mounted memory
controller; `available()` says whether this machine has them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")

# The wrapper joins the cgroup, then runs the job: every process the job starts is inside.
_JOIN = ("import subprocess, sys\n"
         "open(sys.argv[1], 'w').write(str(__import__('os').getpid()))\n"
         "sys.exit(subprocess.call(sys.argv[2:]))\n")


@dataclass
class Limited:
    """How a job ended under a memory limit."""
    returncode: int
    oom_kills: int  # processes of the job the kernel killed for memory
    peak_bytes: int  # the cgroup's peak usage: processes and the page cache they wrote
    stderr: str

    @property
    def fits(self) -> bool:
        return self.returncode == 0 and self.oom_kills == 0


def _version() -> int | None:
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        return 1
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    return None


def available() -> str | None:
    """None where jobs can be limited here, else why not."""
    version = _version()
    if version is None:
        return "no cgroup memory controller on this machine"
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    return None


def _make(name: str, limit: int) -> tuple[Path, int]:
    version = _version()
    if version == 1:
        group = V1_ROOT / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        return group, 1
    subtree = V2_ROOT / "cgroup.subtree_control"
    if "memory" not in subtree.read_text().split():
        subtree.write_text("+memory")  # lets the groups below the root limit memory
    group = V2_ROOT / name
    group.mkdir()
    (group / "memory.max").write_text(str(limit))
    if (group / "memory.swap.max").exists():  # swapping out would hide a job that does not fit
        (group / "memory.swap.max").write_text("0")
    return group, 2


def _kills(group: Path, version: int) -> int:
    text = (group / ("memory.oom_control" if version == 1 else "memory.events")).read_text()
    found = re.search(r"oom_kill (\d+)", text)
    return int(found.group(1)) if found else -1


def _peak(group: Path, version: int) -> int:
    name = "memory.max_usage_in_bytes" if version == 1 else "memory.peak"
    return int((group / name).read_text()) if (group / name).exists() else -1


def run(cmd: Sequence[str], limit: int, env: dict, cwd: Path, timeout: float = 1800) -> Limited:
    """Run `cmd` with `limit` bytes for it and all its children (no cgroup: see `available`)."""
    why = available()
    if why:
        raise RuntimeError(why)
    group, version = _make(f"dtrain-bench-{os.getpid()}-{os.urandom(3).hex()}", limit)
    try:
        proc = subprocess.run([sys.executable, "-c", _JOIN, str(group / "cgroup.procs"), *cmd],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return Limited(proc.returncode, _kills(group, version), _peak(group, version),
                       proc.stderr)
    finally:
        try:
            group.rmdir()
        except OSError:
            pass

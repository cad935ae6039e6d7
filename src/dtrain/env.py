"""Who am I? The process's place in the job, read from the launcher's environment variables.

torchrun's variables win over SLURM's (a torchrun started by srun sees both); with neither, the
process is a single run that never creates a process group. Nothing here starts anything.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from dtrain.errors import UserError


@dataclass(frozen=True)
class Env:
    launcher: str  # "torchrun" | "slurm" | "single"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    slurm_job_id: Optional[str] = None
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        return self.launcher != "single"

    def describe(self) -> str:
        return (f"{self.launcher}: {self.num_nodes} node(s) x {self.local_world_size} rank(s) "
                f"= world size {self.world_size}")


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise UserError(f"environment error: {name}={environ[name]!r} is not an integer") from None


def detect(environ: Mapping[str, str] = os.environ) -> Env:
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and "SLURM_STEP_ID" in environ:
        return _from_slurm(environ)
    return Env(launcher="single", slurm_job_id=environ.get("SLURM_JOB_ID"))


def _from_torchrun(environ: Mapping[str, str]) -> Env:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world
    return Env(
        launcher="torchrun",
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0,
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500,
        slurm_job_id=environ.get("SLURM_JOB_ID"),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT")
        if "TORCHELASTIC_RESTART_COUNT" in environ else 0,
    )


def _from_slurm(environ: Mapping[str, str]) -> Env:
    world = _int(environ, "SLURM_NTASKS")
    num_nodes = _int(environ, "SLURM_JOB_NUM_NODES") if "SLURM_JOB_NUM_NODES" in environ else (
        _int(environ, "SLURM_NNODES") if "SLURM_NNODES" in environ else 1)
    if world % num_nodes != 0:
        raise UserError(f"slurm error: {world} tasks do not divide evenly across {num_nodes} "
                        f"nodes; ask for --ntasks-per-node instead of --ntasks")
    job_id = environ.get("SLURM_JOB_ID", "0")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "127.0.0.1"
    return Env(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
        world_size=world,
        local_world_size=world // num_nodes,
        node_rank=_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0,
        num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ
        else port_for_job(job_id),
        slurm_job_id=job_id,
        restart_count=_int(environ, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in environ else 0,
    )


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the job id, so that jobs sharing a node do not collide."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits[-4:]) % 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, e.g. 'gpu[01-03,07],cpu5' -> gpu01 gpu02 gpu03 gpu07 cpu5."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                for n in range(int(lo), int(hi) + 1):
                    hosts.extend(prefix + str(n).zfill(width) + tail
                                 for tail in (expand_nodelist(rest) if rest else [""]))
            else:
                hosts.extend(prefix + part + tail for tail in (expand_nodelist(rest) if rest else [""]))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if current:
        items.append(current)
    return [i for i in (s.strip() for s in items) if i]

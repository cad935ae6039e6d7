"""Who am I? The process's place in the job, read from the launcher's environment variables.

torchrun's variables win over SLURM's (a torchrun started by srun sees both); with neither, the
process is a single run that never creates a process group. Nothing here starts anything.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dtrain.core.errors import UserError


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
    slurm_job_id: str | None = None
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        return self.launcher != "single"

    def describe(self) -> str:
        return (
            f"{self.launcher}: {self.num_nodes} node(s) x {self.local_world_size} rank(s) "
            f"= world size {self.world_size}"
        )


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise UserError(f"environment error: {name}={environ[name]!r} is not an integer") from None


def detect(environ: Mapping[str, str] = os.environ) -> Env:
    """Where this process stands. Raises UserError for a SLURM launch that cannot work."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_JOB_ID" in environ:
        # srun sets SLURM_STEP_ID in every task it starts; the batch script itself (and an
        # salloc shell) has the job's variables but no step id.
        if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
            return _from_slurm(environ)
        _check_started_by_srun(environ)
    return Env(launcher="single", slurm_job_id=environ.get("SLURM_JOB_ID"))


def _from_torchrun(environ: Mapping[str, str]) -> Env:
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if world > 1 and missing:
        # torchrun (and any env:// launch) sets both: RANK and WORLD_SIZE alone are left over
        # from another launch, and rank 0 would wait for ranks that never come.
        raise UserError(
            f"environment error: RANK={rank} and WORLD_SIZE={world} are set but "
            f"{' and '.join(missing)} not: left over from another launch? unset RANK and "
            f"WORLD_SIZE to train in one process, or start the ranks with torchrun"
        )
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world
    return Env(
        launcher="torchrun",
        rank=rank,
        local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0,
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500,
        slurm_job_id=environ.get("SLURM_JOB_ID"),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT")
        if "TORCHELASTIC_RESTART_COUNT" in environ
        else 0,
    )


def _check_started_by_srun(environ: Mapping[str, str]) -> None:
    """A job that asked for several tasks but started this process directly (from the batch
    script or an salloc shell, not through srun) would train on one of them and idle the rest."""
    tasks = (
        _int(environ, "SLURM_NTASKS")
        if "SLURM_NTASKS" in environ
        else (_int(environ, "SLURM_JOB_NUM_NODES") if "SLURM_JOB_NUM_NODES" in environ else 1)
    )
    if tasks > 1:
        raise UserError(
            f"slurm error: job {environ['SLURM_JOB_ID']} has {tasks} tasks but this "
            f"process was not started by srun, so it would be one task alone; start "
            f"it with 'srun python launch/train.py ...' (slurm/train.sbatch does)"
        )


def _from_slurm(environ: Mapping[str, str]) -> Env:
    # The step's own variables first: a step may use fewer tasks or nodes than the job holds.
    world = _first_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    num_nodes = _first_int(
        environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=1
    )
    node_rank = _first_int(environ, "SLURM_NODEID", default=0)
    per_node_text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    per_node = expand_tasks_per_node(per_node_text) if per_node_text else []
    if len(set(per_node)) > 1 or world % num_nodes != 0:
        layout = per_node_text or f"{world} tasks on {num_nodes} nodes"
        raise UserError(
            f"slurm error: tasks are spread unevenly across nodes ({layout}); every "
            f"node needs the same number of ranks: ask for --ntasks-per-node=N "
            f"instead of --ntasks"
        )
    job_id = environ["SLURM_JOB_ID"]
    nodelist = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
        or "127.0.0.1"
    )
    return Env(
        launcher="slurm",
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_first_int(environ, "SLURM_LOCALID", default=0),
        world_size=world,
        local_world_size=world // num_nodes,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=environ.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        master_port=_int(environ, "MASTER_PORT")
        if "MASTER_PORT" in environ
        else port_for_job(job_id),
        slurm_job_id=job_id,
        restart_count=_first_int(environ, "SLURM_RESTART_COUNT", default=0),
    )


def _first_int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        if name in environ:
            return _int(environ, name)
    if default is None:
        raise UserError(f"environment error: none of {', '.join(names)} is set")
    return default


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts, e.g. '4(x2),3' -> [4, 4, 3]."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise UserError(f"environment error: cannot read the tasks per node {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def device_index(env: Env, visible_gpus: int) -> int:
    """The CUDA device of this rank among the GPUs it sees, or a UserError when the node has
    more ranks than GPUs. With one visible GPU per task, SLURM has bound one GPU to each task
    (--gpus-per-task, --gpu-bind): every task uses its device 0."""
    if env.local_rank < visible_gpus:
        return env.local_rank
    if env.launcher == "slurm" and visible_gpus == 1:
        return 0
    if env.launcher == "slurm":
        raise UserError(
            f"device error: {env.local_world_size} tasks on this node but "
            f"{visible_gpus} visible GPU(s); ask for one task per GPU "
            f"(--ntasks-per-node={visible_gpus}) or as many GPUs as tasks "
            f"(--gpus-per-node={env.local_world_size})"
        )
    raise UserError(
        f"device error: {env.local_world_size} ranks per node requested, found "
        f"{visible_gpus} visible GPU(s); use --nproc_per_node={visible_gpus} or fewer"
    )


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the whole job id, so that jobs sharing a first node do not
    meet: any two jobs whose ids are less than 20000 apart get different ports (the last four
    digits alone gave jobs 10000 apart the same one). An id that is not a number is hashed."""
    text = job_id.strip()
    number = (
        int(text)
        if text.isdigit()
        else int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    )
    return 15000 + number % 20000


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
                    hosts.extend(
                        prefix + str(n).zfill(width) + tail
                        for tail in (expand_nodelist(rest) if rest else [""])
                    )
            else:
                hosts.extend(
                    prefix + part + tail for tail in (expand_nodelist(rest) if rest else [""])
                )
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

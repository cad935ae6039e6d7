"""A run launched as replica groups (parallel.replicas): `GroupLaunch`, this launch's place
among them, is all the assembly asks of the capability (where the group writes and starts, its
ranks' numbering, whether it requeues its job, the groups its loop trains with); `heal_state`
is what a group that heals receives from a live peer.

Group 0 is the run as it would be without replica groups: its run directory, records, metrics
and checkpoints. Every other group writes only its own logs, in `replicas/group_<g>` inside that
directory, and no checkpoint: it starts from group 0's newest checkpoint and heals from a live
peer before its first step (a run whose groups were all lost resumes from group 0's
checkpoints).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from typing import Any

import torch

from dtrain.checkpoint import Contents
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.files.store import Store
from dtrain.parallel import unwrap
from dtrain.parallel.replica_links import quiet_torchft, reach_lighthouse
from dtrain.parallel.replicas import Groups, HealState, OneGroup, Replicas, group_of, lighthouse_of
from dtrain.process import compat, dist, slurm
from dtrain.process.env import Env
from dtrain.process.layout import Layout

FOLDER = "replicas"
START = "start"  # inside a group's directory: the checkpoint it started from
SAMPLE_LOG = "replica_samples"
LIGHTHOUSE_LOG = "lighthouse.log"  # beside the groups' folders: the one a launch started


@dataclasses.dataclass(frozen=True)
class GroupLaunch:
    """This launch's place among the run's replica groups: all the run's assembly asks of
    parallel.replicas. `index` is None for a run without replica groups, which every method
    answers as the plain run it is; `lighthouse_line` says that this launch started the
    lighthouse, if it did (logged once the console is set up)."""

    index: int | None = None
    lighthouse_line: str | None = None

    @classmethod
    def of(cls, cfg: Config) -> GroupLaunch:
        """This launch's group, once its lighthouse answers (the extra missing, no lighthouse
        known or none answering: one line before anything starts)."""
        section = cfg.parallel.replicas
        if not section.groups:
            return cls()
        if cfg.run_url:
            raise UserError(
                "config error: parallel.replicas with run.out_dir in an object store is not "
                "supported yet; use a shared disk for run.out_dir"
            )
        index = group_of(section, dict(os.environ))
        quiet_torchft()
        address = lighthouse_of(section, dict(os.environ))
        log_path = os.path.join(cfg.run_dir, FOLDER, LIGHTHOUSE_LOG)
        line = reach_lighthouse(address, section.timeout_s, section.start_lighthouse, log_path)
        return cls(index, line)

    @property
    def keeps_the_run(self) -> bool:
        """Whether this launch writes the run's checkpoints and records: a run without replica
        groups, or group 0."""
        return not self.index

    def config(self, cfg: Config) -> Config:
        """The config this group runs with: group 0's is the run's own; another group's run
        directory is `replicas/group_<g>` inside the run's, and it saves no checkpoint (where
        it starts from: `start_point`)."""
        if self.keeps_the_run:
            return cfg
        run = dataclasses.replace(
            cfg.run, out_dir=os.path.join(cfg.run_dir, FOLDER), name=f"group_{self.index}"
        )
        return dataclasses.replace(cfg, run=run, ckpt=dataclasses.replace(cfg.ckpt, resume="none"))

    def start_point(self, cfg: Config) -> Config:
        """Another group starts from group 0's newest checkpoint where there is one: close to
        the live groups it then heals from, and at the run's end when the run has finished (it
        then trains nothing). Its files are linked into this group's `start/` first (hard
        links, or copies across file systems), as group 0 may delete that checkpoint
        (ckpt.keep_last) while this group reads it; one rank chooses, for every rank of the
        group."""
        if self.keeps_the_run:
            return cfg
        source = os.path.dirname(cfg.run.out_dir)
        path = dist.on_main(lambda: _linked_newest(source, cfg.run_dir))
        return dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, resume=path or "none"))

    def global_rank(self, layout: Layout) -> int:
        """This rank's place among the ranks of every group, as one DDP run over them would
        number it (its random state for dropout follows it; the ranks of a tp group share the
        first one's)."""
        return (self.index or 0) * layout.world_size + layout.random_rank

    def requeues_its_job(self, env: Env) -> bool:
        """Whether this launch requeues its SLURM job when preempted: a run of its own, or
        group 0 (its job's other groups are job steps beside it), or any group that is a task
        of a job array (each task requeues itself: it is a job of its own to SLURM)."""
        return self.keeps_the_run or slurm.job_label(env.slurm_job_id) != env.slurm_job_id

    def replicas(self, cfg: Config, layout: Layout, contents: Contents, step: int) -> Groups:
        """The replica groups as this group's loop sees them (OneGroup without them)."""
        sample_log = (
            os.path.join(cfg.run_dir, f"{SAMPLE_LOG}.rank{dist.rank()}.jsonl")
            if cfg.parallel.replicas.sample_log
            else None
        )
        keys_per_step = layout.batch_size * layout.grad_accum
        if self.index is None:
            one = OneGroup()
            one.log_samples(sample_log, keys_per_step)
            return one
        return Replicas(
            cfg.parallel.replicas,
            self.index,
            dist.rank(),
            layout.world_size,
            unwrap(contents.model),  # (its names as a checkpoint's, whether wrapped by DDP or not)
            heal_state(contents),
            step,
            keys_per_step,
            sample_log=sample_log,
        )


def _linked_newest(source: str, run_dir: str, tries: int = 5) -> str | None:
    start = os.path.join(run_dir, START)
    for _ in range(tries):  # each try a newer checkpoint: the one chosen was deleted meanwhile
        saved = Store(source).complete()
        if not saved:
            return None
        target = os.path.join(start, saved[0].name)
        if not os.path.isdir(target):
            partial = target + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                shutil.copytree(saved[0].path, partial, copy_function=_link_or_copy)
            except OSError:
                continue
            os.replace(partial, target)
        for name in os.listdir(start):  # the start points of this group's earlier launches
            if name != saved[0].name:
                shutil.rmtree(os.path.join(start, name), ignore_errors=True)
        return target
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copy2(src, dst)


def heal_state(contents: Contents) -> HealState:
    """What a live peer sends a healing group, and how the group takes it: the model, the
    optimizer and every part a checkpoint holds, as this rank holds them (a group's rank r heals
    from the donor's rank r; under FSDP, its shards: plain tensors on the wire, placed back as
    this rank's own). The model's names are the bare module's: a group of one process under
    torchrun (wrapped in DDP) and a plain one heal each other."""
    model = unwrap(contents.model)

    def state() -> dict[str, Any]:
        optimizer = contents.optimizer.state_dict()
        return {
            "model": {k: compat.local_part(v) for k, v in model.state_dict().items()},
            "optimizer": {
                **optimizer,
                "state": compat.tree_map_tensors(compat.local_part, optimizer["state"]),
            },
            "parts": {name: part.state_dict() for name, part in contents.parts.items()},
            "sharded": {
                name: compat.tree_map_tensors(compat.local_part, part.state_dict(full=False))
                for name, part in contents.sharded.items()
            },
        }

    def load(received: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, mine in model.state_dict().items():
                compat.local_part(mine).copy_(received["model"][name])
        contents.optimizer.load_state_dict(
            _placed_like_params(contents.optimizer, received["optimizer"])
        )
        for name, part in contents.parts.items():
            part.load_state_dict(received["parts"][name])
        for name, sharded in contents.sharded.items():
            sharded.load_state_dict(received["sharded"][name])

    return state, load


def _placed_like_params(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict whose per-parameter tensors are local parts, placed as this
    rank's parameters are (DTensors under FSDP; unchanged under DDP or one process)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed: dict[Any, Any] = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        placed[index] = {k: compat.like_param(v, param) for k, v in values.items()}
    return {**state, "state": placed}

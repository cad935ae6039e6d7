"""The run's layout, resolved once from (Config, Env), before any process group exists.

Every figure that depends on how a run is launched — how many ranks on how many nodes, the
device and backend, whether FSDP shards and over how many ranks, the effective batch, the
checkpoint format, and (given the training set's size) the steps per epoch and in total — is
worked out here and nowhere else. `run` builds the run from it, the trainer and the checkpointer
read it, and `dtrain plan` resolves the same layout for a launch that has not happened, so the
plan cannot disagree with the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.process.env import Env, device_index


@dataclass(frozen=True)
class Steps:
    """Optimizer steps of a whole epoch (from its start) and of the whole run."""

    batches_per_epoch: int  # per rank
    per_epoch: int
    total: int


@dataclass(frozen=True)
class Layout:
    env: Env
    device: torch.device  # this rank's
    backend: str | None  # None for a single process
    mode: str  # "ddp" | "fsdp" | "none": what the model is wrapped in (no wrapper alone)
    replicas: int  # FSDP: replica groups (HSDP); 1 otherwise
    shards: int  # FSDP: ranks a parameter is split over; 1 otherwise
    shard_index: int  # which shard this rank holds
    batch_size: int  # per rank and micro-batch
    grad_accum: int
    checkpoint_format: str  # "full" | "sharded"

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def num_nodes(self) -> int:
        return self.env.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.env.local_world_size

    @property
    def distributed(self) -> bool:
        return self.env.distributed

    @property
    def is_fsdp(self) -> bool:
        return self.mode == "fsdp"

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.batch_size * self.world_size * self.grad_accum


def pick_device(env: Env) -> torch.device:
    """CUDA device `local_rank` where there are GPUs, the Apple GPU for a single process, else
    the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", device_index(env, torch.cuda.device_count()))
    mps = getattr(torch.backends, "mps", None)
    if not env.distributed and mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device, cpu_collectives: bool = False) -> str:
    """nccl for CUDA, gloo for the CPU. With `cpu_collectives` (FSDP's CPU offload on GPUs, whose
    gradient norm and clipping run DTensor collectives on CPU tensors) a group with both:
    `cpu:gloo,cuda:nccl`."""
    if requested == "nccl" and device.type != "cuda":
        raise UserError("config error: dist.backend: nccl needs CUDA devices; use gloo or auto")
    if requested == "auto":
        requested = "nccl" if device.type == "cuda" else "gloo"
    if cpu_collectives and requested == "nccl":
        return "cpu:gloo,cuda:nccl"
    return requested


def resolve(cfg: Config, env: Env, device: torch.device | None = None) -> Layout:
    """The layout of `cfg` launched as `env` (this rank's device unless one is given: `plan`
    describes rank 0 of a launch elsewhere). Combinations that cannot work are a UserError."""
    world = env.world_size
    mode = cfg.parallel.mode
    if mode == "none" and world > 1:
        raise UserError(
            f"config error: parallel.mode: 'none' with {world} ranks would train {world} "
            f"unrelated models; use ddp or fsdp"
        )
    if not env.distributed:
        mode = "none"  # one process: nothing to wrap the model in
    replicas, shards, index = 1, 1, 0
    if mode == "fsdp":
        replicas = cfg.parallel.fsdp.hybrid_replicas
        if world % replicas:
            raise UserError(
                f"config error: parallel.fsdp.hybrid_replicas: {replicas} does not divide the "
                f"world size {world}"
            )
        shards = world // replicas
        index = env.rank % shards  # the last dimension of the (replicas, shards) mesh
    device = device if device is not None else pick_device(env)
    backend = None
    if env.distributed:
        cpu_collectives = mode == "fsdp" and cfg.parallel.fsdp.cpu_offload
        backend = pick_backend(cfg.dist.backend, device, cpu_collectives)
    fmt = cfg.ckpt.format
    if fmt == "auto":
        fmt = "sharded" if mode == "fsdp" else "full"
    return Layout(
        env=env,
        device=device,
        backend=backend,
        mode=mode,
        replicas=replicas,
        shards=shards,
        shard_index=index,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.train.grad_accum,
        checkpoint_format=fmt,
    )

"""The run's layout, resolved once from the launch (Env) and how the parallel strategy lays the
ranks out (Mesh), before any process group exists.

Every figure that depends on how a run is launched — how many ranks on how many nodes, the
device and backend, over how many ranks the model's state is split, the effective batch, the
checkpoint format, and (given the training set's size) the steps per epoch and in total — is
worked out here and nowhere else. `run` builds the run from it, the trainer and the checkpointer
read it, and `dtrain plan` resolves the same layout for a launch that has not happened, so the
plan cannot disagree with the run. What differs between parallel modes is not decided here: the
strategy (`parallel.mesh`) fills in a Mesh, and the layout copies its plain fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtrain.core.errors import UserError
from dtrain.process.env import Env, device_index


@dataclass(frozen=True)
class Mesh:
    """How a parallel strategy lays the ranks out: its mode's name, `replicas` groups that each
    split the model's state over `shards` ranks (this rank holds shard `shard_index`), and what
    follows from the strategy for the rest of the run."""

    mode: str  # parallel.mode of the strategy that runs (a single process: "none")
    sharded: bool = False  # parameters, gradients and optimizer state split over `shards` ranks
    replicas: int = 1
    shards: int = 1
    shard_index: int = 0
    checkpoint_format: str = "full"  # what ckpt.format=auto becomes
    cpu_collectives: bool = False  # collectives on CPU tensors besides the device's
    # Ranks each block's weights are split over (tensor parallelism; 1: none). They are the
    # innermost dimension of the mesh: ranks tp*d .. tp*d + tp - 1 hold data rank d's batch.
    tp: int = 1
    # Ranks a pipeline's stages are spread over (1: none): the outermost dimension, so that
    # rank r is stage rank r // (world / pp), and data rank (r // tp) % data_ranks.
    pp: int = 1


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
    mode: str  # the parallel strategy's mode: what the model is wrapped in ("none": nothing)
    sharded: bool  # the model's state split over `shards` ranks (FSDP, HSDP)
    replicas: int  # groups that each hold the whole model (HSDP); 1 otherwise
    shards: int  # ranks a parameter is split over; 1 otherwise
    shard_index: int  # which shard this rank holds
    batch_size: int  # per rank and micro-batch
    grad_accum: int
    checkpoint_format: str  # "full" | "sharded"
    tp: int = 1  # ranks that split each block's weights and read the same batch
    pp: int = 1  # ranks a pipeline's stages are spread over (they read the same batch)

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def data_ranks(self) -> int:
        """The ranks that read batches of their own: one per tensor-parallel group and
        pipeline."""
        return self.env.world_size // (self.tp * self.pp)

    @property
    def data_rank(self) -> int:
        """This rank's place among the `data_ranks` (the sampler's rank, the loader's seed)."""
        return (self.env.rank // self.tp) % self.data_ranks

    @property
    def num_nodes(self) -> int:
        return self.env.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.env.local_world_size

    @property
    def distributed(self) -> bool:
        return self.env.distributed

    def shown_mode(self, asked: str) -> str:
        """The mode as the banner and `dtrain plan` say it, beside `asked` (parallel.mode): a
        single process launched with a config for DDP or FSDP runs as `none (one process)`."""
        return self.mode if self.mode == asked else f"{self.mode} (one process)"

    @property
    def random_rank(self) -> int:
        """The rank whose random states this one restores or is re-seeded as: the first of its
        tp group (the ranks of a group must draw the same dropout masks), else itself."""
        return self.env.rank - self.env.rank % self.tp

    def batch_terms(self) -> str:
        """How the effective batch is made, for the banner and `dtrain plan`."""
        ranks = f"{self.world_size} rank(s)"
        if self.tp > 1:  # a tp group reads one batch between its ranks
            ranks = f"{self.data_ranks} tp group(s) of {self.tp} ranks"
        if self.pp > 1:  # so does a pipeline, its first stage's ranks
            ranks = f"{self.data_ranks} pipeline(s) of {self.pp * self.tp} ranks"
        grouped = self.tp > 1 or self.pp > 1
        return f"{self.batch_size} per {'group' if grouped else 'rank'} x {ranks} x " + (
            f"{self.grad_accum} accumulation"
        )

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.batch_size * self.data_ranks * self.grad_accum


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


def resolve(
    env: Env,
    mesh: Mesh,
    *,
    backend: str,
    batch_size: int,
    grad_accum: int,
    checkpoint_format: str,
    device: torch.device | None = None,
) -> Layout:
    """The layout of a launch as `env` laid out as `mesh` (dist.backend `backend`, ckpt.format
    `checkpoint_format`), on this rank's device unless one is given: `plan` describes rank 0 of a
    launch elsewhere. A backend that cannot work is a UserError."""
    device = device if device is not None else pick_device(env)
    chosen = pick_backend(backend, device, mesh.cpu_collectives) if env.distributed else None
    return Layout(
        env=env,
        device=device,
        backend=chosen,
        mode=mesh.mode,
        sharded=mesh.sharded,
        replicas=mesh.replicas,
        shards=mesh.shards,
        shard_index=mesh.shard_index,
        batch_size=batch_size,
        grad_accum=grad_accum,
        checkpoint_format=mesh.checkpoint_format
        if checkpoint_format == "auto"
        else checkpoint_format,
        tp=mesh.tp,
        pp=mesh.pp,
    )

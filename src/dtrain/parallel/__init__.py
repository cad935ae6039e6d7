"""How the model is spread over the ranks: the parallel strategy (none, DDP, FSDP, HSDP) that
lays the ranks out, builds and wraps the model and answers what differs between the modes in the
loop and in `dtrain plan`; tensor parallelism over a device mesh with the data dimensions
(`tensor`: its strategy, the plans that split a model, their styles; `loss`: the logits left
split by vocabulary for the cross-entropy) and pipeline stages over
the same mesh (`pipeline`: the cut, the schedules); the blocks FSDP shards,
BatchNorm across ranks, shard-by-shard construction (`sharded_init`), the run's numeric
precision (`precision`), and the replica groups that step on when one is lost (`replicas`, torchft).

Outside this package nothing branches on `parallel.mode`: the run asks `mesh` for the layout's
mesh, then `strategy` for the object that builds its model.
"""

from __future__ import annotations

import contextlib
import dataclasses

from torch import nn

from dtrain.config import ParallelConfig
from dtrain.parallel.batchnorm import average_buffers
from dtrain.parallel.blocks import find_blocks
from dtrain.parallel.loss import SplitLoss, splits_logits
from dtrain.parallel.pipe import Evaluator, Pipe
from dtrain.parallel.pipeline import (
    Pipeline,
    StageModel,
    bubble,
    held_names,
    in_flight,
    stage_blocks,
)
from dtrain.parallel.strategies import (
    BY_MODE,
    DDP,
    FSDP,
    HSDP,
    NOTHING,
    Counted,
    SingleProcess,
    Strategy,
    reshard,
    unwrap,
)
from dtrain.parallel.tensor import TensorParallel, split_names
from dtrain.process.env import Env
from dtrain.process.layout import Layout, Mesh

__all__ = [
    "NOTHING",
    "Counted",
    "Evaluator",
    "Pipe",
    "Spread",
    "StageModel",
    "Strategy",
    "average_buffers",
    "bubble",
    "held_names",
    "in_flight",
    "stage_blocks",
    "loss_context",
    "configured",
    "counted",
    "find_blocks",
    "for_world_size",
    "gradient_sync",
    "mesh",
    "pipeline_of",
    "runnable",
    "reshard",
    "spread",
    "split_names",
    "strategy",
    "unwrap",
    "whole_shapes",
]


def configured(cfg: ParallelConfig) -> type[Strategy]:
    """The strategy the section asks for."""
    if cfg.pp.size > 1:
        return Pipeline
    if cfg.tp.size > 1:
        return TensorParallel
    if cfg.mode == "fsdp" and cfg.fsdp.hybrid_replicas > 1:
        return HSDP
    return BY_MODE[cfg.mode]


def chosen(cfg: ParallelConfig, env: Env) -> type[Strategy]:
    """The strategy of the section launched as `env`: a single process wraps the model in
    nothing, whatever the section says."""
    return configured(cfg) if env.distributed else SingleProcess


def mesh(cfg: ParallelConfig, env: Env) -> Mesh:
    """How the strategy of `cfg` launched as `env` lays the ranks out, for `layout.resolve`.
    Combinations that cannot work are a UserError."""
    return chosen(cfg, env).mesh(cfg, env)


def strategy(cfg: ParallelConfig, layout: Layout) -> Strategy:
    """The run's strategy: the one whose mesh the layout holds."""
    return chosen(cfg, layout.env)(cfg, layout)


def for_world_size(cfg: ParallelConfig, world_size: int) -> ParallelConfig:
    """The section as a run at another world size uses it (`dtrain eval` of a training run)."""
    return configured(cfg).for_world_size(cfg, world_size)


def counted(cfg: ParallelConfig, env: Env) -> tuple[list[Counted], Counted]:
    """What `dtrain plan` compares at a launch as `env`: the model replicated (DDP) and sharded
    (FSDP, or HSDP with the section's replica groups); and which of them the section asks for
    (a single process is counted as DDP on one rank)."""
    sharding = configured(dataclasses.replace(cfg, mode=FSDP.mode))
    rows = [DDP.counted(cfg, env), sharding.counted(cfg, env)]
    asked = configured(cfg).plan_row
    return rows, next(row for row in rows if row.row == asked)


def gradient_sync(
    layout: Layout, model: nn.Module, sync: bool
) -> contextlib.AbstractContextManager:
    """The context of a micro-batch's backward under the layout's strategy: gradients
    synchronised only with `sync`."""
    chosen = TensorParallel if layout.tp > 1 else BY_MODE[layout.mode]
    return chosen.gradient_sync(model, sync)


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context of a training step's forward and backward: with loss parallelism, the
    head's logits split by vocabulary and the cross-entropy computed on the parts."""
    return SplitLoss() if splits_logits(model) else NOTHING


def pipeline_of(model: nn.Module) -> Pipe | None:
    """The stages and schedule of a pipeline-parallel run's model (None for any other): its
    steps run through them, not through the model's forward."""
    return model.pipe if isinstance(model, StageModel) else None


def runnable(model: nn.Module) -> nn.Module | Evaluator:
    """What the task calls as the model outside training steps (the start-up check, evaluation):
    the model itself, or a pipeline's stages one after another."""
    return model.pipe.evaluator(model) if isinstance(model, StageModel) else model


def whole_shapes(model: nn.Module) -> dict[str, tuple] | None:
    """The names and full shapes of the whole model where this rank holds a pipeline stage's
    part of it (what a checkpoint of any layout holds), else None."""
    return model.whole_shapes if isinstance(model, StageModel) else None


@dataclasses.dataclass(frozen=True)
class Spread:
    """How the ranks share the texts a task evaluation scores: `groups` of ranks that each run
    batches of their own (a tp group or a pipeline runs each of its batches between its ranks),
    this rank's `group`, whether its logits `count` (a pipeline's earlier stages have none) and
    `source`: a rank that holds logits, whose token every rank takes when they generate."""

    groups: int
    group: int
    counts: bool = True
    source: int = 0


def spread(layout: Layout, model: nn.Module) -> Spread:
    """The groups of the layout's mesh that score together, for the model as built."""
    pipe = pipeline_of(model)
    if pipe is None:
        return Spread(layout.data_ranks, layout.data_rank)
    last_stage = layout.world_size - layout.world_size // layout.pp  # its first rank
    return Spread(layout.data_ranks, layout.data_rank, pipe.last, last_stage)

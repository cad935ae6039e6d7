"""Pipeline parallelism: the model's blocks cut into stages over the `parallel.pp.size` ranks of
a pipeline, each batch cut into micro-batches that flow through the stages in the order of one
of torch's schedules (`torch.distributed.pipelining`), composed with tensor parallelism inside
each stage and data parallelism (DDP or FSDP over the data dimensions) across pipelines, on one
device mesh (pp, dp_replicate, dp_shard, tp): pp outermost, tp innermost.

The built-in GPT is cut at its blocks: the first stage holds the embeddings, the last the final
norm and the head. Every part keeps its parameters' names (`blocks.3.attn.qkv.weight`), so
that a checkpoint of a pipeline run holds what one of any other layout does and loads into it
(DCP reshards). The head is tied to the token embedding: where the two live on different
stages, the last stage holds the embedding too (tied to its head, as in the whole model: the
same names and optimizer state), the two copies' gradients are summed between the first and
last stage's ranks after the backward and the copy is counted once in the gradient norm, so
that both take the same steps as the one tied weight of DDP.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

from torch import nn

from dtrain.config import ModelConfig, ParallelConfig, PipelineConfig
from dtrain.core.errors import UserError
from dtrain.models import GPT
from dtrain.parallel.blocks import checkpoint_activations
from dtrain.parallel.cuts import Part, cut_of
from dtrain.parallel.pipe import Pipe
from dtrain.parallel.precision import Precision
from dtrain.parallel.tensor import TensorParallel, check_divides, parallelize, plan_of
from dtrain.process.env import Env
from dtrain.process.layout import Mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class Pipeline(TensorParallel):
    """parallel.pp.size > 1: the model built whole on every rank from the seed, cut into this
    rank's stages, each split over its tp group by its plan (tp > 1) and wrapped by FSDP2 over
    the data dimensions (more than one pipeline). Checkpoints are DCP's, reshardable onto any
    layout."""

    @classmethod
    def mesh(cls, cfg: ParallelConfig, env: Env) -> Mesh:
        pp, tp, world = cfg.pp.size, cfg.tp.size, env.world_size
        if cfg.mode == "none":
            raise UserError(
                "config error: parallel.pp.size: pipeline parallelism needs parallel.mode ddp "
                "or fsdp for the data dimensions (mode none trains one unrelated model per rank)"
            )
        if world % (pp * tp):
            raise UserError(
                f"config error: parallel.pp.size: pp {pp} x tp {tp} does not divide the world "
                f"size {world}; launch a multiple of {pp * tp} ranks"
            )
        # The data dimensions and tp as tensor parallelism lays them out on one pipeline stage.
        stage = dataclasses.replace(env, world_size=world // pp, rank=env.rank % (world // pp))
        inner = TensorParallel.mesh(cfg, stage)
        return dataclasses.replace(inner, pp=pp, sharded=inner.replicas * inner.shards > 1)

    @classmethod
    def for_world_size(cls, cfg: ParallelConfig, world_size: int) -> ParallelConfig:
        """An evaluation at any world size runs the whole model, without stages."""
        whole = dataclasses.replace(cfg, pp=dataclasses.replace(cfg.pp, size=1))
        return TensorParallel.for_world_size(whole, world_size)

    def build(
        self,
        model_cfg: ModelConfig,
        info: dict[str, Any],
        seed: int,
        precision: Precision,
        prepare: Any = None,
    ) -> tuple[nn.Module, int, list[str]]:
        self._probe_len = int(info.get("seq_len") or 8)  # (what `wrap` checks the cut on)
        model, count, notes = super().build(model_cfg, info, seed, precision, prepare)
        pipe = cast(StageModel, model).pipe
        notes[-1] = (
            notes[-1]
            .replace("mesh ", f"mesh pp {self.layout.pp} x ", 1)
            .replace(
                "then split",
                f"then cut: stage(s) {pipe.stage_ids} of {pipe.num_stages}, "
                f"schedule {self.cfg.pp.schedule}, {pipe.microbatches} micro-batches a step",
            )
        )
        return model, count, notes

    def wrap(
        self,
        model: nn.Module,
        model_cfg: ModelConfig,
        precision: Precision,
        on_meta: bool = False,
        notes: list[str] | None = None,
    ) -> nn.Module:
        layout, pp_cfg = self.layout, self.cfg.pp
        cut = cut_of(model, pp_cfg, layout.pp, model_cfg.name)
        model.to(layout.device)
        vocab = cut.check_whole(model_cfg.name, getattr(self, "_probe_len", 8))
        whole = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        tied = cut.tied()
        mesh = self._mesh()
        if layout.tp > 1:  # the whole model split by its plan, then cut (the plan's names)
            check_divides(model, layout.tp, model_cfg.name)
            tied_names = [n for n, p in model.named_parameters() if id(p) in tied]
            parallelize(model, plan_of(model, self.cfg.tp, model_cfg.name), mesh["tp"])
            tied = {id(model.get_parameter(n)) for n in tied_names}
        pp_rank = layout.env.rank // (layout.world_size // layout.pp)
        stage_ids = [pp_rank + k * layout.pp for k in range(pp_cfg.local_stages)]
        parts = [cut.part(s) for s in stage_ids]
        # Each end stage's names of the weights it shares with the other end (FSDP replaces
        # the parameters: they are found again by name).
        shared = {
            part.stage: [n for n, p in part.named_parameters() if id(p) in tied] for part in parts
        }
        for part in parts:
            if model_cfg.activation_checkpointing:
                for block in part.units():
                    checkpoint_activations(block)
            self._distribute(part, part.units(), precision, notes)
        microbatches = pp_cfg.microbatches * layout.grad_accum
        pipe = Pipe(parts, cut.stages, pp_cfg.schedule, microbatches, mesh, layout.device)
        pipe.share(shared, vocab)
        return StageModel(model, parts, pipe, whole)

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout
        if getattr(self, "_made", None) is None:
            shape = (layout.pp, layout.replicas, layout.shards, layout.tp)
            self._made = init_device_mesh(layout.device.type, shape, mesh_dim_names=MESH_DIMS)
        return self._made


def held_names(
    model: nn.Module, cfg: PipelineConfig, pp: int, model_name: str
) -> list[dict[str, int]]:
    """For `dtrain plan` (the model on the meta device), after the cut's own refusals: each
    stage rank's parameters, by name, with how many copies it holds (the last stage's head
    holds a second copy of the embedding it is tied to)."""
    cut = cut_of(model, cfg, pp, model_name)
    names = {id(p): n for n, p in model.named_parameters()}
    held: list[dict[str, int]] = []
    for rank in range(pp):
        mine: dict[str, int] = {}
        for stage in range(rank, cut.stages, pp):
            for param in cut.part(stage).parameters():
                mine[names[id(param)]] = 1
        held.append(mine)
    return held


def stage_blocks(
    model: nn.Module, cfg: PipelineConfig, pp: int, model_name: str, blocks: list[nn.Module]
) -> list[list[int]]:
    """For `dtrain plan`: the indices in `blocks` (the model's, in order) of the blocks each
    stage rank's stages hold."""
    cut = cut_of(model, cfg, pp, model_name)
    index = {id(block): i for i, block in enumerate(blocks)}
    held: list[list[int]] = []
    for rank in range(pp):
        units = [u for stage in range(rank, cut.stages, pp) for u in cut.part(stage).units()]
        held.append(sorted(index[id(u)] for u in units if id(u) in index))
    return held


def in_flight(cfg: PipelineConfig, pp: int, microbatches: int, rank: int = 0) -> int:
    """The most micro-batches whose activations stage rank `rank` holds at once: all of them
    under GPipe, under 1F1B the stages after it and its own (the pipeline's depth on the first),
    and the interleaved schedules' warm-up over their stages per rank (the first rank's, for
    every rank: an upper bound)."""
    if cfg.schedule == "gpipe":
        return microbatches
    if cfg.local_stages == 1:
        return min(microbatches, pp - rank)
    return min(microbatches * cfg.local_stages, (cfg.local_stages - 1) * pp + 2 * pp - 1)


class StageModel(nn.Module):
    """What this rank holds of the model, under the whole model's names (what the optimizer,
    the checkpoints and the gradient checks see): the whole model's tree pruned to the modules
    its stages hold. Its stages run through `pipe`, not a forward of its own."""

    def __init__(
        self, whole: nn.Module, parts: list[Part], pipe: Pipe, shapes: dict[str, tuple]
    ) -> None:
        super().__init__()
        self.whole_shapes = shapes  # the whole model's names and shapes: what a checkpoint holds
        held = {id(m) for part in parts for m in part.modules()}
        placed: list[str] = []
        for path, module in whole.named_modules():
            inside = any(path.startswith(f"{p}.") for p in placed)
            if not path or inside or id(module) not in held:
                continue
            parent: nn.Module = self
            *outer, attr = path.split(".")
            for name in outer:
                if not hasattr(parent, name):
                    parent.add_module(name, nn.Module())
                parent = getattr(parent, name)
            parent.add_module(attr, module)
            placed.append(path)
        self.pipe = pipe
        # What decoding asks of the whole model (train.eval_tasks under a pipeline): whether
        # it is the built-in GPT, and its window (the GPT's, a Hugging Face config's positions).
        self.built_in = isinstance(whole, GPT)
        self.seq_len: int | None = getattr(whole, "seq_len", None)
        self.config: Any = getattr(whole, "config", None)

    def forward(self, *_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a pipeline stage's model runs through its schedule (parallel.pp)")


def bubble(schedule: str, pp: int, microbatches: int, local_stages: int) -> float:
    """The share of a step a stage rank waits idle by the schedule's shape: (p - 1) / (m + p - 1)
    for GPipe and 1F1B, the interleaved schedules' bubble shrunk by their stages per rank;
    zero bubble's counted as interleaved 1F1B's (its deferred weight gradients fill part of it,
    by how much depends on their cost)."""
    del schedule
    idle = (pp - 1) / local_stages
    return idle / (microbatches + idle) if microbatches + idle else math.nan

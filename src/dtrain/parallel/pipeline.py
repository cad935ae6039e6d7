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

import torch
from torch import nn

from dtrain.config import ModelConfig, ParallelConfig, PipelineConfig
from dtrain.core.errors import UserError
from dtrain.parallel.blocks import checkpoint_activations
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
        stages = check_cut(model, pp_cfg, layout.pp, model_cfg.name)
        model.to(layout.device)
        whole = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        mesh = self._mesh()
        plan = None
        if layout.tp > 1:
            check_divides(model, layout.tp, model_cfg.name)
            plan = plan_of(model, self.cfg.tp, model_cfg.name)
        pp_rank = layout.env.rank // (layout.world_size // layout.pp)
        stage_ids = [pp_rank + k * layout.pp for k in range(pp_cfg.local_stages)]
        depth = len(cast(Any, model).blocks)
        parts = [GPTPart(model, *_blocks_of(s, stages, depth), s, stages) for s in stage_ids]
        for part in parts:
            if plan is not None:
                parallelize(part, plan, mesh["tp"])
            blocks = list(part.blocks.values())
            if model_cfg.activation_checkpointing:
                for block in blocks:
                    checkpoint_activations(block)
            self._distribute(part, blocks, precision, notes)
        microbatches = pp_cfg.microbatches * layout.grad_accum
        pipe = Pipe(parts, stages, pp_cfg.schedule, microbatches, mesh, layout.device)
        return StageModel(parts, pipe, whole)

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout
        if getattr(self, "_made", None) is None:
            shape = (layout.pp, layout.replicas, layout.shards, layout.tp)
            self._made = init_device_mesh(layout.device.type, shape, mesh_dim_names=MESH_DIMS)
        return self._made


def check_cut(model: nn.Module, cfg: PipelineConfig, pp: int, model_name: str) -> int:
    """The number of stages the model is cut into, after checking that it can be (`dtrain plan`
    asks the same of the model on the meta device)."""
    from dtrain.models import GPT  # (models import nothing of parallel)

    if not isinstance(model, GPT):
        raise UserError(
            f"config error: parallel.pp.size: model {model_name} cannot be cut into stages by "
            f"dtrain yet (the built-in gpt can); set parallel.pp.size=1"
        )
    stages = pp * cfg.local_stages
    if stages > len(model.blocks):
        raise UserError(
            f"config error: parallel.pp: {stages} stages (pp {pp} x {cfg.local_stages} per "
            f"rank) for the {len(model.blocks)} blocks of model {model_name}; use fewer stages "
            f"or a deeper model"
        )
    return stages


def held_names(model: nn.Module, cfg: PipelineConfig, pp: int) -> list[dict[str, int]]:
    """For `dtrain plan`: each stage rank's parameters, by name, with how many copies it holds
    (the last stage's head holds a second copy of the embedding it is tied to)."""
    stages = pp * cfg.local_stages
    depth = len(cast(Any, model).blocks)
    held: list[dict[str, int]] = []
    for rank in range(pp):
        names: dict[str, int] = {}
        for stage in range(rank, stages, pp):
            first, end = _blocks_of(stage, stages, depth)
            prefixes = [f"blocks.{i}." for i in range(first, end)]
            if stage == 0:
                prefixes += ["tok_emb.", "pos_emb."]
            if stage == stages - 1:
                prefixes += ["norm.", "head."]
            for name, _ in model.named_parameters():
                if any(name.startswith(p) for p in prefixes):
                    names[name] = 1
            if stage == stages - 1 and stages > 1:
                names["tok_emb.weight"] = names.get("tok_emb.weight", 0) + 1  # the head's copy
        held.append(names)
    return held


def in_flight(cfg: PipelineConfig, pp: int, microbatches: int) -> int:
    """The most micro-batches whose activations a stage rank holds at once: all of them under
    GPipe, at most the pipeline's depth under 1F1B (on its first stage rank), and the
    interleaved schedules' warm-up over their stages per rank."""
    if cfg.schedule == "gpipe":
        return microbatches
    if cfg.local_stages == 1:
        return min(microbatches, pp)
    return min(microbatches * cfg.local_stages, (cfg.local_stages - 1) * pp + 2 * pp - 1)


def _blocks_of(stage: int, stages: int, depth: int) -> tuple[int, int]:
    """The blocks [first, end) of `stage`: as even a cut as there is, the earlier stages taking
    one more where it is not (the last also holds the head)."""
    per, extra = divmod(depth, stages)
    first = stage * per + min(stage, extra)
    return first, first + per + (stage < extra)


class GPTPart(nn.Module):
    """One stage of the built-in GPT: its blocks under their own names, with the embeddings on
    the first stage and the final norm and head on the last; a stage's forward takes the
    previous one's output (the first, the tokens)."""

    tok_emb: nn.Embedding
    pos_emb: nn.Embedding
    drop: nn.Module
    norm: nn.Module
    head: nn.Linear

    def __init__(self, gpt: Any, first: int, end: int, stage: int, stages: int) -> None:
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == stages - 1
        self.vocab = gpt.tok_emb.num_embeddings
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(first, end)})
        if self.last:
            # The head with the embedding it is tied to (unused here): the last stage holds the
            # tied weight under the names, and with the optimizer state, of any other layout.
            self.tok_emb, self.norm, self.head = gpt.tok_emb, gpt.norm, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


class StageModel(nn.Module):
    """What this rank holds of the model, under the whole model's names (what the optimizer,
    the checkpoints and the gradient checks see); its stages run through `pipe`, not a
    forward of its own."""

    def __init__(self, parts: list[GPTPart], pipe: Pipe, whole: dict[str, tuple]) -> None:
        super().__init__()
        self.whole_shapes = whole  # the whole model's names and shapes: what a checkpoint holds
        blocks = nn.ModuleDict()
        for part in parts:
            for name in ("tok_emb", "pos_emb", "drop", "norm", "head"):
                if hasattr(part, name):
                    self.add_module(name, getattr(part, name))
            for index, block in part.blocks.items():
                blocks[index] = block
        self.blocks = blocks
        self.pipe = pipe

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

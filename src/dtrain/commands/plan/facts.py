"""What `dtrain plan` works from: the launch's layout, the datasets' sizes and shapes (no sample
read), and the model on the meta device with its blocks (what FSDP wraps) and their sizes. Both
estimates start here: the plan's report (command.py) and the memory limit's fit (fit.py)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn

from dtrain import data, models, parallel
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.models import Weights
from dtrain.parallel import Counted
from dtrain.process.env import Env, device_index
from dtrain.process.layout import Layout
from dtrain.run.pieces import layout_of


@dataclass
class ModelFacts:
    """A config launched as `nproc` x `nnodes` ranks, before anything runs. Sizes in bytes."""

    layout: Layout  # rank 0's
    counted: list[Counted]  # the strategies the plan compares: replicated, sharded
    chosen: Counted  # the one the config asks for
    device: str  # rank 0's device, described
    device_bytes: int  # the memory one rank may use
    warnings: list[str]  # a launch the run would refuse
    shapes: data.Datasets  # lengths and what models need; no sample is ever read
    model: nn.Module  # on the meta device
    blocks: list[nn.Module]  # what FSDP wraps one by one (not the root)
    trainable: int  # the parameters that train
    block_bytes: int  # all blocks' parameters
    largest_block: int  # the largest block's parameters
    root_bytes: int  # the parameters outside the blocks
    # Under tensor parallelism: the parameters its plan splits (None: a user's plan function,
    # which only a run applies); an empty set without it.
    tp_split: set[str] | None = None
    # Under pipeline parallelism: each stage rank's parameters, with the copies it holds.
    pp_held: list[dict[str, int]] | None = None

    @property
    def shards(self) -> int:
        """The ranks the sharded strategy splits the state over in this launch, whatever the
        config asks for."""
        return next(row.shards for row in self.counted if row.sharded)


def model_facts(cfg: Config, nproc: int, nnodes: int) -> ModelFacts:
    env = launch(nproc, nnodes)
    layout = layout_of(cfg, env)
    counted, chosen = parallel.counted(cfg.parallel, env)
    device, device_bytes, warnings = device_memory(layout)
    shapes = data.sizes_of(cfg.data, cfg.run.seed, cfg.model.args)
    model = models.build(cfg.model, shapes.info, cfg.run.seed, Weights.NONE)
    blocks = [b for b in parallel.find_blocks(model, cfg.parallel.fsdp.wrap) if b is not model]
    block_bytes = param_bytes(blocks)
    tp = cfg.parallel.tp
    # The plan's own refusals (no plan, a size it does not divide) before any process group.
    tp_split = parallel.split_names(model, tp, cfg.model.name) if tp.size > 1 else set()
    pp, pp_held = cfg.parallel.pp, None
    if pp.size > 1:  # the cut's own refusals, likewise
        pp_held = parallel.held_names(model, pp, pp.size, cfg.model.name)
    return ModelFacts(
        layout=layout,
        counted=counted,
        chosen=chosen,
        device=device,
        device_bytes=device_bytes,
        warnings=warnings,
        shapes=shapes,
        model=model,
        blocks=blocks,
        trainable=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        block_bytes=block_bytes,
        largest_block=max((param_bytes([b]) for b in blocks), default=0),
        root_bytes=param_bytes([model]) - block_bytes,
        tp_split=tp_split,
        pp_held=pp_held,
    )


def param_bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def device_memory(layout: Layout) -> tuple[str, int, list[str]]:
    """The device rank 0 of the layout gets, described; the memory one rank may use; warnings
    for a launch the run would refuse (more ranks on a node than GPUs)."""
    device, nproc = layout.device, layout.ranks_per_node
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "mps":
        return "mps", ram, []
    if device.type != "cuda":
        return "cpu", ram // nproc, []  # the node's ranks share its RAM
    warnings = []
    last_rank = dataclasses.replace(layout.env, local_rank=nproc - 1)
    try:
        device_index(last_rank, torch.cuda.device_count())
    except UserError as e:
        warnings.append(f"{str(e).removeprefix('device error: ')}: the run will stop there")
    props = torch.cuda.get_device_properties(0)
    return f"cuda ({props.name})", props.total_memory, warnings


def launch(nproc: int, nnodes: int) -> Env:
    """Rank 0 of a launch of `nnodes` x `nproc` ranks."""
    world = nproc * nnodes
    return Env(
        launcher="torchrun" if world > 1 else "single",
        world_size=world,
        local_world_size=nproc,
        num_nodes=nnodes,
    )

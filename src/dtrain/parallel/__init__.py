"""Wrap a plain model for the run: DDP, FSDP2 (`fully_shard`, per block then the root) or nothing.

Per-block features (activation checkpointing, torch.compile) are applied to the same blocks that
FSDP shards, and without renaming any parameter, so checkpoints load across modes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain import models
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.models import hf
from dtrain.parallel import sharded_init
from dtrain.parallel.precision import Precision
from dtrain.process import dist, host_memory
from dtrain.process.layout import Layout

# Entered at every step where gradient sync is not switched: one context that does nothing,
# made once (a nullcontext keeps no state).
NOTHING = contextlib.nullcontext()


def find_blocks(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The model's repeated blocks: modules of the named classes, or with `None` ('auto') those
    of the classes a Hugging Face model names as its blocks (`_no_split_modules`), else each
    child with parameters of the model's sequential stages (Sequential / ModuleList) that is itself
    made of layers. Blocks are never nested in each other."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()

    def mark(module: nn.Module) -> None:
        blocks.append(module)
        inside.update(id(m) for m in module.modules())

    if class_names is None and own_block_classes(model):
        class_names = own_block_classes(model)
    if class_names is not None:
        wanted = set(class_names)
        for module in model.modules():
            if type(module).__name__ in wanted and id(module) not in inside and module is not model:
                mark(module)
        found = {type(b).__name__ for b in blocks}
        missing = wanted - found
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(
                f"config error: parallel.fsdp.wrap: no module of class "
                f"{', '.join(sorted(missing))} in the model; it has {', '.join(present)}"
            )
        return blocks
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = list(module.children())
        composite = [
            c
            for c in children
            if any(True for _ in c.children()) and any(True for _ in c.parameters())
        ]
        if len(composite) >= 2:
            for child in composite:
                mark(child)
    return blocks


def own_block_classes(model: nn.Module) -> list[str]:
    """The block classes a Hugging Face model declares (`_no_split_modules`) that it has."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    return sorted(declared & {type(m).__name__ for m in model.modules()})


def describe_blocks(blocks: list[nn.Module], model: nn.Module) -> str:
    """For the banner: what FSDP shards as units."""
    counts: dict[str, int] = {}
    for block in blocks:
        if block is not model:
            counts[type(block).__name__] = counts.get(type(block).__name__, 0) + 1
    units = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
    why = " (the model's _no_split_modules)" if own_block_classes(model) else ""
    return f"FSDP units: {units}{why}, then the root"


def _checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in backward instead of storing them. The block keeps its
    parameter names: its forward is replaced on the instance, not wrapped in a new module."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


class CrossRankBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are those of every rank's batch together, on any
    device. torch's SyncBatchNorm (used on GPUs) refuses CPU tensors; this one reduces each
    channel's sum, sum of squares and count in one differentiable all-reduce, whose backward sums
    the gradients of the statistics over the ranks. Parameter and buffer names are BatchNorm's,
    so checkpoints load either way."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input, got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed.nn.functional as dist_nn

        if not self.training or dist.world_size() == 1:
            return super().forward(x)
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        count = torch.full((1,), x.numel() // channels, dtype=x.dtype, device=x.device)
        totals = dist_nn.all_reduce(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = totals[-1]
        mean = totals[:channels] / n
        var = (totals[channels : 2 * channels] / n - mean * mean).clamp_min(0)
        # BatchNorm registers the three buffers together: all tensors, or all None.
        running_mean, running_var = self.running_mean, self.running_var
        batches = self.num_batches_tracked
        if (
            self.track_running_stats
            and running_mean is not None
            and running_var is not None
            and batches is not None
        ):
            with torch.no_grad():
                batches.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(batches)
                running_mean.lerp_(mean.detach(), momentum)
                running_var.lerp_(var.detach() * n / (n - 1).clamp_min(1), momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer computes its statistics over all ranks (parallel.sync_batchnorm)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(
            child, CrossRankBatchNorm
        ):
            synced = CrossRankBatchNorm(
                child.num_features,
                child.eps,
                child.momentum,
                child.affine,
                child.track_running_stats,
            )
            synced.load_state_dict(child.state_dict())
            setattr(model, name, synced)
        else:
            convert_sync_batchnorm(child, device)
    return model


@torch.no_grad()
def average_buffers(model: nn.Module) -> None:
    """Make every rank's floating-point buffers (BatchNorm's running statistics) the mean over
    the ranks, in one all-reduce: without sync_batchnorm each rank's statistics follow its own
    batches, and evaluation and checkpoints must not depend on which rank's copy they see."""
    if dist.world_size() == 1:
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1).float() for b in buffers])
    torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.SUM)
    flat /= torch_dist.get_world_size()
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def build(
    cfg: Config, info: dict[str, Any], layout: Layout, precision: Precision
) -> tuple[nn.Module, int, list[str]]:
    """The model for the run, wrapped for the parallel mode; its number of parameters; and a
    note for the banner on how it was built.

    Under FSDP each rank builds only its own shard (`sharded_init`): the model's constructor runs
    with large tensors holding this rank's rows, the model is sharded on the meta device, and the
    kept values fill the shards. A model whose construction cannot be replayed that way is built
    whole on every rank and then sharded, with a warning saying why."""

    def construct() -> nn.Module:
        model = models.build(cfg.model, info, cfg.run.seed)
        if cfg.parallel.sync_batchnorm and layout.mode != "none":
            model = convert_sync_batchnorm(model, layout.device)
        return model

    if not layout.is_fsdp:
        model = construct()
        return wrap(model, cfg, layout, precision), _count(model), []
    memory_note = host_memory.return_freed_memory()
    notes = [memory_note] if memory_note else []
    shards = layout.shards
    # An `hf:` folder that holds every tensor of the model: each rank reads its own rows of each
    # tensor into its shards, after the build (which draws no weights).
    weight_files = hf.late_weights(cfg.model, info)
    try:
        with hf.weights_later() if weight_files else contextlib.nullcontext():
            model, params, buffers = sharded_init.build_local(
                construct, shards, layout.shard_index, values=weight_files is None
            )
    except sharded_init.NotReplayable as e:
        log.warning(
            f"model {cfg.model.name}: its construction cannot be replayed shard by shard "
            f"({e}); building it whole on every rank, then sharding it"
        )
        model = construct()
        count = _count(model)
        wrapped = wrap(model, cfg, layout, precision, notes=notes)
        return wrapped, count, [f"model built whole on every rank, then sharded ({e})", *notes]
    count = _count(model)
    wrapped = wrap(model, cfg, layout, precision, on_meta=True, notes=notes)
    wrapped.to_empty(device=layout.device)
    sharded_init.materialize(wrapped, params, buffers, weight_files)
    if weight_files:
        notes.append(
            f"weights read by rows: each rank read only its own rows of the folder's "
            f"safetensors ({weight_files.read / 2**20:.1f} of {weight_files.total / 2**20:.1f} "
            f"MiB here)"
        )
    return (
        wrapped,
        count,
        [
            f"model constructed shard by shard: each rank built only its "
            f"own 1/{shards} of every large tensor (values as the whole model's)",
            *notes,
        ],
    )


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def wrap(
    model: nn.Module,
    cfg: Config,
    layout: Layout,
    precision: Precision,
    on_meta: bool = False,
    notes: list[str] | None = None,
) -> nn.Module:
    """Move the model to the device (unless it is on the meta device, to be materialised after
    sharding) and apply the per-block features and the parallel mode; under FSDP, say in `notes`
    what it shards as units."""
    if not on_meta:
        model.to(layout.device)
    if cfg.model.channels_last:
        model.to(memory_format=torch.channels_last)
    wrap_classes = cfg.parallel.fsdp.wrap if isinstance(cfg.parallel.fsdp.wrap, list) else None
    needs_blocks = layout.is_fsdp or cfg.model.activation_checkpointing or cfg.model.compile
    blocks = find_blocks(model, wrap_classes) if needs_blocks else []
    if needs_blocks and not blocks:
        blocks = [model]
    if cfg.model.activation_checkpointing:
        for block in blocks:
            if block is not model:
                _checkpoint_activations(block)
    if cfg.model.compile:
        for block in blocks:
            block.compile()
    if layout.mode == "none":
        return model
    if layout.mode == "ddp":
        ddp = cfg.parallel.ddp
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers.
        sync_buffers = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
            else "broadcast_buffers"
        )
        # The keyword's name depends on the torch version, so it goes in as a dict.
        buffer_option: dict[str, Any] = {sync_buffers: ddp.broadcast_buffers}
        return DDP(
            model,
            device_ids=[layout.device.index] if layout.device.type == "cuda" else None,
            bucket_cap_mb=ddp.bucket_cap_mb,
            find_unused_parameters=ddp.find_unused_parameters,
            static_graph=ddp.static_graph,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            **buffer_option,
        )
    if notes is not None:
        notes.append(describe_blocks(blocks, model))
    return _fully_shard(model, blocks, cfg, layout, precision)


def _fully_shard(
    model: nn.Module, blocks: list[nn.Module], cfg: Config, layout: Layout, precision: Precision
) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        OffloadPolicy,
        fully_shard,
    )

    fsdp = cfg.parallel.fsdp
    device_type = layout.device.type
    if layout.replicas > 1:
        mesh = init_device_mesh(
            device_type, (layout.replicas, layout.shards), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device_type, (layout.shards,), mesh_dim_names=("shard",))
    if fsdp.cpu_offload and device_type != "cuda":
        raise UserError(
            "config error: parallel.fsdp.cpu_offload: offloading needs CUDA devices; "
            "on the CPU the state is already in host memory"
        )
    shard = functools.partial(
        fully_shard,
        mesh=mesh,
        reshard_after_forward=fsdp.reshard_after_forward,
        mp_policy=precision.fsdp_policy(),
        # A plain OffloadPolicy is fully_shard's default: no offloading.
        offload_policy=CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy(),
    )
    for block in blocks:
        if block is not model:
            shard(block)
    shard(model)
    return model


def reshard(model: nn.Module) -> None:
    """Put FSDP2 units back in their sharded state. A forward outside training (the start-up
    check of the task) leaves units unsharded when reshard_after_forward is off, and the
    optimizer must be built on the sharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if isinstance(model, DDP) else model

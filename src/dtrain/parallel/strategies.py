"""The parallel strategy: one object per way of spreading the model over the ranks, made once
from the `parallel` section and the run's layout.

- `SingleProcess` (mode none): the bare model; one process, whatever the config says.
- `DDP`: the whole model on every rank, gradients all-reduced.
- `FSDP`: FSDP2's `fully_shard` per block, then the root; each rank builds and holds only its
  shard of the state (`sharded_init`).
- `HSDP`: FSDP on a 2-D mesh: sharded inside each of `hybrid_replicas` groups, replicated
  across them.

A strategy answers what differs between them: how the ranks are laid out (`mesh`, a class
method: it is asked before any process group exists, and decides the checkpoint's default
format), how the model is built and wrapped (`build`, `wrap`), whether a micro-batch syncs its
gradients (`gradient_sync`), what follows a forward outside training (`settle`), the layout an
evaluation at another world size uses (`for_world_size`), and what `dtrain plan` counts
(`counted`). Gradient clipping needs nothing of it: the norm of FSDP's sharded gradients is a
DTensor whose full value is the global norm, as DDP's is (loop/grads.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain import models
from dtrain.config import ModelConfig, ParallelConfig
from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.models import Weights, hf
from dtrain.parallel import sharded_init
from dtrain.parallel.batchnorm import convert_sync_batchnorm
from dtrain.parallel.blocks import checkpoint_activations, describe_blocks, find_blocks
from dtrain.parallel.precision import Precision
from dtrain.process import host_memory
from dtrain.process.env import Env
from dtrain.process.layout import Layout, Mesh

# Entered at every step where gradient sync is not switched: one context that does nothing,
# made once (a nullcontext keeps no state).
NOTHING = contextlib.nullcontext()

# What changes a model's layers, not its values, before it is distributed (e.g. swapping layers
# for ones that compute differently): the wrappers then hold the layers it made. It may see
# tensors without values (a shard-by-shard construction), and must keep parameters' names.
Prepare = Callable[[nn.Module], object]


@dataclass(frozen=True)
class Counted:
    """A strategy as `dtrain plan` counts it: its row, the ranks its state is split over at the
    launch planned, and whether its parameters are sharded (FSDP's policy casts them: no
    autocast)."""

    row: str  # "ddp" | "fsdp"
    shards: int
    sharded: bool


class Strategy:
    """The bare model on one process; the base of the others."""

    mode: ClassVar[str] = "none"  # parallel.mode's word for it (HSDP's is fsdp)
    sharded: ClassVar[bool] = False  # parameters, gradients and optimizer state split
    checkpoint_format: ClassVar[str] = "full"  # what ckpt.format=auto becomes
    plan_row: ClassVar[str] = "ddp"  # the row of `dtrain plan` that counts it

    def __init__(self, cfg: ParallelConfig, layout: Layout) -> None:
        self.cfg, self.layout = cfg, layout

    @classmethod
    def mesh(cls, cfg: ParallelConfig, env: Env) -> Mesh:
        """How the ranks hold the model (combinations that cannot work are a UserError)."""
        return Mesh(cls.mode, cls.sharded, checkpoint_format=cls.checkpoint_format)

    @classmethod
    def for_world_size(cls, cfg: ParallelConfig, world_size: int) -> ParallelConfig:
        """The section as a run at another world size (an evaluation) uses it."""
        return cfg

    @classmethod
    def counted(cls, cfg: ParallelConfig, env: Env) -> Counted:
        shards = cls.mesh(cfg, env).shards if env.distributed else 1
        return Counted(cls.plan_row, shards, cls.sharded)

    # -- building ------------------------------------------------------------------------------
    def build(
        self,
        model_cfg: ModelConfig,
        info: dict[str, Any],
        seed: int,
        precision: Precision,
        prepare: Prepare | None = None,
    ) -> tuple[nn.Module, int, list[str]]:
        """The model for the run, changed by `prepare` before it is distributed, and wrapped;
        its number of parameters; notes for the banner on how it was built."""
        model = self._construct(model_cfg, info, seed, Weights.LOAD, prepare)
        return self.wrap(model, model_cfg, precision), _count(model), []

    def _construct(
        self,
        model_cfg: ModelConfig,
        info: dict[str, Any],
        seed: int,
        weights: Weights,
        prepare: Prepare | None,
    ) -> nn.Module:
        model = models.build(model_cfg, info, seed, weights)
        if self.cfg.sync_batchnorm and self.layout.distributed:
            model = convert_sync_batchnorm(model, self.layout.device)
        if prepare is not None:
            prepare(model)
        return model

    def wrap(
        self,
        model: nn.Module,
        model_cfg: ModelConfig,
        precision: Precision,
        on_meta: bool = False,
        notes: list[str] | None = None,
    ) -> nn.Module:
        """Move the model to the device (unless it is on the meta device, to be materialised
        after sharding), apply the per-block features (on the blocks FSDP shards, without
        renaming a parameter: checkpoints load across modes) and the strategy's wrapper; say in
        `notes` what is sharded as units."""
        if not on_meta:
            model.to(self.layout.device)
        if model_cfg.channels_last:
            model.to(memory_format=torch.channels_last)
        needs_blocks = self.sharded or model_cfg.activation_checkpointing or model_cfg.compile
        blocks = find_blocks(model, self.cfg.fsdp.wrap) if needs_blocks else []
        if needs_blocks and not blocks:
            blocks = [model]
        if model_cfg.activation_checkpointing:
            for block in blocks:
                if block is not model:
                    checkpoint_activations(block)
        if model_cfg.compile:
            for block in blocks:
                block.compile()
        return self._distribute(model, blocks, precision, notes)

    def _distribute(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        precision: Precision,
        notes: list[str] | None,
    ) -> nn.Module:
        return model

    # -- in the loop ---------------------------------------------------------------------------
    @staticmethod
    def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's backward: gradients synchronised only with `sync`
        (the last micro-batch of an accumulated step)."""
        return NOTHING

    def settle(self, model: nn.Module) -> None:
        """Put the model back as training starts from it after a forward outside training."""


class SingleProcess(Strategy):
    """One process: nothing to wrap the model in; more ranks in mode none are refused."""

    @classmethod
    def mesh(cls, cfg: ParallelConfig, env: Env) -> Mesh:
        if env.world_size > 1:
            raise UserError(
                f"config error: parallel.mode: 'none' with {env.world_size} ranks would train "
                f"{env.world_size} unrelated models; use ddp or fsdp"
            )
        return super().mesh(cfg, env)


class DDP(Strategy):
    """The whole model on every rank; gradients all-reduced in buckets during the backward."""

    mode = "ddp"

    def _distribute(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        precision: Precision,
        notes: list[str] | None,
    ) -> nn.Module:
        ddp = self.cfg.ddp
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers.
        sync_buffers = (
            "forward_sync_buffers"
            if "forward_sync_buffers"
            in inspect.signature(DistributedDataParallel.__init__).parameters
            else "broadcast_buffers"
        )
        # The keyword's name depends on the torch version, so it goes in as a dict.
        buffer_option: dict[str, Any] = {sync_buffers: ddp.broadcast_buffers}
        device = self.layout.device
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=ddp.bucket_cap_mb,
            find_unused_parameters=ddp.find_unused_parameters,
            static_graph=ddp.static_graph,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            **buffer_option,
        )

    @staticmethod
    def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        no_sync = getattr(model, "no_sync", None) if not sync else None
        return no_sync() if no_sync is not None else NOTHING


class FSDP(Strategy):
    """FSDP2 over all ranks: each builds only its own shard of the model, then shards it."""

    mode = "fsdp"
    sharded = True
    checkpoint_format = "sharded"
    plan_row = "fsdp"

    @classmethod
    def mesh(cls, cfg: ParallelConfig, env: Env) -> Mesh:
        replicas = cfg.fsdp.hybrid_replicas
        if env.world_size % replicas:
            raise UserError(
                f"config error: parallel.fsdp.hybrid_replicas: {replicas} does not divide the "
                f"world size {env.world_size}"
            )
        shards = env.world_size // replicas
        return Mesh(
            cls.mode,
            cls.sharded,
            replicas=replicas,
            shards=shards,
            shard_index=env.rank % shards,  # the last dimension of the (replicas, shards) mesh
            checkpoint_format=cls.checkpoint_format,
            # The gradient norm and clipping of offloaded state run collectives on CPU tensors.
            cpu_collectives=cfg.fsdp.cpu_offload,
        )

    def build(
        self,
        model_cfg: ModelConfig,
        info: dict[str, Any],
        seed: int,
        precision: Precision,
        prepare: Prepare | None = None,
    ) -> tuple[nn.Module, int, list[str]]:
        """Each rank builds only its own shard (`sharded_init`): the model's constructor (and
        `prepare`) runs with large tensors holding this rank's rows, the model is sharded on the
        meta device, and the kept values (or an `hf:` folder's rows, read by each rank for its
        own shards) fill the shards. A model whose construction cannot be replayed that way is
        built whole on every rank and then sharded, with a warning saying why."""
        memory_note = host_memory.return_freed_memory()
        notes = [memory_note] if memory_note else []
        weight_files = hf.late_weights(model_cfg, info)
        weights = Weights.LATER if weight_files else Weights.LOAD
        layout = self.layout
        try:
            model, params, buffers = sharded_init.build_local(
                lambda: self._construct(model_cfg, info, seed, weights, None),
                layout.shards,
                layout.shard_index,
                values=weight_files is None,
                prepare=prepare,
            )
        except sharded_init.NotReplayable as e:
            log.warning(
                f"model {model_cfg.name}: its construction cannot be replayed shard by shard "
                f"({e}); building it whole on every rank, then sharding it"
            )
            model = self._construct(model_cfg, info, seed, Weights.LOAD, prepare)
            count = _count(model)
            wrapped = self.wrap(model, model_cfg, precision, notes=notes)
            return wrapped, count, [f"model built whole on every rank, then sharded ({e})", *notes]
        count = _count(model)
        wrapped = self.wrap(model, model_cfg, precision, on_meta=True, notes=notes)
        wrapped.to_empty(device=layout.device)
        sharded_init.materialize(wrapped, params, buffers, weight_files)
        if weight_files:
            notes.append(
                f"weights read by rows: each rank read only its own rows of the folder's "
                f"safetensors ({weight_files.read / 2**20:.1f} of "
                f"{weight_files.total / 2**20:.1f} MiB here)"
            )
        built = (
            f"model constructed shard by shard: each rank built only its own "
            f"1/{layout.shards} of every large tensor (values as the whole model's)"
        )
        return wrapped, count, [built, *notes]

    def _device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            self.layout.device.type, (self.layout.shards,), mesh_dim_names=("shard",)
        )

    def _distribute(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        precision: Precision,
        notes: list[str] | None,
    ) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        if notes is not None:
            notes.append(describe_blocks(blocks, model))
        fsdp = self.cfg.fsdp
        if fsdp.cpu_offload and self.layout.device.type != "cuda":
            raise UserError(
                "config error: parallel.fsdp.cpu_offload: offloading needs CUDA devices; "
                "on the CPU the state is already in host memory"
            )
        shard = functools.partial(
            fully_shard,
            mesh=self._device_mesh(),
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

    @staticmethod
    def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        from torch.distributed.fsdp import FSDPModule

        cast(FSDPModule, model).set_requires_gradient_sync(sync)
        return NOTHING

    def settle(self, model: nn.Module) -> None:
        """A forward outside training (the start-up check of the task) leaves units unsharded
        when reshard_after_forward is off, and the optimizer must be built on the shards."""
        reshard(model)


class HSDP(FSDP):
    """FSDP inside each of `parallel.fsdp.hybrid_replicas` groups, replicated across them."""

    @classmethod
    def for_world_size(cls, cfg: ParallelConfig, world_size: int) -> ParallelConfig:
        """The replica count is a training choice that need not divide another world size:
        there the model is sharded over all ranks."""
        if world_size % cfg.fsdp.hybrid_replicas == 0:
            return cfg
        return dataclasses.replace(cfg, fsdp=dataclasses.replace(cfg.fsdp, hybrid_replicas=1))

    def _device_mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            self.layout.device.type,
            (self.layout.replicas, self.layout.shards),
            mesh_dim_names=("replicate", "shard"),
        )


def reshard(model: nn.Module) -> None:
    """Put FSDP2 units back in their sharded state."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place and needs no unwrapping)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- choosing ----------------------------------------------------------------------------------
BY_MODE: dict[str, type[Strategy]] = {"none": SingleProcess, "ddp": DDP, "fsdp": FSDP}

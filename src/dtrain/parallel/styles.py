"""Parallel styles of dtrain's own, beside torch's: a fused projection split by columns whose
parts each rank must hold its share of (`FusedColwise`), and a module kept whole on every rank
of the tp group as replicated DTensors (`Replicated`)."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


class _Regroup(torch.autograd.Function):
    """A fused projection of `parts` equal parts (GPT's [q; k; v]) split by columns over the
    group: each rank's slice holds whole blocks of columns, not its share of each part. One
    all-to-all gives each rank its columns of every part (its heads of q, k and v), in order;
    the backward sends the gradients back the same way. No arithmetic: exact."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, parts: int, group: Any) -> torch.Tensor:
        size, rank = torch_dist.get_world_size(group), torch_dist.get_rank(group)
        lead, width = local.shape[:-1], local.shape[-1] // parts
        blocks = local.reshape(-1, parts, width).transpose(0, 1)  # (parts, rows, width)
        # Block i of this rank is global block rank * parts + i: part (that // size), the share
        # of rank (that % size). Sent in order of the rank it goes to.
        owner = [(rank * parts + i) % size for i in range(parts)]
        order = sorted(range(parts), key=lambda i: (owner[i], i))
        send = [owner.count(r) for r in range(size)]
        recv = [sum((src * parts + i) % size == rank for i in range(parts)) for src in range(size)]
        out = blocks.new_empty(blocks.shape)  # contiguous (empty_like would keep the transpose)
        torch_dist.all_to_all_single(out, blocks[order].contiguous(), recv, send, group=group)
        ctx.routing = (parts, group, order, send, recv, lead)
        return out.transpose(0, 1).reshape(*lead, parts * width)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        parts, group, order, send, recv, lead = ctx.routing
        width = grad.shape[-1] // parts
        blocks = grad.reshape(-1, parts, width).transpose(0, 1).contiguous()
        back = blocks.new_empty(blocks.shape)
        torch_dist.all_to_all_single(back, blocks, send, recv, group=group)
        restored = torch.empty_like(back)
        restored[order] = back
        return restored.transpose(0, 1).reshape(*lead, parts * width), None, None


class FusedColwise(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is `parts` projections side by side: the
    weight is split by rows as ColwiseParallel splits it (its checkpoint is that of any other
    layout), and the output regrouped so that each rank holds its columns of every part."""

    def __init__(self, parts: int, **layouts: Any) -> None:
        super().__init__(**layouts)
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group, parts = device_mesh.get_group(), self.parts
        module.register_forward_hook(lambda _m, _i, out: _Regroup.apply(out, parts, group))
        return module


def _as_replicated(_module: nn.Module, args: tuple, mesh: Any) -> tuple:
    return tuple(
        DTensor.from_local(a, mesh, [Replicate()], run_check=False)
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
        else a
        for a in args
    )


def _as_local(_module: nn.Module, out: Any, _mesh: Any) -> Any:
    return out.to_local() if isinstance(out, DTensor) else out


class Replicated(ParallelStyle):
    """The whole module on every rank of the group, its parameters DTensors replicated over it
    (inputs in, outputs out as plain tensors). Its gradients are equal on every rank of the
    group (its inputs are), so nothing is exchanged."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        # (torch types input_fn as returning None; the inputs it returns replace the given ones)
        return distribute_module(module, device_mesh, None, cast(Any, _as_replicated), _as_local)

"""What a step asks of the gradients: whether any is non-finite, and their global norm. On a
model of a few thousand parameters either costs more than its optimizer step when done the
general way, so each has a path for the common case (plain tensors of one device and dtype)
that does the same arithmetic with fewer operations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dtrain.process import compat

if TYPE_CHECKING:
    from dtrain.parallel import Pipe
    from dtrain.parallel.precision import Precision


def one_kind(grads: list[torch.Tensor]) -> bool:
    """Whether the gradients are plain dense tensors (no DTensor shards, nothing sparse) of one
    device (CPU or CUDA) and one dtype: what the fused paths below take."""
    if not grads:
        return False
    first = grads[0]
    if first.device.type not in ("cpu", "cuda"):
        return False
    kind = (first.device, first.dtype)
    return all(
        type(g) is torch.Tensor and g.layout == torch.strided and (g.device, g.dtype) == kind
        for g in grads
    )


def total_norm(grads: list[torch.Tensor], fast: bool) -> torch.Tensor:
    """The 2-norm of all the gradients, as torch's get_total_norm(foreach=True) computes it. With
    `fast` (see `one_kind`), its very operations (one foreach norm, the norm of their stack)
    without its grouping of the tensors by device and dtype: the same bits, sooner."""
    if fast:
        with torch.no_grad():
            return torch.linalg.vector_norm(torch.stack(compat.foreach_norms(grads)), 2.0)
    return nn.utils.get_total_norm(grads, foreach=True)


def nonfinite_flag(grads: list[torch.Tensor], one: torch.Tensor) -> torch.Tensor:
    """1.0 where any gradient holds an inf or a nan, else 0.0: a 0-d float tensor on the
    gradients' device, as fused optimizers take it (`found_inf`; Adam's needs the 0-d shape of
    its step counts). One fused pass (the grad scaler's own check, with a scale of exactly 1:
    every gradient keeps its bits). The gradients must be `one_kind`; `one` is a 0-d float32
    1.0 on their device."""
    found = torch.zeros((), dtype=torch.float32, device=one.device)
    compat.flag_nonfinite(grads, found, one)
    return found


class Check:
    """A step's look at its gradients: whether it is non-finite and, where wanted, the global
    norm of the whole (unsharded) model, clipping first when a maximum is set. The parameters
    are listed once (wrapping is done: the set no longer changes), since walking the modules
    for them costs more than a tiny model's optimizer step."""

    def __init__(
        self,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        pipe: Pipe | None = None,
    ) -> None:
        self.params, self.optimizer, self.pipe = params, optimizer, pipe
        self.one = torch.ones((), dtype=torch.float32, device=device)
        self.one_kind: bool | None = None  # the gradients' kind, seen at the first step
        self.device = device

    def __call__(
        self, wants_norm: bool, max_norm: float | None, precision: Precision
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's non-finite flag (float on the device, non-zero: skip it) and its norm
        (None where neither wanted nor needed for clipping). Under fp16, the norm of the
        unscaled gradients (those the optimizer will apply), and the grad scaler decides
        instead of the flag (always zero here)."""
        precision.unscale(self.optimizer)
        grads = [g for p in self.params if (g := p.grad) is not None]
        if self.one_kind is None:  # the gradients' kind does not change during a run
            self.one_kind = one_kind(grads)
        if self.pipe is not None:
            skip, norm = self._over_stages(max_norm)
            return (torch.zeros((), device=self.device) if precision.scaled else skip), norm
        if max_norm is None and not precision.scaled and self.one_kind:
            # Plain tensors (no shards; DDP averaged them: every rank sees the same): one fused
            # pass finds a non-finite gradient, and the dearer norm waits for a check to want it.
            return nonfinite_flag(grads, self.one), (
                total_norm(grads, True) if wants_norm else None
            )
        if max_norm is not None:
            params = [p for p in self.params if p.grad is not None]
            norm = nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            norm = total_norm(grads, bool(self.one_kind))
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the full value is the global norm
            norm = norm.full_tensor()
        if precision.scaled:
            return torch.zeros((), device=self.device), norm
        # The norm is global (reduced over FSDP's shards): every rank reaches the same verdict.
        return (~torch.isfinite(norm)).float(), norm

    def _over_stages(self, max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline's stages each hold some of the weights: the norm of the whole is reduced
        over them (each weight counted once), and clipping scales every rank's gradients by the
        same factor, as torch's clip_grad_norm_ computes it."""
        assert self.pipe is not None
        counted = [g for p in self.pipe.counted(self.params) if (g := p.grad) is not None]
        local = total_norm(counted, bool(self.one_kind))
        if hasattr(local, "full_tensor"):  # (FSDP's or tp's shards of this rank's stages)
            local = local.full_tensor()
        norm = self.pipe.total_norm(local)
        if max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for param in self.params:
                grad = param.grad
                if grad is not None:
                    (grad.to_local() if hasattr(grad, "to_local") else grad).mul_(coef)
        return (~torch.isfinite(norm)).float(), norm

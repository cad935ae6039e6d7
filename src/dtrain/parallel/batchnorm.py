"""BatchNorm across ranks: statistics over every rank's batch (sync_batchnorm), or each rank's
running statistics averaged so that evaluation and checkpoints do not depend on the rank."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import nn

from dtrain.process import dist


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

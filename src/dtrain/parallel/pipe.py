"""A pipeline's stages at run time: `Pipe` runs one optimizer step's micro-batches through them
in the order of one of torch's schedules (the task's loss on the last stage, the tied weight's
gradients summed between the first and last stage), and `Evaluator` runs them one after
another for evaluation. `pipeline.py` cuts the model and makes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as torch_dist
from torch import nn

from dtrain.core.errors import UserError


class _Given:
    """A model that returns the output a stage computed: the task's own loss and metrics of it."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output

    def __call__(self, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        return self.output


def _plain_windows(batch: Any) -> torch.Tensor:
    if not isinstance(batch, torch.Tensor):
        raise UserError(
            "config error: parallel.pp.size: pipeline parallelism takes batches of plain token "
            "windows (task language_model, without loss masks, packed documents or a mix of "
            "sources); set parallel.pp.size=1 for this data"
        )
    return batch


class Pipe:
    """This rank's stages and their schedule: `train` runs one optimizer step's forwards and
    backwards, `evaluator` the stages' forward for evaluation (what the task's metrics read)."""

    def __init__(
        self,
        parts: list[Any],
        num_stages: int,
        schedule: str,
        microbatches: int,
        mesh: Any,
        device: torch.device,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.parts, self.num_stages, self.microbatches = parts, num_stages, microbatches
        self.stage_ids = [part.stage for part in parts]
        self.device = device
        pp_mesh = mesh["pp"]
        self.group = pp_mesh.get_group()
        self.ranks: list[int] = pp_mesh.mesh.tolist()  # this pipeline's ranks, by pp rank
        self.first = any(p.first for p in parts)
        self.last = any(p.last for p in parts)
        stages = [
            PipelineStage(part, sid, num_stages, device, group=self.group)
            for part, sid in zip(parts, self.stage_ids, strict=True)
        ]
        self.task: Any = None
        self.scaler: Any = None
        self._unscaled: dict[int, torch.Tensor] = {}
        self.schedule = _schedule(schedule, stages, microbatches, self._loss)
        self.tied_group = _tied_group(mesh)
        self.tied: list[nn.Parameter] = []
        self.counted_out: set[int] = set()
        self.vocab = 0

    def share(self, names: dict[int, list[str]], vocab: int) -> None:
        """The weights (by name in each stage's part) that the first and the last stage both
        hold (a tied embedding and head): summed after each backward, counted once in the
        gradient norm (on the first stage); and the logits' vocabulary."""
        ends = [part for part in self.parts if part.first != part.last]
        for part in ends:
            params = [part.get_parameter(name) for name in names.get(part.stage, [])]
            self.tied += params
            if part.last:
                self.counted_out |= {id(p) for p in params}
        self.vocab = vocab

    def use_task(self, task: Any, scaler: Any = None) -> None:
        """The task whose loss the last stage computes, and under fp16 the grad scaler that
        scales it before the schedule's backward."""
        self.task, self.scaler = task, scaler
        if scaler is not None:  # (its scale made on every rank: only the last stage scales)
            scaler.scale(torch.zeros((), device=self.device))

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each micro-batch's mean loss over their count: summed, the step's mean; the
        # gradients those of DDP's mean (the schedule's own scaling is off).
        loss = self.task.loss(_Given(output), target) / self.microbatches
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def train(self, batches: list[Any]) -> torch.Tensor:
        """One optimizer step's forwards and backwards over `batches` (the step's micro-batches
        of data.batch_size, cut again into the schedule's): the step's loss, on every rank of
        the pipeline; the tied weight's gradients summed."""
        windows = [_plain_windows(b) for b in batches]
        batch = windows[0] if len(windows) == 1 else torch.cat(windows)
        args = (self.task.model_input(batch),) if self.first else ()
        self._unscaled.clear()
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *args, target=batch if self.last else None, losses=losses, return_outputs=False
        )
        if self.last:  # (the micro-batches' own, as `_loss` computed them before any scaling)
            loss = torch.stack([self._unscaled[id(x)] for x in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        torch_dist.all_reduce(loss, group=self.group)  # from the last stage (0 + x is x)
        self._sum_tied()
        return loss

    def _sum_tied(self) -> None:
        if self.tied_group is None or not self.tied:
            return
        for param in self.tied:
            grad: Any = param.grad
            if grad is None:
                continue
            placements = getattr(param, "placements", None)
            if placements is not None and grad.placements != placements:
                # (the first stage's may come back whole where the weight is split: laid out
                # as the weight on both ends before they are summed)
                grad = param.grad = grad.redistribute(grad.device_mesh, placements)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            torch_dist.all_reduce(local, group=self.tied_group)

    def counted(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters the gradient norm counts: each weight once over the pipeline."""
        return [p for p in params if id(p) not in self.counted_out]

    def total_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The pipeline's gradient norm from this rank's stages' own."""
        squares = local.double().square()
        torch_dist.all_reduce(squares, group=self.group)
        return squares.sqrt().to(local.dtype)

    def evaluator(self, model: nn.Module) -> Evaluator:
        return Evaluator(self, model)

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The stages' forward over a whole batch, stage after stage: the logits on the last
        stage's rank, None on the others."""
        pp_size = len(self.ranks)
        mine = dict(zip(self.stage_ids, self.parts, strict=True))
        x: torch.Tensor | None = inputs
        for stage in range(self.num_stages):
            owner, before = stage % pp_size, (stage - 1) % pp_size
            me = self.ranks.index(torch_dist.get_rank())
            if owner != me:
                if stage > 0 and before == me:
                    _send(cast(torch.Tensor, x), self.ranks[owner])
                continue
            if stage > 0 and before != me:
                x = _recv(self.ranks[before], self.device)
            x = mine[stage](x)
        return x if self.last else None


class Evaluator:
    """The pipeline as the task's metrics call a model: logits on the last stage's rank; on the
    others zeros of the same shape, which evaluation does not count (`counts`)."""

    def __init__(self, pipe: Pipe, model: nn.Module) -> None:
        self.pipe, self.model = pipe, model
        self.counts = pipe.last

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> Evaluator:
        self.model.train(mode)
        return self

    def eval(self) -> Evaluator:
        return self.train(False)

    def __call__(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            _plain_windows(None)  # packed documents: refused in one line
        logits = self.pipe.forward(inputs)
        if logits is not None:
            return logits
        shape = (*inputs.shape, self.pipe.vocab)
        return torch.zeros((), device=inputs.device).expand(shape)


def _send(x: torch.Tensor, to: int) -> None:
    header = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], dtype=torch.int64)
    torch_dist.send(header.to(x.device), to)
    torch_dist.send(x.contiguous(), to)


def _recv(source: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(4, dtype=torch.int64, device=device)
    torch_dist.recv(header, source)
    *shape, dtype = header.tolist()
    x = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    torch_dist.recv(x, source)
    return x


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tied_group(mesh: Any) -> Any:
    """The group of each pipeline's first and last ranks (the same coordinates elsewhere); None
    where they are all of the pipeline (2 stage ranks: its own group would do, but one kind of
    group keeps the code one)."""
    grid = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
    pp = grid.shape[0]
    me = torch_dist.get_rank()
    found = None
    for pair in zip(grid[0].flatten().tolist(), grid[pp - 1].flatten().tolist(), strict=True):
        group = torch_dist.new_group(list(pair))  # (every rank makes every group, in order)
        if me in pair:
            found = group
    return found


def _schedule(name: str, stages: list[Any], microbatches: int, loss: Callable) -> Any:
    from torch.distributed.pipelining import schedules

    single = {"gpipe": schedules.ScheduleGPipe, "1f1b": schedules.Schedule1F1B}
    multi = {
        "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
        "zero_bubble": schedules.ScheduleInterleavedZeroBubble,
    }
    if name in single:
        return single[name](stages[0], microbatches, loss_fn=loss, scale_grads=False)
    return multi[name](stages, microbatches, loss_fn=loss, scale_grads=False)

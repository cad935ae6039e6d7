"""One optimizer step's micro-batches (`train.grad_accum`), each forward and backward in turn,
the gradients synchronised on the last: what a step trains outside a pipeline (a pipeline's
stages run their schedule instead, `parallel.Pipe`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from dtrain import parallel
from dtrain.loop.components import Learner
from dtrain.process import dist
from dtrain.process.layout import Layout
from dtrain.process.whereabouts import Whereabouts


class MicroBatches:
    """The micro-batches of a step on the learner's model, as the layout synchronises them."""

    def __init__(self, learner: Learner, layout: Layout) -> None:
        self.model, self.task, self.precision = learner.model, learner.task, learner.precision
        self.layout, self.accum = layout, layout.grad_accum
        # A task that may count only some targets (tasks.py): see forward_backward.
        self.counted = getattr(learner.task, "counted", None)
        # With loss parallelism, each forward and backward under split logits.
        self.loss_context = parallel.loss_context(learner.model)

    def forward_backward(
        self, fetch: Callable[[], Any], where: Whereabouts
    ) -> tuple[torch.Tensor, float]:
        """The step's micro-batches, forward and backward one after another: the step's loss
        and how long the last backward (which exchanges the gradients) took."""
        model, accum, precision = self.model, self.accum, self.precision
        step_loss: torch.Tensor | None = None
        exchange = 0.0
        fetched, over = [fetch()], None
        if self.counted is not None and self.counted(fetched[0]) is not None:
            # A loss over the targets a mask counts: the step's micro-batches are fetched
            # first, and each one's loss divided by what they count on every rank together.
            fetched += [fetch() for _ in range(accum - 1)]
            over = self.counted_per_rank(fetched)
        for micro in range(accum):
            batch = fetched[micro] if micro < len(fetched) else fetch()
            where.phase = "forward/backward"
            last = micro == accum - 1
            with self.loss_context:
                with self.gradient_sync(last), precision.autocast():
                    if over is not None:
                        loss = self.task.loss(model, batch, over)  # type: ignore[call-arg]
                    else:
                        loss = self.task.loss(model, batch)
                        if accum > 1:  # (dividing by 1 changes no bit, but costs two ops a step)
                            loss = loss / accum
                backward_began = time.perf_counter()
                precision.backward(loss)
            # The last backward exchanges the gradients: the ranks wait there for the slowest.
            exchange = time.perf_counter() - backward_began
            # The first micro-batch's loss as it is (0 + x is x), the others added to it.
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        assert step_loss is not None  # grad_accum >= 1
        return step_loss, exchange

    def counted_per_rank(self, batches: list[Any]) -> torch.Tensor | None:
        """The targets a step's micro-batches count on every rank together, over the world
        size: what each micro-batch's summed loss is divided by, since DDP and FSDP average the
        gradients over the ranks. None where the batches count every target."""
        assert self.counted is not None
        counts = [self.counted(batch) for batch in batches]
        if any(c is None for c in counts):
            return None
        total = dist.all_reduce_sum(torch.stack(counts).sum().float())  # (a new tensor)
        return total.clamp(min=1.0) / dist.world_size()

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Synchronise gradients only on the last micro-batch of an accumulated step."""
        if self.accum == 1:
            return parallel.NOTHING
        return parallel.gradient_sync(self.layout, self.model, sync)

"""The loop's checkpoints: when one is due (`ckpt.every_steps`, `ckpt.every_epochs`), a save
that never keeps non-finite weights, and the run's last one, tried again where a failed save may
pass. What a checkpoint holds is the `Checkpointer`'s business; the loop calls these only after
the ranks agreed (every rank saves, at the same step)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from dtrain.checkpoint import Checkpointer
from dtrain.config import CkptConfig
from dtrain.core.errors import TrainingStopped
from dtrain.loop.components import Learner
from dtrain.loop.state import TrainState
from dtrain.process import compat, dist
from dtrain.process.whereabouts import Whereabouts


class Saving:
    """Saves the run's checkpoints through `checkpoints` at the steps `ckpt` asks; `saved` are
    called after each (the run record). Without `writes` (a replica group other than the first,
    which heals from a live peer instead) it saves nothing."""

    def __init__(
        self,
        checkpoints: Checkpointer,
        ckpt: CkptConfig,
        learner: Learner,
        where: Whereabouts,
        saved: list[Callable[[TrainState], None]],
        writes: bool = True,
    ) -> None:
        self.checkpoints, self.ckpt, self.learner = checkpoints, ckpt, learner
        self.writes = writes
        self.where, self.saved = where, saved
        self.last_save_s: float | None = None  # how long the last save took

    def due_by_steps(self, step: int) -> bool:
        every = self.ckpt.every_steps
        return self.writes and every is not None and step % every == 0

    def due_at_epoch_end(self, state: TrainState) -> bool:
        """At the end of an epoch (`state.epoch` is the next one's): by epochs or by steps."""
        every = self.ckpt.every_epochs
        by_epochs = self.writes and every > 0 and state.epoch % every == 0
        return by_epochs or self.due_by_steps(state.step)

    def save(self, state: TrainState) -> None:
        """A checkpoint at the state's step, unless a rank's weights are not finite (then the
        run stops, the last good checkpoint kept)."""
        started = time.perf_counter()
        model = self.learner.model
        with self.where.doing("checkpoint"):
            self.learner.consistent_buffers()
            if dist.any_rank(not _all_finite(model), self.checkpoints.device):
                raise TrainingStopped(
                    f"the weights are not finite at step {state.step}; not "
                    f"saving them (the last good checkpoint is kept)"
                )
            self.checkpoints.save(state.step, state.epoch, state.last_eval)
        self.last_save_s = time.perf_counter() - started
        for hook in self.saved:
            hook(state)

    def save_last(self, state: TrainState, attempts: int = 4) -> None:
        """The run's last checkpoint, unless this step is saved: where a failed save may pass
        (an object store), tried again after 5, 10 and 20 s; the run fails (exit 1, the previous
        checkpoint kept) only if the last attempt fails too."""
        checkpoints = self.checkpoints
        if not self.writes:
            return
        for attempt in range(attempts):
            if checkpoints.last_saved_step != state.step:
                self.save(state)
            checkpoints.wait()
            if checkpoints.last_saved_step == state.step:
                return
            if attempt < attempts - 1:
                time.sleep(5 * 2**attempt)
        assert checkpoints.last_error is not None
        raise checkpoints.last_error


@torch.no_grad()
def _all_finite(model: nn.Module) -> bool:
    """Whether this rank's parameters (its shards under FSDP) are all finite: one fused check."""
    local = [compat.local_part(p) for p in model.parameters()]
    local = [t for t in local if t.numel()]
    return not local or bool(torch.isfinite(nn.utils.get_total_norm(local, norm_type=math.inf)))

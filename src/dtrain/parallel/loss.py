"""Loss parallelism (`parallel.tp.loss_parallel`): in a training step the output head's logits
stay split by vocabulary over the tp group, and the cross-entropy is computed on the parts
(torch's `loss_parallel`: a max, a sum of exponentials and the target's logit, each reduced over
the group) instead of on logits all-gathered to every rank. The logits a rank holds are 1/tp of
their size, and so is the softmax's memory in the backward. Outside a training step (the
start-up check, evaluation, generation) the head gathers its logits whole, as without it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

# Set while a training step's forward and backward run under split logits.
_SPLIT = contextvars.ContextVar("dtrain_split_logits", default=False)
_MARK = "_dtrain_splits_logits"


def _gathered_outside_a_step(_module: nn.Module, _inputs: tuple, out: Any) -> Any:
    if _SPLIT.get() or not isinstance(out, DTensor):
        return out
    return out.redistribute(out.device_mesh, [Replicate()]).to_local()


class SplitLogits(ColwiseParallel):
    """The output head split by vocabulary (as ColwiseParallel splits it), its logits left a
    DTensor split by their last dimension inside a training step, gathered whole outside."""

    def __init__(self, **layouts: Any) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False, **layouts)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(_gathered_outside_a_step)
        setattr(module, _MARK, True)
        return module


def splits_logits(model: nn.Module) -> bool:
    """Whether a head of `model` leaves its logits split in a training step."""
    return any(getattr(m, _MARK, False) for m in model.modules())


class SplitLoss(contextlib.AbstractContextManager):
    """A training step's forward and backward with the head's logits split and the
    cross-entropy computed on the parts (entered once per micro-batch; not re-entrant)."""

    def __enter__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.callback(_SPLIT.reset, _SPLIT.set(True))
        self._stack.enter_context(loss_parallel())

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

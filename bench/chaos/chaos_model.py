"""The model every chaos job trains (`model.name=chaos_model:paced_cnn`, bench/chaos on the
path): SimpleCNN whose training forward takes at least `delay_s`, so that a fault lands inside a
step (forward, backward, all-reduce) as often as between steps. It is also where the one fault
that must come from inside a rank comes from: when the harness leaves a file `nan.rank<R>` in
$CHAOS_REQUESTS, rank R's next training step gets NaN gradients (a hook on its output's
gradient), and the file is removed so that the fault happens once, whatever restarts follow."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from dtrain.config import ModelConfig
from dtrain.models import SimpleCNN


class PacedCNN(SimpleCNN):
    def __init__(self, num_classes: int, width: int, delay_s: float) -> None:
        super().__init__(num_classes, width=width)
        self.delay_s = delay_s
        requests = os.environ.get("CHAOS_REQUESTS")
        rank = os.environ.get("RANK", "0")
        self.nan_request = os.path.join(requests, f"nan.rank{rank}") if requests else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            time.sleep(self.delay_s)
            if self.nan_request and _take(self.nan_request):
                out.register_hook(lambda grad: grad * float("nan"))
        return out


def _take(path: str) -> bool:
    """Whether the request at `path` was there; it is gone after."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def paced_cnn(cfg: ModelConfig) -> nn.Module:
    return PacedCNN(cfg.num_classes or 10, cfg.args.get("width", 8), cfg.args.get("delay_s", 0.03))

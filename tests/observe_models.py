"""User models for the observability tests, loaded by import path (`model.name=observe_models:NAME`)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from dtrain.config import ModelConfig
from dtrain.models import SimpleCNN


class _Paced(SimpleCNN):
    """SimpleCNN whose training forward takes at least `delay_s`: long enough for a test to catch
    the run part-way (to kill or signal it) without racing a fast machine."""

    def __init__(self, num_classes: int, width: int, delay_s: float, fail_at_call: int) -> None:
        super().__init__(num_classes, width=width)
        self.delay_s, self.fail_at_call, self.calls = delay_s, fail_at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.fail_at_call:
                raise RuntimeError(f"observe_models: deliberate failure in training call {self.calls}")
            time.sleep(self.delay_s)
        return super().forward(x)


def slow_cnn(cfg: ModelConfig) -> nn.Module:
    return _Paced(cfg.num_classes or 10, cfg.args.get("width", 8), cfg.args.get("delay_s", 0.1), 0)


def failing_cnn(cfg: ModelConfig) -> nn.Module:
    return _Paced(cfg.num_classes or 10, cfg.args.get("width", 8), 0.0, cfg.args.get("fail_at", 3))


def straggler_cnn(cfg: ModelConfig) -> nn.Module:
    """slow_cnn on one rank (`slow_rank`, 1 unless set), at full speed elsewhere: a straggler."""
    slow = int(os.environ.get("RANK", "0")) == cfg.args.get("slow_rank", 1)
    delay_s = cfg.args.get("delay_s", 0.1) if slow else 0.0
    return _Paced(cfg.num_classes or 10, cfg.args.get("width", 8), delay_s, 0)

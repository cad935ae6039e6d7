"""Optimizers and the learning-rate schedule (warmup, then cosine, step or plateau decay)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dtrain.config import OptimConfig, SchedConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Built after wrapping, so that under FSDP it holds the sharded parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


class LRSchedule:
    """Sets every parameter group's lr for each optimizer step: linear warmup from 0 over
    `warmup_steps`, then cosine to `min_lr` over the rest of `total_steps`, a step decay, a
    plateau decay driven by evaluations, or constant. Its state is plain numbers."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedConfig, base_lr: float,
                 total_steps: int, monitor_mode: str = "max") -> None:
        self.optimizer, self.cfg, self.base_lr = optimizer, cfg, base_lr
        self.total_steps = max(1, total_steps)
        self.monitor_mode = monitor_mode
        self.plateau_scale, self.plateau_best, self.plateau_bad_evals = 1.0, None, 0
        self.apply(0)

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return self.base_lr * (step + 1) / (cfg.warmup_steps + 1)
        if cfg.name == "cosine":
            span = max(1, self.total_steps - cfg.warmup_steps)
            progress = min(1.0, (step - cfg.warmup_steps) / span)
            return cfg.min_lr + (self.base_lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        if cfg.name == "step":
            return self.base_lr * cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
        if cfg.name == "plateau":
            return self.base_lr * self.plateau_scale
        return self.base_lr

    def apply(self, step: int) -> float:
        """Set the lr for optimizer step number `step` (0-based) and return it."""
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def on_eval(self, value: float) -> None:
        """Plateau: decay after `patience` evaluations without improvement of the monitored metric."""
        if self.cfg.name != "plateau":
            return
        better = (self.plateau_best is None or
                  (value > self.plateau_best if self.monitor_mode == "max" else value < self.plateau_best))
        if better:
            self.plateau_best, self.plateau_bad_evals = value, 0
            return
        self.plateau_bad_evals += 1
        if self.plateau_bad_evals > self.cfg.patience:
            self.plateau_scale *= self.cfg.gamma
            self.plateau_bad_evals = 0

    def state_dict(self) -> dict[str, Any]:
        return {"plateau_scale": self.plateau_scale, "plateau_best": self.plateau_best,
                "plateau_bad_evals": self.plateau_bad_evals, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The schedule continues as it started: its length was fixed when the run started, so
        resuming on another number of ranks (other steps per epoch) does not bend the curve."""
        self.plateau_scale = float(state["plateau_scale"])
        self.plateau_best = state["plateau_best"]
        self.plateau_bad_evals = int(state["plateau_bad_evals"])
        if "total_steps" in state:
            self.total_steps = int(state["total_steps"])

"""Optimizers (with groups that exclude some parameters from weight decay) and the learning-rate
schedule (warmup, then cosine, step or plateau decay), or the user's own by import path."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain.config import OptimConfig, SchedConfig, registry
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import load_callable
from dtrain.core.monitor import improves
from dtrain.process import compat


def no_decay_names(model: nn.Module, rule: Any) -> set[str]:
    """Names of the parameters that get no weight decay. `auto` (as AdamW recipes do): biases,
    the weights of normalisation layers, embeddings (nn.Embedding, and parameters whose name says
    `embed`). A list: those matching any of its globs."""
    names = set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if rule == "auto":
                if (
                    name == "bias"
                    or isinstance(module, (*compat.NORM_LAYERS, nn.Embedding))
                    or "embed" in name
                ):
                    names.add(full)
            elif any(fnmatch.fnmatchcase(full, pattern) for pattern in rule):
                names.add(full)
    return names


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """One group with weight decay and one without (either left out when empty). A parameter
    shared by two modules (tied weights) is in one group once: named_parameters() names it once."""
    from dtrain.parallel import unwrap

    plain = unwrap(model)
    exempt = no_decay_names(plain, cfg.no_decay)
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in plain.named_parameters():
        if param.requires_grad:
            (no_decay if name in exempt else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """For the banner: the parameters by weight decay (groups that differ in nothing else that
    is shown, as both are with optim.weight_decay 0, are said as one)."""
    counts: dict[float, int] = {}
    for group in optimizer.param_groups:
        decay = group.get("weight_decay", 0)
        counts[decay] = counts.get(decay, 0) + sum(p.numel() for p in group["params"])
    parts = [f"{count:,} parameters with weight decay {decay:g}" for decay, count in counts.items()]
    return ("optimizer groups: " if len(parts) > 1 else "optimizer: ") + "; ".join(parts)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by `optim.name` (see registry.OPTIMIZERS). Built after wrapping, so
    that under FSDP it holds the sharded parameters."""
    try:
        return registry.OPTIMIZERS.builder(cfg.name)(param_groups(model, cfg), cfg)
    except ValueError as e:  # torch's check of a value the schema let through
        raise UserError(
            f"config error: optim: {cfg.name} refused the config ({first_line(e)})"
        ) from None


# ---------------------------------------------------------------------------------------------
# Optimizers, by registry.OPTIMIZERS: (parameter groups, optim config) -> Optimizer
#
# Fused kernels where torch has them for these parameters: one kernel per step, and a step that
# a device flag (found_inf) can skip, so that a non-finite step is decided on the device.


def _fused(groups: list[dict[str, Any]]) -> bool | None:
    return all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"]) or None


@dataclass(frozen=True)
class StateShape:
    """What an optimizer keeps for each parameter (for `dtrain plan`): tensors of the
    parameter's size, and whether a step count too."""

    slots: int
    step: bool


def sgd_state(cfg: OptimConfig) -> StateShape:
    return StateShape(slots=1 if cfg.momentum != 0 else 0, step=False)


def adam_state(cfg: OptimConfig) -> StateShape:
    return StateShape(slots=2, step=True)  # first and second moments


def user_state(cfg: OptimConfig) -> StateShape:
    return StateShape(slots=2, step=False)  # not known before it is built: two moments assumed


def sgd(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    # torch has no DTensor rule for fused SGD: SGD under FSDP uses foreach.
    sharded = any(hasattr(p, "to_local") for g in groups for p in g["params"])
    return torch.optim.SGD(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        fused=None if sharded else _fused(groups),
    )


def adam(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=_fused(groups))


def adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=_fused(groups))


def build_user_optimizer(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """A user's optimizer by import path, called with the parameter groups and the config."""
    optimizer = load_callable(cfg.name, "optim.name")(groups, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"config error: optim.name: {cfg.name} returned "
            f"{type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    return optimizer


# ---------------------------------------------------------------------------------------------
# Schedules, by registry.SCHEDULES: (optimizer, sched config, base_lr, total_steps, monitor_mode)


class LRSchedule:
    """Sets every parameter group's lr for each optimizer step: linear warmup from 0 over
    `warmup_steps`, then cosine to `min_lr` over the rest of `total_steps`, a step decay, a
    plateau decay driven by evaluations, or constant. Its state is plain numbers."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: SchedConfig,
        base_lr: float,
        total_steps: int,
        monitor_mode: str = "max",
    ) -> None:
        self.optimizer, self.cfg, self.base_lr = optimizer, cfg, base_lr
        self.total_steps = max(1, total_steps)
        self.monitor_mode = monitor_mode
        self.plateau_scale, self.plateau_bad_evals = 1.0, 0
        self.plateau_best: float | None = None
        self.apply(0)

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return self.base_lr * (step + 1) / (cfg.warmup_steps + 1)
        if cfg.name == "cosine":
            span = max(1, self.total_steps - cfg.warmup_steps)
            progress = min(1.0, (step - cfg.warmup_steps) / span)
            return cfg.min_lr + (self.base_lr - cfg.min_lr) * 0.5 * (
                1 + math.cos(math.pi * progress)
            )
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

    def on_eval(self, value: float | None) -> None:
        """Plateau: decay after `patience` evaluations without the monitored metric improving."""
        if self.cfg.name != "plateau" or value is None:
            return
        if improves(value, self.plateau_best, self.monitor_mode):
            self.plateau_best, self.plateau_bad_evals = value, 0
            return
        self.plateau_bad_evals += 1
        if self.plateau_bad_evals > self.cfg.patience:
            self.plateau_scale *= self.cfg.gamma
            self.plateau_bad_evals = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "plateau_scale": self.plateau_scale,
            "plateau_best": self.plateau_best,
            "plateau_bad_evals": self.plateau_bad_evals,
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The schedule continues as it started: its length was fixed when the run started, so
        resuming on another number of ranks (other steps per epoch) does not bend the curve."""
        self.plateau_scale = float(state["plateau_scale"])
        self.plateau_best = state["plateau_best"]
        self.plateau_bad_evals = int(state["plateau_bad_evals"])
        if "total_steps" in state:
            self.total_steps = int(state["total_steps"])


class UserSchedule:
    """A user's scheduler by import path (`sched.name: mypkg.sched:build`, called with the
    optimizer, the schedule config and the run's total steps; it returns a torch LRScheduler or
    anything with step(), state_dict() and load_state_dict()), stepped once per optimizer step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: SchedConfig,
        base_lr: float,
        total_steps: int,
        monitor_mode: str = "max",
    ) -> None:
        # base_lr and monitor_mode are the built-in schedules' business: the user's scheduler
        # reads its own settings from the config.
        self.total_steps = max(1, total_steps)
        self.scheduler = load_callable(cfg.name, "sched.name")(optimizer, cfg, self.total_steps)
        missing = [
            m
            for m in ("step", "state_dict", "load_state_dict")
            if not callable(getattr(self.scheduler, m, None))
        ]
        if missing:
            raise UserError(
                f"config error: sched.name: {cfg.name} returned "
                f"{type(self.scheduler).__name__}, which has no {', '.join(missing)}"
            )
        self.stepped = 0

    def apply(self, step: int) -> None:
        while self.stepped < step:
            self.scheduler.step()
            self.stepped += 1

    def on_eval(self, value: float | None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "user": self.scheduler.state_dict(),
            "stepped": self.stepped,
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["user"])
        self.stepped = int(state["stepped"])
        self.total_steps = int(state["total_steps"])


def build_schedule(
    optimizer: torch.optim.Optimizer,
    cfg: SchedConfig,
    base_lr: float,
    total_steps: int,
    monitor_mode: str,
) -> LRSchedule | UserSchedule:
    """The schedule named by `sched.name` (see registry.SCHEDULES)."""
    return registry.SCHEDULES.builder(cfg.name)(
        optimizer, cfg, base_lr=base_lr, total_steps=total_steps, monitor_mode=monitor_mode
    )

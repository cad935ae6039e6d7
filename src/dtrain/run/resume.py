"""What a resume changes beyond the checkpoint's own contents: starting weights where the
checkpoint lacks them, the learning-rate schedule of a run whose length or steps changed, and the
line of a run already at its length."""

from __future__ import annotations

from typing import Any

from torch import nn

from dtrain.checkpoint import Checkpointer, Resumed
from dtrain.config import Config
from dtrain.files.resume_policy import is_length_change
from dtrain.loop.optim import LRSchedule, UserSchedule
from dtrain.loop.state import TrainState
from dtrain.models.spec import ModelSpec
from dtrain.observe import log
from dtrain.process.layout import Layout, Steps
from dtrain.run.pieces import Pieces


def resume_or_start(
    checkpoints: Checkpointer,
    cfg: Config,
    layout: Layout,
    pieces: Pieces,
    spec: ModelSpec,
    state: TrainState,
    schedule: LRSchedule | UserSchedule,
) -> Resumed | None:
    """Resume what `ckpt.resume` names, or start from model.init_from/pretrained (or the
    model's own initialisation): returns where it resumed from, or None for a fresh start. A
    base that a checkpoint does not hold (LoRA) is loaded first, whichever it is."""
    model: nn.Module = pieces.model
    starting = pieces.starting_weights
    if starting and not spec.holds_everything:  # the base is not in a checkpoint
        log.info(starting.load(model))
    resumed = checkpoints.resume()
    if resumed and state.reached(cfg.train.epochs, cfg.train.max_steps):
        return resumed  # nothing trains (`already_past`)
    if resumed:
        reconcile_schedule(schedule, checkpoints.config_changes, cfg, state, layout, pieces.steps)
        if starting and spec.holds_everything:
            log.info("model.init_from/pretrained not used: the resumed checkpoint has the weights")
    elif starting and spec.holds_everything:
        log.info(starting.load(model))
    return resumed


# Changes of what a step is (allowed only with ckpt.resume_config_change=allow): the schedule
# made for the old steps cannot continue as it was. train.epochs and train.max_steps are the
# run's length: ckpt.on_length_change.
_SCHEDULE_KEYS = (
    "data.batch_size",
    "train.grad_accum",
    "sched.",
)


def reconcile_schedule(
    schedule: Any, changes: list[str], cfg: Config, state: TrainState, layout: Layout, steps: Steps
) -> None:
    """A resumed schedule keeps the length it had when the run started (another world size does
    not bend it), unless the user changed the run's length on purpose: changes of what a step is
    (allowed with ckpt.resume_config_change=allow) re-span it; a changed train.epochs or
    train.max_steps does what ckpt.on_length_change says, in one line."""
    if any(c.startswith(_SCHEDULE_KEYS) for c in changes):
        log.info(
            f"the learning-rate schedule now spans {steps.total} steps "
            f"(was {schedule.total_steps}), following the changed config"
        )
        schedule.total_steps = max(1, steps.total)
        return
    length = [c for c in changes if is_length_change(c)]
    if length:
        log.info(_length_change(schedule, length, cfg, state, layout, steps))


def _length_change(
    schedule: Any, length: list[str], cfg: Config, state: TrainState, layout: Layout, steps: Steps
) -> str:
    """Applies ckpt.on_length_change to the schedule and says what the run now does."""
    step_samples = layout.effective_batch
    done_in_epoch = state.samples_in_epoch // step_samples
    left = steps.per_epoch * (cfg.train.epochs - state.epoch) - done_in_epoch
    end = state.step + max(0, left)
    if cfg.train.max_steps:
        end = min(end, cfg.train.max_steps)
    said = (
        f"run length changed on resume ({'; '.join(length)}): training continues from step "
        f"{state.step} to step {end}"
    )
    lr_at = getattr(schedule, "lr_at", None)
    if lr_at is None:  # a user's scheduler: built for the new length, then given its saved state
        return f"{said}; the user schedule {cfg.sched.name} was built for {steps.total} steps"
    old_total, before = schedule.total_steps, lr_at(state.step)
    if cfg.ckpt.on_length_change == "keep":
        return (
            f"{said}; the learning-rate schedule keeps its {old_total} steps "
            f"(ckpt.on_length_change=keep): lr {before:.4g} at step {state.step}, and "
            f"{lr_at(old_total):.4g} from step {old_total} on"
        )
    schedule.total_steps = max(1, steps.total)
    return (
        f"{said}; the learning-rate schedule is re-spanned from {old_total} to "
        f"{schedule.total_steps} steps, as if the run had been this long from the start "
        f"(ckpt.on_length_change=respan): lr at step {state.step} {before:.4g} -> "
        f"{lr_at(state.step):.4g}"
    )


def already_past(cfg: Config, state: TrainState, shown: str) -> str:
    asked = f"train.epochs={cfg.train.epochs}"
    if cfg.train.max_steps:
        asked += f", train.max_steps={cfg.train.max_steps}"
    return (
        f"{shown} is already at or past the asked length ({asked}): it trained to step "
        f"{state.step}, epoch {state.epoch}; nothing to train, and its config.yaml and record "
        f"are unchanged"
    )

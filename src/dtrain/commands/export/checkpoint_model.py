"""A checkpoint's model for an export, read in this one process (no process group): full and
sharded checkpoints alike, every file checked against the marker's digests; its metadata; and an
input like the run's data to check an export on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn

from dtrain import checkpoint, config, models, tasks
from dtrain.checkpoint.load import trained_shapes
from dtrain.checkpoint.state import load_checked, read_sharded, shape_mismatch
from dtrain.config import registry
from dtrain.core.errors import UserError
from dtrain.models.spec import spec_of
from dtrain.run.weights import prepare_base


@dataclasses.dataclass(frozen=True)
class SavedAs:
    """How a kind of checkpoint holds the model: the file of its metadata, and whether its
    tensors lie in DCP's files (read in parts, a file at a time) or in that file itself."""

    meta_file: str
    in_parts: bool


# By the kind `checkpoint.open_checkpoint` names.
KINDS = {
    "full": SavedAs(checkpoint.FULL_FILE, in_parts=False),
    "sharded": SavedAs(checkpoint.META_FILE, in_parts=True),
}


def open_saved(path: str) -> tuple[str, SavedAs]:
    """The folder of the checkpoint at `path` (checked complete) and how it holds the model."""
    folder, kind = checkpoint.open_checkpoint(path)
    return folder, KINDS[kind]


def load_model(
    path: str,
    weights: str = "model",
    adapters: bool = False,
    untrusted: tuple[str, ...] = (),
    shown: str | None = None,
) -> tuple[nn.Module, dict]:
    """The model of the checkpoint at `path` (a checkpoint directory or its checkpoint.pt), in
    eval mode on the CPU, and the checkpoint's metadata; with `weights` "ema", holding the
    checkpoint's moving average of the weights. Every file read is checked against the marker's
    digests: a damaged checkpoint is refused (exit 2), not exported. A LoRA run's adapters go
    onto their base (checked by its digest), then are merged into it: the model and the config
    in `meta` are the base's; with `adapters`, the model keeps them apart (peft's model). Code
    that the checkpoint's config names for the keys `untrusted` is refused (`refuse_code`)."""
    folder, saved_as = open_saved(path)
    meta_path = os.path.join(folder, saved_as.meta_file)
    meta = load_checked(path if os.path.isfile(path) else meta_path)
    refuse_code(meta, shown or path, untrusted)
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, meta["model_info"], cfg.run.seed)
    spec = spec_of(cfg.model)
    with one_process():  # (a sharded model.init_from: the base, read here)
        prepare_base(model, cfg, meta["model_info"], path)
    held = trained_shapes(model, spec)
    if saved_as.in_parts:
        state = {"model": {k: v for k, v in model.state_dict().items() if k in held}}
        with one_process():
            read_sharded(folder, state)
        saved = state["model"]
    else:
        saved = meta["model"]
    problem = shape_mismatch(held, {k: tuple(v.shape) for k, v in saved.items()})
    if problem:
        raise UserError(f"checkpoint error: {path}: {problem}")
    model.load_state_dict(saved, strict=spec.holds_everything)
    if weights == "ema":
        with one_process():
            _load_ema(model, folder)
    if spec.adapters and not adapters:
        merged: Any = model
        model = merged.merge_and_unload()
        meta = {**meta, "config": config.to_dict(dataclasses.replace(cfg, model=spec.base))}
    return model.float().eval(), meta


def config_with_data(meta: dict, overrides: list[str], read_for: str) -> config.Config:
    """The checkpoint's config with `data.*` overrides on top (`read_for`: what the data is
    read for, as the refusal of another key says)."""
    saved = copy.deepcopy(meta["config"])
    for text in overrides:
        key, value = config.parse_override(text)
        if not key.startswith("data."):
            raise UserError(
                f"export error: override '{text}': only data.* keys are taken (they say where "
                f"{read_for} comes from; the model is the checkpoint's)"
            )
        config.set_dotted(saved, key, value)
    return config.from_dict(saved)


def refuse_code(meta: dict, shown: str, keys: tuple[str, ...]) -> None:
    """One line, before anything is imported, when the checkpoint's config (not the user's own
    config of this command) names code that building `keys` runs."""
    if keys:
        named = registry.code_named(config.from_dict(meta["config"]), keys)
        registry.refuse_code(named, f"the checkpoint {shown}: its config")


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """DCP warns that it reads in a single process when no process group exists: that is what
    export means to do, so the user is not told."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load_ema(model: nn.Module, folder: str) -> None:
    # Imported here: only `--weights ema` needs the EMA module.
    from dtrain.loop import ema

    if not ema.has_ema(folder):
        raise UserError(
            f"export error: {folder} was saved without EMA weights (train.ema.decay unset); "
            f"use --weights model"
        )
    ema.load_ema_into(model, folder)


def example_input(meta: dict, size: int = 4) -> Any:
    """A model input like the run's data, from the task (None when the task cannot say)."""
    cfg = config.from_dict(meta["config"])
    task = tasks.build(cfg.task, meta["model_info"])
    make = getattr(task, "example_input", None)
    return make(meta["model_info"], size) if make is not None else None

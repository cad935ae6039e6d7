"""Datasets, the resumable distributed sampler, and the loaders.

`build` gives the train and validation datasets that `data.name` names and what a model builder
needs to know about them (`info`: number of classes, channels and image size for images; vocabulary
and window length for text; what a user's dataset declares). Modules: `sampler` (the order of
samples), `images`, `text` and `user` (the datasets), `loaders` (DataLoaders, collate, device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.data import images, text, user
from dtrain.data.images import ImageDataset, Normalize, Transform
from dtrain.data.loaders import Stacked, close_loaders, collate, loaders, to_device, workers_for
from dtrain.data.sampler import EvalSampler, ResumableSampler, sample_random
from dtrain.errors import UserError
from dtrain.imports import is_import_path

__all__ = [
    "Datasets",
    "build",
    "loaders",
    "close_loaders",
    "collate",
    "to_device",
    "Stacked",
    "workers_for",
    "ImageDataset",
    "Normalize",
    "Transform",
    "ResumableSampler",
    "EvalSampler",
    "sample_random",
    "NAMES",
]

NAMES = (*images.NAMES, "text")
DEFAULT_SEQ_LEN = 256


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    info: dict[str, Any]  # what model builders and tasks may need: num_classes, vocab_size, ...
    notes: list[str] = field(default_factory=list)  # lines for the start-up banner
    # What a batch goes through once on the device (images: uint8 -> normalised float32).
    on_device: Callable[[Any], Any] | None = None

    def replaced(self) -> int | None:
        """Training samples this rank replaced because they could not be read (None when the
        training set never replaces any): summed over the ranks for the records."""
        count = getattr(self.train, "replaced_count", None)
        return count() if count is not None and getattr(self.train, "skip_bad", False) else None


def seq_len_of(cfg: DataConfig, model_args: dict | None = None) -> int:
    """The text window's length: data.text.seq_len, else the model's seq_len, else 256."""
    return cfg.text.seq_len or int((model_args or {}).get("seq_len") or DEFAULT_SEQ_LEN)


def build(cfg: DataConfig, seed: int, model_args: dict | None = None) -> Datasets:
    """The train and validation datasets named by `data.name`."""
    if is_import_path(cfg.name):
        return Datasets(*user.build(cfg))
    if cfg.name == "text":
        train, val, info, note = text.build(cfg, seq_len_of(cfg, model_args))
        return Datasets(train, val, info, [note])
    if cfg.name not in images.NAMES:
        raise UserError(
            f"config error: data.name: unknown dataset '{cfg.name}'; use one of "
            f"{', '.join(NAMES)} or module:function"
        )
    train, val, info, notes, normalize = images.build(cfg, seed)
    return Datasets(train, val, info, notes, normalize)

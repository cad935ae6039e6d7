"""A user's datasets, by import path: `data.name: mypkg.data:build`, a function of the data config
returning `(train_dataset, val_dataset)`. Items may be tensors, tuples, lists or (nested) dicts;
the default collate stacks them. What a model builder may need to know (`num_classes`, an image
`sample_shape` (C, H, W), anything else in an `info` dict) is declared on the train dataset, or,
for (image, label) items, read from the first sample."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.core.imports import load_callable
from dtrain.data.loaders import Datasets, SizedDataset
from dtrain.data.sampler import SampleKey, index_of


class IndexOnly(Dataset):
    """A user's dataset behind keyed sampling: passes the index on and ignores the epoch."""

    def __init__(self, dataset: SizedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: SampleKey) -> Any:
        return self.dataset[index_of(key)]


def declared_info(train: SizedDataset) -> dict[str, Any]:
    info: dict[str, Any] = dict(getattr(train, "info", None) or {})
    classes = getattr(train, "num_classes", None) or len(getattr(train, "classes", ()) or ())
    if classes:
        info.setdefault("num_classes", classes)
    shape = getattr(train, "sample_shape", None)
    if shape is None and len(train):
        first = train[0]
        if (
            isinstance(first, (tuple, list))
            and first
            and isinstance(first[0], torch.Tensor)
            and first[0].dim() == 3
        ):
            shape = tuple(first[0].shape)
    if shape is not None:
        info.setdefault("in_channels", shape[0])
        info.setdefault("image_size", shape[-1])
    return info


def build(cfg: DataConfig, seed: int) -> Datasets:
    """The user's `data.name` function, called with the data config."""
    result = load_callable(cfg.name, "data.name")(cfg)
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise UserError(
            f"data error: {cfg.name} must return (train_dataset, val_dataset); it returned {got}"
        )
    train, val = result
    return Datasets(IndexOnly(train), val, declared_info(train))

"""Datasets, the resumable distributed sampler, and the loaders.

`build` gives the train and validation datasets that `data.name` names and what a model builder
needs to know about them (`info`: number of classes, channels and image size for images; vocabulary
and window length for text and token files; what a user's dataset declares). Modules: `sampler`
(the order of samples), `images` (+ `decode`, `transforms`), `text`, `tokens` (+ `windows`, `mix`),
`hf` (+ `hf_rows`) and `user` (the datasets' builders), `loaders` (the `Datasets` and `Loaders`
types, collate, device).
"""

from __future__ import annotations

import dataclasses
import inspect

from dtrain.config import DataConfig, registry
from dtrain.data.images import ImageDataset
from dtrain.data.loaders import (
    Datasets,
    Loaders,
    Stacked,
    close_loader,
    close_loaders,
    collate,
    loaders,
    to_device,
    validation_loader,
    workers_for,
)
from dtrain.data.sampler import EvalSampler, ResumableSampler, sample_random
from dtrain.data.text import seq_len_of
from dtrain.data.transforms import Normalize, Transform

__all__ = [
    "Datasets",
    "Loaders",
    "build",
    "loaders",
    "close_loaders",
    "close_loader",
    "validation_loader",
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
    "seq_len_of",
]


def build(
    cfg: DataConfig, seed: int, model_args: dict | None = None, val_only: bool = False
) -> Datasets:
    """The train and validation datasets named by `data.name` (see registry.DATASETS).
    `val_only` (evaluation): a builder that can (an image folder, token files) reads the
    validation split alone, so that a dataset of that split only can be evaluated; the others
    build both, of which evaluation reads one."""
    builder = registry.DATASETS.builder(cfg.name)
    settled = _settled(cfg, model_args)
    if val_only and "val_only" in inspect.signature(builder).parameters:
        return builder(settled, seed, val_only=True)
    return builder(settled, seed)


def sizes_of(cfg: DataConfig, seed: int, model_args: dict | None = None) -> Datasets:
    """What `build` would give, as lengths and `info` only: no sample is read (`dtrain plan`;
    the functions are in data/sizes.py, hence the name)."""
    return registry.DATASETS.sizes(cfg.name)(_settled(cfg, model_args), seed)


def _settled(cfg: DataConfig, model_args: dict | None) -> DataConfig:
    """The data config with what it leaves to the model settled: the length of a text or token
    window (`seq_len_of`)."""
    seq_len = seq_len_of(cfg, model_args)
    return dataclasses.replace(
        cfg,
        text=dataclasses.replace(cfg.text, seq_len=seq_len),
        tokens=dataclasses.replace(cfg.tokens, seq_len=seq_len),
    )

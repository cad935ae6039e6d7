"""The seams of the data package (`Datasets`, what every dataset builder returns; `Loaders`, the
train and validation loaders), how a batch is collated, and how it reaches the device."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

import torch
from torch.utils.data import DataLoader, default_collate

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.data.sampler import EvalSampler, Prefix, ResumableSampler
from dtrain.process import compat, rng


class SizedDataset(Protocol):
    """A map-style dataset that knows its length (the samplers and the step count need it)."""

    def __getitem__(self, index: int, /) -> Any: ...

    def __len__(self) -> int: ...


class NoSamples:
    """The training set of a dataset built for evaluation only (`data.build(val_only=True)`)."""

    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: object) -> None:
        raise IndexError("a dataset built for evaluation has no training samples")


NO_SAMPLES = NoSamples()


@dataclass
class Datasets:
    """What a dataset builder (registry.DATASETS) returns."""

    train: SizedDataset
    val: SizedDataset
    info: dict[str, Any]  # what model builders and tasks may need: num_classes, vocab_size, ...
    notes: list[str] = field(default_factory=list)  # lines for the start-up banner
    # What a batch goes through once on the device (images: uint8 -> normalised float32).
    on_device: Callable[[Any], Any] | None = None

    def replaced(self) -> int | None:
        """Training samples this rank replaced because they could not be read (None when the
        training set never replaces any): summed over the ranks for the records."""
        count = getattr(self.train, "replaced_count", None)
        return count() if count is not None and getattr(self.train, "skip_bad", False) else None


@dataclass(frozen=True)
class Loaders:
    """The train loader (steered through its sampler's `set_epoch`) and the validation loader."""

    train: DataLoader
    train_sampler: ResumableSampler
    val: DataLoader
    val_sampler: EvalSampler


class Stacked(list):
    """A whole batch a dataset made at once in `__getitems__`. dtrain's collate hands the stacked
    batch over as it is, instead of stacking a copy of its samples; as a list of the samples
    (views) it also works with torch's default collate, for anyone using the dataset directly."""

    def __init__(self, batch: Any) -> None:
        if isinstance(batch, torch.Tensor):
            samples: list = list(batch.unbind(0))
        else:
            samples = list(zip(*(part.unbind(0) for part in batch), strict=False))
        super().__init__(samples)
        self.batch = batch


def collate(samples: Any) -> Any:
    """The loaders' collate function: a `Stacked` batch as it is, a tensor a dataset already
    stacked as it is, anything else (tensors, tuples, lists, dicts of them) by torch's default."""
    if isinstance(samples, Stacked):
        return samples.batch
    if isinstance(samples, torch.Tensor):
        return samples
    return default_collate(samples)


def to_device(
    batch: Any,
    device: torch.device,
    on_device: Callable[[Any], Any] | None = None,
    channels_last: bool = False,
) -> Any:
    """Every tensor of a batch (tensors, tuples, lists, namedtuples, dicts, nested) on `device`
    (asynchronously from pinned memory on CUDA), then what the data does on the device (images:
    uint8 to normalised float), then, with `channels_last`, 4-D float inputs in that format."""
    batch = _moved(batch, device)
    if on_device is not None:
        batch = on_device(batch)
    if channels_last:
        batch = compat.tree_map_tensors(
            lambda t: (
                t.contiguous(memory_format=torch.channels_last)
                if t.dim() == 4 and t.is_floating_point()
                else t
            ),
            batch,
        )
    return batch


def _moved(batch: Any, device: torch.device) -> Any:
    """`batch` with its tensors on `device`. The common batches (a tensor, a tuple, list or dict
    of tensors) directly, with nothing to do for CPU tensors on the CPU; any other tree through
    the general walk, which costs more than a tiny model's optimizer step."""
    if device.type == "cpu":
        if isinstance(batch, torch.Tensor) and batch.device.type == "cpu":
            return batch
        if type(batch) in (tuple, list) and all(
            type(t) is torch.Tensor and t.device.type == "cpu" for t in batch
        ):
            return batch
    non_blocking = device.type == "cuda"
    return compat.tree_map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def workers_for(cfg: DataConfig, local_world_size: int) -> tuple[int, str]:
    """data.num_workers, with `auto` worked out from the CPUs this process may use: one fewer
    than each rank's share (the rank itself needs one), at most 8."""
    if cfg.num_workers != "auto":
        return int(cfg.num_workers), "set by data.num_workers"
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    per_rank = max(1, cpus // max(1, local_world_size))
    workers = max(0, min(8, per_rank - 1))
    return workers, (
        f"auto: {cpus} CPU(s) for {local_world_size} rank(s) on this node, "
        f"{per_rank} per rank, one of them for the rank itself"
    )


def close_loaders(loaders: Loaders | None) -> None:
    """Stop the persistent worker processes of the loaders now (`close_loader`)."""
    if loaders is None:
        return
    for loader in (loaders.train, loaders.val):
        close_loader(loader)


def close_loader(loader: DataLoader | None) -> None:
    """Stop a loader's persistent worker processes now: the launcher leaves with os._exit,
    which skips the interpreter's clean-up that would otherwise stop them. A worker that a
    signal already ended (torchrun stopping every worker after another rank failed) makes the
    loader raise while it is stopped: that must not replace the error the run ends with."""
    if loader is None:
        return
    try:
        compat.shutdown_workers(loader)
    except RuntimeError as e:  # "DataLoader worker (pid N) is killed by signal: ..."
        log.debug(f"stopping the loader workers: {e}")


class _LoaderOptions(TypedDict):
    """What the train and validation loaders share."""

    num_workers: int
    pin_memory: bool
    collate_fn: Callable[[Any], Any]
    persistent_workers: bool
    worker_init_fn: Callable[[int], None] | None


def loaders(
    train_set: Any,
    val_set: Any,
    *,
    cfg: DataConfig,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
    overfit_batches: int = 0,
    workers: int = 0,
) -> Loaders:
    """The train loader (steered through its sampler's `set_epoch`) and the validation loader,
    with `workers` loader processes each."""
    # A dataset that orders itself (a mix of sources, data/mix.py) is handed the epoch's
    # positions as they are: its order is a function of (seed, epoch, position).
    shuffle = not getattr(train_set, "orders_itself", False)
    if overfit_batches:
        count = overfit_batches * cfg.batch_size * world_size
        train_set = Prefix(train_set, min(count, len(train_set)))
        shuffle = False
    per_step = cfg.batch_size * world_size
    if len(train_set) < per_step:
        raise UserError(
            f"data error: the training set has {len(train_set)} samples, fewer than "
            f"one step needs ({world_size} ranks x batch {cfg.batch_size}); lower "
            f"data.batch_size or add data"
        )
    train_sampler = ResumableSampler(
        len(train_set), rank, world_size, seed, shuffle, cfg.drop_last, cfg.batch_size
    )
    common = _options(cfg, device, workers)
    generator = torch.Generator().manual_seed(seed + rank)
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.batch_size,
        sampler=train_sampler,
        # The sampler applies data.drop_last itself: it serves whole batches only, except the
        # one short step that keeps what a world-size change left of an epoch. The loader
        # dropping a part batch would lose those samples.
        drop_last=False,
        generator=generator,
        **common,
    )
    val_loader, val_sampler = validation_loader(
        val_set, cfg=cfg, rank=rank, world_size=world_size, device=device, workers=workers
    )
    return Loaders(train_loader, train_sampler, val_loader, val_sampler)


def validation_loader(
    val_set: Any, *, cfg: DataConfig, rank: int, world_size: int, device: torch.device, workers: int
) -> tuple[DataLoader, EvalSampler]:
    """The validation loader and its sampler (each sample once over all ranks): training's, and
    what evaluation alone builds."""
    if len(val_set) == 0:
        raise UserError("data error: the validation set is empty")
    sampler = EvalSampler(len(val_set), rank, world_size)
    loader = DataLoader(
        val_set,
        batch_size=cfg.eval_batch_size or cfg.batch_size,
        sampler=sampler,
        **_options(cfg, device, workers),
    )
    return loader, sampler


def _options(cfg: DataConfig, device: torch.device, workers: int) -> _LoaderOptions:
    return _LoaderOptions(
        num_workers=workers,
        pin_memory=device.type == "cuda",
        collate_fn=collate,
        persistent_workers=workers > 0 and cfg.persistent_workers,
        worker_init_fn=rng.seed_loader_worker if workers else None,
    )

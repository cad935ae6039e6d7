"""Datasets, the resumable distributed sampler, and the loaders.

Augmentation randomness is a pure function of (seed, epoch, sample index): it does not depend on
how many batches came before, on the number of loader workers, or on the world size. Together with
a sampler that can start part-way through an epoch, that makes a mid-epoch resume bit-exact.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from dtrain import synthetic
from dtrain.config import DataConfig
from dtrain.errors import UserError
from dtrain.imports import load_callable

SampleKey = Union[int, tuple[int, int]]  # an index, or (epoch, index) for a training sample
_MASK64 = (1 << 64) - 1
_CROP_PADDING = 4


# ---------------------------------------------------------------------------------------------
# Per-sample randomness

def sample_random(seed: int, epoch: int, index: int) -> int:
    """64 random bits for one sample in one epoch (splitmix64 of the three numbers)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def augment(padded: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """Random crop of `size` from an image already padded by 4 on each side, and a random flip."""
    span = padded.shape[-1] - size + 1
    top, left, flip = bits % span, (bits >> 16) % span, (bits >> 32) & 1
    crop = padded[..., top:top + size, left:left + size]
    return crop.flip(-1) if flip else crop


# ---------------------------------------------------------------------------------------------
# Datasets

class ImageDataset(Dataset):
    """uint8 images (N, C, H, W) with labels; normalises, and augments when `augment_seed` is set.

    Keys are an index, or (epoch, index) so that a training sample's augmentation is fixed by
    the epoch and the index alone.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: Sequence[float],
                 std: Sequence[float], augment_seed: Optional[int] = None) -> None:
        self.size = images.shape[-1]
        self.augment_seed = augment_seed
        if augment_seed is not None:  # pad once, so that every crop is a slice
            images = F.pad(images, [_CROP_PADDING] * 4)
        self.images, self.labels = images, labels
        channels = images.shape[1]
        self.mean = torch.tensor(mean, dtype=torch.float32).view(channels, 1, 1) * 255
        self.inv_std = 1.0 / (torch.tensor(std, dtype=torch.float32).view(channels, 1, 1) * 255)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = self.images[index]
        if self.augment_seed is not None:
            image = augment(image, sample_random(self.augment_seed, epoch, index), self.size)
        return (image.float() - self.mean) * self.inv_std, self.labels[index]

    def __getitems__(self, keys: list[SampleKey]) -> "Batch":
        """A whole batch at once (the DataLoader calls this instead of __getitem__ per key): the
        same crops and flips as `augment`, stacked as uint8 and normalised in one operation,
        which saves most of the per-sample tensor operations of the training process."""
        pairs = [key if isinstance(key, tuple) else (0, key) for key in keys]
        index = torch.tensor([i for _, i in pairs], dtype=torch.long)
        if self.augment_seed is None:
            images = self.images[index]
        else:
            span = self.images.shape[-1] - self.size + 1
            bits = [sample_random(self.augment_seed, epoch, i) for epoch, i in pairs]
            top = torch.tensor([b % span for b in bits])
            left = torch.tensor([(b >> 16) % span for b in bits])
            flip = torch.tensor([bool((b >> 32) & 1) for b in bits]).view(-1, 1, 1, 1)
            # Every crop of every image as a view (N, C, span, span, size, size): one indexing
            # operation then copies out the batch's crops.
            windows = self.images.unfold(2, self.size, 1).unfold(3, self.size, 1)
            images = windows[index, :, top, left]
            images = torch.where(flip, images.flip(-1), images)
        normalised = images.float().sub_(self.mean).mul_(self.inv_std)  # the same two roundings
        return Batch(normalised, self.labels[index])


class Batch(list):
    """A batch's samples, as the DataLoader expects `__getitems__` to return them, that also
    holds them already stacked, so that `collate` hands those over instead of stacking a copy."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__(zip(images.unbind(0), labels.unbind(0)))
        self.stacked = [images, labels]


def collate(batch: list) -> Any:
    """The loaders' collate function: a `Batch` as stacked, anything else as torch's default."""
    return batch.stacked if isinstance(batch, Batch) else default_collate(batch)


class IndexOnly(Dataset):
    """A user's dataset behind keyed sampling: passes the index on and ignores the epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: SampleKey) -> Any:
        return self.dataset[key[1] if isinstance(key, tuple) else key]


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    image_size: int


def build(cfg: DataConfig, seed: int) -> Datasets:
    """The train and validation datasets named by `data.name`."""
    if ":" in cfg.name:
        return _user_datasets(cfg)
    builders: dict[str, Callable[[DataConfig], tuple]] = {
        "synthetic": _synthetic, "cifar10": _cifar10, "mnist": _mnist,
        "fashion_mnist": _mnist, "imagefolder": _imagefolder,
    }
    if cfg.name not in builders:
        raise UserError(f"config error: data.name: unknown dataset '{cfg.name}'; use one of "
                        f"{', '.join(builders)} or module:function")
    (train_x, train_y), (val_x, val_y), num_classes, mean, std = builders[cfg.name](cfg)
    augment_seed = seed if cfg.augment else None
    return Datasets(
        train=ImageDataset(train_x, train_y, mean, std, augment_seed),
        val=ImageDataset(val_x, val_y, mean, std, None),
        num_classes=num_classes, in_channels=train_x.shape[1], image_size=train_x.shape[-1],
    )


def _synthetic(cfg: DataConfig) -> tuple:
    train = synthetic.generate(cfg.synthetic.train_size, "train")
    val = synthetic.generate(cfg.synthetic.val_size, "val")
    return train, val, len(synthetic.CLASSES), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def _missing(what: str, where: str, expect: str) -> UserError:
    return UserError(f"data error: {what} not found under '{where}': {expect} "
                     f"(or set data.download=true where the machine is online)")


def _cifar10(cfg: DataConfig) -> tuple:
    from torchvision.datasets import CIFAR10
    try:
        train = CIFAR10(cfg.root, train=True, download=cfg.download)
        val = CIFAR10(cfg.root, train=False, download=cfg.download)
    except RuntimeError:
        raise _missing("CIFAR-10", cfg.root, "put the extracted 'cifar-10-batches-py' folder there"
                       ) from None
    as_tensor = lambda d: (torch.from_numpy(d.data).permute(0, 3, 1, 2).contiguous(),  # noqa: E731
                           torch.tensor(d.targets))
    return (as_tensor(train), as_tensor(val), 10,
            (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def _mnist(cfg: DataConfig) -> tuple:
    from torchvision.datasets import MNIST, FashionMNIST
    cls, folder = (MNIST, "MNIST") if cfg.name == "mnist" else (FashionMNIST, "FashionMNIST")
    try:
        train = cls(cfg.root, train=True, download=cfg.download)
        val = cls(cfg.root, train=False, download=cfg.download)
    except RuntimeError:
        raise _missing(folder, cfg.root, f"put the '{folder}/raw' files there") from None
    as_tensor = lambda d: (d.data.unsqueeze(1).contiguous(), d.targets.clone())  # noqa: E731
    return as_tensor(train), as_tensor(val), 10, (0.5,), (0.25,)


def _imagefolder(cfg: DataConfig) -> tuple:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms.functional import pil_to_tensor, resize
    size = cfg.image_size or 224
    splits = []
    for split in ("train", "val"):
        path = os.path.join(cfg.root, split)
        if not os.path.isdir(path):
            raise _missing(f"image folder '{split}'", cfg.root, f"expected {path}/<class>/<image>")
        try:
            folder = ImageFolder(path)
        except (FileNotFoundError, RuntimeError) as e:
            raise UserError(f"data error: {path}: {e}") from None
        images = [resize(pil_to_tensor(folder.loader(p).convert("RGB")), [size, size], antialias=True)
                  for p, _ in folder.samples]
        splits.append((folder.classes, torch.stack(images), torch.tensor(folder.targets)))
    (train_classes, train_x, train_y), (val_classes, val_x, val_y) = splits
    if train_classes != val_classes:
        raise UserError(f"data error: {cfg.root}: train and val class folders differ "
                        f"({train_classes} vs {val_classes})")
    return ((train_x, train_y), (val_x, val_y), len(train_classes),
            (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def _user_datasets(cfg: DataConfig) -> Datasets:
    result = load_callable(cfg.name, "data.name")(cfg)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UserError(f"data error: {cfg.name} must return (train_dataset, val_dataset)")
    train, val = result
    # A dataset may declare its sample shape (C, H, W); otherwise the first sample tells.
    shape = getattr(train, "sample_shape", None) or tuple(train[0][0].shape)
    num_classes = getattr(train, "num_classes", None) or len(getattr(train, "classes", ()))
    return Datasets(train=IndexOnly(train), val=val, num_classes=num_classes,
                    in_channels=shape[0], image_size=shape[-1])


# ---------------------------------------------------------------------------------------------
# Sampling

class ResumableSampler(Sampler[tuple[int, int]]):
    """DistributedSampler's order, keyed by (epoch, index), able to start part-way through an epoch.

    The epoch's order is a permutation seeded by seed + epoch (as DistributedSampler's), and rank r
    takes every world-th sample from position r. After k steps the ranks together have consumed
    exactly the first `consumed` positions, whatever the world size, so a resume maps the
    position by global samples consumed and never skips or repeats a sample.
    """

    def __init__(self, size: int, rank: int, world_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        self.epoch, self.consumed = epoch, consumed

    def _order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        if self.drop_last:
            order = order[:self.size - self.size % self.world_size]
        else:
            order += order[:(-self.size) % self.world_size]
        rest = order[self.consumed:]
        uneven = len(rest) % self.world_size  # only after a world-size change
        if uneven:
            rest = rest[:-uneven] if self.drop_last else rest + rest[:self.world_size - uneven]
        return rest

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, i) for i in self._order()[self.rank::self.world_size]])

    def __len__(self) -> int:
        return len(self._order()) // self.world_size


class EvalSampler(Sampler[int]):
    """Rank r takes positions r, r + world, ...; short ranks repeat a sample so that every rank
    runs the same number of batches (FSDP's forward is a collective). `valid_count` says how
    many of a rank's samples are real: each sample is counted exactly once over all ranks."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.per_rank = math.ceil(size / world_size)
        self.valid_count = len(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter([min(self.rank + j * self.world_size, self.size - 1) for j in range(self.per_rank)])

    def __len__(self) -> int:
        return self.per_rank


class Prefix(Dataset):
    """The first `count` samples of a dataset, keys passed through unchanged."""

    def __init__(self, dataset: Dataset, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: SampleKey) -> Any:
        return self.dataset[key]


def _seed_worker(worker_id: int) -> None:
    """Give each loader worker its own seed (for users' own random transforms)."""
    seed = torch.utils.data.get_worker_info().seed % 2**32
    random.seed(seed)
    numpy.random.seed(seed)


def close_loaders(loaders: tuple) -> None:
    """Stop the persistent worker processes of the loaders now: the launcher leaves with
    os._exit, which skips the interpreter's clean-up that would otherwise stop them."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def loaders(datasets: Datasets, cfg: DataConfig, seed: int, rank: int, world_size: int,
            device: torch.device, overfit_batches: int = 0
            ) -> tuple[DataLoader, ResumableSampler, DataLoader, EvalSampler]:
    """The train loader (steered through its sampler's `set_epoch`) and the validation loader."""
    train_set, shuffle = datasets.train, True
    if overfit_batches:
        count = overfit_batches * cfg.batch_size * world_size
        train_set = Prefix(train_set, min(count, len(train_set)))
        shuffle = False
    per_step = cfg.batch_size * world_size
    if len(train_set) < per_step:
        raise UserError(f"data error: the training set has {len(train_set)} samples, fewer than "
                        f"one step needs ({world_size} ranks x batch {cfg.batch_size}); lower "
                        f"data.batch_size or add data")
    if len(datasets.val) == 0:
        raise UserError("data error: the validation set is empty")
    train_sampler = ResumableSampler(len(train_set), rank, world_size, seed, shuffle, cfg.drop_last)
    val_sampler = EvalSampler(len(datasets.val), rank, world_size)
    workers = cfg.num_workers
    common = dict(num_workers=workers, pin_memory=device.type == "cuda", collate_fn=collate,
                  persistent_workers=workers > 0 and cfg.persistent_workers,
                  worker_init_fn=_seed_worker if workers else None)
    generator = torch.Generator().manual_seed(seed + rank)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              drop_last=cfg.drop_last, generator=generator, **common)
    val_loader = DataLoader(datasets.val, batch_size=cfg.eval_batch_size or cfg.batch_size,
                            sampler=val_sampler, **common)
    return train_loader, train_sampler, val_loader, val_sampler
